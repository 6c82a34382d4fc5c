"""The traced path (trainmem.recorded) on every causal-LM model type transformers ships, against a full trace.

For each model_type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: its default config
(``AutoConfig.for_model(type)``) shrunk to small widths (hidden 64, 4 heads of 16, vocabulary 256, at most 4
experts; per-layer lists dropped so that the config class derives them for the new layer count, or cut where it
does not), with enough layers for the layer pattern to repeat three times (``prefix + 3 * period + 1``, so the
remainder is exercised too where the period is over 1), and at least 5 (a period of one layer is then recorded at
2 and 3 layers and extrapolated over 2 more). The traced path records its two reduced traces and extrapolates;
the same config is then traced in full (trace.trace_step), and every phase's allocated bytes are compared.

    PYTHONPATH=src python benchmarks/every_model_type.py [--types a,b] [--limit-s 240] [--jobs 2] [--out results.jsonl]

Prints one line per type (within 1% in every phase / the worst phase's error / why it could not run) and the
table for docs/accuracy.md at the end; results are appended to ``--out`` as they come (a rerun skips the types
already there). Each type runs in a process of its own, so that one that crashes the interpreter is a row too.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HIDDEN, HEADS, HEAD_DIM, VOCAB = 64, 4, 16, 256
_PROBE_LAYERS = 24  # the layer count whose built layers the period is read from
_SIZE = re.compile(r"(size|_dim|_rank|inner|_embd|_embed|d_model|d_ff|ffn|width)s?$")
_NOT_SIZE = re.compile(r"vocab|position|window|chunk|conv|kernel|state_size|time_step|patch|image|group_size|"
                       r"bucket|num_|n_|block_size|_ctx|cache")
_HIDDEN = ("hidden_size", "n_embd", "n_embed", "d_model", "dim", "model_dim", "embed_dim")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
          "decoder_attention_heads")
_KV = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_routed")
_LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
_PER_TOK = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k")
# LFM2-8B-A1B's published config: short-convolution layers with a full-attention layer among them (its
# layer_types); transformers' Lfm2MoeConfig leaves layer_types None and its model indexes it.
_UNSET_LAYER_TYPES = {"lfm2_moe": ("conv", "conv", "full_attention")}
_LAYER_KEYS = _LAYERS + ("num_encoder_layers", "num_decoder_layers", "encoder_layers")
# Defaults transformers' config classes leave unset (None) though their modelling code needs a number; a published
# checkpoint's config.json sets each of them. Filled only where the default is None.
_UNSET_SIZES = {"head_dim": HEAD_DIM, "num_key_value_heads": HEADS, "n_routed_experts": 4, "n_shared_experts": 1,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "indexer_n_heads": HEADS,
                "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 32,
                "indexer_compress_ratio": 4}


def shrink(cfg: dict, layers: int, truncate_lists: bool = False) -> dict:
    """A transformers config dict with small widths and ``layers`` layers (module docstring). A per-layer list is
    dropped, so that the config class derives it for the new count, or, with ``truncate_lists`` (for the classes
    that do not derive it: Llama 4's layer_types, Zamba2's layers_block_type, GPT-Neo's attention_layers), cut to
    its first ``layers`` entries, the pattern's start."""
    out = {}
    hidden_old = next((cfg[k] for k in _HIDDEN if isinstance(cfg.get(k), int) and cfg[k] > 0), None) or 1024
    scale = HIDDEN / hidden_old
    drop = {"_name_or_path", "architectures", "torch_dtype", "dtype", "transformers_version", "_commit_hash",
            "bos_token_id", "eos_token_id", "pad_token_id", "auto_map", "quantization_config"}
    old_layers = next((cfg[k] for k in _LAYERS if isinstance(cfg.get(k), int) and cfg[k] > 0), None)
    for key, value in cfg.items():
        if key in drop:
            continue
        if isinstance(value, dict) and "model_type" in value:  # a sub-config (text_config): shrunk alike
            out[key] = shrink(value, layers, truncate_lists)
            continue
        if key == "per_layer_config" and isinstance(value, dict):  # {layer index: its own sizes} (Gemma 4)
            out[key] = {i: _shrunk_overrides(v) for i, v in value.items() if str(i).isdigit() and int(i) < layers}
            continue
        if isinstance(value, list) and old_layers and len(value) == old_layers and "rope" not in key:
            if truncate_lists:
                out[key] = value[:layers]
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            out[key] = value
            continue
        out[key] = _shrunk_int(key, value, scale)
    for key in _HIDDEN:
        if key in cfg:
            out[key] = HIDDEN
    heads_old = next((cfg[k] for k in _HEADS if isinstance(cfg.get(k), int)), None)
    for key in _HEADS:
        if key in cfg:
            out[key] = HEADS
    for key in _KV:
        if isinstance(cfg.get(key), int) and heads_old:
            out[key] = 1 if cfg[key] == 1 else HEADS if cfg[key] >= heads_old else 2
    for key in ("head_dim", "kv_channels", "attention_head_size", "d_head"):
        if isinstance(cfg.get(key), int):  # (MLA's head_dim is its rotary part)
            out[key] = HEAD_DIM // 2 if isinstance(cfg.get("qk_rope_head_dim"), int) else HEAD_DIM
    for key in _LAYER_KEYS:
        if key in cfg:
            out[key] = layers
    if not any(key in cfg for key in _LAYER_KEYS):
        out["num_hidden_layers"] = layers
    if all(isinstance(cfg.get(k), int) for k in ("n_input_layers", "n_recurrent_layers", "n_output_layers")):
        out.update(n_input_layers=1, n_output_layers=1, n_recurrent_layers=layers - 2)  # (Dory: they sum to it)
    for key, value in _UNSET_SIZES.items():
        if key in cfg and cfg[key] is None:
            out[key] = value
    if cfg.get("is_decoder") is False:  # a causal LM head wants the decoder (Reformer refuses otherwise)
        out["is_decoder"] = True
    _mamba_heads(cfg, out)
    for key in _EXPERTS:
        if isinstance(cfg.get(key), int) and cfg[key] > 4:
            out[key] = 4
    for key in _PER_TOK:
        if isinstance(cfg.get(key), int) and cfg[key] > 2:
            out[key] = 2
    for key in cfg:  # (Marian's decoder_vocab_size, Gemma 3n's vocab_size_per_layer_input too)
        if "vocab_size" in key and isinstance(cfg[key], int) and cfg[key] > VOCAB:
            out[key] = VOCAB
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_sequence_length"):
        if isinstance(cfg.get(key), int):
            out[key] = 512
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # (the defaults can lie past the new vocabulary)
        if isinstance(cfg.get(key), int):
            out[key] = 0
    for key, value in (("rotary_dim", HEAD_DIM // 2), ("qk_rope_head_dim", HEAD_DIM // 2), ("rope_dim", HEAD_DIM // 2),
                       ("qk_nope_head_dim", HEAD_DIM), ("v_head_dim", HEAD_DIM), ("kv_lora_rank", 32),
                       ("q_lora_rank", 32)):
        if isinstance(cfg.get(key), int):
            out[key] = value
    for key in ("qk_head_dim", "head_dim"):  # DeepSeek's qk_head_dim, dots3's sliding layers' head_dim: derived
        if (isinstance(cfg.get(key), int) and "qk_nope_head_dim" in out and "qk_rope_head_dim" in out
                and cfg[key] == cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]):
            out[key] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if isinstance(cfg.get("attention_types"), list) and isinstance(cfg.get("attention_layers"), list):
        pattern = cfg["attention_types"][0][0]  # GPT-Neo's [[pattern, repeats]], expanded to one per layer
        whole, rest = divmod(layers, len(pattern))
        out["attention_types"] = [[pattern, whole]] + ([[pattern[:rest], 1]] if rest else [])
    if isinstance(cfg.get("axial_pos_embds_dim"), list):  # Reformer's axial position widths sum to the hidden size
        dims = cfg["axial_pos_embds_dim"]
        out["axial_pos_embds_dim"] = [HIDDEN * d // sum(dims) for d in dims]
    if isinstance(cfg.get("attn_config"), dict) and "rope_theta" not in cfg["attn_config"]:
        # DBRX reads rope_theta from attn_config, and clamps q, k and v by clip_qkv (torch.clamp refuses two Nones);
        # DBRX's published config sets both (rope_theta 500,000, clip_qkv 8)
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        out["attn_config"] = {**cfg["attn_config"], "rope_theta": theta,
                              "clip_qkv": cfg["attn_config"].get("clip_qkv") or 8.0}
    if cfg.get("model_type") in _UNSET_LAYER_TYPES and cfg.get("layer_types") is None:
        pattern = _UNSET_LAYER_TYPES[cfg["model_type"]]
        out["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    experts = next((out[k] for k in _EXPERTS if isinstance(out.get(k), int)), None)
    if isinstance(cfg.get("n_group"), int) and experts and cfg["n_group"] > 1:
        out["n_group"] = 2 if experts % 2 == 0 else 1  # (the router views the experts as n_group groups)
        if isinstance(cfg.get("topk_group"), int):
            out["topk_group"] = min(cfg["topk_group"], out["n_group"])
    if isinstance(cfg.get("sliding_window"), int) and cfg["sliding_window"] > 0:
        out["sliding_window"] = 32  # shorter than the traced sequence, so the window is reached
    return out


def _mamba_heads(cfg: dict, out: dict) -> None:
    """Mamba-2's heads times head width equal expand x hidden (the config classes check it): at most HEADS heads,
    their width derived from the shrunk hidden size."""
    for heads, width, expand in (("mamba_n_heads", "mamba_d_head", "mamba_expand"),
                                 ("num_heads", "head_dim", "expand")):
        if not all(isinstance(cfg.get(k), int) for k in (heads, width, expand)):
            continue
        hidden_old = next((cfg[k] for k in _HIDDEN if isinstance(cfg.get(k), int)), None)
        if hidden_old and cfg[heads] * cfg[width] == cfg[expand] * hidden_old:
            out[heads] = min(cfg[heads], HEADS)
            out[width] = cfg[expand] * HIDDEN // out[heads]


def _shrunk_overrides(entry: dict) -> dict:
    """One layer's own sizes in a per_layer_config, shrunk as the config's own: heads and head widths to the small
    ones, other sizes by the hidden size's ratio."""
    if not isinstance(entry, dict):
        return entry
    small = {**{k: HEADS for k in _HEADS + _KV}, "head_dim": 2 * HEAD_DIM, "kv_lora_rank": 32,
             "qk_nope_head_dim": HEAD_DIM, "v_head_dim": HEAD_DIM}
    out = {}
    for key, value in entry.items():
        if isinstance(value, bool) or not isinstance(value, int):
            out[key] = value
        elif key in small:
            out[key] = small[key]
        elif key in _EXPERTS:
            out[key] = min(value, 4)
        else:
            out[key] = _shrunk_int(key, value, HIDDEN / 1024)
    return out


def _derives_per_layer_lists(model_type: str, defaults: dict) -> bool:
    """Whether the config class accepts the shrunk config with its per-layer lists dropped (it derives them)."""
    from transformers import AutoConfig

    shrunk = {k: v for k, v in shrink(defaults, _PROBE_LAYERS).items() if k != "model_type"}
    try:
        AutoConfig.for_model(model_type, **shrunk)
    except Exception:  # noqa: BLE001 (any refusal: try the lists cut instead)
        return False
    return True


def _shrunk_int(key: str, value: int, scale: float) -> int:
    if _SIZE.search(key) and not _NOT_SIZE.search(key) and value > 64:
        return max(16, round(value * scale / 16) * 16)
    return value


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:150] or type(exc).__name__
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {text} ({Path(where.filename).name}:{where.lineno})"


class _TimeUp(Exception):
    pass


def _alarm(signum, frame):
    raise _TimeUp()


def one_type(model_type: str, settings, limit_s: int) -> dict:
    """Record, extrapolate and trace in full one model_type; a dict with the outcome."""
    from transformers import AutoConfig

    from trainmem import recorded
    from trainmem.meta_count import spec_by_building
    from trainmem.trace import trace_step

    row: dict = {"model_type": model_type}
    started = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    stage = "config"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            defaults = AutoConfig.for_model(model_type).to_dict()
        truncate = not _derives_per_layer_lists(model_type, defaults)
        probe = dict(shrink(defaults, _PROBE_LAYERS, truncate), model_type=model_type)
        stage = "build"
        plan = recorded.layer_plan(probe)[0]
        layers = max(5, plan.prefix + 3 * plan.period + (1 if plan.period > 1 else 0))
        if plan.prefix + plan.period >= _PROBE_LAYERS:  # no layer repeats among the probe's (DiffLlama's per-layer
            layers = 5  # lambda_init): every layer is traced whichever the count, so the smallest count will do
        cfg = dict(shrink(defaults, layers, truncate), model_type=model_type)
        try:
            spec = spec_by_building(cfg, model_type, "every_model_type")
        except Exception:  # noqa: BLE001 (a pattern that must end on a whole period, as Gemma 4's per-layer sizes)
            if plan.period == 1:
                raise
            layers -= 1
            cfg = dict(shrink(defaults, layers, truncate), model_type=model_type)
            spec = spec_by_building(cfg, model_type, "every_model_type")
        stage = "recorded"
        t = time.perf_counter()
        phases, plan = recorded.record(cfg, settings, spec, progress=False)
        row.update(layers=layers, period=plan.period, prefix=plan.prefix, counts=list(plan.counts),
                   recorded_s=round(time.perf_counter() - t, 2))
        stage = "full trace"
        t = time.perf_counter()
        full = trace_step(cfg, settings, spec).phases
        row["full_s"] = round(time.perf_counter() - t, 2)
        errors = {a.name: (a.allocated_bytes - b.allocated_bytes) / b.allocated_bytes for a, b in zip(phases, full)}
        row.update(errors=errors, exact=all(a == b for a, b in zip(phases, full)),
                   worst=max(abs(e) for e in errors.values()))
        row["outcome"] = "within 1%" if row["worst"] <= 0.01 else "off"
    except _TimeUp:
        row.update(outcome="timeout", why=f"{stage}: over {limit_s} s")
    except Exception as exc:  # noqa: BLE001 (each type's failure is its row)
        row.update(outcome="error", why=f"{stage}: {_one_line(exc)}")
        if stage == "recorded":  # is it the traced path's failure, or does the full trace fail the same way?
            stage = "full trace after the recorded one failed"
            try:
                trace_step(cfg, settings, spec)
                row["why"] = "the traced path fails where a full trace runs: " + row["why"]
            except _TimeUp:
                row["why"] += f" (the full trace ran past {limit_s} s)"
            except Exception as full_exc:  # noqa: BLE001
                row["why"] = f"the trace itself cannot run this step: {_one_line(full_exc)}"
    finally:
        signal.alarm(0)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def describe(row: dict) -> str:
    if row["outcome"] in ("within 1%", "off"):
        worst = max(row["errors"].items(), key=lambda kv: abs(kv[1]))
        pattern = f"period {row['period']}" + (f" after {row['prefix']}" if row["prefix"] else "")
        how = f"recorded {' and '.join(map(str, row['counts']))} of {row['layers']} layers, {pattern}"
        result = "exact (every byte)" if row["exact"] else f"worst {worst[0]} {worst[1]:+.3%}"
        return f"{row['outcome']}: {result}; {how}"
    return f"{row['outcome']}: {row['why']}"


def _in_child(model_type: str, args) -> dict:
    """``one_type`` in a process of its own: a type whose build or trace crashes the interpreter (a segfault in
    dots1's fake-tensor step) or hangs in C code is its own row, not the end of the run."""
    command = [sys.executable, __file__, "--one", model_type, "--limit-s", str(args.limit_s),
               "--batch", str(args.batch), "--seq", str(args.seq)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.limit_s + 60)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "outcome": "timeout", "why": f"over {args.limit_s + 60} s (killed)"}
    last = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    if done.returncode == 0 and last:
        return json.loads(last[0])
    how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
    return {"model_type": model_type, "outcome": "error", "why": f"the process died ({how})"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: all causal-LM types)")
    parser.add_argument("--limit-s", type=int, default=240, help="per type")
    parser.add_argument("--out", default="every_model_type.jsonl")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=1, help="types run at once, each in a process of its own")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (the child: one type, its row as JSON on stdout)
    args = parser.parse_args(argv)
    from trainmem.progress import quiet_libraries

    quiet_libraries()
    from trainmem.settings import TrainingSettings

    settings = TrainingSettings(batch=args.batch, seq=args.seq)
    if args.one:
        print(json.dumps(one_type(args.one, settings, args.limit_s)), flush=True)
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = args.types.split(",") if args.types else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    out = Path(args.out)
    done = {}
    if out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            done[row["model_type"]] = row
    todo = [t for t in types if t not in done]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(lambda t: _in_child(t, args), todo):
            done[row["model_type"]] = row
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{row['model_type']}: {describe(row)}", flush=True)
    rows = [done[t] for t in types]
    within = sum(r["outcome"] == "within 1%" for r in rows)
    print(f"\n{within} of {len(rows)} types within 1% in every phase "
          f"({sum(r.get('exact', False) for r in rows)} exact); batch {args.batch} x {args.seq}, "
          f"{settings.recipe}, {settings.attention}")
    print("\n| model_type | result |\n|---|---|")
    for r in rows:
        print(f"| `{r['model_type']}` | {describe(r).replace('|', '/')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
