"""The traced path (trainmem.recorded) on every causal-LM model type transformers ships, against a full trace.

For each model_type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: its default config
(``AutoConfig.for_model(type)``) shrunk to small widths (hidden 64, 4 heads of 16, vocabulary 256, at most 4
experts; per-layer lists dropped so that the config class derives them for the new layer count, or cut where it
does not), with enough layers for the layer pattern to repeat three times (``prefix + 3 * period + 1``, so the
remainder is exercised too where the period is over 1), and at least 5 (a period of one layer is then recorded at
2 and 3 layers and extrapolated over 2 more). The traced path records its two reduced traces and extrapolates;
the same config is then traced in full (trace.trace_step), and every phase's allocated bytes are compared.

    PYTHONPATH=src python benchmarks/every_model_type.py [--types a,b] [--limit-s 240] [--out results.jsonl]

Prints one line per type (within 1% in every phase / the worst phase's error / why it could not run) and the
table for docs/accuracy.md at the end; results are appended to ``--out`` as they come (a rerun skips the types
already there).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

HIDDEN, HEADS, HEAD_DIM, VOCAB = 64, 4, 16, 256
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
    for key in ("head_dim", "kv_channels", "attention_head_size"):
        if isinstance(cfg.get(key), int):  # (MLA's head_dim is its rotary part)
            out[key] = HEAD_DIM // 2 if isinstance(cfg.get("qk_rope_head_dim"), int) else HEAD_DIM
    for key in _LAYERS:
        if key in cfg or key == "num_hidden_layers":
            out[key] = layers
    for key in _EXPERTS:
        if isinstance(cfg.get(key), int) and cfg[key] > 4:
            out[key] = 4
    for key in _PER_TOK:
        if isinstance(cfg.get(key), int) and cfg[key] > 2:
            out[key] = 2
    if isinstance(cfg.get("vocab_size"), int):
        out["vocab_size"] = VOCAB
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
    if isinstance(cfg.get("qk_head_dim"), int) and "qk_nope_head_dim" in out and "qk_rope_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]  # (DeepSeek's, derived)
    experts = next((out[k] for k in _EXPERTS if isinstance(out.get(k), int)), None)
    if isinstance(cfg.get("n_group"), int) and experts and cfg["n_group"] > 1:
        out["n_group"] = 2 if experts % 2 == 0 else 1  # (the router views the experts as n_group groups)
        if isinstance(cfg.get("topk_group"), int):
            out["topk_group"] = min(cfg["topk_group"], out["n_group"])
    if isinstance(cfg.get("sliding_window"), int) and cfg["sliding_window"] > 0:
        out["sliding_window"] = 32  # shorter than the traced sequence, so the window is reached
    return out


def _derives_per_layer_lists(model_type: str, defaults: dict) -> bool:
    """Whether the config class accepts the shrunk config with its per-layer lists dropped (it derives them)."""
    from transformers import AutoConfig

    shrunk = {k: v for k, v in shrink(defaults, 24).items() if k != "model_type"}
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
        probe = dict(shrink(defaults, 24, truncate), model_type=model_type)
        stage = "build"
        plan = recorded.layer_plan(probe)[0]
        layers = max(5, plan.prefix + 3 * plan.period + (1 if plan.period > 1 else 0))
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: all causal-LM types)")
    parser.add_argument("--limit-s", type=int, default=240, help="per type")
    parser.add_argument("--out", default="every_model_type.jsonl")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    from trainmem.progress import quiet_libraries

    quiet_libraries()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from trainmem.settings import TrainingSettings

    settings = TrainingSettings(batch=args.batch, seq=args.seq)
    types = args.types.split(",") if args.types else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    out = Path(args.out)
    done = {}
    if out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            done[row["model_type"]] = row
    for model_type in types:
        if model_type not in done:
            done[model_type] = one_type(model_type, settings, args.limit_s)
            with out.open("a") as f:
                f.write(json.dumps(done[model_type]) + "\n")
        print(f"{model_type}: {describe(done[model_type])}", flush=True)
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
