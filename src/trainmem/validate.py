"""trainmem validate: the estimate against the trace over a matrix of models and settings, as a Markdown report.

Each row traces one steady-state training step (``trainmem.trace``) and estimates the same set-up; it reports the
peak of the step (the largest phase) and each category of memory at that peak, with the relative error. The full
matrix uses scaled-down configs of each family (same head grouping, MLP ratio, norms and attention code; tiny
widths) so that it runs in minutes on a laptop CPU, plus full-size rows where the trace is affordable.
"""

from __future__ import annotations

import datetime as _dt
import itertools
from dataclasses import dataclass

from .catalog import catalog_config
from .estimate import estimate_model
from .models import spec_from_config
from .settings import make_settings
from .timeline import CATEGORIES

FAMILIES = {  # family -> catalog model it is scaled down from
    "llama": "llama-3-8b", "mistral": "mistral-7b", "qwen2": "qwen2.5-0.5b", "gemma2": "gemma-2-9b",
    "gpt2": "gpt2", "gpt_neox": "pythia-1b", "phi3": "phi-3-mini-4k", "mixtral": "mixtral-8x7b",
}
RECIPES = ("fp32", "amp-bf16", "mixed-bf16", "pure-bf16")
CHECKPOINTING = ("none", "full")
SHAPES = ((1, 128), (4, 64))
OPTIMIZERS = ("adamw", "sgd")
TOTAL_TOLERANCE = 0.03
CATEGORY_TOLERANCE = 0.05


def scale_down(config: dict, heads: int = 4, head_dim: int = 16, layers: int = 3, vocab: int = 512) -> dict:
    """Same family and structure, tiny widths: keeps the query/kv head grouping (at least 2 kv heads where the
    original has more than one), the MLP-to-hidden ratio, the norms and the attention implementation."""
    drop = ("_name_or_path", "torch_dtype", "bos_token_id", "eos_token_id")
    cfg = {k: v for k, v in config.items() if k not in drop}
    cfg["pad_token_id"] = 0  # the real one can lie outside the shrunk vocabulary
    if cfg["model_type"] == "gpt2":
        h = heads * head_dim
        return dict(cfg, n_embd=h, n_head=heads, n_layer=layers, vocab_size=vocab, n_positions=256, n_inner=None,
                    hidden_size=h, num_attention_heads=heads, num_key_value_heads=heads, num_hidden_layers=layers,
                    intermediate_size=4 * h, max_position_embeddings=256)
    h_old, a_old = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_old = cfg.get("num_key_value_heads") or a_old
    group = a_old // kv_old
    heads = max(heads, 2 * group if kv_old > 1 else group) // group * group
    h = heads * head_dim
    cfg.update(hidden_size=h, num_attention_heads=heads, num_key_value_heads=heads // group, head_dim=head_dim,
               num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=256,
               intermediate_size=max(8, round(cfg["intermediate_size"] / h_old * h)))
    if "num_local_experts" in cfg:
        cfg["num_local_experts"] = min(cfg["num_local_experts"], 4)
    return cfg


@dataclass(frozen=True)
class Row:
    family: str
    recipe: str
    checkpointing: str
    batch: int
    seq: int
    optimizer: str
    phase: str
    estimate: dict[str, int]
    trace: dict[str, int]

    @property
    def total_error(self) -> float:
        t = sum(self.trace.values())
        return (sum(self.estimate.values()) - t) / t

    def category_error(self, category: str) -> float | None:
        """Relative error of one category, None where the trace has under 1% of the peak in it (noise)."""
        t, total = self.trace[category], sum(self.trace.values())
        if t < 0.01 * total:
            return None
        return (self.estimate[category] - t) / t

    @property
    def within_tolerance(self) -> bool:
        errors = [self.category_error(c) for c in CATEGORIES]
        return abs(self.total_error) <= TOTAL_TOLERANCE and all(
            e is None or abs(e) <= CATEGORY_TOLERANCE for e in errors)


def run_row(config: dict, family: str, recipe: str, checkpointing: str, batch: int, seq: int,
            optimizer: str, dropout: float = 0.0) -> Row:
    from .trace import trace_step

    # The matrix runs with dropout 0: dropout with full checkpointing is not modelled for every family yet
    # (docs/accuracy.md); tests/test_validate.py checks dropout rows that are.
    settings = make_settings(recipe=recipe, checkpointing=checkpointing, batch=batch, seq=seq, optimizer=optimizer,
                             dropout=dropout)
    traced = trace_step(config, settings, spec_from_config(config))
    est = estimate_model(spec_from_config(config), settings)
    peak = traced.peak
    est_phase = next(p for p in est.phases if p.name == peak.name)
    return Row(family, recipe, checkpointing, batch, seq, optimizer, peak.name, est_phase.by_category(),
               peak.by_category())


FULL_SIZE_FAMILIES = ("llama", "mistral", "qwen2", "gemma2", "gpt2", "gpt_neox", "phi3")
"""Families traced at their real size (up to 9B: a row takes 8-80 s); Mixtral (47B) only scaled down."""
FULL_SIZE_SHAPES = ((1, 1024), (8, 1024))  # GPT-2's context is 1,024; 8 x 1,024 puts activations at the peak


def matrix(quick: bool = False, full_size: bool = False):
    """The rows to run: (family, recipe, checkpointing, (batch, seq), optimizer).

    Scaled-down (default): every family, recipe, checkpointing, shape and optimizer. ``quick``, what CI runs:
    SGD, whose small states leave the peak in forward or backward where the activation model is tested (AdamW's
    peak is mostly its optimizer step, static memory only). ``full_size``: the real configs up to 9B with SGD and
    longer sequences."""
    if full_size:
        families, recipes, shapes, optimizers = FULL_SIZE_FAMILIES, RECIPES, FULL_SIZE_SHAPES, ("sgd",)
    elif quick:
        families, recipes, shapes, optimizers = ("llama", "gpt2", "gemma2", "mixtral"), ("fp32", "pure-bf16"), \
            SHAPES[:1], ("sgd",)
    else:
        families, recipes, shapes, optimizers = tuple(FAMILIES), RECIPES, SHAPES, OPTIMIZERS
    for family, recipe, ckpt, shape, optimizer in itertools.product(families, recipes, CHECKPOINTING, shapes,
                                                                    optimizers):
        if family == "mixtral" and recipe in ("fp32", "amp-bf16"):
            continue  # not traceable: grouped_mm needs bf16 under FakeTensorMode (trace.py)
        yield family, recipe, ckpt, shape, optimizer


def _run(task: tuple, full_size: bool) -> Row:
    family, recipe, ckpt, (batch, seq), optimizer = task
    config = catalog_config(FAMILIES[family])
    if not full_size:
        config = scale_down(config)
    return run_row(config, family, recipe, ckpt, batch, seq, optimizer)


def validate(quick: bool = False, progress=None, full_size: bool = False, jobs: int = 1) -> list[Row]:
    """Run the matrix; ``jobs`` > 1 traces rows in that many worker processes (results in matrix order)."""
    tasks = list(matrix(quick, full_size))
    if jobs <= 1:
        rows = []
        for task in tasks:
            rows.append(_run(task, full_size))
            if progress:
                progress(rows[-1])
        return rows
    import functools
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: each worker imports torch afresh instead of inheriting a forked interpreter's threads.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = []
        for row in pool.map(functools.partial(_run, full_size=full_size), tasks):
            rows.append(row)
            if progress:
                progress(row)
    return rows


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2%}"


MATRIX_FULL_SIZE = "## Matrix: full-size configs"
MATRIX_SCALED = "## Matrix: scaled-down configs"
KEPT_SECTIONS = ("## Tracing full-size models: time and memory", "## CUDA measurements")
"""From benchmarks/ scripts (trace timings, CUDA measurements): kept as they are when the report is rewritten."""


def _sections(text: str) -> tuple[str, dict[str, str]]:
    """A Markdown document as its intro and its "## " sections (heading line -> whole section text)."""
    intro, sections, current = [], {}, None
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            current = line.rstrip("\n")
            sections[current] = ""
        if current is None:
            intro.append(line)
        else:
            sections[current] += line
    return "".join(intro), sections


def _matrix_section(rows: list[Row], full_size: bool, quick: bool) -> str:
    import torch
    import transformers

    ok = sum(r.within_tolerance for r in rows)
    worst = max(rows, key=lambda r: abs(r.total_error))
    scored = [(abs(e), e, c, r) for r in rows for c in CATEGORIES if (e := r.category_error(c)) is not None]
    _, cat_error, cat, cat_row = max(scored, key=lambda x: x[0])
    command = "trainmem validate" + (" --full-size" if full_size else "") + (" --quick" if quick else "")
    what = ("The real configs of the catalog (Llama-3-8B, Mistral-7B, Qwen2.5-0.5B, Gemma-2-9B, GPT-2, Pythia-1B, "
            "Phi-3-mini), SGD. At these shapes most peaks are the optimizer step or the end of backward (the "
            "embedding's V x h gradient), where activations are under 1% of the peak and not scored: this matrix "
            "checks the timeline at real size, the scaled-down one the activation terms." if full_size else
            "Scaled-down configs of each family (3 layers, 4+ heads of 16, vocabulary 512; `validate.scale_down`).")
    lines = [
        MATRIX_FULL_SIZE if full_size else MATRIX_SCALED,
        "",
        f"`{command}` on {_dt.date.today().isoformat()} with torch {torch.__version__}, transformers "
        f"{transformers.__version__}. {what} Dropout 0.",
        "",
        f"**{ok} of {len(rows)} rows within tolerance.** Largest total error: {worst.total_error:+.2%} "
        f"({worst.family}, {worst.recipe}, checkpointing {worst.checkpointing}, b={worst.batch} s={worst.seq}, "
        f"{worst.optimizer}). Largest category error: {cat_error:+.2%} ({cat}; {cat_row.family}, {cat_row.recipe}, "
        f"checkpointing {cat_row.checkpointing}, b={cat_row.batch} s={cat_row.seq}, {cat_row.optimizer}).",
        "",
        "| family | recipe | ckpt | b x s | optimizer | peak phase | estimate | trace | total | params | grads | "
        "states | activations | temporaries | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cats = " | ".join(_pct(r.category_error(c)) for c in CATEGORIES)
        lines.append(
            f"| {r.family} | {r.recipe} | {r.checkpointing} | {r.batch}x{r.seq} | {r.optimizer} | {r.phase} | "
            f"{sum(r.estimate.values()):,} | {sum(r.trace.values()):,} | {_pct(r.total_error)} | {cats} | "
            f"{'yes' if r.within_tolerance else '**no**'} |")
    return "\n".join(lines) + "\n\n"


_INTRO = f"""# Accuracy: estimate vs trace

Each row traces one steady-state training step of the transformers model (FakeTensorMode, MemTracker,
allocations rounded to 512 bytes like CUDA; `trainmem trace`) and compares the estimate with it at the traced
peak phase, in total and per category. Tolerance: {TOTAL_TOLERANCE:.0%} on the total, {CATEGORY_TOLERANCE:.0%} on each
category (parameters, gradients, optimizer states, activations, temporaries); a category under 1% of the peak is
not scored. `trainmem validate` rewrites the scaled-down matrix, `trainmem validate --full-size --jobs 2` the
full-size one, each keeping the other sections; `benchmarks/cuda_accuracy.py` rewrites the CUDA section and
`benchmarks/trace_full_size.py` prints the trace timings.

"""

_STATIC_SECTIONS = {
    "## CI": """## CI

CI runs the reduced matrix (`trainmem validate --quick`, 14 rows: Llama, GPT-2 and Gemma 2 in fp32 and pure-bf16,
Mixtral in pure-bf16, checkpointing none and full, batch 1 x 128, SGD so that the peak falls in forward or
backward) and fails when one of its rows leaves its tolerance (tests/test_validate.py).

""",
    "## Where the trace corrects a plain MemTracker run": """## Where the trace corrects a plain MemTracker run

- Recomputed activations: MemTracker tags what a checkpointed layer's recompute allocates as activations only
  inside the submodules it calls (the layer's own ops, e.g. the residual adds, became temporaries) and leaves its
  marker set after an early-stopped recompute; the trace marks the whole recompute itself
  (`TrainingStep.recomputing`).
- Packed-sequence check: without a KV cache (checkpointing) transformers inspects `position_ids` for packed
  sequences, which fake tensors cannot answer, and would build a dense causal mask (and repeat k and v for SDPA)
  that a real run with one sequence per row does not build; the trace answers the check as a real run does.

""",
    "## What the trace does not see": """## What the trace does not see

- Dropout: on the CPU, SDPA with dropout falls back to the math kernel and dropout keeps float masks; the trace
  runs CUDA's kernels instead (the flash kernel, fused bool-mask dropout). The matrix runs with dropout 0;
  tests/test_validate.py checks five dropout-0.1 rows (GPT-2, Llama, Gemma 2, Phi-3, Mixtral). Not modelled yet:
  dropout together with full checkpointing in Gemma 2 under amp-bf16 (total -2.6% to -5.7%, activations -15% to
  -18%) and GPT-NeoX in fp32 (total -2.0% to -2.5%), where the recompute keeps tensors the model does not count.
- CPU autocast's op lists differ slightly from CUDA's.
- The CUDA context, cuBLAS workspaces and the caching allocator's fragmentation are not allocations: the
  estimate's `reserved` and `device` figures add them (docs/method.md section 5).
- Host memory: non-reentrant checkpointing keeps each layer's CPU RNG state (5,056 bytes), on the host.
""",
}

_ORDER = (*KEPT_SECTIONS, MATRIX_FULL_SIZE, MATRIX_SCALED, *_STATIC_SECTIONS)


def replace_sections(existing: str | None, new_sections: dict[str, str]) -> str:
    """The accuracy report ``existing`` with ``new_sections`` (heading -> section text, heading line included)
    put in place and the generated static sections refreshed; every other section is kept, in the report's order.
    ``benchmarks/cuda_accuracy.py`` writes its section through this too."""
    _, sections = _sections(existing or "")
    sections.update(_STATIC_SECTIONS)
    sections.update(new_sections)
    ordered = [h for h in _ORDER if h in sections] + [h for h in sections if h not in _ORDER]
    body = "\n\n".join(sections[h].rstrip("\n") for h in ordered)  # one blank line between sections
    return _INTRO + body + "\n"


def markdown(rows: list[Row], full_size: bool = False, quick: bool = False, existing: str | None = None) -> str:
    """The accuracy report with this run's matrix section; every other section of ``existing`` (the report
    being rewritten) is kept: the other matrix, the trace timings and the CUDA measurements."""
    heading = MATRIX_FULL_SIZE if full_size else MATRIX_SCALED
    return replace_sections(existing, {heading: _matrix_section(rows, full_size, quick)})


# --------------------------------------------------------------------------------------------------------------
# Random models: a differential test of the estimate against the trace on configs nobody chose
# --------------------------------------------------------------------------------------------------------------

RANDOM_RECIPES = ("fp32", "amp-bf16", "amp-fp16", "mixed-bf16", "mixed-fp16", "mixed-bf16-fp32grads", "pure-bf16",
                  "pure-bf16-bf16states")
RANDOM_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor")


def random_case(pick) -> tuple[dict, dict]:
    """One random small model of a supported type and one random training set-up: ``(config, settings)``.

    ``pick(label, options)`` returns one of ``options``: ``random.Random(seed).choice`` for ``trainmem validate
    --random``, a hypothesis draw in tests/test_random_models.py, so both explore the same space."""
    from .models import SUPPORTED_MODEL_TYPES

    # Proportions of real models (fake tensors cost the same at any size): head dims that are and are not
    # multiples of 8, grouped-query and multi-query attention, MLPs 2-4x wide, vocabularies 8-64x the width.
    model_type = pick("model_type", SUPPORTED_MODEL_TYPES)
    head_dim = pick("head_dim", (64, 80, 96, 128, 100, 36))
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        head_dim = head_dim // 16 * 16  # grouped_mm needs 16-byte aligned rows
    kv = pick("kv_heads", (1, 2, 4))
    group = pick("group", (1, 2, 4))
    heads = kv * group
    hidden = heads * head_dim
    layers = pick("layers", (1, 2, 3))
    vocab = hidden * pick("vocab_ratio", (8, 16, 64)) + pick("vocab_odd", (0, 7))
    inter = int(hidden * pick("mlp_ratio", (2.0, 2.6875, 4.0))) // 16 * 16
    seq = pick("seq", (128, 256, 512, 1000))
    window = pick("sliding_window", (None, seq // 2, seq, 4 * seq))
    dropout = pick("config_dropout", (0.0, 0.1))
    tie = pick("tie_word_embeddings", (True, False))
    bias = pick("bias", (True, False))
    cfg: dict = {"model_type": model_type, "vocab_size": vocab, "tie_word_embeddings": tie, "pad_token_id": 0,
                 "bos_token_id": 1, "eos_token_id": 2}
    llama_like = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                      num_hidden_layers=layers, intermediate_size=inter, max_position_embeddings=4096,
                      attention_dropout=dropout)
    if model_type in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                      "gemma3_text", "phi3"):
        cfg.update(llama_like)
        if pick("explicit_head_dim", (False, True)):
            cfg["head_dim"] = pick("other_head_dim", (64, 128, 72))
        elif model_type in ("qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text"):
            cfg["head_dim"] = head_dim  # these families default to 128 or 256, too large for a tiny model
    if model_type == "llama":
        cfg.update(attention_bias=bias, mlp_bias=pick("mlp_bias", (False, True)))
    elif model_type in ("mistral", "mixtral"):
        cfg["sliding_window"] = window
        if model_type == "mixtral":
            experts = pick("experts", (2, 3, 4))
            cfg.update(num_local_experts=experts, num_experts_per_tok=pick("top_k", tuple(range(1, experts + 1))))
    elif model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if window is not None:
            cfg.update(use_sliding_window=True, sliding_window=window, max_window_layers=pick("window_layers", (0, 1)))
        if model_type == "qwen3":
            cfg["attention_bias"] = bias
        if model_type.endswith("moe"):
            experts = pick("experts", (2, 3, 4))
            cfg.update(num_experts=experts, num_experts_per_tok=pick("top_k", tuple(range(1, experts + 1))),
                       moe_intermediate_size=pick("moe_intermediate", (hidden // 64 * 16, hidden)),
                       decoder_sparse_step=pick("sparse_step", (1, 2)), mlp_only_layers=pick("mlp_only", ([], [0])),
                       norm_topk_prob=pick("norm_topk", (False, True)))
            if model_type == "qwen2_moe":
                cfg.update(shared_expert_intermediate_size=pick("shared", (hidden // 2, hidden)), qkv_bias=bias)
    elif model_type in ("gemma2", "gemma3_text"):
        cfg.update(sliding_window=window or 4096, query_pre_attn_scalar=head_dim)
        if model_type == "gemma2":
            cfg.update(attn_logit_softcapping=pick("attn_softcap", (None, 50.0)),
                       final_logit_softcapping=pick("final_softcap", (None, 30.0)))
    elif model_type == "phi3":
        cfg.update(resid_pdrop=dropout, embd_pdrop=dropout, sliding_window=window,
                   partial_rotary_factor=pick("partial_rotary", (1.0, 0.5)))
    elif model_type == "gpt2":
        cfg = {k: v for k, v in cfg.items() if k != "pad_token_id"}
        cfg.update(n_embd=hidden, n_head=heads, n_layer=layers, n_positions=4096, n_inner=pick("n_inner", (None, inter)),
                   attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout,
                   activation_function=pick("activation", ("gelu_new", "gelu", "relu")))
    elif model_type == "gpt_neox":
        cfg.update(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers, intermediate_size=inter,
                   max_position_embeddings=4096, attention_dropout=dropout, hidden_dropout=dropout,
                   use_parallel_residual=pick("parallel_residual", (True, False)), attention_bias=bias,
                   rotary_pct=pick("rotary_pct", (0.25, 0.5, 1.0)))
    elif model_type == "falcon":
        layout = pick("falcon_layout", ("7b", "sequential", "new", "alibi"))
        cfg.update(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers, bias=bias,
                   attention_dropout=dropout, hidden_dropout=dropout, max_position_embeddings=4096,
                   ffn_hidden_size=pick("ffn", (None, inter)))
        if layout == "7b":
            cfg.update(multi_query=True, parallel_attn=True, new_decoder_architecture=False)
        elif layout == "sequential":
            cfg.update(multi_query=pick("multi_query", (True, False)), parallel_attn=False,
                       new_decoder_architecture=False)
        elif layout == "new":
            cfg.update(new_decoder_architecture=True, num_kv_heads=kv, parallel_attn=True,
                       num_ln_in_parallel_attn=pick("ln_in_parallel", (None, 1, 2)))
        else:
            cfg.update(alibi=True, multi_query=pick("multi_query", (True, False)), parallel_attn=pick("parallel",
                       (True, False)), new_decoder_architecture=False)
    elif model_type == "opt":
        pre = pick("layer_norm_before", (True, False))
        cfg.update(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers, ffn_dim=inter,
                   max_position_embeddings=4096, do_layer_norm_before=pre, enable_bias=bias, dropout=dropout,
                   attention_dropout=dropout, word_embed_proj_dim=pick("proj", (None, hidden // 2)) if pre else None,
                   activation_function=pick("activation", ("relu", "gelu")))
    elif model_type == "bloom":
        cfg.update(hidden_size=hidden, n_head=heads, n_layer=layers, hidden_dropout=dropout,
                   attention_dropout=dropout,
                   apply_residual_connection_post_layernorm=pick("post_ln_residual", (False, True)))
    elif model_type == "deepseek_v3":
        rope = pick("rope_dim", (16, 32))
        experts = pick("experts", (2, 4))
        cfg.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads, num_hidden_layers=layers,
                   intermediate_size=inter, moe_intermediate_size=pick("moe_intermediate", (hidden // 64 * 16, hidden // 32 * 16)),
                   n_routed_experts=experts, num_experts_per_tok=pick("top_k", tuple(range(1, experts + 1))),
                   n_shared_experts=pick("shared", (0, 1)), first_k_dense_replace=pick("dense_layers", (0, 1)),
                   n_group=1, topk_group=1, q_lora_rank=pick("q_lora", (None, hidden // 2)),
                   kv_lora_rank=pick("kv_lora", (hidden // 8, hidden // 4)), qk_nope_head_dim=pick("nope_dim", (32, 64)),
                   qk_rope_head_dim=rope, v_head_dim=pick("v_dim", (32, 64, 96)),
                   max_position_embeddings=4096, attention_dropout=dropout, attention_bias=bias)
    recipe = pick("recipe", RANDOM_RECIPES)
    settings = dict(
        recipe=recipe, optimizer=pick("optimizer", RANDOM_OPTIMIZERS), batch=pick("batch", (1, 2, 4)), seq=seq,
        attention=pick("attention", ("sdpa", "eager")), checkpointing=pick("checkpointing", ("none", "full")),
        dropout=pick("dropout", (None, 0.0, 0.1)), grad_accum=pick("grad_accum", (1, 1, 2)))
    return cfg, settings
