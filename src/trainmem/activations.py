"""Activation memory: the tensors a training forward pass saves for backward, term by term.

Every term below is one tensor that a transformers module's forward creates and an autograd node keeps,
with its size in bytes per token (per element of batch x sequence). The terms follow the module code of
``transformers/models/<family>/modeling_<family>.py`` (5.x) and the autograd formulas of
``torch/csrc/autograd/FunctionsManual.cpp`` / ``tools/autograd/derivatives.yaml`` (which inputs or outputs each
op saves); ``tests/test_activations.py`` checks the per-layer totals against what PyTorch actually saves
(``torch.autograd.graph.saved_tensors_hooks``) for scaled-down configs of each family. docs/method.md writes the
per-layer sums in closed form and compares them with Korthikanti et al. (2022).

Conventions: ``h`` hidden size, ``a`` query heads, ``kv`` key/value heads, ``d`` head dim, ``I`` MLP width,
``s`` sequence length, ``V`` vocabulary. ``c`` is the byte size of the compute dtype (matmul outputs), ``r`` of
the residual stream (fp32 under autocast, else the weights' dtype). A tensor that several ops save counts once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property

from . import compiled_loss
from .kernels import (EAGER, EFFICIENT, EFFICIENT_MASK_MULTIPLE, FLASH, FLASH_MAX_HEAD_DIM, MATH,
                      efficient_lse_per_token, efficient_mask_width, flash_head_dim, sdpa_backend)
from .models import MLP, Attention, Layer, ModelSpec, MoE, runs_of
from .owners import OwnerKind
from .recipes import DTYPE_BYTES, Recipe
from .settings import OFFLOAD_MIN_BYTES, OUTPUT_CHUNKS, TrainingSettings

FP32 = 4
INDEX = 8  # int64 indices (embedding input, routing indices, labels)
MASK = 1  # torch.bool dropout masks


@dataclass(frozen=True)
class Term:
    """One saved tensor (or a group of identical ones), in bytes per token.

    ``name`` is for people (``--explain``); the timeline decides when a term is freed from ``module`` and
    ``kind`` only, so rewording a label cannot move the peak."""

    name: str
    bytes_per_token: float
    module: str = ""
    """The module whose backward frees it, where the timeline needs to know: a norm ("input_norm",
    "post_attention_norm", "pre_feedforward_norm", "post_feedforward_norm", "mlp_norm", "final_norm",
    "embedding_norm"), "routed_experts", "shared_expert", "lm_head", "project_in", "embedding_dropout" or
    "embedding" (the ids its lookup reads); "" for the rest."""
    kind: str = ""
    """What it is within that module: a norm's "input_fp32", "rsqrt", "normalised" (RMSNorm) or "input", "stats"
    (LayerNorm); the routed experts' "intermediate" (what their gate_up backward frees); the LM head's
    "autocast_weight_copy"; "back_from_host" for the offloaded layer inputs backward has brought back."""
    input_of: str = ""
    """The Linears that read this tensor, by site (lora.SITE_CONSUMERS: "o_input", "expert_input", ...), where
    ``module`` does not say it already: a frozen Linear does not keep its input for a weight gradient it does not
    take, so a LoRA step drops the tensor (lora.lora_activations) unless ``kind`` is "shared_input" (another op
    keeps it too). Changes no byte of a full fine-tune."""
    input_share: float = 1.0
    """The part of ``bytes_per_token`` that is that input (one term can stand for several tensors: the experts'
    activation and product)."""
    normalised_bytes: float = 0.0
    """Bytes per token of a norm's normalised value within this term (kept for the norm weight's gradient only:
    a frozen norm keeps none)."""
    owner: OwnerKind | None = None
    """Whose it is where the list it is in does not say (``trainmem diff``: diff.py): the loss's terms among the
    head's, the loss's constant among the model's. Changes no byte."""


# Term kinds the attention formulas look terms up by (module ""): what a term is, whatever its label says.
SOFTMAX_PROBABILITIES = "softmax_probabilities"
"""The eager softmax's output, in the softmax's dtype (fp32 when its bytes per token are 4 x heads x seq)."""
COMPUTE_PROBABILITIES = "compute_probabilities"
"""The probabilities cast to the compute dtype or dropped out: what the matmul with v keeps."""
DROPOUT_MASK = "attention_dropout_mask"
CONTIGUOUS_OUTPUT = "attention_contiguous_output"
"""Eager attention's output made contiguous for o_proj."""
SAVED_V = "attention_saved_v"
"""The v the eager matmul with the probabilities keeps (repeated, or a view keeping the fused projection)."""
ALIBI_MASK_COPY = "alibi_mask_copy"
"""Falcon's ALiBi float mask cast or padded per layer for the memory-efficient kernel."""


@dataclass(frozen=True)
class Precision:
    """The byte sizes an activation formula needs, derived from the recipe."""

    compute: int
    """Matmul outputs (bf16/fp16 under autocast or half weights, else fp32)."""
    residual: int
    """The residual stream and norm outputs: fp32 under autocast (weights are fp32), else the weights' dtype."""
    autocast: bool

    @property
    def experts(self) -> int:
        """Routed experts (transformers' grouped_mm): not an autocast op, so they run in the weights' dtype."""
        return self.residual if self.autocast else self.compute

    @classmethod
    def of(cls, recipe: Recipe) -> "Precision":
        compute = DTYPE_BYTES[recipe.compute]
        residual = DTYPE_BYTES[recipe.weights]
        return cls(compute=compute, residual=residual, autocast=recipe.autocast)


@dataclass(frozen=True)
class LayerActivations:
    """Saved tensors of one decoder layer (all ``count`` identical layers of a run save the same)."""

    layer: Layer
    count: int
    terms: tuple[Term, ...]
    constant_bytes: int
    """Batch-independent bytes per layer: the half copies of its Linear weights that autocast makes and
    backward keeps, and Gemma's fp32 ``1 + weight`` of each RMSNorm."""
    checkpoint_terms: tuple[Term, ...]
    """What a checkpointed layer keeps instead of ``terms`` (its input)."""
    attention_input_casts: int = 0
    """Of ``constant_bytes``, autocast's half copies of the attention's input projections: the only ones made by
    the time its kernel runs (autocast casts a weight when its matmul is called)."""
    kernel: str = EAGER
    """The attention kernel a GPU runs for this layer (kernels.py)."""
    cache_extra: float = 0.0
    """Bytes per token its KV cache holds beyond what backward keeps (use_cache, no checkpointing)."""
    returned_extra: float = 0.0
    """Bytes per token of attention weights the layer holds until it returns (AttentionTerms.returned_extra)."""
    attention_bytes_per_token: float = 0.0
    """The part of ``terms`` from the input norm to o_proj's input (the rest is the MLP block's)."""
    attention_released: float = 0.0
    """Of that, bytes per token freed before the attention kernel's backward (AttentionTerms.released)."""
    attention_backward: float = 0.0
    """Bytes per token of the attention kernel backward's temporaries (AttentionTerms.backward)."""
    attention_forward: float = 0.0
    """Bytes per token of a checkpointed attention forward's worst moment (AttentionTerms.forward)."""
    softmax_extra: float = 0.0
    """AttentionTerms.softmax_extra of this layer."""
    after_softmax: float = 0.0
    """AttentionTerms.after_softmax of this layer."""
    returned_to_model: float = 0.0
    """AttentionTerms.returned_to_model of this layer."""
    held_by_layer: float = 0.0
    """AttentionTerms.held_by_layer of this layer."""
    matmul_backward: float = 0.0
    """AttentionTerms.matmul_backward of this layer."""
    recompute_locals: float = 0.0
    """AttentionTerms.recompute_locals of this layer."""
    recompute_saved: float = 0.0
    """AttentionTerms.recompute_saved of this layer."""
    recompute_kernel_saved: float = 0.0
    """AttentionTerms.recompute_kernel_saved of this layer."""
    math_return_extra: float = 0.0
    """AttentionTerms.math_return_extra of this layer."""
    checkpointed: bool = False
    """Whether these layers are checkpointed: every layer under --checkpointing full, every second one (0, 2,
    ...) under selective."""

    @property
    def bytes_per_token(self) -> float:
        return sum(t.bytes_per_token for t in self.terms)


# --------------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------------



def uses_kv_cache(settings: TrainingSettings) -> bool:
    """transformers' causal LMs build a KV cache in training unless gradient checkpointing turns use_cache off;
    torchtune's models (--loss chunked-output) have none."""
    return settings.checkpointing == "none" and settings.loss != "chunked-output"


def _norm_terms(spec: ModelSpec, width: int, p: Precision, label: str, input_bytes: int, module: str) -> list[Term]:
    """What a norm saves of its own (its output is saved by whoever consumes it).

    RMSNorm (LlamaRMSNorm): ``x.to(float32)`` kept by ``pow`` (4 B even when x is already fp32, then it is x
    itself), ``rsqrt`` (4 B per row), and the normalised value cast back to the input dtype, kept by the
    multiplication with the weight. Gemma's variant keeps the fp32 normalised value instead.
    LayerNorm (``native_layer_norm``): its input, mean and rstd (fp32 per row on CUDA).
    """
    if spec.norm == "layer":
        if spec.traits.layer_norm_upcast:  # (OlmoLayerNorm normalises ``hidden_states.to(torch.float32)``)
            input_bytes = FP32
        return [Term(f"{label}: input", input_bytes * width, module, "input"),
                Term(f"{label}: mean, rstd", 2 * FP32, module, "stats")]
    normed = FP32 if spec.traits.rms_norm_fp32_plus_one or spec.traits.rms_norm_fp32_product else input_bytes
    terms = [
        Term(f"{label}: input in fp32", FP32 * width, module, "input_fp32"),
        Term(f"{label}: rsqrt", FP32, module, "rsqrt"),
        Term(f"{label}: normalised", normed * width, module, "normalised"),
    ]
    if spec.traits.norm_centred_twice:  # CohereLayerNorm: the second x - mean (modeling_cohere.py)
        terms.append(Term(f"{label}: input less its mean, again (fp32)", FP32 * width, module, "input_fp32"))
    return terms


def _linear_inputs(p: Precision, width: int, consumers: int, label: str, input_bytes: int,
                   site: str = "") -> list[Term]:
    """The input a Linear keeps for its weight gradient.

    Without autocast the consumers share the tensor they read. Under autocast each Linear casts an fp32 input
    to half precision itself (activations are not in autocast's cast cache), so each keeps its own copy.
    """
    if p.autocast and input_bytes == FP32:
        return [Term(f"{label}: half copy per Linear x{consumers}", consumers * p.compute * width, site,
                     "linear_input")]
    return [Term(f"{label}", input_bytes * width, site, "linear_input")]


@dataclass(frozen=True)
class AttentionTerms:
    """What one layer's attention keeps for backward, the kernel that keeps it, and what its KV cache holds on top."""

    terms: tuple[Term, ...]
    kernel: str
    """eager, flash, efficient or math (kernels.py)."""
    cache_extra: float = 0.0
    """Bytes per token the KV cache (use_cache) holds that backward does not keep: alive until the model's output
    is dropped, so counted at the forward peak only."""
    returned_extra: float = 0.0
    """Bytes per token of the attention weights eager attention returns, when backward does not keep that tensor:
    the decoder layer holds them (``hidden_states, _ = self.self_attn(...)``) until it returns."""
    released: float = 0.0
    """Bytes per token of these terms freed before the kernel's own backward runs (o_proj's input, and for eager and
    math attention what the matmul with v and the dropout kept)."""
    backward: float = 0.0
    """Bytes per token of the kernel backward's temporaries at its worst moment."""
    forward: float = 0.0
    """Bytes per token alive at the attention forward's worst moment when nothing is saved (a checkpointed layer's
    first forward): the kernel's inputs and, for eager and math attention, two s x s tensors at once."""
    forward_inputs: float = 0.0
    """Bytes per token the attention forward holds beside the kernel's own tensors: its input (the norm output,
    an argument alive until it returns), the projections' outputs and q, k and v as the kernel reads them."""
    softmax_extra: float = 0.0
    """Eager and math attention, without checkpointing: bytes per token alive at the softmax beyond what is saved
    (its s x s input, and the fp32 upcast of a half input)."""
    after_softmax: float = 0.0
    """Of the terms, bytes per token created after the softmax (the probabilities the matmul with v keeps, the
    dropout mask, the output copy)."""
    math_return_extra: float = 0.0
    """The math kernel without checkpointing, as it returns: bytes per token alive beyond what is saved by then
    (``after_softmax`` with the rest): ``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/
    attention.cpp) returns ``{matmul(attn, value_acc).to(origin_dtype), attn.to(origin_dtype)}``, so the fp32
    product and, for half inputs, a half copy of the (dropped) probabilities exist with the kernel's locals (those of
    ``softmax_extra`` but its freed masked scores) before SDPA drops the second output (traced: Falcon, ALiBi,
    mixed-fp16, dropout 0.1, 2 x 1,000: -4.0% at the forward peak without this moment)."""
    returned_to_model: float = 0.0
    """Bytes per token of the attention probabilities the decoder layer returns and the base model holds (``outputs
    = block(...)``) until the next layer returns: Falcon's and BLOOM's eager paths. Extra only where nothing keeps
    them for backward, i.e. in a checkpointed forward."""
    held_by_layer: float = 0.0
    """Bytes per token the decoder layer holds in locals through its MLP in a checkpointed forward: the attention
    weights eager attention returns (``hidden_states, _ = self.self_attn(...)``; BLOOM's ``attn_weights``) and
    GPT-2's ``attn_output``."""
    matmul_backward: float = 0.0
    """Eager and math attention: bytes per token of the temporaries when the product of the probabilities and v
    runs its backward, the kernel's first: the gradient of its output (o_proj's input gradient) and of its two
    inputs (the s x s probabilities, and v at every head), while nothing of the attention is freed yet."""
    rotary_forward: float = 0.0
    """Bytes per token alive during RoPE in a checkpointed forward (nothing saved): the norm output, the three
    projections' outputs (q and k are still held by their variables) and, while q or k is rotated,
    ``q * cos``, ``rotate_half(q)`` (a ``torch.cat``) and its product with ``sin`` (for k, beside the rotated q)."""
    recompute_locals: float = 0.0
    """BLOOM: bytes per token BloomAttention.forward holds at its end beyond what it saved (it ends with the
    residual add): the fused q/k/v output (copied from with more than one sequence), the baddbmm scores, the
    masked scores, dense's output and the residual sum, and with hidden dropout its dropped copy."""
    recompute_saved: float = 0.0
    """Falcon's eager attention: bytes per token that a checkpointed layer's recompute has saved by the softmax
    beyond what ``forward`` (the first, checkpointed forward's moment, which saves nothing) holds there: the scores
    matmul's q and k (copies or casts; views of the fused output are held anyway) and, under autocast,
    query_key_value's half input cast (and its weight cast, a constant the timeline adds)."""
    recompute_kernel_saved: float = 0.0
    """Bytes per token that a checkpointed layer's recompute has saved inside attention, by its worst moment,
    beyond that moment in the first (no-grad) forward: BLOOM's fp32 softmax output, which the first forward frees
    once it is cast back and the recompute saves for the softmax's backward, alive at the dropout (_bloom_forward);
    the math kernel's contiguous copies of the scaled q and k its scores' matmul saves (Falcon's SDPA)."""


def sdpa_mask(spec: ModelSpec, layer: Layer, seq: int) -> bool:
    """Whether transformers hands SDPA a mask for this layer: a sliding window the sequence reaches
    (masking_utils._ignore_causal_mask_sdpa: ``kv_length >= local_attention_size``), or Falcon, which always
    materialises its mask (modeling_falcon.py, ``allow_is_causal_skip=False``); otherwise SDPA runs with
    ``is_causal`` and no mask."""
    if spec.traits.sdpa_mask_always:
        return True
    return layer.sliding_window is not None and seq >= layer.sliding_window


def _attention_terms(spec: ModelSpec, layer: Layer, settings: TrainingSettings, p: Precision, kernel: str,
                     dropout: float) -> AttentionTerms:
    """Self-attention from the projections' outputs to o_proj's input, for the families that use transformers'
    shared attention functions (integrations/sdpa_attention.py, each modeling file's eager_attention_forward).

    The kernel is the one a GPU runs (kernels.sdpa_backend). What each keeps (derivatives.yaml and the kernels'
    autograd formulas, checked with saved_tensors_hooks on the CUDA-emulating trace):
    - flash: q, k, v and the output at the head dim padded to a multiple of 8, and the fp32 logsumexp (4a);
    - memory-efficient: q, k, v, the output, the fp32 logsumexp padded to 32 rows, and the float mask it converted
      from the boolean one (padded to 16 columns);
    - math: fp32 copies of q and k scaled and of v (k and v expanded to every query head), the fp32 s x s
      probabilities, and with dropout its bool mask and the dropped probabilities;
    - eager: q, k and v as its matmuls read them (k and v repeated to every head), the softmax output, the
      probabilities in the matmul's dtype, the dropout mask, and the output copied contiguous for o_proj.
    """
    att = layer.attention
    a, kv, d, dv, c = att.num_heads, att.num_kv_heads, att.head_dim, att.v_head_dim, p.compute
    s, batch = settings.seq, settings.batch
    terms: list[Term] = []
    if att.qk_norm:
        # Qwen3/Gemma3 q_norm and k_norm: RMSNorm over each head, input = projection output (compute dtype);
        # Gemma's RMSNorm keeps its normalised value in fp32.
        # OLMo-2's normalise the whole projection output (one rsqrt per token) and keep the fp32 normalised value.
        normed = FP32 if spec.traits.rms_norm_fp32_plus_one or spec.traits.rms_norm_fp32_product else c
        for name, heads in (("q_norm", a), ("k_norm", kv)):
            if att.qk_layer_norm:  # Phi's q/k LayerNorms: their input (an fp32 copy under autocast) and mean, rstd
                terms += [Term(f"{name}: input", (FP32 if p.autocast else c) * heads * d, name, "input"),
                          Term(f"{name}: mean, rstd", 2 * FP32 * heads, name, "stats")]
                continue
            rows = 1 if att.qk_norm_width == "projection" else heads
            terms += [Term(f"{name}: input in fp32", FP32 * heads * d, name, "input_fp32"),
                      Term(f"{name}: rsqrt", FP32 * rows, name, "rsqrt"),
                      Term(f"{name}: normalised", normed * heads * d, name, "normalised")]
            if spec.traits.norm_centred_twice:
                terms.append(Term(f"{name}: input less its mean, again (fp32)", FP32 * heads * d, name, "input_fp32"))
    if att.clip_qkv:  # (OLMo's in-place clamp_ of each projection output keeps its input for backward)
        terms.append(Term("q, k, v projection outputs before the in-place clamp (clip_qkv)",
                          c * (a * d + kv * (d + dv))))
    rotary = att.rotary_dim > 0
    if rotary and spec.traits.rotary_tables_per_layer:  # (one (1, 1, s, rotary dim) pair, shared by the batch)
        pairs = 2 if spec.traits.rotary_tables_split else 1  # (GPT-J: one pair for k, one for q)
        terms.append(Term("cos, sin repeated for this layer's rotary",
                          pairs * 2 * _rotary_table_bytes(spec, p) * att.rotary_dim / batch))
    use_cache = uses_kv_cache(settings)
    # Under autocast the rotary tables follow the fp32 hidden states, so the rotated q and k are fp32.
    qk_bytes = p.residual if p.autocast and rotary and not spec.traits.rotary_in_input_dtype else c
    # GPT-2: q, k and v are views of one projection output (c_attn); with use_cache, DynamicLayer.update torch.cat's
    # k and v into the cache and attention reads those copies.
    fused_views = att.fused_qkv and not rotary
    # Partial-rotary families build q with torch.cat, laid out (b, a, s, d): flash's output follows q's layout.
    q_by_cat = spec.traits.q_built_by_cat
    mask = kernel == EAGER or sdpa_mask(spec, layer, s)
    repeat = kv < a and (kernel == EAGER or mask or d != dv or d > FLASH_MAX_HEAD_DIM)
    kv_passed = a if repeat else kv
    # repeat_kv expands and reshapes: one key/value head becomes a stride-0 view of every head (no copy), which the
    # memory-efficient kernel reads as it is; several heads are copied.
    repeat_copies = repeat and kv > 1
    if kernel != EAGER:
        offsets = (0, 0, 0)
        if not use_cache and fused_views:
            offsets = (0, a * d, (a + kv) * d)
        elif not use_cache and spec.traits.fused_qkv_layout == "per_head":
            offsets = (0, 0, 2 * d)
        elif not use_cache and spec.traits.fused_qkv_layout == "blocks":
            offsets = (0, 0, (a + kv) * d)
        if repeat or (p.autocast and qk_bytes != c):
            offsets = (0, 0, offsets[2] if not repeat else 0)
        kernel = sdpa_backend(dtype=_DTYPE_OF_BYTES[c], head_dim_qk=d, head_dim_v=dv, q_heads=a, kv_heads=kv_passed,
                              has_mask=mask, enable_gqa=kv_passed < a, q_len=s, kv_len=s, is_causal=not mask,
                              storage_offsets=offsets)
    repeated = " repeated to every head" if kv_passed != kv else ""
    rot = " after rotary" if rotary else ""
    k_cache = qk_bytes * kv * d if use_cache else 0.0
    v_cache = c * kv * dv if use_cache else 0.0
    k_kept = v_kept = False  # whether attention keeps the cache's own tensors (then the cache adds nothing)
    returned = released = backward = softmax_extra = after_softmax = bloom_forward = returned_to_model = 0.0
    matmul_backward = recompute_locals = recompute_kernel_saved = math_return_extra = 0.0
    held_by_layer = 0.0

    if kernel == FLASH:
        d8, dv8 = flash_head_dim(d), flash_head_dim(dv)
        pad = d8 != d or dv8 != dv
        padded = " padded to a multiple of 8" if pad else ""
        if fused_views and not pad:
            terms.append(Term("q, k, v (one fused projection output, kept by q's view)", c * (a * d + 2 * kv * d)))
            if use_cache:
                terms.append(Term("k, v copied into the KV cache (use_cache)", c * kv * (d + dv)))
            k_kept = v_kept = True
        else:
            terms += [Term("q" + rot + padded, c * a * d8), Term("k" + rot + repeated + padded, c * kv_passed * d8),
                      Term("v" + repeated + padded, c * kv_passed * dv8)]
            k_kept = not repeat and not pad and qk_bytes == c
            v_kept = not repeat and not pad
        terms += [Term("attention output" + padded, c * a * dv8, "o_input", "shared_input"),
                  Term("softmax logsumexp (fp32)", FP32 * a)]
        # (with one head the output's ``transpose(1, 2)`` is contiguous already, a size-1 dimension's stride does
        # not count, so ``.contiguous()`` returns it: traced, StableLM with 1 head, pure-bf16, +1.19% at the loss
        # with the copy, seed 31415 case 37 of ``validate --random``)
        if pad or (q_by_cat and a > 1):
            terms.append(Term("attention output copied contiguous (o_proj input)", c * a * dv, "o_input",
                              "linear_input"))
            released = c * a * dv
        backward = flash_backward_per_token(c, a, kv_passed, d, dv, s)
    elif kernel == EFFICIENT:
        if fused_views:
            terms.append(Term("q, k, v (one fused projection output, kept by q's view)", c * (a * d + 2 * kv * d)))
            if use_cache:
                terms.append(Term("k, v copied into the KV cache (use_cache)", c * kv * (d + dv)))
            k_kept = v_kept = True
        else:
            kept = kv_passed if repeat_copies else kv
            repeated = " repeated to every head" if repeat_copies else \
                (" (one head viewed as every head)" if repeat else "")
            # autocast's cast of an fp32 k (rotary under autocast) copies the one-head view to every head
            k_cast = repeat and not repeat_copies and qk_bytes != c
            terms += [Term("q" + rot, c * a * d),
                      Term("k" + rot + (" cast to every head" if k_cast else repeated),
                           c * (kv_passed if k_cast else kept) * d),
                      Term("v" + repeated, c * kept * dv)]
            k_kept, v_kept = not repeat_copies and qk_bytes == c, not repeat_copies
        terms += [Term("attention output (o_proj input)", c * a * dv, "o_input", "shared_input"),
                  Term("softmax logsumexp (fp32, padded to 32 rows)", efficient_lse_per_token(a, s))]
        if mask:
            terms.append(Term("attention mask converted to the compute dtype (padded to 16 columns)",
                              c * efficient_mask_width(s)))
        backward = c * (a * d + kv_passed * (d + dv)) + c * a * dv  # dq, dk, dv beside d(output)
    elif kernel == MATH:
        terms += [Term("q scaled (fp32)", FP32 * a * d), Term("k scaled, every head (fp32)", FP32 * a * d),
                  Term("v, every head (fp32)", FP32 * a * dv), Term("softmax probabilities (fp32)", FP32 * a * s)]
        if dropout > 0:
            terms += [Term("attention dropout mask", MASK * a * s), Term("dropped probabilities (fp32)", FP32 * a * s)]
        v_kept = c == FP32 and kv == a
        terms.append(Term("attention output copied contiguous (o_proj input)", c * a * dv, "o_input", "linear_input"))
        released, backward = math_backward_per_token(c, a, dv, s, dropout)
        matmul_backward = math_matmul_backward_per_token(c, a, dv, s)
        softmax_extra = FP32 * a * s + math_softmax_locals(
            c, qk_bytes, a, kv, kv_passed, d, dv, s, batch, has_mask=mask, use_cache=use_cache,
            caller_q=c * (a * d + 2 * kv * d) if fused_views else qk_bytes * a * d, v_kept=v_kept,
            q_copied=not q_by_cat and batch > 1 and a > 1,
            cast=sdpa_autocast_casts(p, a, kv_passed, d, dv, qk_bytes, c))
        after_softmax = c * a * dv + ((MASK + FP32) * a * s if dropout > 0 else 0)
        math_return_extra = math_return_locals(softmax_extra, c, a, dv, s)
    else:  # eager
        gpt2_eager = spec.traits.eager_attention == "gpt2"
        # (GPT-BigCode's multi-query c_attn: repeat_kv expands its one k and v head, which the matmuls copy to every
        # head, and q's view is copied too; the fused output is then held only by the attention's locals)
        views_repeated = fused_views and kv_passed != kv
        fused_views = fused_views and not views_repeated
        eager = _eager_terms(spec, att, p, s, batch, dropout, qk_bytes, kv_passed, fused_views, use_cache)
        terms += eager
        # the dropout sees the probabilities cast to q's dtype (llama-style ``.to(query.dtype)``; GPT-2, GPT-J: v's)
        to_v = gpt2_eager or spec.traits.eager_attention == "fp32_scores"
        dropout_bytes = c if to_v else qk_bytes
        released, backward = eager_backward_per_token(eager, c, a, dv, s, dropout_bytes)
        if fused_views and not use_cache and batch > 1 and a > 1:
            released += c * a * dv  # the batched matmul's copy of v (a strided view of c_attn's output)
        matmul_backward = c * a * s + 2 * c * a * dv
        held_by_layer = dropout_bytes * a * s + (c * spec.hidden_size if gpt2_eager else 0)
        if att.sinks:
            # (the returned weights are ``probs[..., :-1]`` cast to v's dtype: a view keeping the sink column too
            # where the softmax is already in it, the cast copy under autocast)
            held_by_layer = c * a * s + (c * a if p.residual == c else 0)
            # In the recompute (grad mode) the scores matmul saves autocast's half casts of the fp32 q and k, and
            # the dropout its mask, all freed by the no-grad forward's moment at the cast to v's dtype (traced:
            # amp-fp16, dropout 0.1, full checkpointing, 1 x 256: 0.45 MB short at the top layer's recompute;
            # seed 765427750 case 6 of ``validate --random``)
            recompute_kernel_saved = (c * (a * d + kv_passed * d) if qk_bytes != c else 0) \
                + (MASK * a * s if dropout > 0 and p.residual != c else 0)
        # (the cast back to q's dtype under autocast: eager_softmax_moment's cast_to)
        softmax_extra, after_softmax = eager_softmax_moment(eager, p, a, s, 0 if gpt2_eager else dropout_bytes,
                                                            spec.traits.eager_attention == "fp32_scores")
        if att.sinks:
            # GPT-OSS keeps ``attn_weights`` (scores plus mask) and ``combined_logits`` (s + 1 wide) bound beside the
            # softmax output through the cast to v's dtype (a term after the softmax that exists at that moment)
            softmax_extra = p.residual * a * (2 * s + 1)
            after_softmax = sum(t.bytes_per_token for t in eager if t.kind == CONTIGUOUS_OUTPUT)
        laid_out = batch > 1 and a > 1
        if views_repeated:
            # (query: a view of c_attn's output, a local until the attention returns, so the output stays whole; v's
            # copy to every head is made by the matmul with v, after the softmax)
            softmax_extra += c * (a * d + kv * (d + dv))
            after_softmax += c * a * dv
        if (not att.fused_qkv and not q_by_cat and not gpt2_eager and spec.traits.block == "standard"
                and (laid_out or qk_bytes != c)):
            # The attention forward's q (``query_states``: rotated, or q_proj's output viewed (b, a, s, d)) is laid
            # out (b, s, a, d): the batched matmul copies it to (b * a, s, d) and keeps the copy, while the forward's
            # local still holds q itself (or autocast's half cast of an fp32 q). Traced: Llama, pure-bf16, the last
            # layer's softmax, 512 bytes per token at 4 x 64 heads; StarCoder2, fp32, 4 x 1,024, 4 MiB short
            softmax_extra += qk_bytes * a * d
            if laid_out and qk_bytes != c and kv_passed != kv and not (kv == 1 and batch == 1):
                # (under autocast k is fp32 after RoPE: repeat_kv's fp32 copy stays in eager_attention_forward's
                # ``key_states`` while the matmul keeps its half cast)
                softmax_extra += qk_bytes * a * d
        if spec.traits.block == "bloom":  # BloomAttention keeps the baddbmm scores in a local beside the masked ones
            softmax_extra += c * a * s
            bloom_forward = _bloom_forward(spec, p, a, d, s, dropout, settings.batch)
            recompute_kernel_saved = _bloom_forward(spec, p, a, d, s, dropout, settings.batch,
                                                    recompute=True) - bloom_forward
            returned_to_model = held_by_layer = c * a * s
            h, w = spec.hidden_size, p.residual
            hidden_dropout = spec.dropout.hidden if settings.dropout is None else settings.dropout
            recompute_locals = ((3 * c * h if settings.batch > 1 else 0) + (c + w) * a * s + c * h + w * h
                                + (c * h if hidden_dropout > 0 else 0))
        # repeat_kv's view of one head is copied by the batched matmul unless the batch is 1
        kv_viewed = kv_passed == kv or (kv == 1 and settings.batch == 1)
        # (GPT-J's matmul keeps fp32 copies of a half q and k: the KV cache's k is then a tensor of its own)
        k_copied = spec.traits.eager_attention == "fp32_scores" and not p.autocast and c != FP32
        k_kept = fused_views or (kv_viewed and qk_bytes == c and not k_copied)
        v_kept = fused_views or kv_viewed
        # Llama-style eager attention returns the dropped-out probabilities; when they are fp32 (autocast with
        # rotary q) the matmul with v keeps a half cast instead, so the returned tensor is extra.
        # (GPT-OSS casts to v's dtype after the dropout: what it returns is the half cast the matmul keeps)
        if dropout > 0 and p.autocast and qk_bytes == FP32 and spec.traits.eager_attention == "llama" and not att.sinks:
            returned = FP32 * a * s
    if not use_cache and att.fused_qkv and rotary and kernel in (FLASH, EFFICIENT) and v_kept:
        # Without a cache copy (gradient checkpointing turns use_cache off) v is a view of the fused q/k/v
        # projection output (GPT-NeoX, Phi-3), and the kernel keeping v keeps all of it.
        terms.append(Term("rest of the fused q/k/v output (kept by v's view)", c * (a + kv) * d))
    cache_extra = (0.0 if k_kept else k_cache) + (0.0 if v_kept else v_cache)
    # The checkpointed forward: the norm output (the attention's argument), the fused projection output a local
    # keeps (fused-qkv families), q and k after rotary, v, and the copies repeat_kv makes.
    # (q, k and v are views of a fused projection's output; RoPE makes new q and k.)
    # (with post-norms only, OLMo-2, the argument is the layer input itself, which the checkpoint keeps)
    # (OPT's post-norm layers too: their attention reads the layer input, the norms come after the residual adds)
    argument = 0 if spec.traits.attention_reads_layer_input else p.residual * spec.hidden_size
    inputs = argument
    if att.fused_qkv:
        inputs += c * (a * d + kv * (d + dv))
    if rotary or not att.fused_qkv:
        inputs += qk_bytes * (a * d + kv * d)
    if not att.fused_qkv:
        inputs += c * kv * dv
    if repeat_copies:  # (k repeated in its own dtype: fp32 after rotary under autocast)
        inputs += qk_bytes * a * d + c * a * dv
    if spec.traits.rotary_split_locals:
        # (PhiAttention: query_rot/key_rot and the q_proj/k_proj outputs the passed views hold, alive to its end)
        # (the passed views are of the q/k LayerNorms' outputs where there are some: fp32 under autocast)
        passed = FP32 if att.qk_norm and att.qk_layer_norm and p.autocast else c
        split_locals = passed * (a * d + kv * d) + qk_bytes * att.rotary_dim * (a + kv)
        inputs += split_locals
        softmax_extra += split_locals if softmax_extra else 0.0
    forward = bloom_forward
    rotary_forward = 0.0
    if rotary and not att.fused_qkv and att.rotary_dim == d:  # modeling_llama.py apply_rotary_pos_emb and kin
        rotary_forward = argument + c * (a * d + kv * (d + dv)) + _rotary_locals(spec, p, a, kv, d, qk_bytes)
    if kernel == MATH:
        # (with the half casts of an fp32 rotated q and k autocast's wrapper holds through the call; traced:
        # Mistral, amp-fp16, head dim 100, a sliding window, full checkpointing, 1 x 2,000: -1.76% without them)
        forward = inputs + math_forward_per_token(c, a, kv_passed, d, dv, s, batch, has_mask=mask,
                                                  enable_gqa=kv_passed < a, dropout=dropout) \
            + sdpa_autocast_casts(p, a, kv_passed, d, dv, qk_bytes, c)
    elif kernel == EFFICIENT and mask and not forward:
        # The memory-efficient kernel converts the boolean mask to a float (b, 1, s, s) one and pads its columns
        # to a multiple of 16 (F.pad, a copy, where s is not one): both are alive at once, before the output
        # exists, beside q, k and v (traced: a checkpointed Qwen3 layer with a sliding window, 1 x 1,000, was
        # -1.57% at the forward peak without them); the padded one stays through the kernel.
        forward = efficient_masked_forward(inputs, c, a, dv, s, mask_heads=1, converted=True)
    return AttentionTerms(tuple(terms), kernel, cache_extra, returned, released, backward, forward=forward,
                          forward_inputs=inputs, softmax_extra=softmax_extra, after_softmax=after_softmax,
                          math_return_extra=math_return_extra,
                          returned_to_model=returned_to_model, held_by_layer=held_by_layer,
                          matmul_backward=matmul_backward, rotary_forward=rotary_forward,
                          recompute_locals=recompute_locals, recompute_kernel_saved=recompute_kernel_saved)


def _bloom_forward(spec: ModelSpec, p: Precision, a: int, d: int, s: int, dropout: float, batch: int,
                   recompute: bool = False) -> float:
    """BloomAttention.forward in a checkpointed forward, per token: its locals live until it returns, so beside
    the norm output, the fused q/k/v output and (batch > 1: with one sequence the merge of the batch and head
    dimensions is a view) the three copies ``reshape`` makes of its strided views, the
    baddbmm scores and the masked scores (in the mask's dtype, the parameters') stay, and the probabilities (cast
    back to q's dtype, then dropped out: the dropout's input is freed once it returns) follow: the worst moment is
    the softmax (with its fp32 upcast of half scores), the dropout (its input, output and mask), or the end, where
    the context, its merged copy, dense's output and the residual sum exist too (traced). In the ``recompute``
    (grad mode) the softmax saves its fp32 output, still alive at the dropout (traced: amp-bf16, dropout 0.1, full
    checkpointing, 2 x 512, -7.3% at the backward peak without it)."""
    c, w, h = p.compute, p.residual, spec.hidden_size
    inputs = w * h + c * 3 * h + (3 * c * a * d if batch > 1 else 0)
    # softmax(dtype=fp32) upcasts half masked scores first; its fp32 output is then cast back to q's dtype
    upcast, cast_back = (FP32 if w != FP32 else 0), (c if c != FP32 else 0)
    at_softmax = c + w + FP32 + max(upcast, cast_back)
    at_dropout = c + w + 2 * c + MASK + (FP32 if recompute else 0) if dropout > 0 else 0
    at_end = c + w + c + (MASK if dropout > 0 else 0)
    return inputs + max(at_softmax * a * s, at_dropout * a * s, at_end * a * s + 3 * c * h + w * h)


def _rotary_locals(spec: ModelSpec, p: Precision, a: int, kv: int, d: int, qk_bytes: int) -> int:
    """Bytes per token apply_rotary_pos_emb holds at its worst moment beside the caller's q, k and v, where nothing
    is saved (a checkpointed forward): while q is rotated, ``q * cos``, ``rotate_half(q)`` and its product with
    sin; while k is, the rotated q beside k's three; where the rotation runs in fp32 and is cast back to q's dtype
    (rotary_in_input_dtype), both rotated fp32 tensors beside their half casts. The products take the tables' dtype
    (fp32 ones: OLMo, OLMo-2/3, ERNIE 4.5), ``rotate_half`` q's (a half ``torch.cat``; Cohere's float copies are
    rotated as fp32, ERNIE copies the half one to fp32), and Cohere's ``q.float()`` and ``k.float()`` are held for
    the call (modeling_cohere.py, modeling_olmo2.py, modeling_ernie4_5.py ``apply_rotary_pos_emb``; traced: Cohere,
    amp-bf16, full checkpointing, 4 x 1,000, -10.9% at the backward peak with the products in half)."""
    c, traits = p.compute, spec.traits
    if not traits.rotary_in_input_dtype or c == FP32:
        return qk_bytes * max(3 * a * d, a * d + 3 * kv * d)
    held = FP32 * (a * d + kv * d) if traits.rotary_float_copies else 0
    products = FP32 if traits.rotary_tables_fp32 or traits.rotary_float_copies else c
    rotated = FP32 if traits.rotary_float_copies else c + (FP32 if traits.rotary_half_copied else 0)
    rotating = max((2 * products + rotated) * a * d, products * a * d + (2 * products + rotated) * kv * d)
    cast_back = (products + c) * (a * d + kv * d) if products != c else 0
    return held + max(rotating, cast_back)


def _rotary_table_bytes(spec: ModelSpec, p: Precision) -> int:
    """The dtype of the rotary cos and sin: the hidden states' (Llama's ``cos.to(dtype=x.dtype)``) or fp32."""
    return FP32 if spec.traits.rotary_tables_fp32 else p.residual


def _half_q(spec: ModelSpec, att: Attention) -> bool:
    """Whether q reaches attention in the projections' dtype under autocast: unrotated (OPT, SmolLM3's NoPE
    layers, Cohere 2's full layers: nothing promotes the half projection output) or rotated and cast back
    (OLMo-2, Cohere: rotary_in_input_dtype). Llama's rotary tables follow the fp32 hidden states instead, so its
    rotated q is fp32. (GPT-2's eager attention takes its softmax in the scores' dtype, with no cast-back copy.)"""
    return spec.traits.rotary_in_input_dtype or (att.rotary_dim == 0 and spec.traits.eager_attention == "llama")


def efficient_masked_forward(inputs: float, c: int, a: int, dv: int, s: int, mask_heads: int,
                             converted: bool) -> float:
    """Bytes per token of the memory-efficient kernel's worst moment in a checkpointed forward with a mask: beside
    its ``inputs``, the mask as the kernel prepares it (sdpa_attention.cpp / attention.cpp: a boolean mask converted
    to a float one in q's dtype, or a float one of another dtype cast, then padded to 16 columns with F.pad where s
    is not a multiple), the converted and the padded copy alive at once before the output and the fp32 logsumexp
    exist; the padded one stays through the kernel. ``mask_heads``: its heads (1 for a (b, 1, s, s) mask, a for
    Falcon's ALiBi bias); ``converted``: whether the caller's mask is copied before padding."""
    width = efficient_mask_width(s)
    padded = c * mask_heads * width if converted or width != s else 0
    unpadded = c * mask_heads * s if converted and width != s else 0
    return inputs + padded + max(c * a * dv + efficient_lse_per_token(a, s), unpadded)


def _attention_forward_peak(attention: AttentionTerms, att: Attention, p: Precision, s: int, dropout: float,
                            half_q: bool = False, probs_to_v: bool = False) -> float:
    """A checkpointed layer's attention forward keeps nothing for backward, so its worst moment is the kernel's:
    q, k and v with the fused kernels' output; for eager and math attention two s x s tensors (the softmax's input
    and output, or the dropout's input and output with its mask) in the softmax's dtype. The dropout reads the
    probabilities cast to q's dtype (Llama's ``.to(query.dtype)``: half where ``half_q``) or, ``probs_to_v``, to
    v's (GPT-2's ``.type(value.dtype)``, GPT-J's: the projections' half dtype under autocast)."""
    a, kv, d, dv, c = att.num_heads, att.num_kv_heads, att.head_dim, att.v_head_dim, p.compute
    inputs = attention.forward_inputs or c * (a * d + 2 * a * dv)
    if attention.kernel in (FLASH, EFFICIENT):
        return inputs + c * a * dv
    if attention.kernel == MATH:
        return inputs + FP32 * a * (2 * d + dv) + 2 * FP32 * a * s + (MASK * a * s if dropout > 0 else 0)
    # Eager, at the softmax: under autocast or in fp32 the scores (plus the fp32 mask) are fp32, so input and output
    # are; in half precision a family that asks for an fp32 softmax also holds the upcast copy of its half input;
    # GPT-2 and Falcon take it in the half dtype.
    upcasts = any(t.kind == SOFTMAX_PROBABILITIES and t.bytes_per_token == FP32 * a * s for t in attention.terms)
    if att.sinks:
        # GPT-OSS at ``.to(value_states.dtype)``: the scores plus the mask (``attn_weights``, still bound), the
        # logits less their maximum (``combined_logits``, s + 1 wide), the softmax output and, where v is half and
        # the softmax fp32 (autocast), the cast (traced: amp-bf16, full checkpointing, 1 x 1,024, -19% without it).
        # With dropout the dropped copy of the scores is alive too, with its mask at the dropout and with the
        # cast at ``.to`` (traced: fp32, eager, dropout 0.1, full checkpointing, 1 x 512: -13.3% without it)
        probs = p.residual
        cast = c if probs != c else 0
        held = 4 * probs + max(MASK, cast) if dropout > 0 else 3 * probs + cast
        return inputs + held * a * s + 2 * probs * a
    if p.autocast or c == FP32:
        # (under autocast with q already half, OLMo-2 and Cohere, ``.to(query.dtype)`` copies the fp32 softmax
        # output while its input is still bound: a third s x s tensor)
        scores = 2 * FP32 + (c if p.autocast and half_q else 0)
    else:
        scores = c + 2 * FP32 if upcasts else 2 * c
    if dropout > 0:  # at the dropout: the probabilities, their dropped copy and the mask
        # (traced: GPT-2, amp-bf16, dropout 0.1, full checkpointing, 4 x 1,000: +9.9% at the forward peak with fp32
        # probabilities, which ``.type(value.dtype)`` has cast to bf16 and freed by then)
        probs = c if half_q or probs_to_v else FP32 if p.autocast or c == FP32 else c
        scores = max(scores, 2 * probs + MASK)
    return inputs + scores * a * s


def math_forward_per_token(c: int, a: int, kv: int, d: int, dv: int, s: int, batch: int, has_mask: bool,
                           enable_gqa: bool, dropout: float, mask_copy: float | None = None) -> float:
    """The math kernel's worst forward moment beside its inputs, per token (aten/src/ATen/native/transformers/
    attention.cpp, ``_scaled_dot_product_attention_math``, a composite whose ops were traced on plain tensors):
    half q, k, v are first copied to fp32 (``query_acc`` and kin, locals until it returns); q is scaled; with
    ``is_causal`` an fp32 (s, s) mask is built; with ``enable_gqa`` k and v are repeated to every head
    (``repeat_interleave``); then the scores and the masked scores (``attn.add(mask)``, out of place) coexist, or,
    with dropout, the probabilities, their dropped copy and its bool mask (the scaled k and the matmul's copies
    are freed once the scores exist, as nothing is saved). A boolean mask from the caller is first converted to a
    float one in q's dtype (``convert_boolean_attn_mask``), alive for the call; ``mask_copy`` replaces it where the
    caller's mask is a float one (Falcon's ALiBi bias: autocast's half cast of it, or nothing)."""
    acc = FP32 * (a * d + kv * (d + dv)) if c != FP32 else 0
    repeats = FP32 * a * (d + dv) if enable_gqa else 0
    masks = (c * s if mask_copy is None else mask_copy) if has_mask else FP32 * s / batch
    scores = 2 * FP32 * a * s + (MASK * a * s if dropout > 0 else 0)
    return acc + repeats + FP32 * a * d + masks + scores


def math_return_locals(softmax_extra: float, c: int, a: int, dv: int, s: int) -> float:
    """AttentionTerms.math_return_extra from the softmax moment's locals (``softmax_extra``, whose fp32 masked
    scores are freed by then): the fp32 product with v and, for half inputs, the half copy of the probabilities."""
    return softmax_extra - FP32 * a * s + FP32 * a * dv + (c * a * s if c != FP32 else 0)


def sdpa_autocast_casts(p: Precision, a: int, kv: int, d: int, dv: int, qk: int, v: int) -> float:
    """Bytes per token of the half copies autocast makes of SDPA's fp32 arguments (SDPA is on CUDA's
    lower-precision list, aten/src/ATen/autocast_mode.cpp; ``cached_cast`` copies a tensor that is no leaf) and
    holds through the kernel call: q and k in ``qk``'s dtype (fp32 after RoPE under autocast), v in ``v``'s
    (fp32 where Falcon's Linear adds its bias after the matmul); ``kv`` heads of k and v as passed."""
    if not p.autocast:
        return 0.0
    c = p.compute
    return (c * (a * d + kv * d) if qk != c else 0) + (c * kv * dv if v != c else 0)


def math_softmax_locals(c: int, qk: int, a: int, kv: int, kv_passed: int, d: int, dv: int, s: int, batch: int,
                        has_mask: bool, use_cache: bool, caller_q: float, v_kept: bool, q_copied: bool,
                        cast: float) -> float:
    """Bytes per token alive at the math kernel's softmax without checkpointing beside what is saved and the masked
    scores, none of them saved (aten/src/ATen/native/transformers/attention.cpp,
    ``_scaled_dot_product_attention_math``: its locals live until it returns; traced tensor by tensor on a
    StarCoder2 / Mistral layer, fp32, 4 x 1,024, where they were the forward's missing 16 MiB): the caller's q
    (the attention forward's ``query_states``; ``caller_q``), and its k and v where no KV cache copied them; the
    fp32 copies of half q, k, v (``query_acc`` and kin; the v the second matmul saves is not extra); the scaled q
    (``query``), whose contiguous copy is what its matmul saves where q is laid out (b, s, a, d) and the batch
    and head dimensions do not merge into a view (``q_copied``); under autocast the half casts of the fp32 rotated
    q and k, which autocast's wrapper holds through the call (``cast``); the causal fp32
    (s, s) mask or the float mask converted from a boolean one; k expanded to every head (``enable_gqa``); and k
    and v repeated by transformers' ``repeat_kv`` (kv_passed > kv), locals of its sdpa_attention_forward."""
    caller = caller_q + (0 if use_cache else qk * kv * d + (0 if v_kept else c * kv * dv))
    if kv_passed > kv:  # repeat_kv's copies, passed as k and v (the fp32 v is then the saved one)
        caller += qk * a * d + (c * a * dv if c != FP32 else 0)
    gqa = kv_passed < a
    acc = FP32 * (a * d + kv_passed * d + (kv_passed * dv if gqa else 0)) if c != FP32 else 0
    scaled_q = FP32 * a * d if q_copied else 0
    masks = c * s if has_mask else FP32 * s / batch
    expanded_k = FP32 * a * d if gqa else 0
    return caller + acc + scaled_q + masks + expanded_k + cast


def flash_backward_per_token(c: int, a: int, kv: int, d: int, dv: int, s: int) -> float:
    """The flash kernel's backward (flash_api.cpp ``mha_bwd``): dq, dk, dv at the padded head dim; an fp32 dq
    accumulator of (b, round128(s), a, round(d, 32 or 64)) and fp32 softmax_d of (b, a, round128(s)); with fewer
    key/value heads, dk and dv expanded to every query head before they are summed back; beside them the gradient of
    the output it reads (o_proj's input gradient, traced)."""
    d8, dv8 = flash_head_dim(d), flash_head_dim(dv)
    rows = math.ceil(s / 128) * 128 / s
    d_rounded = math.ceil(d8 / (32 if d8 <= 128 else 64)) * (32 if d8 <= 128 else 64)
    expanded = c * a * (d8 + dv8) if kv < a else 0
    return c * (a * d8 + kv * (d8 + dv8)) + FP32 * a * (d_rounded + 1) * rows + expanded + c * a * dv


def math_backward_per_token(c: int, a: int, dv: int, s: int, dropout: float) -> tuple[float, float]:
    """The math kernel's backward at its softmax (or dropout, whose mask is then still alive): the gradient of the
    probabilities and of the scores (fp32, s x s each) and of v (fp32, every head); by then o_proj's input copy, v
    and the dropped probabilities are freed."""
    released = c * a * dv + FP32 * a * dv + (FP32 * a * s if dropout > 0 else 0)
    return released, 2 * FP32 * a * s + FP32 * a * dv


def math_matmul_backward_per_token(c: int, a: int, dv: int, s: int) -> float:
    """The math kernel's product with v, backward: the output's gradient in q's dtype and its fp32 cast (the
    kernel's ``.to(origin_dtype)``), and the fp32 gradients of the probabilities and of v."""
    return c * a * dv + (FP32 * a * dv if c != FP32 else 0) + FP32 * a * (s + dv)


def eager_softmax_moment(terms: list[Term], p: Precision, a: int, s: int, cast_to: int = 0,
                         fp32_scores: bool = False) -> tuple[float, float]:
    """Eager attention's forward at its softmax, without checkpointing: the scores (its input, in the scores' dtype:
    fp32 under autocast or in fp32, where the fp32 mask promotes them) and, for an fp32 softmax of half scores, the
    upcast copy are alive beside what is saved; the terms after the softmax do not exist yet. ``cast_to``: the
    bytes of q's dtype where ``softmax(attn_weights, dtype=torch.float32).to(query.dtype)`` (eager_attention_forward
    of modeling_llama.py and kin, OPT, BLOOM) makes a half copy while ``attn_weights``, the scores, is still bound
    (traced: OPT under autocast, whose q is the half q_proj output, -8% at the forward peak without it); 0 where q
    is fp32 (rotated by fp32 tables under autocast: ``.to`` returns the same tensor). ``fp32_scores``: the scores
    are fp32 in every recipe (GPT-J's matmul of fp32 casts of q and k)."""
    c = p.compute
    probs = next(t.bytes_per_token for t in terms if t.kind == SOFTMAX_PROBABILITIES) / (a * s)
    scores = FP32 if p.autocast or c == FP32 or fp32_scores else c
    upcast = FP32 if probs == FP32 and scores != FP32 else 0  # (freed before the cast: the larger of the two)
    cast = cast_to if probs == FP32 and cast_to and cast_to != FP32 else 0
    extra = scores + max(upcast, cast)
    after = sum(t.bytes_per_token for t in terms if t.kind in (COMPUTE_PROBABILITIES, DROPOUT_MASK,
                                                                CONTIGUOUS_OUTPUT))
    return extra * a * s, after


def eager_backward_per_token(terms: list[Term], c: int, a: int, dv: int, s: int,
                             dropout_bytes: int) -> tuple[float, float]:
    """Eager attention's backward at its softmax: the gradient of the probabilities (in the softmax's dtype) and of
    the scores, s x s each, and the gradient of v (every head); by then the output copy, v, the probabilities the
    matmul with v kept and the dropout mask are freed."""
    by_kind = {t.kind: t.bytes_per_token for t in terms if t.kind}
    probs = by_kind[SOFTMAX_PROBABILITIES] / (a * s)
    # Two s x s gradients coexist at the softmax's backward, and at the dropout's when the dropout runs on the fp32
    # probabilities (then with its mask still alive); a dropout on probabilities already cast to half has smaller
    # gradients, so the softmax's moment wins and the mask is freed by then.
    dropout_in_fp32 = probs == FP32 and dropout_bytes == FP32
    released = sum(by_kind.get(kind, 0.0) for kind in (SAVED_V, CONTIGUOUS_OUTPUT, COMPUTE_PROBABILITIES))
    if not dropout_in_fp32:
        released += by_kind.get(DROPOUT_MASK, 0.0)
    return released, 2 * probs * a * s + c * a * dv


def _eager_terms(spec: ModelSpec, att: Attention, p: Precision, s: int, batch: int, dropout: float, qk_bytes: int,
                 kv_passed: int, fused_views: bool, use_cache: bool) -> list[Term]:
    """Eager attention: ``softmax(q @ k.T * scale + mask)`` then dropout then ``@ v``, with matmuls under autocast
    casting fp32 operands to half (and keeping the copies)."""
    a, kv, d, dv, c = att.num_heads, att.num_kv_heads, att.head_dim, att.v_head_dim, p.compute
    terms: list[Term] = []
    if fused_views:
        # GPT-2: q (and without a cache k and v) are views of the fused projection output, whose storage is kept,
        # unless the batched matmul must copy q (batch > 1 with several heads), which then keeps the copy instead.
        terms.append(Term("q, k, v (one fused projection output)", c * (a * d + 2 * kv * d)))
        if use_cache and (batch == 1 or a == 1):
            terms.append(Term("k, v copied into the KV cache (use_cache)", c * kv * (d + dv)))
    else:
        repeated = " repeated to every head" if kv_passed != kv else ""
        # repeat_kv's expand + reshape copies, except one kv head with batch 1, which reshapes without a copy
        kept = a if kv_passed != kv and not (kv == 1 and batch == 1) else kv
        # (GPT-J's ``query.to(torch.float32)`` and k's: fp32 copies the matmul keeps, unless autocast casts back)
        qk = FP32 if spec.traits.eager_attention == "fp32_scores" and not p.autocast else c
        terms += [Term("q" + (" (fp32)" if qk != c else ""), qk * a * d),
                  Term("k" + repeated + (" (fp32)" if qk != c else ""), qk * kept * d)]
        if att.fused_qkv and (batch == 1 or kv == 1) and kept == kv and not use_cache:
            # GPT-NeoX/Phi-3 (RoPE makes new q and k): v is a view of the fused projection output, which the
            # matmul with v keeps whole when it needs no copy (one sequence or one head, no repeat, no cache)
            terms.append(Term("v (a view of the fused q/k/v output, which it keeps)", c * (a * d + kv * (d + dv)),
                              kind=SAVED_V))
        else:
            terms.append(Term("v" + repeated, c * kept * dv, kind=SAVED_V))
    # The softmax's dtype: fp32 where the family upcasts (Llama and most) or autocast does (CUDA's list), else the
    # scores' dtype (GPT-2, Falcon, OPT compute it in the matmul's dtype without autocast).
    softmax_fp32 = p.autocast or spec.traits.eager_attention != "gpt2"
    probs = FP32 if softmax_fp32 else c
    if att.sinks:
        # GPT-OSS (modeling_gpt_oss.py, eager_attention_forward): the scores plus the mask (in the hidden states'
        # dtype, so fp32 under autocast) joined by ``torch.cat`` to the per-head sink logit, less their row maximum
        # (``max`` keeps its int64 indices), then ``softmax(..., dtype=combined_logits.dtype)``: no upcast, one
        # more column, which ``probs[..., :-1]`` drops by a view that keeps the whole output.
        probs = p.residual
    terms.append(Term("softmax probabilities" + (" (fp32)" if probs == FP32 else ""), probs * a * s,
                      kind=SOFTMAX_PROBABILITIES))
    if att.sinks:
        terms += [Term("softmax output's sink column", probs * a), Term("row maxima's indices (int64)", INDEX * a)]
    if probs != c or dropout > 0:
        # the probabilities cast to the compute dtype, or dropped out, are what the matmul with v keeps
        terms.append(Term("probabilities in compute dtype (matmul with v)", c * a * s, kind=COMPUTE_PROBABILITIES))
    if dropout > 0:
        terms.append(Term("attention dropout mask", MASK * a * s, kind=DROPOUT_MASK))
    if att.logit_softcap:
        # attn_logit_softcapping: scores / cap -> tanh -> * cap; tanh keeps its output.
        terms.append(Term("attention softcapping tanh output", c * a * s))
    terms.append(Term("attention output, contiguous (o_proj input)", c * a * dv, kind=CONTIGUOUS_OUTPUT,
                      input_of="o_input"))
    return terms


def _falcon_attention_terms(spec: ModelSpec, layer: Layer, settings: TrainingSettings, p: Precision, kernel: str,
                            dropout: float) -> AttentionTerms:
    """FalconAttention (modeling_falcon.py), which calls SDPA itself: always with a materialised mask, never with
    ``enable_gqa``, so multi-query keys (one head) rule out both fused kernels and the math kernel runs; the new
    decoder architecture broadcasts k and v to every head first. Its eager path takes the softmax in the hidden
    states' dtype and, without ALiBi, applies no attention dropout."""
    att = layer.attention
    a, kv, d, c, r = att.num_heads, att.num_kv_heads, att.head_dim, p.compute, p.residual
    s = settings.seq
    rotary = att.rotary_dim > 0
    use_cache = uses_kv_cache(settings)
    # FalconLinear adds its bias after the (autocast) matmul, so with a bias q, k and v come out in fp32.
    v_bytes = r if p.autocast and att.qkv_bias else c
    qk_bytes = r if p.autocast and (rotary or att.qkv_bias) else c
    kv_heads = a if att.kv_broadcast else kv
    k_cache = qk_bytes * kv_heads * d if use_cache else 0.0
    v_cache = v_bytes * kv_heads * d if use_cache else 0.0
    terms: list[Term] = []
    if kernel == EAGER:
        dropout = dropout if not rotary else 0.0
        # The matmuls broadcast one key/value head over the query heads: with one sequence the reshape to a batch
        # of matrices is a view (stride 0), so they keep the one-head tensors (the cache's, with use_cache).
        one_head = kv_heads == 1 and settings.batch == 1
        kept_heads = 1 if one_head else a
        kv_name = "" if one_head else ", every head"
        # Without RoPE, q (and without a cache k and v, in the old multi-head layout) are views of the fused
        # query_key_value output (``_split_heads``; the reshape to the same shape copies nothing); with one
        # sequence the matmuls' fold of (batch, heads) into one batch dimension is a view too, so they keep the
        # whole fused output (traced); with several sequences they keep their own contiguous copies. A cast (fp32
        # q/k/v under autocast with a bias) copies.
        views = _falcon_eager_views(att, rotary, use_cache, settings.batch == 1, v_bytes == c)
        if views:
            terms.append(Term(f"query_key_value output (kept by the view{'s' if len(views) > 1 else ''} "
                              f"{', '.join(views)})", c * (a + 2 * kv) * d))
        terms += [term for name, term in (("q", Term("q", c * a * d)), ("k", Term("k" + kv_name, c * kept_heads * d)),
                                          ("v", Term("v" + kv_name, c * kept_heads * d))) if name not in views]
        terms += [Term("softmax probabilities" + (" (fp32)" if r == FP32 else ""), r * a * s,
                       kind=SOFTMAX_PROBABILITIES)]
        if dropout > 0:
            terms.append(Term("attention dropout mask", MASK * a * s))
        if r != c or dropout > 0:
            terms.append(Term("probabilities in compute dtype (matmul with v)", c * a * s))
        terms.append(Term("attention output, merged (dense input)", c * a * d, input_of="o_input"))
        # (v's backward frees nothing where v is a view of the fused output q or k still keeps)
        v_freed = c * kept_heads * d if "v" not in views else c * (a + 2 * kv) * d if views == ("v",) else 0
        released: float = c * a * d + v_freed + (c * a * s if r != c or dropout > 0 else 0)
        # At the softmax (without checkpointing): the scores (a local), the masked scores the softmax reads (fp32
        # under autocast, where the mask is) and, with ALiBi, the fp32 upcast, the biased logits and (in half
        # precision) the cast back the softmax makes for its dtype argument.
        masked = FP32 if p.autocast else c
        if rotary:
            extra: float = c + masked
        else:
            extra = c + 3 * FP32 if c != FP32 else 3 * FP32
            if r != FP32:
                extra += c
        # A checkpointed forward keeps nothing, so the softmax's moment is those tensors and its output; with ALiBi
        # and dropout, the dropout's (the logits and scores are locals: alive until the function returns).
        scores = extra + r
        if not rotary and dropout > 0:
            scores = max(scores, extra - FP32 + 2 * r + MASK)
        forward = _falcon_forward_inputs(spec, layer, p, v_bytes, qk_bytes) + scores * a * s
        # The matmuls read k and v from the cache's torch.cat (DynamicLayer.update); they keep those very tensors
        # when every head is there already and no autocast cast intervenes, and then the cache adds nothing.
        cache_extra = (0.0 if kv_heads == kept_heads and qk_bytes == c else k_cache) + \
            (0.0 if kv_heads == kept_heads and v_bytes == c else v_cache)
        # With ALiBi and dropout under autocast the layer holds the returned fp32 dropped probabilities; the matmul
        # with v keeps a half copy.
        held = r * a * s if not rotary and dropout > 0 and r != c else 0.0
        # The recompute (under full checkpointing) saves as it goes: by the softmax the scores matmul has kept q and
        # k (not views of the fused output, which forward counts) and under autocast query_key_value its half input
        # (traced: ALiBi, amp-fp16, 1 x 1,000, 3.2 MiB of 120 short at the backward peak without them)
        saved = (c * a * d if "q" not in views else 0) + (c * kept_heads * d if "k" not in views else 0) \
            + (c * spec.hidden_size if p.autocast else 0)
        # Backward at the softmax: its output (saved) and the gradients of its output and input, s x s each, in the
        # softmax's dtype. With ALiBi and half hidden states (pure-*) the logits are fp32 (the half scores are
        # upcast first): after the softmax's backward, which frees its output, the cast's and the in-place scale's
        # backward make two fp32 gradients, the larger moment (traced: pure-bf16, 2 x 1,000, -15.5% at the backward
        # peak without them)
        backward: float = 2 * r * a * s + c * a * d
        if not rotary and r != FP32:
            released += r * a * s
            backward = 2 * FP32 * a * s + c * a * d
        # Without checkpointing, FalconAttention's locals nothing saves are alive at the softmax too: the
        # query_key_value output where no view keeps it, and under autocast the fp32 norm output(s) whose half
        # copies the Linears save (traced: RoPE, fp32, 1 x 1,000: -2.4% at the forward peak without them)
        locals_at_softmax = (0 if views else v_bytes * (a + 2 * kv) * d) \
            + (_falcon_norm_outputs(spec, layer, p) if p.autocast else 0)
        return AttentionTerms(tuple(terms), EAGER, cache_extra, held, released, backward,
                              forward=forward, softmax_extra=extra * a * s + locals_at_softmax,
                              returned_to_model=r * a * s,
                              recompute_saved=saved,
                              matmul_backward=c * a * s + 2 * c * a * d,
                              after_softmax=c * a * d + ((c if r != c or dropout > 0 else 0) + (
                                  MASK if dropout > 0 else 0)) * a * s)
    backend = sdpa_backend(dtype=_DTYPE_OF_BYTES[c], head_dim_qk=d, head_dim_v=d, q_heads=a, kv_heads=kv_heads,
                           has_mask=True, enable_gqa=False, q_len=s, kv_len=s, is_causal=False)
    sdpa_dropout = dropout if not rotary else 0.0  # the rotary path calls SDPA with dropout_p=0.0
    if backend == EFFICIENT:
        # Which of q, k and v reach the kernel as views of the fused query_key_value output (then that whole output
        # is kept): without rotary, a cache or an autocast cast, the old multi-head layout's q, k and v all are.
        proj_bytes = v_bytes
        multi_head_views = kv == a and not att.kv_broadcast
        q_view = not rotary and proj_bytes == c
        k_view = multi_head_views and not rotary and not use_cache and proj_bytes == c
        v_view = multi_head_views and not use_cache and proj_bytes == c
        views = tuple(name for name, is_view in (("q", q_view), ("k", k_view), ("v", v_view)) if is_view)
        if views:
            terms.append(Term(f"query_key_value output (kept by the view{'s' if len(views) > 1 else ''} "
                              f"{', '.join(views)})", c * (a + 2 * kv) * d))
        # The new architecture's k and v are views broadcasting the key/value heads (their reshape to the same
        # shape copies nothing): the kernel keeps the small index copies, unless RoPE (k) or the cache made new
        # tensors at every head, or autocast cast them (a copy of a broadcast view has every head).
        k_heads = kv if att.kv_broadcast and not rotary and not use_cache and qk_bytes == c else a
        v_heads = kv if att.kv_broadcast and not use_cache and v_bytes == c else a
        terms += [Term(name, c * heads * d) for name, is_view, heads in (
            ("q" + (" after rotary" if rotary else ""), q_view, a), ("k", k_view, k_heads), ("v", v_view, v_heads))
            if not is_view]
        terms += [Term("attention output (dense input)", c * a * d, kind="shared_input", input_of="o_input"),
                  Term("softmax logsumexp (fp32, padded to 32 rows)", efficient_lse_per_token(a, s))]
        if rotary:  # the boolean (b, 1, s, s) mask, converted to a float one per call
            terms.append(Term("attention mask converted to the compute dtype (padded to 16 columns)",
                              c * efficient_mask_width(s)))
        elif r != c or s % EFFICIENT_MASK_MULTIPLE:  # the ALiBi float mask, cast or padded per call
            terms.append(Term("ALiBi mask cast/padded per layer (heads x padded columns)",
                              c * a * efficient_mask_width(s), kind=ALIBI_MASK_COPY))
        extra = (0.0 if qk_bytes == c else k_cache) + (0.0 if v_bytes == c else v_cache)
        # A checkpointed forward's worst moment is at the kernel: FalconAttention's locals, autocast's half copies
        # of fp32 arguments, and the mask as the kernel prepares it. With RoPE, the boolean mask is converted to a
        # float (b, 1, s, s) one and padded to 16 columns (a copy, where s is not a multiple), both alive before
        # the output exists, as in _attention_terms (traced: Falcon, one head of width 100, fp32, selective
        # checkpointing, 1 x 1,000, seed 20261203 case 4 of ``validate --random``: -23.4% at the forward peak
        # without them); ALiBi's float bias is cast (autocast) and padded per call.
        inputs = _falcon_forward_inputs(spec, layer, p, v_bytes, qk_bytes) \
            + sdpa_autocast_casts(p, a, kv_heads, d, d, qk_bytes, v_bytes)
        forward = efficient_masked_forward(inputs, c, a, d, s, mask_heads=1 if rotary else a,
                                           converted=rotary or r != c)
        return AttentionTerms(tuple(terms), EFFICIENT, extra, 0.0, 0.0, c * 4 * a * d,  # dq, dk, dv, d(output)
                              forward=forward)
    # A single key/value head broadcast over one sequence's heads reshapes without a copy (stride 0)
    kv_kept = 1 if kv_heads == 1 and settings.batch == 1 else a
    # A checkpointed forward keeps nothing: its worst moment is the kernel's scores beside FalconAttention's
    # locals, autocast's half casts of its fp32 q, k, v and the math kernel's own (math_forward_per_token; traced:
    # amp-fp16, head dim 100, 1 x 1,000, -17.9% without them, the generic q/k/v-and-scores fallback)
    forward = _falcon_forward_inputs(spec, layer, p, v_bytes, qk_bytes) \
        + sdpa_autocast_casts(p, a, kv_heads, d, d, qk_bytes, v_bytes) \
        + math_forward_per_token(c, a, kv_heads, d, d, s, settings.batch, has_mask=True, enable_gqa=False,
                                 dropout=sdpa_dropout,
                                 # ALiBi: the float (b, a, s, s) bias in the hidden states' dtype, cast by autocast
                                 mask_copy=None if rotary else (c * a * s if p.autocast and r != c else 0))
    terms += [Term("q scaled (fp32)", FP32 * a * d), Term("k scaled (fp32)", FP32 * kv_kept * d),
              Term("v (fp32)", FP32 * kv_kept * d), Term("softmax probabilities (fp32)", FP32 * a * s)]
    if sdpa_dropout > 0:
        terms += [Term("attention dropout mask", MASK * a * s), Term("dropped probabilities (fp32)", FP32 * a * s)]
    terms.append(Term("attention output copied contiguous (dense input)", c * a * d, input_of="o_input"))
    released, backward = math_backward_per_token(c, a, d, s, sdpa_dropout)
    # A one-head v broadcast over one sequence's heads (stride 0) is saved at one head, and the gradient of v is
    # summed back to it before the softmax's backward (traced: multi-query, amp-bf16, 1 x 1,000: -1.0% at the
    # backward peak with every head's)
    released -= FP32 * (a - kv_kept) * d
    backward -= FP32 * (a - kv_kept) * d
    # Without checkpointing, at the kernel's softmax: its masked scores (fp32) beside what is saved, and the locals
    # nothing saves: the norm outputs under autocast (the Linears save their half copies), the query_key_value
    # output, q and k as the kernel reads them where no cache's torch.cat replaced them, the kernel's fp32 copies
    # of half q and k (v's is saved), autocast's casts and the mask as prepared for the call (traced: ALiBi,
    # amp-fp16, head dim 100, 2 x 1,000: -5.2% at the forward peak without them).
    # (in fp32 the kernel's v is the one passed, which it saves: the cache's tensor where there is one)
    v_is_cache = c == FP32 and use_cache and kv_kept == kv_heads
    q_copy, k_copy, v_copy = _falcon_qkv_copies(att, v_bytes, qk_bytes)
    # Where one key/value head is expanded to every head (several sequences), the product with v copies v after
    # the softmax: at the softmax v is only the one passed (or its fp32 copy), a local (traced: multi-query, 2 x
    # 1,000, +1.2% with the copy counted there)
    v_expanded = kv_kept != kv_heads
    caller = (_falcon_norm_outputs(spec, layer, p) if p.autocast else 0) + v_bytes * (a + 2 * kv) * d + q_copy \
        + (0 if use_cache else k_copy + (v_copy if c != FP32 or v_expanded else 0))
    acc = FP32 * (a * d + kv_heads * d + (kv_heads * d if v_expanded else 0)) if c != FP32 else 0
    # q is laid out (b, s, a, d) (``_split_heads``' transpose); with several sequences and heads the scores'
    # matmul cannot fold batch and heads into a view of the scaled q, so it saves a contiguous copy and the scaled
    # q itself is a local (as in math_softmax_locals; traced: 2 x 1,000, four heads, -1.1% without it)
    scaled_q = FP32 * a * d if settings.batch > 1 and a > 1 else 0
    mask_local = c * s if rotary else (c * a * s if p.autocast and r != c else 0)
    softmax_extra = FP32 * a * s + caller + acc + scaled_q + mask_local \
        + sdpa_autocast_casts(p, a, kv_heads, d, d, qk_bytes, v_bytes)
    after_softmax = c * a * d + ((MASK + FP32) * a * s if sdpa_dropout > 0 else 0) \
        + (FP32 * kv_kept * d if v_expanded else 0)
    # In a checkpointed layer's recompute (grad mode) the scores' matmul saves the contiguous copies it makes of the
    # scaled k (and of the scaled q where it cannot be a view), which the no-grad forward frees at once: alive at
    # the masked scores' add (traced: amp-bf16, dropout 0.1, full checkpointing, 4 x 256, two heads: -3.5% at the
    # backward peak without them)
    recompute_kernel_saved = FP32 * kv_kept * d + scaled_q
    return AttentionTerms(tuple(terms), MATH, k_cache + (0.0 if v_is_cache else v_cache), 0.0, released, backward,
                          forward=forward, matmul_backward=math_matmul_backward_per_token(c, a, d, s),
                          softmax_extra=softmax_extra, after_softmax=after_softmax,
                          math_return_extra=math_return_locals(softmax_extra, c, a, d, s),
                          recompute_kernel_saved=recompute_kernel_saved)


def _falcon_eager_views(att: Attention, rotary: bool, use_cache: bool, one_sequence: bool,
                        uncast: bool) -> tuple[str, ...]:
    """Which of q, k and v FalconAttention's eager matmuls keep as views of the fused query_key_value output
    (modeling_falcon.py ``_split_heads``): in the old layouts q without RoPE, and k and v also without a cache
    (DynamicLayer.update's torch.cat makes new ones) where every head has its own (multi-query indexes its one
    key/value head with a list, which copies); only with one sequence (the matmul's reshape of a strided
    (batch, heads) pair copies otherwise, unless there is one head) and no autocast cast. The new architecture
    indexes k and v with a list (copies) and flattens q's (groups, heads per group) pair, a view only with one
    head per group (traced: one head, 2 x 1,000, -4.8% at the backward peak with q counted as a copy)."""
    if not ((one_sequence or att.num_heads == 1) and uncast):
        return ()
    if att.kv_broadcast:
        return ("q",) if att.num_kv_heads == att.num_heads and not rotary else ()
    multi_head_views = att.num_kv_heads == att.num_heads
    return tuple(name for name, is_view in (("q", not rotary), ("k", multi_head_views and not rotary and not use_cache),
                                            ("v", multi_head_views and not use_cache)) if is_view)


def _falcon_forward_inputs(spec: ModelSpec, layer: Layer, p: Precision, fused_bytes: int, qk_bytes: int) -> float:
    """FalconAttention.forward's locals at its kernel, per token (modeling_falcon.py ``_split_heads``): the norm
    output(s) (the new architecture's second norm, for the MLP, is computed first), the query_key_value output,
    and q, k, v as the kernel reads them (_falcon_qkv_copies)."""
    att = layer.attention
    a, kv, d = att.num_heads, att.num_kv_heads, att.head_dim
    return _falcon_norm_outputs(spec, layer, p) + fused_bytes * (a + 2 * kv) * d \
        + sum(_falcon_qkv_copies(att, fused_bytes, qk_bytes))


def _falcon_norm_outputs(spec: ModelSpec, layer: Layer, p: Precision) -> float:
    """The norm outputs a Falcon layer computes before its attention, per token (the new architecture's second
    norm, for the MLP, is computed first)."""
    norms = 2 if layer.attention.kv_broadcast and layer.num_norms == 2 else 1
    return p.residual * spec.hidden_size * norms


def _falcon_qkv_copies(att: Attention, fused_bytes: int, qk_bytes: int) -> tuple[float, float, float]:
    """Bytes per token of q, k and v beyond the query_key_value output they come from: the new architecture copies
    all three to every head (flatten of a broadcast), the multi-query layout copies k and v (index with a list),
    the multi-head one takes views; RoPE then makes new q and k."""
    a, kv, d = att.num_heads, att.num_kv_heads, att.head_dim
    if att.kv_broadcast:
        q = k = v = fused_bytes * a * d
    elif kv == 1:
        q, k, v = 0, fused_bytes * d, fused_bytes * d
    else:
        q = k = v = 0
    if att.rotary_dim > 0:
        q, k = qk_bytes * a * d, qk_bytes * (a if att.kv_broadcast else kv) * d
    return q, k, v


_DTYPE_OF_BYTES = {4: "fp32", 2: "bf16", 1: "fp8"}


def _mla_terms(spec: ModelSpec, layer: Layer, settings: TrainingSettings, p: Precision, kernel: str,
               dropout: float) -> AttentionTerms:
    """DeepSeek-V3 multi-head latent attention (modeling_deepseek_v3.py, DeepseekV3Attention, transformers 5): the
    low-rank query and the compressed key/value pass through RMSNorms; ``expand_kv`` builds k as a new tensor and v
    as a view of kv_b_proj's output (so keeping v keeps that whole output); q is a torch.cat of its two parts, so
    flash's output follows its (b, a, s, d) layout and is copied for o_proj. q/k and v head dims differ, so flash
    runs only when they happen to be equal."""
    att = layer.attention
    a, c, rope, dv, qk = att.num_heads, p.compute, att.qk_rope_head_dim, att.v_head_dim, att.head_dim
    nope = qk - rope
    s = settings.seq
    use_cache = uses_kv_cache(settings)
    terms: list[Term] = []
    kvr = att.kv_lora_rank
    if att.q_lora_rank:
        q = att.q_lora_rank
        terms += [Term("q_a_layernorm: input in fp32, rsqrt, normalised", FP32 * q + FP32 + c * q,
                       normalised_bytes=c * q),
                  Term("q_a_layernorm output (q_b_proj input)", c * q, input_of="q_b_input")]
    # kv_a_layernorm reads a view of kv_a_proj_with_mqa's output; in fp32 its no-op upcast keeps that whole output.
    terms += [Term("kv_a_layernorm: input in fp32, rsqrt, normalised",
                   FP32 * (kvr + rope if c == FP32 else kvr) + FP32 + c * kvr, normalised_bytes=c * kvr),
              Term("kv_a_layernorm output (kv_b_proj input)", c * kvr, input_of="kv_b_input")]
    kv_b_out = c * a * (nope + dv)
    q_bytes = p.residual if p.autocast else c  # the rotated half is fp32 under autocast, and the cat promotes
    # The cache (use_cache) keeps the latents: the normalised kv (fp32 under autocast, where kv_b_proj keeps a
    # half cast instead) and the rotated shared key.
    cache_extra = ((FP32 * kvr if p.autocast else 0) + q_bytes * rope) if use_cache else 0.0
    # A checkpointed forward holds DeepseekV3Attention.forward's locals at the kernel: its input, q_b_proj's output,
    # kv_a_proj_with_mqa's and kv_a_layernorm's, the rotated q and shared k, q (torch.cat), k (expand_kv's new
    # tensor) and kv_b_proj's output (v is a view of it).
    inputs = (p.residual * spec.hidden_size + c * a * qk + c * (kvr + rope) + c * kvr + q_bytes * (a + 1) * rope
              + q_bytes * a * qk + c * a * qk + kv_b_out)
    if kernel == EAGER:
        terms += [Term("q", c * a * qk), Term("k", c * a * qk),
                  Term("softmax probabilities (fp32)", FP32 * a * s, kind=SOFTMAX_PROBABILITIES)]
        if c != FP32 or dropout > 0:
            terms.append(Term("probabilities in compute dtype (matmul with v)", c * a * s))
        if dropout > 0:
            terms.append(Term("attention dropout mask", MASK * a * s))
        # the batched matmul with v copies the strided view of kv_b_proj's output
        terms += [Term("v, contiguous copy", c * a * dv), Term("attention output, contiguous (o_proj input)",
                                                                c * a * dv, input_of="o_input")]
        released: float = 2 * c * a * dv + (c * a * s if c != FP32 or dropout > 0 else 0)
        if dropout > 0 and q_bytes != FP32:
            # the dropout (on probabilities cast to q's half dtype) has run its backward by the softmax's: its mask
            # is freed (with fp32 probabilities the dropout's own moment, mask alive, is the larger)
            released += MASK * a * s
        # eager_attention_forward returns the dropped probabilities, which DeepseekV3DecoderLayer holds in ``_``
        # to its end: under autocast they are fp32 (the cat with the rotated half promotes q, and the softmax's
        # ``.to(query.dtype)`` keeps fp32), while the matmul with v keeps a half cast, so they are a tensor of
        # their own (traced: amp-fp16, eager, dropout 0.1, full checkpointing, 8 KiB per token short at the
        # routed experts' recompute; seed 20261205 case 4 of ``validate --random``)
        returned = FP32 * a * s if dropout > 0 and q_bytes == FP32 and c != FP32 else 0.0
        return AttentionTerms(tuple(terms), EAGER, cache_extra, returned, released, 2 * FP32 * a * s + c * a * dv,
                              forward_inputs=inputs, matmul_backward=c * a * s + 2 * c * a * dv)
    backend = sdpa_backend(dtype=_DTYPE_OF_BYTES[c], head_dim_qk=qk, head_dim_v=dv, q_heads=a, kv_heads=a,
                           has_mask=False, enable_gqa=False, q_len=s, kv_len=s, is_causal=True,
                           storage_offsets=(0, 0, nope))
    if backend == FLASH:
        d8 = flash_head_dim(qk)
        pad = d8 != qk
        terms += [Term("q" + (" padded" if pad else ""), c * a * d8), Term("k" + (" padded" if pad else ""),
                                                                           c * a * d8),
                  Term("v padded" if pad else "v (a view of kv_b_proj's output, which it keeps)",
                       c * a * d8 if pad else kv_b_out),
                  Term("attention output", c * a * d8), Term("softmax logsumexp (fp32)", FP32 * a),
                  Term("attention output copied contiguous (o_proj input)", c * a * dv, input_of="o_input")]
        released, backward = c * a * dv, flash_backward_per_token(c, a, a, qk, dv, s)
    elif backend == EFFICIENT:
        terms += [Term("q", c * a * qk), Term("k", c * a * qk),
                  Term("v (a view of kv_b_proj's output, which it keeps)", kv_b_out),
                  Term("attention output (o_proj input)", c * a * dv, kind="shared_input", input_of="o_input"),
                  Term("softmax logsumexp (fp32, padded to 32 rows)", efficient_lse_per_token(a, s))]
        released, backward = 0.0, c * a * (2 * qk + 2 * dv)  # dq, dk, dv beside d(output)
    else:
        v_kept = Term("v (a view of kv_b_proj's output, which it keeps)", kv_b_out) if c == FP32 else \
            Term("v (fp32)", FP32 * a * dv)
        terms += [Term("q scaled (fp32)", FP32 * a * qk), Term("k scaled (fp32)", FP32 * a * qk), v_kept,
                  Term("softmax probabilities (fp32)", FP32 * a * s)]
        if dropout > 0:
            terms += [Term("attention dropout mask", MASK * a * s), Term("dropped probabilities (fp32)", FP32 * a * s)]
        terms.append(Term("attention output copied contiguous (o_proj input)", c * a * dv, input_of="o_input"))
        released, backward = math_backward_per_token(c, a, dv, s, dropout)
    matmul_backward = math_matmul_backward_per_token(c, a, dv, s) if backend == MATH else 0.0
    return AttentionTerms(tuple(terms), backend, cache_extra, 0.0, released, backward, forward_inputs=inputs,
                          matmul_backward=matmul_backward)


def _mlp_terms(mlp: MLP, p: Precision, fc1_bytes: int | None = None) -> list[Term]:
    """``fc1_bytes``: the dtype fc1 returns when it is not the compute dtype (FalconLinear adds its fp32 bias after
    the autocast matmul, so under autocast its output is fp32)."""
    c, i = p.compute, mlp.intermediate_size
    f = fc1_bytes or c
    act = mlp.activation
    if mlp.gated:
        # gate and up outputs (kept by the activation and the product), the activation output, the product
        # (down_proj's input). A fused gate_up_proj keeps one 2I-wide output: the same bytes.
        return [Term("gate, up projections", 2 * c * i), Term(f"{act}(gate)", c * i),
                Term("gate*up (down_proj input)", c * i, "down_input", "linear_input")]
    if act == "relu":
        # relu keeps its output only, which is also fc2's input (OPT); under autocast fc2 casts an fp32 one.
        return [Term("relu output (fc2 input)", f * i, "down_input", "shared_input")] + (
            [Term("fc2 input cast", c * i, "down_input", "linear_input")] if f != c else [])
    if act == "gelu_new":
        # NewGELUActivation is Python: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3)))). pow keeps x,
        # tanh its output, the last product 0.5*x and 1+tanh. On CUDA pow is on autocast's fp32 list, so under
        # autocast x is upcast and the chain after it runs in fp32; fc2 casts the result back.
        w = FP32 if p.autocast else c
        return [Term("fc1 output (pow's input)" + (" upcast to fp32" if p.autocast else ""), w * i),
                Term("tanh output, 1 + tanh", 2 * w * i), Term("0.5 * x", c * i),
                Term("gelu output (fc2 input)", c * i, "down_input", "linear_input")]
    return [Term("fc1 output", f * i), Term(f"{act} output (fc2 input)", c * i, "down_input", "linear_input")]


def _moe_terms(moe: MoE, h: int, p: Precision) -> list[Term]:
    """Routed experts in transformers 5: the router (MixtralTopKRouter and kin) and the default
    ``grouped_mm`` experts path (integrations/moe.py, grouped_mm_experts_forward). grouped_mm is not an
    autocast op and casts its input to the weights' dtype, so under autocast the experts run in fp32."""
    e, k, i = moe.num_experts, moe.top_k, moe.expert_intermediate_size
    w = p.experts
    terms = _router_terms(moe, h, p)
    weight_bytes = p.compute if moe.weights_in_compute_dtype else _router_score_bytes(moe, p)
    # (with biases, ``gate_up_proj_bias[expert_ids_g]`` keeps the sorted expert ids as a fourth index)
    indices = 4 if moe.bias else 3
    terms += [
        Term(f"routing bookkeeping per (token, expert) pair ({indices} int64 indices and the weight)",
             k * (indices * INDEX + weight_bytes)),
        Term("tokens gathered per selected expert", k * w * h, input_of="expert_input"),
        Term("expert gate_up outputs", k * 2 * w * i, "routed_experts", "intermediate"),
    ]
    if moe.gate == "clamped_swiglu":
        # GptOssExperts._apply_gate: ``gate.clamp(max=limit)`` (kept by the product with the sigmoid), its sigmoid
        # (``torch.sigmoid(gate * alpha)``: the scalar product keeps nothing), ``glu``, ``up + 1`` (the clamp of up
        # keeps gate_up's view) and their product (the down projection's input: a fifth of this term).
        terms.append(Term("expert clamped gate, its sigmoid, glu, up + 1 and their product", k * 5 * w * i,
                          "routed_experts", "intermediate", "expert_down_input", input_share=0.2))
    else:
        # (the product is the down projection's input: half of this term)
        terms.append(Term("expert activation and product", k * 2 * w * i, "routed_experts", "intermediate",
                          "expert_down_input", input_share=0.5))
    terms.append(Term("expert outputs (weighted by the router)", k * w * h, "routed_experts", "intermediate"))
    if moe.shared_intermediate_size:
        shared = MLP(moe.shared_intermediate_size, True, moe.activation)
        terms += [Term(f"shared expert: {t.name}", t.bytes_per_token, "shared_expert",
                       input_of="shared_down_input" if t.module == "down_input" else "")
                  for t in _mlp_terms(shared, p)]
    elif moe.shared_always_built and p.autocast:
        terms.append(Term("zero-width shared experts: their gate and up projections' input casts", 2 * p.compute * h))
    if moe.shared_expert_gate:
        # sigmoid(shared_expert_gate(x)) * shared_expert(x): the product keeps both factors.
        terms.append(Term("shared expert output and its sigmoid gate", p.compute * (h + 1)))
    return terms


def _router_score_bytes(moe: MoE, p: Precision) -> int:
    """dtype of the router's scores: fp32 softmax, or DeepSeek's sigmoid of the logits (half under autocast)."""
    return p.compute if moe.router == "sigmoid_grouped" and p.autocast else FP32


def _router_terms(moe: MoE, h: int, p: Precision) -> list[Term]:
    """What the router keeps. Softmax routers (MixtralTopKRouter, Qwen2MoeTopKRouter): the fp32 softmax, the top-k
    indices, and with normalisation the divided weights and their sum. DeepseekV3TopkRouter: its fp32 upcast input
    (under autocast F.linear casts it back to half instead), the sigmoid scores, the top-k indices, and with
    normalisation the divided weights and their sum. Its group selection (``scores_for_choice``, the per-group
    top-2, ``group_idx``, ``group_mask``, ``score_mask``) is off the differentiable path: only the integer
    ``topk_indices`` leave it, the discarded top-k values free their autograd nodes, and what those nodes saved
    goes with them (traced: nothing of it alive in backward, DeepSeek-V3 fp32 without checkpointing)."""
    e, k = moe.num_experts, moe.top_k
    scores = _router_score_bytes(moe, p)
    norm = [Term("top-k weights divided by their sum, and the sum (fp32)", scores * k + FP32)] \
        if moe.normalize_top_k else []
    if moe.router == "softmax":
        return [Term("router softmax (fp32)", FP32 * e), Term("top-k indices (int64)", INDEX * k)] + norm
    if moe.router == "topk_softmax":
        # GptOssTopKRouter: ``torch.topk`` of the logits (its indices kept), then the softmax of the k values in the
        # logits' dtype (the compute dtype: F.linear's output)
        return [Term("router softmax over the top-k logits", p.compute * k), Term("top-k indices (int64)", INDEX * k)]
    # Under autocast F.linear casts the fp32 upcast back to half: that copy is one of the MLP input's casts.
    upcast = FP32 * h if p.compute != FP32 and not p.autocast else 0
    terms = [Term("router input in fp32", upcast, input_of="router_input"), Term("router sigmoid scores", scores * e),
             Term("top-k indices (int64)", INDEX * k)]
    return [t for t in terms if t.bytes_per_token] + norm


# --------------------------------------------------------------------------------------------------------
# One layer
# --------------------------------------------------------------------------------------------------------


def _hidden_dropout_sites(spec: ModelSpec, layer: Layer) -> int:
    """Residual dropouts per layer (each keeps a bool mask): GPT-2, OPT, Phi-3, NeoX, BLOOM: 2; Falcon: 1-2;
    StableLM: 1 (the MLP output's)."""
    if spec.traits.hidden_dropout == "per_residual_add":
        return 1 if layer.parallel_residual else 2
    return {"per_block": 2, "after_mlp": 1}.get(spec.traits.hidden_dropout, 0)


def _sequence_sharded(terms: list[Term], shards: int) -> list[Term]:
    """Terms in a sequence-parallel region (norms, residual dropouts, the layer input): 1/T of the tokens on each
    tensor-parallel rank (Korthikanti et al. 2022, arXiv:2205.05198 section 4.2.2). The Linear inputs are not among
    them: DTensor's ColwiseParallel all-gathers its input and autograd keeps the gathered tensor (Megatron instead
    keeps the shard and gathers it again in backward: docs/accuracy.md)."""
    if shards == 1:
        return terms
    return [replace(t, bytes_per_token=t.bytes_per_token / shards) for t in terms]


def layer_activations(spec: ModelSpec, layer: Layer, count: int, recipe: Recipe,
                      settings: TrainingSettings) -> LayerActivations:
    p = Precision.of(recipe)
    h, s = spec.hidden_size, settings.seq
    r = p.residual
    att = layer.attention
    attn_dropout = spec.dropout.attention if settings.dropout is None else settings.dropout
    attn_dropout = attn_dropout if spec.traits.attention_dropout else 0.0
    hidden_dropout = spec.dropout.hidden if settings.dropout is None else settings.dropout
    kernel = settings.attention
    terms: list[Term] = []
    sp = spec.sequence_shards

    def norm_terms(label: str, input_bytes: int, module: str) -> list[Term]:
        return _sequence_sharded(_norm_terms(spec, h, p, label, input_bytes, module), sp)

    # --- attention block: pre-norm, its output read by the q/k/v projections -----------------------------
    post_norms = spec.traits.norm_placement == "post"
    reads_input = spec.traits.attention_reads_layer_input
    if not reads_input:
        terms += norm_terms("input norm", r, "input_norm")
    # Linears reading the input norm's output (with post-norms, the layer input): one fused qkv; q/k/v; MLA's
    # q_a_proj and kv_a_proj_with_mqa.
    qkv_consumers = 1 if att.fused_qkv else 2 if att.kind == "mla" else 3
    terms += _linear_inputs(p, h, qkv_consumers, "layer input (q/k/v projections' input)" if reads_input else
                            "input norm output (q/k/v projections' input)", r, "qkv_input")
    gemma = spec.traits.rms_norm_fp32_plus_one
    if att.kind == "mla":
        attention = _mla_terms(spec, layer, settings, p, kernel, attn_dropout)
    elif spec.traits.block == "falcon":
        attention = _falcon_attention_terms(spec, layer, settings, p, kernel, attn_dropout)
    else:
        attention = _attention_terms(spec, layer, settings, p, kernel, attn_dropout)
    terms += attention.terms
    attention_bytes = sum(t.bytes_per_token for t in terms)

    # --- MLP block: its norm (if it has its own), then the MLP's input ------------------------------------
    if layer.moe:  # the router, the shared expert's gate and up projections, and its sigmoid gate
        mlp_consumers = 1 + (2 if layer.moe.shared_intermediate_size else 0) + int(layer.moe.shared_expert_gate)
    else:
        mlp_consumers = 2 if (layer.mlp and layer.mlp.gated and not layer.mlp.fused_gate_up) else 1
    if layer.num_norms == 4:
        # Gemma 2/3 sandwich norms: post_attention_layernorm on the attention output (before the residual
        # add), pre_feedforward_layernorm, and post_feedforward_layernorm on the MLP output (GLM-4's
        # Glm4DecoderLayer has the same four: post_self_attn_layernorm, post_attention_layernorm, post_mlp_layernorm).
        terms += norm_terms("post-attention norm", p.compute, "post_attention_norm")
        terms += norm_terms("pre-feedforward norm", r, "pre_feedforward_norm")
        terms += norm_terms("post-feedforward norm", p.compute, "post_feedforward_norm")
    elif spec.traits.norm_after_residual:
        # OPT with do_layer_norm_before false: self_attn_layer_norm on the attention's residual sum, its output the
        # MLP's input, and final_layer_norm on the MLP's residual sum, its output the layer's. Each backward frees
        # what the norm saved as the block it follows: the final norm's first, before the MLP's backward (a norm on
        # the layer's output), the attention norm's after the MLP's, before attention's (traced: fp32, full
        # checkpointing, 2 x 256: 0.5 MiB held too long at each, the peak -2.2% without)
        terms += norm_terms("attention residual norm", r, "post_attention_norm")
        terms += norm_terms("output norm", r, "post_feedforward_norm")
    elif post_norms:
        # OLMo-2: post_attention_layernorm on o_proj's output and post_feedforward_layernorm on the MLP's, each
        # before its residual add (Olmo2DecoderLayer); the MLP reads the residual stream itself.
        terms += norm_terms("post-attention norm", p.compute, "post_attention_norm")
        terms += norm_terms("post-feedforward norm", p.compute, "post_feedforward_norm")
    elif layer.parallel_residual and layer.num_norms == 1:
        pass  # Falcon-7B: the MLP reads the same norm output as attention
    elif layer.parallel_residual:
        # GPT-NeoX's post_attention_layernorm and Falcon's ln_mlp read the layer input, which the first norm
        # already keeps: only their statistics are new.
        terms += norm_terms("MLP norm", r, "mlp_norm")[1:]
    else:
        terms += norm_terms("post-attention norm", r, "post_attention_norm")
    if layer.parallel_residual and layer.num_norms == 1:
        if p.autocast:  # the shared fp32 norm output is cast again by each MLP Linear
            terms += [replace(t, input_of="mlp_input")
                      for t in _linear_inputs(p, h, mlp_consumers, "input norm output (MLP input)", r)]
    else:
        terms += _linear_inputs(p, h, mlp_consumers, "MLP norm output (MLP input)", r, "mlp_input")
    falcon_bias = spec.traits.bias_after_matmul and p.autocast and att.qkv_bias
    if layer.mlp:
        terms += _mlp_terms(layer.mlp, p, fc1_bytes=p.residual if falcon_bias else None)
    else:
        terms += _moe_terms(layer.moe, h, p)  # type: ignore[arg-type]
    sites = _hidden_dropout_sites(spec, layer)
    if hidden_dropout > 0 and sites:
        terms += _sequence_sharded([Term(f"residual dropout masks x{sites}", sites * MASK * h)], sp)
    if spec.context_shards > 1:
        # Context parallelism as Megatron's all-gather variant and Llama 3 (arXiv:2407.21783 section 3.3.2) run
        # it: each rank's queries attend to the keys and values all-gathered from the other C - 1 ranks, and the
        # kernel keeps them for backward (ring attention, TransformerEngine's p2p, keeps only its own).
        kv_width = att.num_kv_heads * (att.head_dim + att.v_head_dim) if att.kind == "mha" else \
            att.num_heads * (att.head_dim + att.v_head_dim)
        terms.append(Term(f"keys and values gathered from the other {spec.context_shards - 1} context-parallel "
                          "ranks", (spec.context_shards - 1) * p.compute * kv_width))

    constant = attention_input_casts = 0
    if p.autocast:
        from .models import layer_tensors

        matrices = [t for t in layer_tensors(layer, h, spec.norm_vectors)
                    if len(t.shape) == 2 and t.role != "norm"]  # (Cohere's q/k norm weights are 2-D)
        constant += p.compute * sum(t.numel for t in matrices)
        attention_input_casts = p.compute * sum(t.numel for t in matrices if t.role == "attention_input")
    if gemma:  # GemmaRMSNorm multiplies by (1 + weight.float()), a new fp32 vector kept by the product
        constant += FP32 * h * layer.num_norms
        if att.qk_norm:
            constant += FP32 * 2 * att.head_dim
    checkpoint = tuple(_sequence_sharded([Term("layer input (checkpoint)", r * h)], sp))
    # (GPT-J casts the fp32 probabilities to v's dtype, half under autocast, while the scores are bound)
    to_v_dtype = spec.traits.eager_attention == "fp32_scores"
    if settings.checkpointing == "op":
        checkpoint += op_sac_terms(layer, h, p, attention.kernel, s)
    return LayerActivations(layer, count, tuple(terms), constant, checkpoint, attention_input_casts,
                            attention.kernel, attention.cache_extra,
                            attention.returned_extra, attention_bytes, attention.released, attention.backward,
                            max(attention.forward or _attention_forward_peak(
                                    attention, att, p, s, attn_dropout, _half_q(spec, att) or to_v_dtype,
                                    probs_to_v=spec.traits.eager_attention != "llama"),
                                attention.rotary_forward),
                            attention.softmax_extra, attention.after_softmax, attention.returned_to_model,
                            attention.held_by_layer, matmul_backward=attention.matmul_backward,
                            math_return_extra=attention.math_return_extra,
                            recompute_locals=attention.recompute_locals, recompute_saved=attention.recompute_saved,
                            recompute_kernel_saved=attention.recompute_kernel_saved)


# --------------------------------------------------------------------------------------------------------
# The whole model: embedding, layers, head and loss
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationEstimate:
    """Everything the forward pass of one micro-batch keeps for backward, and the logits around the loss."""

    tokens: int
    """batch x seq of the micro-batch."""
    layers: tuple[LayerActivations, ...]
    embedding_terms: tuple[Term, ...]
    head_terms: tuple[Term, ...]
    """Final norm, LM head input, loss: per token."""
    constant_terms: tuple[Term, ...]
    """Bytes independent of the batch: rotary tables, autocast weight copies of the head and routers."""
    logits_bytes: int
    """The logits tensor the model returns (compute dtype), alive from the LM head to the end of backward's
    start when the caller keeps the output object."""
    loss_transient_bytes: int
    """Working memory of the loss on top of what is saved: fp32 upcast of the logits during forward."""
    checkpointing: str
    kv_cache_bytes: int = 0
    """Held by the KV cache the model returns (use_cache=True, the config default) but not saved for backward:
    under autocast the cache keeps each layer's fp32 rotated keys while attention keeps their bf16 casts. Alive
    until the output object is dropped, so it counts at the forward peak only."""
    mask_bytes: int = 0
    """Attention masks alive while the decoder layers run, beyond those in the constants (with checkpointing the
    masks the layers receive are constants, kept for the recompute)."""

    decoder_locals_bytes: int = 0
    """Tensors the base model's forward keeps in locals through its layer loop that backward does not keep: GPT-2's
    token and position embeddings (summed into the first hidden states), OPT's too and its position tensors. Freed
    when the base model returns, before the logits."""

    compiled: bool = False
    """--compile: the decoder layers are compiled (compiled_layer's terms)."""
    offloaded: bool = False
    """--offload-activations: the checkpointed layers' inputs live in host memory (host_bytes) until backward."""

    @property
    def checkpoint_compiled(self) -> bool:
        """Whether each checkpointed layer's checkpoint is inside its compiled region (torchtitan's order for its
        SAC, --checkpointing op: compiled_checkpoint_terms), so that it recomputes inside its compiled backward.
        --checkpointing full with --compile is torchtune's order, the compiled layer inside the checkpoint."""
        return self.compiled and self.checkpointing in CHECKPOINT_COMPILED

    @property
    def host_bytes(self) -> int:
        """Host memory at the end of forward: every tensor of OFFLOAD_MIN_BYTES or more saved inside the decoder
        (each checkpointed layer's input, the embedding's indices, the final norm's tensors), each a copy of its
        own. (The device figures keep the embedding's and final norm's: a few h-wide tensors, traced +0.15-0.8%.)"""
        if not self.offloaded:
            return 0

        def copied(per_token: float) -> int:
            size = int(per_token * self.tokens)
            return size if size >= OFFLOAD_MIN_BYTES else 0

        inputs = sum(copied(sum(t.bytes_per_token for t in la.checkpoint_terms)) * la.count for la in self.layers)
        inside = [t for t in self.embedding_terms if t.kind != "back_from_host"] + \
            [t for t in self.head_terms if t.module == "final_norm"]
        return inputs + sum(copied(t.bytes_per_token) for t in inside)

    def layer_saved_bytes(self, layer: LayerActivations) -> int:
        if layer.checkpointed and self.offloaded:
            return 0
        if layer.checkpointed:
            return int(sum(t.bytes_per_token for t in layer.checkpoint_terms) * self.tokens)
        return int(layer.bytes_per_token * self.tokens) + layer.constant_bytes

    @cached_property  # (asked for at every moment of a timeline)
    def layers_bytes(self) -> int:
        return sum(self.layer_saved_bytes(la) * la.count for la in self.layers)

    @cached_property
    def embedding_bytes(self) -> int:
        return int(sum(t.bytes_per_token for t in self.embedding_terms) * self.tokens)

    @cached_property
    def embedding_lookup_bytes(self) -> int:
        """What the embedding terms still hold while the embedding's own backward runs, the step's last: what the
        lookups read (the ids); project_in, the embedding dropout and the embedding norm ran their backward before
        it and freed theirs (traced: BLOOM's word_embeddings_layernorm input, 2.5 MiB at 4 x 128 x 1,280 fp32,
        gone by embedding_dense_backward)."""
        before = ("project_in", "embedding_dropout", "embedding_norm")
        return int(sum(t.bytes_per_token for t in self.embedding_terms if t.module not in before) * self.tokens)

    @cached_property
    def head_bytes(self) -> int:
        return int(sum(t.bytes_per_token for t in self.head_terms) * self.tokens)

    @cached_property
    def constant_bytes(self) -> int:
        return int(sum(t.bytes_per_token for t in self.constant_terms))

    @cached_property
    def saved_bytes(self) -> int:
        """Saved for backward at the end of the forward pass (what saved_tensors_hooks would see)."""
        return self.layers_bytes + self.embedding_bytes + self.head_bytes + self.constant_bytes

    @property
    def recompute_bytes(self) -> int:
        """With full checkpointing, one layer's activations exist again while it is recomputed in backward."""
        if self.checkpointing != "full":
            return 0
        return max(int(la.bytes_per_token * self.tokens) + la.constant_bytes for la in self.layers)


def effective_kernel(spec: ModelSpec, kernel: str) -> str:
    if kernel == "sdpa" and not spec.traits.sdpa_supported:
        return "eager"
    return kernel


def llama_style_layers(spec: ModelSpec) -> bool:
    """Every layer shaped as Llama's: attention (no MLA) then a gated dense MLP, two norms, sequential residuals,
    no projected embeddings: the ground the compiled-layer model is built on."""
    return lora_layers_modelled(spec) and all(lay.dense_mlp.gated for lay, _ in spec.layer_runs)


def lora_layers_modelled(spec: ModelSpec) -> bool:
    """Layers shaped as Llama's or as the same with a plain two-Linear MLP (GPT-2, OPT without
    projected embeddings): attention (no MLA), a dense MLP, two norms, sequential residuals."""
    return bool(spec.layer_runs) and spec.traits.block == "standard" and not spec.projects_embeddings and not any(
        lay.attention.kind == "mla" or lay.moe or lay.mlp is None or lay.parallel_residual or lay.num_norms != 2
        for lay, _ in spec.layer_runs)


def runs_dropout(spec: ModelSpec, settings: TrainingSettings) -> bool:
    """Whether the step drops anything out in attention or the residual stream (--dropout, else the config's)."""
    if settings.dropout is not None:
        return settings.dropout > 0
    return bool(spec.dropout.attention or spec.dropout.hidden)


def op_checkpointing_unmodelled(spec: ModelSpec, settings: TrainingSettings) -> str | None:
    """Why --checkpointing op is not modelled for this set-up, or None: Llama-like dense layers (llama, mistral,
    qwen2 and the like), SDPA."""
    if not llama_style_layers(spec) or any(
            lay.attention.fused_qkv or lay.dense_mlp.fused_gate_up or lay.attention.qk_norm or lay.attention.kind != "mha"
            for lay, _ in spec.layer_runs) or spec.traits.norm_placement == "post" or \
            spec.traits.rms_norm_fp32_plus_one:
        return (f"checkpointing 'op' (torchtitan's per-op SAC) is modelled for Llama-like layers (llama, mistral, "
                f"qwen2: separate q/k/v and gate/up Linears, no q/k norm); {spec.model_type}'s are not")
    if settings.attention != "sdpa":
        return f"checkpointing 'op' is modelled with --attention sdpa (torchtitan's); got {settings.attention!r}"
    if any(sdpa_mask(spec, lay, settings.seq) for lay, _ in spec.layer_runs):
        return ("checkpointing 'op' is modelled with causal SDPA, no mask (a sliding window the sequence reaches "
                "gives the kernel a mask); give a shorter --seq or --checkpointing full")
    if runs_dropout(spec, settings):
        return "checkpointing 'op' is modelled without dropout (torchtitan's Llama has none); give --dropout 0"
    return None


def compile_modelled(spec: ModelSpec, recipe: Recipe, settings: TrainingSettings) -> str | None:
    """Why --compile's layers are not modelled for this set-up, or None: Llama-style layers with separate q, k, v,
    full rotary, two RMSNorms, no q/k norms, SDPA, half precision without autocast, no dropout (checked against
    the aot_eager_decomp_partition trace, tests/test_finetune_switches.py)."""
    if (not llama_style_layers(spec) or spec.norm != "rms" or spec.traits.rms_norm_fp32_plus_one
            or any(lay.attention.qk_norm or lay.attention.fused_qkv or lay.dense_mlp.fused_gate_up
                   or lay.attention.rotary_dim != lay.attention.head_dim for lay, _ in spec.layer_runs)):
        return f"{spec.model_type}'s layers (compiled layers are modelled for Llama-style layers)"
    if recipe.autocast or recipe.compute == "fp32":
        return (f"the {recipe.name} recipe (compiled layers are modelled in half precision without autocast: "
                "pure-bf16*, mixed-*)")
    if effective_kernel(spec, settings.attention) != "sdpa":
        return f"{settings.attention} attention (compiled layers are modelled with SDPA)"
    if any(sdpa_mask(spec, lay, settings.seq) for lay, _ in spec.layer_runs):
        # (traced: the masked kernel's saved mask and expanded k, v are not in compiled_layer's terms)
        return (f"a sliding window of {min(lay.sliding_window for lay, _ in spec.layer_runs if lay.sliding_window)} "
                f"tokens that a {settings.seq}-token sequence reaches (compiled layers are modelled with causal "
                "SDPA, no mask)")
    if runs_dropout(spec, settings):
        return "dropout (compiled layers are modelled without dropout)"
    return None


CHECKPOINT_COMPILED = ("op", "selective")
"""The checkpointing whose checkpoint torch.compile wraps (torchtitan: apply_ac, then apply_compile per block)."""


def compiled_layer(la: LayerActivations, h: int, p: Precision, checkpointing: str = "none") -> LayerActivations:
    """What a torch.compile'd Llama-style layer saves (AOTAutograd's min-cut partitioner, default memory budget,
    traced with aot_eager_decomp_partition): the layer input and each RMSNorm's rstd (the fp32 upcasts are
    recomputed), the two norm outputs (matmul inputs), q after rotary, k, v, SDPA's logsumexp, the attention output
    as o_proj reads it (SDPA's output is a view of it), the residual after attention, and the MLP's gate and up
    outputs and their product (SiLU is recomputed): per token c(3I + 2h + 2ad + 2kv·d) + 2r·h + 4a + 8, against
    eager's two fp32 norm upcasts and SiLU output besides."""
    from dataclasses import replace

    layer, c, r = la.layer, p.compute, p.residual
    att, mlp = layer.attention, layer.dense_mlp
    a, kv, d = att.num_heads, att.num_kv_heads, att.head_dim
    attention_terms = (
        Term("layer input", r * h, "input_norm"),
        Term("input norm rstd (fp32)", FP32, "input_norm"),
        Term("input norm output (q, k, v input)", c * h, "qkv_input", "linear_input"),
        Term("q after rotary", c * a * d),
        Term("k after rotary, v", 2 * c * kv * d),
        Term("SDPA logsumexp (fp32)", FP32 * a),
        # (SDPA keeps its output for its own backward: saved whatever o_proj does)
        Term("attention output (o_proj input)", c * a * d, "o_input", "shared_input"),
    )
    mlp_terms = (
        Term("residual after attention", r * h, "post_attention_norm"),
        Term("post-attention norm rstd (fp32)", FP32, "post_attention_norm"),
        Term("post-attention norm output (gate, up input)", c * h, "mlp_input", "linear_input"),
        Term("gate, up outputs", 2 * c * mlp.intermediate_size),
        Term("SiLU(gate) x up (down input)", c * mlp.intermediate_size, "down_input", "linear_input"),
    )
    kept = compiled_checkpoint_terms(la) if checkpointing in CHECKPOINT_COMPILED else la.checkpoint_terms
    return replace(la, terms=attention_terms + mlp_terms, checkpoint_terms=kept,
                   attention_bytes_per_token=sum(t.bytes_per_token for t in attention_terms))


COMPILED_SAVED = "compiled_saved"
"""Term kind of a checkpointed compiled layer's saved op output (compiled_checkpoint_terms)."""


def compiled_checkpoint_terms(la: LayerActivations) -> tuple[Term, ...]:
    """What a compiled layer inside a checkpoint keeps until its backward, in torchtitan's order (the checkpoint
    applied to the block, then torch.compile of the block: the compiled region is the checkpoint). Dynamo turns
    the checkpoint into ``tag_activation_checkpoint``, which runs the policy on every op of the region while
    AOTAutograd traces it and tags the node with its answer (torch/_higher_order_ops/wrap.py,
    ``tag_activation_checkpoint_impl``: plain checkpointing, ``_always_prefer_recompute``;
    torch/utils/checkpoint.py, ``_CachingTorchDispatchMode.__torch_dispatch__``: ``node.meta["recompute"] =
    policy``). The min-cut partitioner then must recompute a PREFER_RECOMPUTE node (partitioners.py,
    ``must_recompute`` and its infinite edge to the sink) and may not recompute a MUST_SAVE one
    (``should_ban_recomputation``: "marked MUST_SAVE"), which it saves only where backward needs its value: so
    the layer keeps its input (a graph input), under --checkpointing op the policy's saved outputs but down_proj's
    (the layer's last matmul, read only by the residual add, whose backward needs nothing), and under selective
    nothing else. The SDPA kernel's output and logsumexp are saved as the policy's (its two philox scalars too,
    a few bytes). Traced with aot_eager_decomp_partition (tests/test_opsac.py)."""
    inputs = tuple(t for t in la.checkpoint_terms if t.kind not in (OP_SAVED, OP_SAVED_UNTAKEN))
    saved = tuple(Term(t.name.replace("saved by the op policy", "saved by the op policy, compiled"),
                       t.bytes_per_token, t.module, COMPILED_SAVED)
                  for t in la.checkpoint_terms if t.kind == OP_SAVED)
    return inputs + saved


def op_sac_terms(layer: Layer, h: int, p: Precision, kernel: str, seq: int) -> tuple[Term, ...]:
    """What torchtitan's per-op SAC (--checkpointing op) keeps of a layer beyond its input: the outputs of the
    ops in its save list (opsac.py), i.e. the saved matmuls' outputs in the compute dtype and the SDPA kernel's
    output and fp32 logsumexp (the flash kernel's at the head dim padded to 8, the memory-efficient one's
    logsumexp padded to 32 rows, as the kernel keeps them for its own backward: _attention_terms)."""
    from .opsac import SDPA_KERNELS, saved_projections

    c, att = p.compute, layer.attention
    saved = saved_projections(layer, h)
    # In backward the recompute takes each saved output back from SAC's cache (_CachedTorchDispatchMode pops it):
    # then it is one of the recomputed activations (SDPA's v, SiLU's gate) or dies in the recompute as without
    # the policy (q before rotary). The recompute stops once the last tensor autograd saves exists
    # (torch.utils.checkpoint's early stop), at down_proj's matmul, before it runs: a saved down_proj output is
    # never taken back and stays in the cache until the layer's backward has run (traced).
    # (``module``: the Linear whose output it is, or "attention": the timeline's forward moments read it)
    terms = [Term(f"{name} output (saved by the op policy)", c * width, name, OP_SAVED if name != "down_proj"
                  else OP_SAVED_UNTAKEN) for name, width in saved]
    if kernel in SDPA_KERNELS:
        dv = flash_head_dim(att.v_head_dim) if kernel == FLASH else att.v_head_dim
        lse = FP32 * att.num_heads if kernel == FLASH else efficient_lse_per_token(att.num_heads, seq)
        terms += [Term("attention output (saved by the op policy)", c * att.num_heads * dv, "attention", OP_SAVED),
                  Term("softmax logsumexp (saved by the op policy)", lse, "attention", OP_SAVED)]
    return tuple(terms)


OP_SAVED, OP_SAVED_UNTAKEN = "op_saved", "op_saved_untaken"
"""Term kinds of what --checkpointing op keeps beyond the layer input: taken back by the recompute, or not."""


def checkpointed_runs(spec: ModelSpec, checkpointing: str) -> list[tuple[Layer, int, bool]]:
    """The layer runs split where checkpointing starts or stops: (layer, count, checkpointed). Selective
    checkpointing takes layers 0, 2, 4, ... (settings.SELECTIVE_EVERY)."""
    from .settings import SELECTIVE_EVERY

    if checkpointing != "selective":
        return [(layer, count, checkpointing in ("full", "op")) for layer, count in spec.layer_runs]
    flagged = runs_of((layer, i % SELECTIVE_EVERY == 0) for i, layer in enumerate(spec.layers))
    return [(layer, count, flag) for (layer, flag), count in flagged]


def estimate_activations(spec: ModelSpec, recipe: Recipe, settings: TrainingSettings) -> ActivationEstimate:
    """Saved activations of one micro-batch of ``settings.batch`` x ``settings.seq`` tokens."""
    from dataclasses import replace

    settings = replace(settings, attention=effective_kernel(spec, settings.attention))
    p = Precision.of(recipe)
    h, v, s = spec.hidden_size, spec.vocab_size, settings.seq
    tokens = settings.batch * s
    computed: dict[tuple[object, ...], LayerActivations] = {}  # (selective checkpointing splits a run into a run per layer)
    runs = []
    for layer, count, checkpointed in checkpointed_runs(spec, settings.checkpointing):
        if (layer, count, checkpointed) not in computed:
            base = computed.get((layer, 1, False)) or layer_activations(spec, layer, 1, recipe, settings)
            computed[(layer, 1, False)] = base
            computed[(layer, count, checkpointed)] = replace(base, count=count, checkpointed=checkpointed)
        runs.append(computed[(layer, count, checkpointed)])
    layers = tuple(runs)
    if settings.compile:
        layers = tuple(compiled_layer(la, h, p, settings.checkpointing) for la in layers)
    emb_dropout = spec.dropout.embedding if settings.dropout is None else settings.dropout

    embedding = [Term("input_ids (embedding backward)", INDEX, "embedding", "input_ids")] if spec.has_embedding else []
    if settings.offload_activations:
        # torchtune's OffloadActivations (training/_activation_offloading.py): each checkpointed layer's input
        # goes to host memory as it is saved; backward brings back the layer it is at and prefetches the next.
        embedding.append(Term("layer inputs back from host (the current layer's and the next one's)",
                              2 * p.residual * h, kind="back_from_host"))
    constant: list[Term] = []
    if spec.traits.position_ids == "per_token" and spec.has_embedding:
        embedding.append(Term("position ids", INDEX))
    projected = spec.projects_embeddings and spec.has_embedding and spec.has_head  # OPT-350m (not split by stages)
    if projected:
        # project_in (E -> h) keeps its input, the embeddings (cast to half under autocast); autocast's copy of its
        # weight lives until its backward, the step's last
        embedding.append(Term("project_in input (the embeddings)", p.compute * spec.embedding_dim, "project_in"))
        if p.autocast:
            constant.append(Term("autocast copy of the project_in weight", p.compute * spec.embedding_dim * h))
    if spec.traits.position_ids == "per_sequence" and spec.has_embedding:
        constant.append(Term("position ids", INDEX * s))
    if spec.embedding_norm and spec.has_embedding:
        embedding += _norm_terms(spec, h, p, "embedding norm", p.residual, "embedding_norm")
    if emb_dropout > 0 and spec.traits.embedding_dropout and spec.has_embedding:
        embedding.append(Term("embedding dropout mask", MASK * h, "embedding_dropout"))
    rotary_dims = {layer.attention.rotary_dim for layer, _ in spec.layer_runs if layer.attention.rotary_dim}
    if _unrotated_tables_dim(spec) and settings.checkpointing != "none":
        # (no layer saves them: they outlive the base model's forward only where checkpoints keep the layers'
        # keyword arguments for the recompute; traced: Falcon with ALiBi, amp-fp16, 1 x 1,000, 0.76 MiB short)
        rotary_dims = {_unrotated_tables_dim(spec)}
    if rotary_dims:
        # cos and sin, (1, s, rotary dim) in the residual dtype, shared by every layer; Gemma 3 has one pair per
        # layer type the config lists (modeling_gemma3.py, Gemma3TextModel.forward: ``for layer_type in
        # set(self.config.layer_types)``): a model whose layers all slide (or none do) builds one.
        kinds = {layer.sliding_window is not None for layer, _ in spec.layer_runs}
        tables = min(spec.traits.rotary_tables, len(kinds))
        if not spec.traits.rotary_tables_per_layer or settings.checkpointing != "none":
            # (GPT-J: halves of one; GPT-OSS: the frequencies alone)
            width = max(rotary_dims) // (2 if spec.traits.rotary_tables_split or spec.traits.rotary_tables_half else 1)
            constant.append(Term("rotary cos, sin", tables * 2 * _rotary_table_bytes(spec, p) * s * width))

    masks_built, masks_used = _mask_bytes(spec, settings, p)
    if settings.checkpointing != "none":
        # (only the checkpointed layers' masks: under selective checkpointing the others die with the forward)
        masks_used = _masks_kept(spec, settings, p, tuple((la.layer, la.checkpointed) for la in layers))
    if masks_used and settings.checkpointing != "none":
        # Checkpointed layers receive the masks as keyword arguments, which the checkpoints keep for the recompute,
        # so they live until the first layer's backward (traced); without checkpointing they die with the forward.
        constant.append(Term("attention masks kept for the recompute", masks_used))
    elif masks_used and any(la.kernel == EFFICIENT and not any(t.kind == ALIBI_MASK_COPY for t in la.terms)
                            for la in layers if la.layer.attention.rotary_dim == 0 and spec.traits.block == "falcon"):
        # Falcon's ALiBi mask reaches the memory-efficient kernel uncopied (already in q's dtype, width a multiple
        # of 16), and the kernel keeps it for backward: one tensor shared by every layer (traced).
        constant.append(Term("ALiBi mask kept by the memory-efficient kernel", masks_used))
        masks_built -= masks_used

    head = (_sequence_sharded(_norm_terms(spec, h, p, "final norm", p.residual, "final_norm"), spec.sequence_shards)
            if spec.final_norm_runs else [])
    if not spec.has_head:
        # A pipeline stage before the last: its output is sent to the next stage, nothing of the head is here.
        return _activation_estimate(spec, settings, layers, tokens, embedding, [], constant, 0, 0, p, emb_dropout,
                                    masks_built, masks_used)
    if spec.traits.rms_norm_fp32_plus_one:
        constant.append(Term("final norm (1 + weight) in fp32", FP32 * h))
    if projected:
        # project_out (h -> E) keeps the final norm output (its half copy under autocast); the LM head, its output
        head += _linear_inputs(p, h, 1, "final norm output (project_out input)", p.residual)
        head.append(Term("project_out output (LM head input)", p.compute * spec.embedding_dim))
    else:
        head += _linear_inputs(p, h, 1, "final norm output (LM head input)", p.residual, "head_input")
    if spec.final_logit_softcap:
        head.append(Term("final logit softcapping tanh output", p.compute * v, owner=OwnerKind.LOSS))
    if settings.loss == "chunked":
        # Liger-Kernel's fused linear cross-entropy: the gradient of the hidden states is computed chunk by
        # chunk in the forward pass and kept; the logits never exist whole.
        head += [Term("gradient of the LM head input (computed in forward)", p.compute * h)]
        logits_bytes = 0
        loss_transient = 0
    elif settings.loss == "chunked-output":
        # torchtune's CEWithChunkedOutputLoss (torchtune/modules/loss/ce_chunked_output_loss.py): every slice's
        # logits are kept in a list until the loss is summed; each slice's fp32 copy lives only through its own
        # cross_entropy, whose log_softmax keeps its fp32 output. The labels are views.
        if settings.compile:
            # torchtune's compile_loss, as inductor runs it (compiled_loss.py): the partitioner keeps each
            # slice's half logits (the loss's own input, alive anyway) and two fp32 values per row (max,
            # logsumexp) instead of the fp32 log_softmax; the fused kernel makes no vocabulary-wide temporary.
            head += [Term("logits kept by the compiled loss (all slices)", p.compute * v, owner=OwnerKind.LOSS),
                     Term("max and logsumexp per row (fp32)",
                          compiled_loss.total(compiled_loss.FORWARD, "saved", 1, v, p.compute), owner=OwnerKind.LOSS)]
            logits_bytes = 0
            loss_transient = compiled_loss.total(compiled_loss.FORWARD, "temporary", tokens // OUTPUT_CHUNKS, v,
                                                 p.compute)
        else:
            head += [Term("log_softmax output (fp32, all slices)", FP32 * v, owner=OwnerKind.LOSS)]
            logits_bytes = p.compute * v * tokens
            loss_transient = (FP32 * v * tokens // OUTPUT_CHUNKS) if p.compute != FP32 else 0
    else:
        # transformers' ForCausalLMLoss: logits.float(), then cross_entropy = log_softmax + nll_loss. log_softmax
        # keeps its fp32 output, nll_loss the shifted labels.
        head += [Term("log_softmax output (fp32)", FP32 * v, owner=OwnerKind.LOSS),
                 Term("shifted labels (int64)", INDEX, owner=OwnerKind.LOSS)]
        logits_bytes = p.compute * v * tokens
        loss_transient = (FP32 * v * tokens) if p.compute != FP32 else 0
        if spec.vocab_shards > 1:
            # PyTorch's loss_parallel (torch/distributed/tensor/parallel/loss.py, _log_softmax): the logits less
            # their all-reduced max, and its exp, both fp32 V / T, beside the fp32 copy, before the log_softmax
            # output (counted among the saved) exists: one fp32 V / T more than transformers' loss (traced)
            loss_transient += FP32 * v * tokens
    constant.append(Term("loss total_weight", FP32, owner=OwnerKind.LOSS))
    if p.autocast:
        # (with project_out, its weight's copy too: both are made after the layers and used by the head's backward)
        head_weight = spec.vocab_size * (spec.embedding_dim or h) + (h * spec.embedding_dim if projected else 0)
        constant.append(Term("autocast copy of the LM head weight", p.compute * head_weight, "lm_head",
                             "autocast_weight_copy"))
    return _activation_estimate(spec, settings, layers, tokens, embedding, head, constant, logits_bytes,
                                loss_transient, p, emb_dropout, masks_built, masks_used)


def _activation_estimate(spec: ModelSpec, settings: TrainingSettings, layers: tuple[LayerActivations, ...],
                         tokens: int, embedding: Iterable[Term], head: Iterable[Term], constant: Iterable[Term],
                         logits_bytes: int, loss_transient: int, p: Precision, emb_dropout: float, masks_built: int,
                         masks_used: int) -> ActivationEstimate:
    # DynamicLayer.update torch.cat's each layer's keys and values into the cache the model returns; what attention
    # does not keep itself (fp32 rotated keys under autocast, k and v a kernel copies) is alive until the output is
    # dropped.
    kv_cache = int(sum(la.cache_extra * tokens * la.count for la in layers))
    return ActivationEstimate(
        tokens=tokens, layers=layers, embedding_terms=tuple(embedding), head_terms=tuple(head),
        constant_terms=tuple(constant), logits_bytes=logits_bytes, loss_transient_bytes=loss_transient,
        checkpointing=settings.checkpointing, kv_cache_bytes=kv_cache,
        mask_bytes=masks_built if settings.checkpointing == "none" else masks_built - masks_used,
        decoder_locals_bytes=int((_decoder_locals(spec, p, emb_dropout, settings.batch)
                                  + _unused_rotary_tables(spec, settings, p)) * tokens)
        if spec.has_embedding else 0,
        offloaded=settings.offload_activations, compiled=settings.compile,
    )


def _decoder_locals(spec: ModelSpec, p: Precision, emb_dropout: float, batch: int = 1) -> float:
    """Per token, see ActivationEstimate.decoder_locals_bytes (GPT2Model.forward and GPTBigCodeModel.forward:
    inputs_embeds and position_embeds, one (1, s, h) row for the batch, as ``position_ids`` is ``unsqueeze(0)``'d;
    traced: GPT-2, amp-bf16, full checkpointing, 4 x 1,000, +0.97% at the forward peak with a position row per
    sequence; OPTDecoder.forward: inputs_embeds, pos_embeds, the fp32 position_attention_mask and int64
    position_ids; GPTNeoXModel.forward and GPTJModel.forward: inputs_embeds, when the embedding dropout makes a new
    tensor of it)."""
    embedded = p.residual * spec.hidden_size
    if spec.traits.decoder_locals == "token_and_shared_position":
        return embedded + embedded / batch
    if spec.traits.decoder_locals == "opt":
        # with project_in, inputs_embeds is its output (half under autocast)
        return (p.compute * spec.hidden_size if spec.projects_embeddings else embedded) + embedded + FP32 + INDEX
    if spec.traits.decoder_locals == "dropped_embeddings" and emb_dropout > 0:
        return embedded
    return 0


def _unused_rotary_tables(spec: ModelSpec, settings: TrainingSettings, p: Precision) -> float:
    """Per token: the rotary cos and sin a base model builds for layers that apply no rotary (Falcon with ALiBi,
    FamilyTraits.rotary_tables_without_rotary), (1, s, head dim) each, locals of its forward through the layer
    loop. Without checkpointing nothing keeps them past it (with checkpointing they are constants, kept for the
    recompute; traced: ALiBi, amp-bf16, 1 x 1,000, 0.8 MB short at the last layer's softmax without them)."""
    head_dim = _unrotated_tables_dim(spec)
    if not head_dim or settings.checkpointing != "none":
        return 0.0
    return 2 * _rotary_table_bytes(spec, p) * head_dim / settings.batch


def _unrotated_tables_dim(spec: ModelSpec) -> int:
    """The width of the rotary cos and sin a base model builds though none of its layers applies rotary
    (FamilyTraits.rotary_tables_without_rotary: the full head dim), 0 where it builds none of that kind."""
    if not spec.traits.rotary_tables_without_rotary or \
            any(layer.attention.rotary_dim for layer, _ in spec.layer_runs):
        return 0
    return max(layer.attention.head_dim for layer, _ in spec.layer_runs)


def _mask_bytes(spec: ModelSpec, settings: TrainingSettings, p: Precision) -> tuple[int, int]:
    """The attention masks the base model builds once per forward (masking_utils.py): (bytes built, bytes handed to
    the layers). Eager attention gets a float (batch, 1, s, s) mask in the hidden states' dtype for full attention
    always and for sliding attention when a layer slides; SDPA a boolean one only where a layer needs a mask
    (sdpa_mask), built (1, 1, s, s) and expanded to the batch as a view when no padding mask is passed (the step
    trainmem models passes none: one full sequence per row); the eager float mask is the ``torch.where`` of that
    view, so it has the batch dimension. Falcon with ALiBi folds the bias in: a float (batch, heads, s, s) one. Masks built but handed to no
    layer (a full-attention one in a model whose layers all slide) live until the base model returns."""
    if not spec.has_architecture:
        return 0, 0
    size = _mask_size(spec, settings, p)
    used = {_layer_mask(spec, layer, settings) for layer, _ in spec.layer_runs} - {None}
    if settings.attention == EAGER and not _alibi_mask(spec):
        built = used | spec.traits.eager_masks_always_built
    else:
        # a sliding mask built for no layer (ModelSpec.sliding_mask_window; sdpa_mask's rule: kv_length >= window)
        built = used | ({True} if spec.sliding_mask_window is not None and settings.seq >= spec.sliding_mask_window
                        and not _alibi_mask(spec) else set())
    return len(built) * size, len(used) * size


def _alibi_mask(spec: ModelSpec) -> bool:
    return spec.traits.block == "falcon" and spec.layer_runs[0][0].attention.rotary_dim == 0


def _mask_size(spec: ModelSpec, settings: TrainingSettings, p: Precision) -> int:
    """Bytes of one of the masks _mask_bytes describes."""
    b, s = settings.batch, settings.seq
    if _alibi_mask(spec):
        return p.residual * b * spec.layer_runs[0][0].attention.num_heads * s * s
    return p.residual * b * s * s if settings.attention == EAGER else MASK * s * s


def _layer_mask(spec: ModelSpec, layer: Layer, settings: TrainingSettings) -> bool | str | None:
    """Which of the base model's masks ``layer`` is handed (the sliding one: True, the full one: False, Falcon's
    ALiBi bias), None where it gets none (SDPA without a mask, sdpa_mask)."""
    if _alibi_mask(spec):
        return "alibi"
    if settings.attention != EAGER and not sdpa_mask(spec, layer, settings.seq):
        return None
    return layer.sliding_window is not None


def _masks_kept(spec: ModelSpec, settings: TrainingSettings, p: Precision,
                layers: tuple[tuple[Layer, bool], ...]) -> int:
    """Bytes of the masks handed to a checkpointed layer of ``layers`` ((layer, checkpointed) pairs), which its
    checkpoint keeps for the recompute. Traced: Gemma 2, its sliding layer 0 checkpointed (selective), eager: only
    the sliding mask outlives the forward (seed 2718 case 27 of ``validate --random``, +1.92% with both)."""
    kinds = {_layer_mask(spec, layer, settings) for layer, checkpointed in layers if checkpointed} - {None}
    return len(kinds) * _mask_size(spec, settings, p) if spec.has_architecture else 0


def recompute_masks_freed(spec: ModelSpec, settings: TrainingSettings, p: Precision,
                          layers: tuple[tuple[Layer, bool], ...]) -> tuple[int, ...]:
    """Under checkpointing, of the masks kept for the recompute ("attention masks kept for the recompute"), the bytes
    already freed when each of ``layers`` (the model's, first to last, with whether each is checkpointed) runs its
    backward, and last when every layer has: the base model's forward has returned, so a mask lives as long as a
    checkpoint that keeps it, that of the lowest checkpointed layer handed it (torch/utils/checkpoint.py keeps a checkpointed layer's arguments until its backward;
    Qwen3Model.forward and kin hand each layer ``causal_mask_mapping[decoder_layer.attention_type]``, its own
    kind only). Traced: Qwen3 with its top layer sliding, eager, full checkpointing: the sliding mask is gone by
    the lower layer's recompute (seed 2718 case 29 of ``validate --random``)."""
    if not spec.has_architecture or settings.checkpointing == "none":
        return (0,) * (len(layers) + 1)
    # (a family without an SDPA path runs eager and gets eager's masks: GPT-OSS's full-attention layer is handed
    # one, freed after its backward; traced: mixed-bf16, --attention sdpa, full checkpointing, +0.67% at the lower
    # sliding layer's recompute with it kept)
    settings = replace(settings, attention=effective_kernel(spec, settings.attention))
    size = _mask_size(spec, settings, p)
    kinds = [_layer_mask(spec, layer, settings) if checkpointed else None for layer, checkpointed in layers]
    lowest = {kind: kinds.index(kind) for kind in set(kinds) - {None}}
    return tuple(size * sum(1 for first in lowest.values() if first > i) for i in range(len(layers))) \
        + (size * len(lowest),)
