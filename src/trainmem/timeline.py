"""The memory of one training step as it runs, phase by phase, as ``torch.cuda.max_memory_allocated()`` sees it.

A steady-state step (the second and later: optimizer states exist) of the usual loop::

    loss = model(**batch).loss        # forward: activations saved layer by layer, then logits and the loss
    loss.backward()                   # backward: activations freed layer by layer while gradients appear
    optimizer.step()                  # states updated; foreach implementations allocate temporaries
    optimizer.zero_grad(set_to_none=True)

Each phase's peak is the static memory alive in it plus what that phase allocates at its worst moment. Backward
is walked layer by layer from the last: layers below still hold their activations, layers above have released
theirs and produced their gradients, and each layer contributes its own worst moment (its MLP backward, or its
recompute under checkpointing). The numbers are checked against PyTorch by ``trainmem trace``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from .activations import (FP32, INDEX, MASK, OP_SAVED, OP_SAVED_UNTAKEN, ActivationEstimate,
                          LayerActivations, Precision, _hidden_dropout_sites, _router_score_bytes,
                          recompute_masks_freed)
from .compiled_loss import backward_bytes as compiled_loss_backward_bytes
from .kernels import MATH
from .models import MLP_ROLES, ModelSpec, layer_tensors
from .optimizers import Optimizer
from .owners import Owner, OwnerKind
from .recipes import Recipe
from .settings import OUTPUT_CHUNKS, TrainingSettings
from .sharding import RankLayout

if TYPE_CHECKING:  # (names for the annotations only)
    from .activations import Term
    from .lora import FineTune
    from .models import Layer, MoE, ParamTensor
    from .sharding import Buffer

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "temporaries")


@dataclass(frozen=True)
class Phase:
    name: str
    """load, forward, backward, optimizer, between_steps."""
    moment: str
    """When in the phase the peak happens, in words."""
    parameters: int
    gradients: int
    optimizer_states: int
    """Optimizer states and fp32 master weights."""
    activations: int
    temporaries: int
    at: Owner | None = field(default=None, compare=False, kw_only=True)
    """Where a backward moment of step_candidates is: the loss's backward, a decoder layer's (its index) or the
    embedding's, for ``trainmem diff`` (diff.py) to split its bytes by owner; None elsewhere. Not part of a phase's
    value."""

    @property
    def allocated_bytes(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.temporaries

    def by_category(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in CATEGORIES}


def _mlp_width(layer: Layer) -> int:
    """I-wide tensors per token: the MLP's width, or top-k times an expert's width for MoE."""
    if layer.moe:
        return layer.moe.top_k * layer.moe.expert_intermediate_size
    assert layer.mlp is not None  # (mlp xor moe)
    return layer.mlp.intermediate_size


def _mlp_transient(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int,
                   settings: TrainingSettings | None = None) -> int:
    """The gradient temporaries of one layer's MLP backward: while the product's backward runs, d(product),
    d(activation) and d(up) coexist (3 x I wide; 2 for a plain GELU/ReLU MLP; GPT-2's Python gelu_new chains three; BLOOM's six),
    beside the residual stream's gradient (alive throughout, traced with and without checkpointing). Falcon's
    biased Linears under autocast make its MLP fp32; with parallel attention and hidden dropout the dropped
    gradient of the summed outputs waits for the attention's backward too (traced)."""
    layer = la.layer
    plain = layer.mlp is not None and not layer.mlp.gated and layer.mlp.activation != "gelu_new"
    wide = 2 if plain else 3
    if layer.mlp is not None and layer.mlp.activation == "bloom_gelu":
        # GeLUFunction.backward (modeling_bloom.bloom_gelu_back) evaluates the tanh GELU's derivative in Python:
        # tanh_out, 0.5 * x, 1 - tanh_out**2, 0.107 * x and its product with x are alive at once beside the
        # incoming gradient (6 I-wide, traced).
        wide = 6
    width = _mlp_bytes(layer, p)
    if p.autocast and layer.mlp is not None and layer.mlp.activation == "gelu_new":
        width = FP32  # pow upcasts x on CUDA's autocast list: the chain's gradients are fp32 (traced)
    falcon = spec.traits.block == "falcon" and layer.mlp is not None
    if falcon and p.autocast and layer.attention.qkv_bias:
        width = FP32
    mlp = wide * width * _mlp_width(layer)
    if falcon and layer.parallel_residual and settings is not None and _mlp_output_dropout(spec, layer, settings):
        mlp += _mlp_output_bytes(spec, layer, p) * spec.hidden_size
    return (mlp + p.residual * spec.hidden_size) * tokens + _attention_gradient_waiting(spec, layer, p, tokens)


def _gate_up_moments(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int,
                     tensors: list[ParamTensor], gradients_of: Recipe) -> tuple[tuple[str, int, int, int], ...]:
    """See _LayerBytes.gate_up_moments: (the moment's name, what the layer has freed, the temporaries, the
    gradients accumulated beyond down_proj's) at each moment.

    When a fused gate/up projection runs its backward, ``chunk``'s backward has concatenated the gradients of the
    gate and of up into one 2 I-wide tensor, and the projection makes its weight's gradient (in the matmul's dtype:
    the half copy's under autocast) and its input's, beside the residual stream's gradient; the MLP's saves but its
    input (the gate/up output, the activation's, the product), those of a norm on the layer's output and
    down_proj's half weight copy (released with down_proj's MmBackward0) are freed by then (traced: GLM-4, fp32,
    tied embeddings, full checkpointing, 1 x 256: the peak, -0.38% with 20 MB of temporaries counted as
    activations without this moment).

    Under autocast, the half weight gradient's cast to the parameter's dtype (ToCopyBackward0) is a later moment:
    the matmul's node has released its saved half weight copy and input copy, and its input gradient is freed. A
    fused projection has one (traced: Phi-3, amp-fp16, full checkpointing, seed 7730419 case 113 of ``validate
    --random``: +2.02% when its first moment counted the fp32 gradient and down_proj's copy); separate gate and up
    projections have two, of which the second is the larger: every save of the MLP is freed, the first
    projection's gradient is accumulated and its input's gradient, cast back to the norm output's dtype, waits
    for the second's (traced: Llama-3.2-1B's layers with a 512-token vocabulary, amp-bf16, full checkpointing,
    1 x 64: -0.64% at the backward peak without it)."""
    mlp = la.layer.mlp
    if mlp is None or la.layer.moe or not (mlp.fused_gate_up or (mlp.gated and p.autocast)):
        return ()
    c, h, width = _mlp_bytes(la.layer, p), spec.hidden_size, _mlp_width(la.layer)
    numel, down = _numel(tensors, "mlp"), _numel(tensors, "mlp_down")
    copies = p.compute if p.autocast else 0  # autocast's half weight copies, saved by the matmuls
    freed = 4 * c * width * tokens + int(_term_bytes(la.terms, "post_feedforward_norm") * tokens) + copies * down
    waiting = (p.residual * h + p.compute * h) * tokens + _attention_gradient_waiting(spec, la.layer, p, tokens)
    if not mlp.fused_gate_up:  # gate_proj's and up_proj's (numel / 2 each), at the second one's cast
        one = numel // 2
        first = _param_bytes(one, gradients_of.gradient_bytes)
        return (("gate and up projections' weight gradient cast", freed + copies * (numel + 2 * h * tokens),
                 waiting + p.residual * h * tokens + copies * one + first, first),)
    matmul_grad = copies * numel or _param_bytes(numel, _autograd_grad_bytes(gradients_of))
    moments: tuple[tuple[str, int, int, int], ...] = (
        ("gate_up projection", freed, waiting + 2 * c * width * tokens + matmul_grad, 0),)
    if copies:
        cast = _param_bytes(numel, gradients_of.gradient_bytes)
        moments += (("gate_up projection's weight gradient cast", freed + copies * (numel + h * tokens),
                     waiting + matmul_grad + cast, 0),)
    return moments


def _attention_gradient_waiting(spec: ModelSpec, layer: Layer, p: Precision, tokens: int) -> int:
    """Cohere's ``residual + attention + mlp``: the inner add's backward runs before the MLP's (its node is the
    later one) and, under autocast, casts the gradient for the half attention output: a half hidden-state tensor
    alive through the MLP's backward (traced: seed 5's case 69 of ``validate --random``)."""
    return p.compute * spec.hidden_size * tokens if p.autocast and _shares_one_norm(spec, layer) else 0


def _mlp_output_dropout(spec: ModelSpec, layer: Layer, settings: TrainingSettings) -> bool:
    p = spec.dropout.hidden if settings.dropout is None else settings.dropout
    return p > 0 and _hidden_dropout_sites(spec, layer) > 0


def _mlp_bytes(layer: Layer, p: Precision) -> int:
    """The dtype the MLP's intermediate tensors have: the routed experts run in their weights' dtype."""
    return p.experts if layer.moe else p.compute


def _numel(tensors: Iterable[ParamTensor], *roles: str) -> int:
    """Elements of the tensors with one of ``roles``."""
    return sum(t.numel for t in tensors if t.role in roles)


def _term_bytes(terms: Iterable[Term], module: str, *kinds: str, exclude: tuple[str, ...] = ()) -> float:
    """Bytes per token of the terms of ``module`` (of ``kinds`` if given, less ``exclude``)."""
    return sum(t.bytes_per_token for t in terms if t.module == module and (not kinds or t.kind in kinds)
               and t.kind not in exclude)


def _experts_transient(spec: ModelSpec, la: LayerActivations, p: Precision, recipe: Recipe, tokens: int,
                       frozen: bool = False) -> int:
    """The routed experts' gate_up backward (transformers' grouped_mm experts, traced): d(gate_up output),
    d(gathered input), the router weights' gradient and the gate_up weight gradient, beside the residual one; no
    weight gradient where the experts are ``frozen`` (LoRA on attention only: grouped_mm's backward then computes
    its input's gradient alone)."""
    moe = la.layer.moe
    if moe is None:
        return 0
    w, k, i, h = p.experts, moe.top_k, moe.expert_intermediate_size, spec.hidden_size
    weight_grad = 0 if frozen else _param_bytes(moe.local_experts * 2 * i * h, _autograd_grad_bytes(recipe))
    return (k * (2 * w * i + w * h + FP32) + p.residual * h) * tokens + weight_grad


def _experts_weighting_transient(spec: ModelSpec, layer: Layer, p: Precision, tokens: int) -> int:
    """See _LayerBytes.experts_weighting_transient (traced: transformers' grouped_mm experts, Qwen2-MoE's block)."""
    moe = layer.moe
    if moe is None:
        return 0
    per_token = (3 * moe.top_k * _weighted_bytes(moe, p) + p.residual) * spec.hidden_size
    if moe.shared_expert_gate:
        per_token += (p.compute + p.residual) * spec.hidden_size
    elif _shared_first(layer):
        per_token += p.residual * spec.hidden_size  # the MoE input's gradient, with the shared experts' part
    return int(per_token * tokens)


def _weighted_bytes(moe: MoE, p: Precision) -> int:
    """The router-weighted expert outputs' dtype: the experts' output times the routing weights (fp32 unless cast
    to the compute dtype), promoted."""
    weights = p.compute if moe.weights_in_compute_dtype else _router_score_bytes(moe, p)
    return max(p.experts, weights)


def _shared_first(layer: Layer) -> bool:
    """Whether the shared experts' backward runs before the routed experts' (DeepSeek-V3's order:
    DeepseekV3MoE.forward adds ``self.shared_experts(residuals)`` after the routed experts). DeepSeek builds its
    shared-expert MLP even with ``n_shared_experts`` 0 (``shared_always_built``): zero wide, its backward still
    makes the MoE input's h-wide gradient first (traced: DeepSeek-V3, fp32, no shared experts, full checkpointing,
    -2.4% at the router weighting's backward without it)."""
    moe = layer.moe
    return bool(moe and (moe.shared_intermediate_size or moe.shared_always_built) and moe.router == "sigmoid_grouped")


def _experts_weighting_freed(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int) -> int:
    """See _LayerBytes.experts_weighting_freed."""
    layer = la.layer
    if layer.moe is None:
        return 0
    # grouped_mm_experts_forward's gather back to token order (``weighted_out[inv_perm]``) runs its backward first
    # and frees the int64 ``inv_perm`` it saved (traced: 8 bytes per (token, expert) pair over without it, Mixtral,
    # Qwen-MoE and DeepSeek-V3 alike)
    inv_perm = INDEX * layer.moe.top_k * tokens
    if layer.moe.shared_expert_gate:
        # Qwen2-MoE's ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` runs its backward before the routed
        # experts' too (made after them): the shared output it saved goes, and under autocast shared_expert_gate's
        # half cast of its input (traced: amp-bf16, full checkpointing, +1.4% at the router weighting without it)
        gate_input = p.compute * spec.hidden_size if p.autocast else 0
        return inv_perm + (p.compute * spec.hidden_size + gate_input) * tokens
    if _shared_first(layer):
        return inv_perm + _shared_experts_freed(spec, la, p, tokens)
    return inv_perm


def _shared_experts_freed(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int) -> int:
    """What DeepSeek-V3's shared-expert MLP (DeepseekV3MLP, gate_proj/up_proj/down_proj on the MoE input) frees
    by its backward, which runs before the routed experts' (_shared_first): its own saved tensors; the copies of
    its input only it keeps (under autocast the gate's and up's half casts; in a half recipe without autocast the
    norm output itself, of which the router keeps its fp32 upcast; in fp32 the router keeps the same tensor); and
    under autocast the half copies of its three weights. Traced: DeepSeek-V3 with 1 and 0 shared experts (zero
    wide, still built), full checkpointing, fp32, pure-bf16, amp-bf16: 12-90 kB over at the router weighting's
    backward without the copies and casts."""
    h = spec.hidden_size
    copies = 2 * p.compute * h if p.autocast else p.compute * h if p.compute != FP32 else 0
    casts = p.compute * _numel(layer_tensors(la.layer, h, spec.norm_vectors), "shared_expert") if p.autocast else 0
    return int((_term_bytes(la.terms, "shared_expert") + copies) * tokens) + casts


def _norm_moment(spec: ModelSpec, la: LayerActivations, p: Precision, recipe: Recipe,
                 tensors: list[ParamTensor], tokens: int, attention_live: int) -> tuple[int, int, int]:
    """See _LayerBytes.norm_moment."""
    # the norm's own terms, less its normalised value (the MLP's input copies are not the norm's)
    norm = [t for t in la.terms if t.module in ("post_attention_norm", "mlp_norm") and t.kind != "normalised"]
    if spec.norm != "rms" or not norm or la.layer.parallel_residual or _has_output_norm(la):
        return 0, 0, 0
    live = attention_live + int((la.attention_released + sum(t.bytes_per_token for t in norm)) * tokens)
    o_proj = _numel(tensors, "attention_output")
    live += p.compute * o_proj if p.autocast else 0  # o_proj's backward has not run: its half weight copy is alive
    mlp_grads = _param_bytes(_numel(tensors, *MLP_ROLES), recipe.gradient_bytes)
    temps = (5 * FP32 + p.residual) * spec.hidden_size * (tokens // spec.sequence_shards)  # (sequence parallel: 1/T)
    return live, mlp_grads, temps


def _shares_one_norm(spec: ModelSpec, layer: Layer) -> bool:
    """Attention and the MLP read one norm's output in parallel (CohereDecoderLayer): the MLP's backward runs first
    (its nodes are the later ones) and the gradient of that output it made waits, in the residual dtype, for the
    attention's (traced: Cohere, one hidden-state tensor at the attention's backward). FalconDecoderLayer's own
    terms cover Falcon-7B."""
    return layer.parallel_residual and layer.num_norms == 1 and spec.traits.block == "standard"


def _norm_gradients_waiting(spec: ModelSpec, la: LayerActivations) -> int:
    """Hidden-state gradients (residual dtype) alive at the attention's backward: the residual stream's, and where
    the MLP read the same norm output in parallel, the gradient of that output the MLP's backward made, waiting for
    the attention's (_shares_one_norm; FalconDecoderLayer with one norm and the SDPA math kernel likewise, traced:
    multi-query and new-architecture layers, 1-2 x 1,000, -0.9 to -1.0% at the backward peak without it; its eager
    and fused-kernel terms were fitted with this tensor inside them)."""
    layer = la.layer
    falcon_shared = (spec.traits.block == "falcon" and layer.parallel_residual and layer.num_norms == 1
                     and la.kernel == MATH)
    return 2 if _shares_one_norm(spec, layer) or falcon_shared else 1


def _layer_input_saved(spec: ModelSpec, p: Precision) -> bool:
    """Whether a layer's first module keeps the layer input itself for backward: a LayerNorm does (its input); an
    RMSNorm's ``x.to(float32)`` is x itself only when x is fp32; CohereLayerNorm keeps only ``x - mean``; with
    post-norms (OLMo-2) or norms after the residual adds (OPT's) the q/k/v projections read it, keeping it unless
    autocast casts it for them."""
    if spec.traits.attention_reads_layer_input:
        return not p.autocast
    if spec.norm == "layer":  # (OlmoLayerNorm keeps its fp32 copy: the input itself only when it is fp32)
        return p.residual == FP32 if spec.traits.layer_norm_upcast else True
    if spec.traits.norm_centred_twice:
        return False
    return p.residual == FP32


def _down_projection_locals(spec: ModelSpec, la: LayerActivations, p: Precision) -> int:
    """Bytes per token alive beside the saved tensors while the down projection writes its output, none of them
    saved: the attention output a parallel block holds through its MLP (PhiDecoderLayer's ``attn_outputs``), and
    under autocast gelu_new's fp32 output, which fc2 reads and casts (the cast is what it saves; traced: Phi
    amp-bf16, the forward's peak at the last fc2)."""
    layer = la.layer
    held = p.compute * spec.hidden_size if _shares_one_norm(spec, layer) or spec.traits.attention_output_held else 0
    held += _input_norm_output_held(spec, layer, p)
    mlp = layer.mlp
    if p.autocast and mlp is not None and not mlp.gated and mlp.activation == "gelu_new":
        held += FP32 * mlp.intermediate_size
    return held


def _input_norm_output_held(spec: ModelSpec, layer: Layer, p: Precision) -> int:
    """StableLmDecoderLayer's sequential path keeps the input norm's output in ``hidden_states`` through the MLP
    (``mlp_output = self.mlp(self.post_attention_layernorm(residual))`` rebinds nothing): under autocast an fp32
    tensor the q/k/v projections do not keep (their half casts are what they save). Traced: StableLM, amp-bf16,
    eager, dropout 0.1, full checkpointing, 1 x 512: 0.5 MiB short at the recompute's down projection."""
    if spec.traits.attention_output_held and not layer.parallel_residual and p.autocast:
        return p.residual * spec.hidden_size
    return 0


def _residual_sum_locals(spec: ModelSpec, layer: Layer, p: Precision) -> int:
    """Bytes per token alive beside the saved tensors while a layer's last residual add writes its output, none of
    them saved (an add keeps nothing): the MLP's output (or its dropped copy, or the post-feedforward norm's
    output), the attention output where the layer still holds it (a parallel block adds it in the same expression;
    StableLM's ``self_attn_output``) and, in a parallel block's three-term sum, the partial sum (in the residual's
    dtype where the residual comes first, FamilyTraits.residual_first_in_parallel_sum). Traced: StableLM, parallel
    residual, amp-bf16, eager, dropout 0.1: the forward's peak is ``residual + self_attn_output + mlp_output`` in
    the last layer, beside both partial sums (modeling_stablelm.py, StableLmDecoderLayer.forward)."""
    h = spec.hidden_size
    held = (p.compute if layer.parallel_residual or spec.traits.attention_output_held else 0) * h \
        + _input_norm_output_held(spec, layer, p)
    partial = 0
    if layer.parallel_residual:
        partial = p.residual if spec.traits.residual_first_in_parallel_sum else p.compute
    return (_mlp_output_bytes(spec, layer, p) + partial + p.residual) * h + held


def _has_output_norm(la: LayerActivations) -> bool:
    return any(t.module == "post_feedforward_norm" for t in la.terms)


def _mlp_output_bytes(spec: ModelSpec, layer: Layer, p: Precision) -> int:
    """The dtype a dense MLP returns: the compute dtype, except FalconLinear's bias added after an autocast matmul
    (fp32); MoE blocks return the hidden states' dtype (``.to(hidden_states.dtype)``)."""
    if layer.mlp is None:
        return p.residual
    if spec.traits.bias_after_matmul and p.autocast and layer.attention.qkv_bias:
        return p.residual
    return p.compute


def _recompute_gradient(spec: ModelSpec, layer: Layer, p: Precision, output_norm: bool,
                        output_dropout: bool = False) -> int:
    """See _LayerBytes.recompute_gradient, per token: the residual stream's gradient, and beside it what the
    layer's backward made before its first node that needs a saved tensor started the recompute."""
    if layer.moe:
        top_k = layer.moe.top_k
        if _shared_first(layer):
            # DeepSeek's shared experts, added after the routed ones, run their backward first: it needs their
            # saved tensors, so the recompute starts before the routed sum's backward (traced: DeepSeek-V3, no
            # shared experts, amp-fp16, full checkpointing, seed 20261205 case 4: +4.8% at the backward peak with
            # the weighted outputs' gradient). Under autocast the shared experts' output is half beside the fp32
            # routed sum: the add's backward casts the gradient for them (traced there: 640 B per token short
            # without the cast)
            extra = p.compute if p.compute != p.residual else 0
        else:
            # the gradient of the weighted outputs in token order, made by the sum's and the view's backward before
            # the gather's backward needs its saved indices; with one expert per token the sum's backward expands
            # the gradient over a size-1 dimension and the view's reshapes it, both views, so there is none
            # (traced: GPT-OSS, top-1, fp32, eager, full checkpointing, 1 x 512 and 1 x 1,024: +0.8-1.2% at the
            # backward peak with it)
            extra = top_k * _weighted_bytes(layer.moe, p) if top_k > 1 else 0
    elif output_norm:
        # Gemma's post-feedforward norm: its output cast back to a half input dtype saves nothing, so its
        # backward, an fp32 gradient, runs before the recompute
        extra = FP32 if p.compute != FP32 else 0
    elif spec.traits.block == "falcon" and p.autocast and layer.attention.qkv_bias:
        # FalconLinear adds its fp32 bias after the half matmul (``hidden_states + self.bias``): that add's
        # backward, which needs nothing saved, casts the gradient to the matmul's half dtype before the recompute
        # (traced: ALiBi, amp-fp16, eager, full checkpointing); unless the layer ends with its hidden dropout
        # (``dropout_add``), whose backward needs its saved mask first (traced: amp-bf16, dropout 0.1, 4 x 256:
        # +1.2% at the backward peak with the cast)
        extra = 0 if output_dropout else p.compute
    else:
        # under autocast, the residual add's backward casts the gradient to the MLP output's half dtype, and in a
        # parallel block whose sum starts with the residual (``residual + self_attn_output + mlp_output``) the
        # partial sum's backward casts it to the attention output's as well (traced: StableLM, amp-bf16)
        half = _mlp_output_bytes(spec, layer, p) != p.residual
        extra = p.compute * (2 if half and layer.parallel_residual and spec.traits.residual_first_in_parallel_sum
                             else 1 if half else 0)
    return (p.residual + extra) * spec.hidden_size


def _recompute_end(spec: ModelSpec, la: LayerActivations, p: Precision, settings: TrainingSettings,
                   tokens: int) -> int:
    """See _LayerBytes.recompute_end. FalconDecoderLayer also holds ``attention_output`` (dense's output) and,
    under autocast, the attention's fp32 norm output through the MLP; FalconLinear adds its bias after the matmul,
    so under autocast fc1's output, its GELU (held while fc2 runs; fc2 keeps a half copy) and fc2's output plus
    bias are fp32. Its recompute goes on to ``dropout_add`` when there is hidden dropout, which is the worse
    moment unless the fp32 GELU output (freed by then) outweighs it (traced)."""
    layer = la.layer
    h = spec.hidden_size
    per_token = la.returned_extra
    if layer.moe:
        return _moe_recompute_end(spec, la, p, tokens)
    if layer.mlp and _has_output_norm(la):
        # Gemma 2/3: the recompute goes on into the post-feedforward norm, whose input (the MLP's output) it holds;
        # the MLP's argument is gone by then
        return int((per_token + p.compute * h) * tokens)
    dropout = _mlp_output_dropout(spec, layer, settings)
    if spec.traits.block != "falcon":
        return int((per_token + _standard_recompute_end(spec, la, p, dropout)) * tokens)
    if layer.mlp:
        per_token += (p.residual if p.autocast else 0) * h  # the MLP's argument
    biased = p.autocast and layer.attention.qkv_bias
    out = p.residual if biased else p.compute
    per_token += out * h  # attention_output
    if p.autocast and not (layer.parallel_residual and layer.num_norms == 1):
        per_token += p.residual * h  # attention_layernorm_out, not the MLP's norm output
    gelu = p.residual * layer.dense_mlp.intermediate_size if biased and layer.mlp else 0  # the fp32 GELU, held
    if dropout:
        # the recompute goes on to dropout_add's mask: fc2's output is written first (plus bias: fp32), beside the
        # fp32 GELU; then the MLP's output and its dropped copy (the mask exists)
        at_down = (p.compute - MASK) * h + (p.residual * h if biased else 0) + gelu
        at_dropout = 2 * out * h
    else:
        # fc2's matmul packs its inputs (the GELU's half copy, the weight's cast) before it runs, and they are the
        # layer's last saved tensors: the recompute stops there, fc2's output never exists (traced: seed 7730419
        # case 175 of ``validate --random``, amp-fp16, eager, full checkpointing: +2.99% before)
        at_down = at_dropout = gelu
    return int((per_token + max(at_down, at_dropout)) * tokens)


def _standard_recompute_end(spec: ModelSpec, la: LayerActivations, p: Precision, dropout: bool) -> float:
    """_recompute_end's bytes per token beyond the returned attention weights, for a dense layer of a standard
    block. Where down_proj's matmul saves the layer's last tensors the recompute stops before its output exists:
    the autograd kernel packs a matmul's saved inputs before it runs it (torch's generated VariableType,
    MmBackward0's self_ and mat2_), and the pack hook of the last one ends the recompute
    (torch/utils/checkpoint.py, _StopRecomputationError); alive then are the MLP's argument (the norm's fp32
    output under autocast, held by the caller during the call) and what _down_projection_locals counts
    (StableLM's self_attn_output, a parallel block's attention output, gelu_new's fp32 output under autocast).
    Traced: Qwen3, amp-fp16, eager (seed 2718 case 29 of ``validate --random``: the recompute's last allocation
    is down_proj's weight cast); Phi, amp-bf16, eager, dropout (seed 20261202 case 59). With a dropout after the
    MLP its mask, an output, is the last tensor saved: the down projection's output is written first, beside the
    locals (the fp32 GELU still alive), then the dropped copy and the mask exist beside that output, the GELU
    freed, and the norm output only where the layer holds it (a parallel block's shared input; traced: StableLM,
    parallel residual, amp-bf16, eager, dropout 0.1, the recompute ends at the mask)."""
    layer, h = la.layer, spec.hidden_size
    if not layer.mlp:
        return 0.0
    argument = (p.residual if p.autocast else 0) * h
    locals_ = _down_projection_locals(spec, la, p)
    if not dropout:
        return argument + locals_
    at_output = argument + locals_ + (p.compute - MASK) * h  # (the mask, in the layer's activations, not yet)
    held = p.compute * h if _shares_one_norm(spec, layer) or spec.traits.attention_output_held else 0
    at_mask = (argument if layer.parallel_residual else 0) + held + 2 * p.compute * h
    return max(at_output, at_mask)


def _routing_weight_bytes(moe: MoE, p: Precision) -> int:
    """The routing weights' dtype (``top_k_weights``, ``sample_weights_g``): cast to the router logits' (Qwen-MoE)
    or the scores' (fp32 softmax; DeepSeek's sigmoid)."""
    return p.compute if moe.weights_in_compute_dtype else _router_score_bytes(moe, p)


def _routing_locals(moe: MoE, p: Precision) -> int:
    """Bytes per token that the MoE block and transformers' grouped_mm_experts_forward (integrations/moe.py) hold
    in locals while the routed experts run, and no backward keeps: the router logits (the ``_`` of
    ``_, top_k_weights, top_k_index = self.gate(hidden_states)``, MixtralSparseMoeBlock and kin; the logits of
    an fp32 upcast in DeepseekV3TopkRouter, half under autocast), the top-k weights themselves (the in-place
    division saves a clone, the gathers only indices), the sorted expert ids ``expert_ids_g`` and ``histc``'s
    input (fp32 on the CPU, int32 on CUDA: 4 bytes either way)."""
    logits = p.compute if moe.router in ("softmax", "topk_softmax") else _router_score_bytes(moe, p)
    return moe.num_experts * logits + moe.top_k * (_routing_weight_bytes(moe, p) + INDEX + FP32)


def _moe_recompute_end(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int) -> int:
    """See _LayerBytes.recompute_end, for a MoE layer. The routed experts' recompute reaches the gather back to
    token order (``weighted_out[inv_perm]``, whose saved ``inv_perm`` is the layer's last saved tensor): the
    weighted outputs exist, ``torch.arange`` is being written into ``inv_perm``, the routing locals are alive
    (_routing_locals) and so is the block's argument, the norm output, where nothing saved it (under autocast
    the router keeps a half cast; in DeepSeek's half recipes its fp32 upcast). DeepSeek's shared experts run after
    the routed ones: not yet recomputed at that moment (_shared_experts_freed), they end the recompute later,
    beside the routed output. Traced: Mixtral amp-bf16, eager, full checkpointing, -2.58% at the backward peak
    without the locals (seed 9191 case 7 of ``validate --random``)."""
    layer, h = la.layer, spec.hidden_size
    moe = layer.moe_block
    weighted = la.returned_extra + moe.top_k * _weighted_bytes(moe, p) * h
    argument = p.residual * h if p.autocast else p.compute * h if _shared_first(layer) and p.compute != FP32 else 0
    # The decoder layer's ``residual`` (the sum after attention) is held through the MLP; where the post-attention
    # norm saved an fp32 copy of a half one instead of the tensor itself, it is one more (traced: GPT-OSS,
    # mixed-fp16 and mixed-bf16, full checkpointing; seed 20261204 case 469 of ``validate --random``)
    if _term_bytes(la.terms, "post_attention_norm", "input_fp32") and p.residual != FP32:
        argument += p.residual * h
    # With biased experts the down projection's gathered biases stay in grouped_mm_experts_forward's
    # ``selected_biases`` to its end (traced: GPT-OSS, mixed-bf16, experts narrower than the width)
    down_biases = moe.top_k * p.experts * h if moe.bias else 0
    routed = int((weighted + _routing_locals(moe, p) + moe.top_k * INDEX + argument + down_biases) * tokens)
    if moe.gate == "clamped_swiglu":
        # GptOssExperts._apply_gate's product, recomputed: beyond what the recompute has saved by then, the gathered
        # gate_up biases and the clamped up (3 I, no backward keeps them), while the down projection's output and
        # inv_perm are not made yet (traced: amp-bf16, full checkpointing, -2.2% at the backward peak without it)
        at_product = _clamped_swiglu_at_product(moe, p, h)
        routed = max(routed, int((la.returned_extra + at_product + _routing_locals(moe, p) + argument) * tokens))
    if not _shared_first(layer):
        return routed
    # The shared experts' saves come later, so the recompute goes on through the gather back to token order: its
    # output exists beside the weighted outputs it reads (traced: DeepSeek-V3, amp-fp16, no shared experts, full
    # checkpointing, -4.05% at the backward peak without it; seed 20261205 case 4 of ``validate --random``)
    gathered_back = int(moe.top_k * _weighted_bytes(moe, p) * h * tokens)
    return max(routed + gathered_back - _shared_experts_freed(spec, la, p, tokens), int(weighted * tokens))


def _clamped_swiglu_at_product(moe: MoE, p: Precision, h: int) -> float:
    """Bytes per token at GptOssExperts._apply_gate's product beyond what the layer saves by then: per (token,
    expert) pair the gathered gate_up biases and the clamped up (3 I, no backward keeps them), less the down
    projection's output and inv_perm, not made yet."""
    return moe.top_k * (p.experts * (3 * moe.expert_intermediate_size - h) - INDEX)


def _lora_recompute_end(spec: ModelSpec, la: LayerActivations, p: Precision, settings: TrainingSettings,
                        finetune: FineTune) -> int:
    """Per token, how a LoRA layer's recompute end differs from a fully trained one's (_recompute_end). An adapted
    down_proj saves its adapter's inputs after the base Linear has run (peft's ``result = self.base_layer(x)``,
    then ``lora_B(lora_A(dropout(x)))``): its output is written. A frozen one without an adapter saves only the
    weight (its input takes a gradient, its weight none), so the recompute stops before its output is written, and
    its argument, the MLP's product, which nothing saved, is alive (traced: Qwen3 under autocast, q,v adapters)."""
    layer = la.layer
    if not la.checkpointed or layer.mlp is None or layer.moe or _has_output_norm(la):
        return 0
    # (_recompute_end leaves down_proj's output out where its matmul saves the layer's last tensors)
    written = p.compute * spec.hidden_size if (spec.traits.block != "falcon"
                                               and not _mlp_output_dropout(spec, layer, settings)) else 0
    if spec.traits.block != "standard" or _adapted_down(spec, la, p, finetune):
        return written
    return written + p.compute * layer.mlp.intermediate_size - p.compute * spec.hidden_size


def _layer_casts(spec: ModelSpec, la: LayerActivations, p: Precision) -> tuple[int, int]:
    """The half weight copies autocast's cast cache holds for a layer by its attention kernel (its input
    projections') and by its MLP product (all but the down projection's, made when it runs). The grouped_mm
    experts are not autocast."""
    matrices = [t for t in layer_tensors(la.layer, spec.hidden_size, spec.norm_vectors) if len(t.shape) == 2]
    attention = _numel(matrices, "attention_input")
    mlp = sum(t.numel for t in matrices if t.role not in _DOWN_PROJECTIONS)
    return p.compute * attention, p.compute * mlp


_DOWN_PROJECTIONS = ("mlp_down", "expert_down")


def _forward_transient(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int,
                       casts: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """A layer's forward when autograd keeps nothing (non-reentrant checkpointing): tensors die as soon as Python
    drops them, so the worst moment is the MLP product being formed from the activation and up outputs (3 I-wide
    tensors), or attention with q, k, v and its output, beside the residual stream and the norm output, and the
    weight casts autocast has cached by then (``casts``, see _layer_casts)."""
    c, w, h = p.compute, p.residual, spec.hidden_size
    layer = la.layer
    att = layer.attention
    wide = 3  # gated: activation output, up output, product
    if layer.mlp is not None and not layer.mlp.gated:
        # The Python GELUs' intermediates (traced): gelu_new's x, 0.5 * x, pow(x, 3) and 0.044715 * pow(x, 3);
        # BloomGelu's x, x * 0.5, 0.79788456 * x, 0.044715 * x and its product with x.
        wide = {"gelu_new": 4, "bloom_gelu": 5}.get(layer.mlp.activation, 2)
    if layer.moe or (layer.mlp is not None and layer.mlp.fused_gate_up):
        # one gate_up output (2 I wide: Phi-3's gate_up_proj, the experts') stays alive beside the activation and
        # the product, its two halves being views of it
        wide = 4
    if layer.moe and layer.moe.gate == "clamped_swiglu":
        # GptOssExperts._apply_gate, at ``(up + 1) * glu``: gate_up's output (2 I), the gathered gate_up biases
        # grouped_mm_experts_forward still holds in ``selected_biases`` (2 I), the clamped gate and up, glu, up + 1
        # and the product (traced: fp32, full checkpointing, -11.4% at the forward peak with the 4 I of act * up)
        wide = 9
    mlp: float = wide * _mlp_bytes(layer, p) * _mlp_width(layer)
    if layer.moe:  # grouped_mm_experts_forward holds the gathered tokens in a local until it returns
        mlp += layer.moe.top_k * p.experts * h
        # and the routing beside them, none of it saved here: the top-k indices, the sort's permutation and the
        # permuted weights, with what no backward keeps either (_routing_locals; traced: Mixtral, fp32, full
        # checkpointing, -1.1% at the forward peak without them)
        moe = layer.moe
        routing = _routing_locals(moe, p) + moe.top_k * (2 * INDEX + _routing_weight_bytes(moe, p))
        # The gather back to token order (``weighted_out[inv_perm]``) is the other candidate: the gathered tokens,
        # the down projection's output, the weighted outputs and their permuted copy, k x h wide each, with
        # inv_perm (traced: Qwen3-MoE, experts narrower than the width, -4.1% at the forward peak without it)
        gather_back = 2 * moe.top_k * (p.experts + _weighted_bytes(moe, p)) * h + moe.top_k * INDEX
        # Qwen2MoeSparseMoeBlock.forward runs its shared expert before the routed ones: its output is a local
        # through both moments (DeepSeek's run after them, _shared_first). Traced: Qwen2-MoE, fp32, full
        # checkpointing, -2.05% at the forward peak without it (seed 20261205 case 66 of ``validate --random``)
        shared_output = c * h if moe.shared_intermediate_size and not _shared_first(layer) else 0
        mlp = max(mlp, gather_back) + routing + shared_output
    mlp += la.held_by_layer  # the attention weights eager attention returned, held in the block's locals
    attn = la.attention_forward or c * (2 * att.num_heads * att.head_dim + 2 * att.num_kv_heads * att.head_dim)
    # Beside, in the MLP: the layer input (the caller's variable), the residual and the norm output; in attention,
    # the layer input (its norm output is counted in ``attention_forward``).
    # Both moments are returned, not their maximum: which is larger depends on the batch (the casts are constant),
    # and every candidate must stay linear in the batch for the compiled step model (stepmodel.py).
    return int((mlp + 3 * w * h) * tokens + casts[1]), int((attn + w * h) * tokens + casts[0])


def _down_projection_forward(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int, casts: int) -> int:
    """A checkpointed layer's forward (autograd keeps nothing) when its down projection's output is written, under
    autocast: the product (down_proj's input), the gate/up output where one fused projection made it (Phi3MLP's
    ``gate`` is a view of it, alive until the MLP returns), the output, the down projection's half weight copy
    (autocast makes it as the matmul runs) beside the other cached casts (``casts``, see _layer_casts) and, as at
    the product (_forward_transient), the layer input, the residual and the norm output. Larger than the product's
    moment where the copy outweighs the activation's output, i.e. with fewer tokens than the width (traced: Phi-3,
    amp-fp16, full checkpointing, 32 tokens, width 128: -2.1% at the forward peak without it). 0 for MoE and
    ungated MLPs, and without autocast (no copy: the product's moment is the larger)."""
    layer, mlp = la.layer, la.layer.mlp
    if layer.moe or mlp is None or not mlp.gated or not p.autocast:
        return 0
    c, w, h, width = p.compute, p.residual, spec.hidden_size, _mlp_width(layer)
    held = (2 * width if mlp.fused_gate_up else 0) + width + h
    down_copy = c * _numel(layer_tensors(layer, h, spec.norm_vectors), "mlp_down")
    return int((c * held + 3 * w * h + la.held_by_layer) * tokens) + casts + down_copy


def _op_saved_in_forward(la: LayerActivations, tokens: int) -> tuple[int, int]:
    """--checkpointing op: what SAC's cache holds of the layer beyond what _forward_transient counts at its two
    moments (the MLP product being formed; attention's kernel). At the product: every saved output made by then
    (q, v, attention's output and logsumexp, gate: the three I-wide tensors there are SiLU's output, up's and the
    product) but up's, already among them; at the kernel: q and k as their matmuls made them, beside the rotated
    copies attention reads (v is read as it is, the kernel's outputs are counted). (0, 0) without the policy."""
    def saved(*modules: str, but: tuple[str, ...] = ()) -> int:
        return int(sum(t.bytes_per_token for t in la.checkpoint_terms if t.kind in (OP_SAVED, OP_SAVED_UNTAKEN)
                       and (not modules or t.module in modules) and t.module not in but) * tokens)

    return saved(but=("up_proj", "down_proj")), saved("q_proj", "k_proj")


def _adapter_forward_transients(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int,
                                finetune: FineTune) -> tuple[int, ...]:
    """A checkpointed layer's forward under LoRA: at each adapted Linear, peft's ``result + lora_B(lora_A(x)) *
    scaling`` (peft/tuners/lora/layer.py, ``Linear.forward``) holds the base output, the scaled adapter output and
    their sum (in the adapter's dtype: the sum is promoted before ``result.to``; in half under autocast), and the
    adapter's copy of the input where its dtype differs (with lora_dropout, the dropped-out input and its mask too),
    beside what that point of the layer holds: the layer input and the norm output (attention), or the layer input,
    the residual and the norm output (MLP), the attention output (o), and the outputs made before it (q and k beside
    v, the activation beside up, the product for down). Nothing is saved, so the gate's output is gone when up runs.
    Under autocast every frozen Linear's matmul also holds its weight's half copy (autocast caches none of a weight
    that takes no gradient) and the half copy of an fp32 input, beside its output."""
    from .lora import adapter_bytes_per_value

    options = finetune.lora
    c, w, h = p.compute, p.residual, spec.hidden_size
    ab = c if p.autocast else adapter_bytes_per_value(options, p.compute)
    fp32_adapters = adapter_bytes_per_value(options, p.compute) == FP32 and c != FP32
    context = {"qkv_input": w * h + c * h, "mlp_input": 3 * w * h,
               "down_input": (2 if spec.traits.mlp_inline else 3) * w * h}
    half_input = {"qkv_input": p.residual != c, "o_input": False, "mlp_input": p.residual != c, "down_input": False}
    out = []
    for name, site, width_in, width_out, before, adapted in _adapter_sites(spec, la, p, finetune, every=p.autocast):
        alive = (w * h + c * width_in if site == "o_input" else context[site] + c * width_in if site == "down_input"
                 else context[site] + (before if name != "mlp.up_proj" else c * width_out))
        if p.autocast:  # the base matmul: its weight's and its input's half copies, and its output
            out.append(int((alive + c * width_in * half_input[site] + c * width_out) * tokens)
                       + c * width_in * width_out)
        if not adapted:
            continue
        if p.autocast and fp32_adapters and site in ("o_input", "down_input"):
            # peft copies the half input to the adapters' fp32 (_cast_input_dtype), and lora_A's matmul casts that
            # back to half: both beside the base output when A's output is made; the fp32 copy, a local of the
            # Linear's forward, stays through the sum (traced: Qwen2 all-linear, the forward's peak)
            fp32_copy = FP32 * width_in
            out.append(int((alive + fp32_copy + c * width_in + c * width_out + c * options.rank) * tokens))
            out.append(int((alive + fp32_copy + 3 * c * width_out) * tokens))
            continue
        if p.autocast:
            copy = c * width_in * half_input[site]
        else:
            copy = (ab * width_in if ab != c else 0) + ((ab + MASK) * width_in if options.dropout > 0 else 0)
        if options.dora:
            # nothing saved: the identity and A's output die once B @ A is made (_dora_site)
            out += [int((alive + copy + c * width_out + per_token) * tokens) + fixed
                    for per_token, fixed in _dora_site(finetune, p, width_in, width_out, saving=False,
                                                          bias=_has_bias(spec, la, name))]
        else:
            out.append(int((alive + copy + c * width_out + 2 * ab * width_out) * tokens))
    return tuple(out)


def _dora_site(finetune: FineTune, p: Precision, width_in: int, width_out: int, saving: bool, stops: bool = False,
               bias: bool = False) -> tuple[tuple[int, int], tuple[int, int]]:
    """DoRA at one adapted Linear (peft/tuners/lora/dora.py, ``DoraLinearLayer.forward``), beyond the base output
    and the adapter's input copy: (bytes per token, fixed bytes) at its two worst moments.

    The weight norm: B @ A is made by running the adapters on an in x in identity (``get_lora_weight``), the base
    weight is cast to the adapter's dtype (dequantized first from a quantized base), and ``weight + scaling *
    lora_weight`` makes the scaled B @ A and the sum, all out x in, before the column norm is taken. Where the
    step saves (``saving``: no checkpoint, or a checkpointed layer's recompute), the graph of B @ A holds the
    identity and A's output until the forward returns; a checkpointed layer's first forward saves nothing, so they
    die once B @ A is made.

    The output: ``(mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling`` while B @ A and the
    cast weight are still locals: the adapter output, the first product and the product and its scaled copy, all
    out wide in the adapter's dtype (the products promote the base output to it); the A output too where nothing is
    saved (saved, it is among the adapter's activations). A recompute that ``stops`` at this Linear's last saved
    tensor (the second product's) has made the first product only. A Linear with a bias (GPT-2, OPT) takes it off
    the base output first (``base_result - bias``): that new tensor is what the first product keeps, beside the
    base output."""
    from .lora import adapter_bytes_per_value

    ab = adapter_bytes_per_value(finetune.lora, p.compute)
    n, m, r = width_in, width_out, finetune.lora.rank
    casts = (ab != p.compute) + (finetune.base_quant is not None)
    graph = n * n + r * n if saving else 0
    norm = ab * (graph + (3 + casts) * m * n if saving else max(n * n + r * n + m * n, (3 + casts) * m * n))
    result = ab * (graph + (1 + casts) * m * n)
    return (0, norm), (ab * (1 if stops else 3) * m + (0 if saving else ab * m) + (p.compute * m if bias else 0),
                       result)


def _dora_backward(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int,
                   finetune: FineTune) -> tuple[int, int]:
    """DoRA's backward at the MLP's widest adapted Linear (gate, up, gate_up or fc1): (gradient temporaries beyond
    the LoRA step's, what is freed beyond it). The backward of ``(scale - 1) * base_result + scale * lora_result *
    scaling`` makes the scaled gradient, the gradient of the adapter output and each product to be summed into the
    magnitude's gradient, three out-wide tensors in the adapter's dtype at once beside the incoming gradient (in
    the adapter's dtype, with the base output's gradient cast back, where the sum was promoted), and beside the
    activation's gradient where gate and up are separate Linears (up's runs first). By then the activation has
    run its backward (for separate gate and up, only the product: the gate's output is still kept) and freed what
    it saved (traced: Qwen2 all-linear without checkpointing, 5 fp32 I-wide gradients in fp32, 4 fp32 and 2 bf16
    with fp32 adapters on bf16; Phi-3's gate_up, four 2I-wide)."""
    from .lora import adapter_bytes_per_value

    if not finetune.lora.dora:
        return 0, 0
    widths = [site[3] for site in _adapter_sites(spec, la, p, finetune) if site[1] == "mlp_input"]
    if not widths:
        return 0, 0
    c = p.compute
    ab = adapter_bytes_per_value(finetune.lora, c)
    mlp = la.layer.dense_mlp
    separate = mlp.gated and not mlp.fused_gate_up  # (up's backward first: the activation's gradient waits)
    m = max(widths)
    at_site = (c * mlp.intermediate_size if separate else 0) + (c if ab == c else ab + c) * m + 3 * ab * m
    extra = max(0, (at_site + p.residual * spec.hidden_size) * tokens - _mlp_transient(spec, la, p, tokens))
    # the activation's saved tensors, between the MLP input's and down_proj's input's: all freed, but for a gated
    # MLP the gate's output, which the activation's backward (after up's) frees
    modules = [t.module for t in la.terms]
    last = modules.index("down_input") if "down_input" in modules else len(modules)
    freed = sum(t.bytes_per_token for t in la.terms[_mlp_saves_start(la):last] if not t.module)
    if separate:  # (a fused gate_up Linear runs its backward after both halves')
        freed -= c * mlp.intermediate_size
    return extra, int(freed * tokens)


def _mlp_saves_start(la: LayerActivations) -> int:
    """The index of the first of a layer's terms that its MLP's Linears and activation save: after the MLP input's
    terms (its norm output, the adapters' copies), or after the post-attention norm's where nothing keeps that
    input (frozen gate and up projections)."""
    modules = [t.module for t in la.terms]
    before = "mlp_input" if "mlp_input" in modules else "post_attention_norm"
    return len(modules) - modules[::-1].index(before)


_BEFORE_ATTENTION = ("input_norm", "q_norm", "k_norm")
"""The modules of a layer that save their tensors before its attention kernel runs."""


def _saved_before_attention(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int,
                            shared_input: int) -> int:
    """What a checkpointed layer's recompute has saved by the time it reaches attention, beyond what the first
    (no-grad) forward holds there (_forward_transient): the input norm's and the q/k norms' saves and, under
    autocast, the q/k/v projections' half copies of an fp32 input (without autocast they read the norm output,
    the attention's argument, which the forward's moment holds); less the layer input where the input norm saves
    that tensor itself (``shared_input``: the moment holds the layer input). Traced: a Cohere layer with q/k
    norms, amp-bf16, 4 x 1,000, was -10.9% at the backward peak without them."""
    copies = p.autocast and p.residual != p.compute
    saved = sum(t.bytes_per_token for t in la.terms
                if t.module in _BEFORE_ATTENTION or (copies and t.module == "qkv_input"))
    aliased = 0 if spec.traits.attention_reads_layer_input else shared_input
    return max(0, int(saved * tokens) - aliased)


def _has_bias(spec: ModelSpec, la: LayerActivations, linear: str) -> bool:
    return any(t.name == f"{linear}.bias" for t in layer_tensors(la.layer, spec.hidden_size, spec.norm_vectors))


_AdapterSite = tuple[str, str, int, int, int, bool]
"""An _adapter_sites entry: (name, its input's site tag, in, out, the outputs made before it, whether adapted)."""


def _adapted_down(spec: ModelSpec, la: LayerActivations, p: Precision,
                  finetune: FineTune) -> list[_AdapterSite]:
    """The adapted down projection (down_proj, fc2) of a LoRA layer, as an _adapter_sites entry; empty where it is
    frozen."""
    return [site for site in _adapter_sites(spec, la, p, finetune) if site[1] == "down_input"]


def _adapter_sites(spec: ModelSpec, la: LayerActivations, p: Precision, finetune: FineTune,
                   every: bool = False) -> list[_AdapterSite]:
    """Each adapted Linear of a Llama-style layer (``every``: each Linear): (name, its input's site tag, in, out,
    the outputs made before it in its block that are alive when it runs, whether it is adapted)."""
    from .lora import adapted_names

    att, mlp = la.layer.attention, la.layer.mlp
    if att is None or mlp is None:
        return []
    c, h = p.compute, spec.hidden_size
    q, kv, inter = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim, mlp.intermediate_size
    sites = [("q_proj", "qkv_input", h, q, 0), ("k_proj", "qkv_input", h, kv, c * q),
             ("v_proj", "qkv_input", h, kv, c * (q + kv)), ("qkv_proj", "qkv_input", h, q + 2 * kv, 0),
             ("o_proj", "o_input", q, h, 0), ("mlp.gate_proj", "mlp_input", h, inter, 0),
             ("mlp.up_proj", "mlp_input", h, inter, 2 * c * inter), ("mlp.gate_up_proj", "mlp_input", h, 2 * inter, 0),
             ("mlp.down_proj", "down_input", inter, h, 0), ("mlp.fc1", "mlp_input", h, inter, 0),
             ("mlp.fc2", "down_input", inter, h, 0)]
    chosen = adapted_names(spec, finetune.lora)
    present = {t.name.removesuffix(".weight") for t in layer_tensors(la.layer, spec.hidden_size, spec.norm_vectors)}
    return [(*site, site[0] in chosen) for site in sites if site[0] in present and (every or site[0] in chosen)]


def _adapted_down_gradient(spec: ModelSpec, la: LayerActivations, p: Precision, finetune: FineTune) -> int:
    """Per token, how an adapted down projection's backward differs from a frozen one's where its fp32 adapters sit
    on a half base (no autocast): the adapter branch runs first, so at lora_A's weight gradient the input's
    gradient is the adapter copy's, in fp32, beside the gradient of A's output and the base output's gradient
    cast back from the promoted sum (traced: GPT-2 all-linear, pure-bf16 with full checkpointing)."""
    from .lora import adapter_bytes_per_value

    down = _adapted_down(spec, la, p, finetune)
    c = p.compute
    ab = adapter_bytes_per_value(finetune.lora, c)
    if not down or p.autocast or ab == c or finetune.lora.dora:
        return 0
    width_in, width_out = down[0][2], down[0][3]
    return (ab - c) * width_in + c * width_out + ab * finetune.lora.rank


def _adapter_recompute_gradient(spec: ModelSpec, la: LayerActivations, p: Precision, finetune: FineTune) -> int:
    """Per token, what a checkpointed layer's backward has made before its recompute starts, where its last Linear
    (down_proj) is adapted: the recompute starts at the first node that unpacks a saved tensor, lora_B's matmul,
    and the nodes before it save nothing (peft's ``result + lora_B(lora_A(x)) * scaling``, then ``result.to``):
    the gradient of the scaled adapter output (MulBackward by the float scaling, in the adapter's dtype) and, where
    the sum was promoted to the adapter's dtype, the gradient of the base output cast back by AddBackward (traced:
    Llama LoRA all-linear, pure-bf16 with fp32 adapters, an fp32 and a bf16 hidden-wide tensor beside the layer's
    output gradient)."""
    from .lora import adapter_bytes_per_value

    if not la.checkpointed:
        return 0
    down = _adapted_down(spec, la, p, finetune)
    if not down:
        return 0
    c = p.compute
    ab = c if p.autocast else adapter_bytes_per_value(finetune.lora, c)
    # DoRA (``(scale - 1) * base_result + scale * lora_result * scaling``): the recompute starts at the second
    # product's backward, and the gradient of the adapter's promoted output waits for the first product's
    dora_waiting = ab if finetune.lora.dora and ab != c else 0
    return (ab + (c if ab != c else 0) + dora_waiting) * down[0][3]


def _adapter_recompute_moments(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int,
                               finetune: FineTune, recompute: bool = True) -> tuple[tuple[int, int], ...]:
    """A checkpointed LoRA layer's recompute (in backward, saving for real; or, not ``recompute``, a DoRA layer's
    forward without checkpointing, which saves the same and runs to its end): at each adapted Linear's adapter sum,
    the layer's saved tensors up to that Linear's input site (its adapters' input copies and A outputs included),
    the outputs made before it in its block (q beside k; the gate's output and its activation beside up), and as
    temporaries its base output and the scaled adapter output and their sum in the adapter's dtype (as in
    _adapter_forward_transients)."""
    from .lora import adapter_bytes_per_value

    adapter_bytes = adapter_bytes_per_value(finetune.lora, p.compute)
    c, w, h = p.compute, p.residual, spec.hidden_size
    ab = c if p.autocast else adapter_bytes  # (under autocast lora_B's matmul, so its output, is in half)
    # unsaved locals of the layer: the norm output (attention), the residual and the norm output (MLP)
    locals_ = {"qkv_input": c * h, "o_input": 0, "mlp_input": 2 * w * h, "down_input": 2 * w * h}
    # under autocast the inputs of o and down are half tensors, which peft copies to the adapters' fp32 (its
    # _cast_input_dtype) before lora_A casts them back: the fp32 copy is a local of the adapted Linear (traced)
    half_inputs_copied = p.autocast and adapter_bytes != c
    order = [t.module for t in la.terms]
    out = []
    # under autocast every Linear's matmul keeps its weight's half copy (and each adapter's, rank x (in + out))
    # for its input's gradient: those the recompute has made by each site (traced: 425,984 bytes at the down
    # projection of a Llama layer with hidden 128, all-linear)
    copies, weight_copies = 0, {}
    for name, _, width_in, width_out, _, adapted in _adapter_sites(spec, la, p, finetune, every=True):
        if p.autocast:
            copies += c * width_in * width_out + (c * finetune.lora.rank * (width_in + width_out) if adapted else 0)
        weight_copies[name] = copies
    # A norm whose saved input is its input tensor itself (LayerNorm; RMSNorm whose fp32 upcast is a no-op) shares
    # it: the input norm's with the layer input the checkpoint kept, the post-attention norm's with the residual;
    # a Linear input kept as it is (adapters in the compute dtype read the tensor itself) is the norm output local
    # (traced: Phi-3 in fp32, 768 bytes a token counted twice at gate_up)
    input_is_saved = spec.norm == "layer" or w == FP32
    # (the norm that reads the residual: Gemma's sandwich has the post-attention norm on the attention output)
    residual_norm = "pre_feedforward_norm" if la.layer.num_norms == 4 else "post_attention_norm"
    sites = _adapter_sites(spec, la, p, finetune)
    dora = finetune.lora.dora
    r = finetune.lora.rank

    def own(width_in: int, width_out: int) -> int:
        """A DoRA adapter's saved bytes per token: its input copy, A's output, the base and adapter outputs."""
        return (ab * width_in if ab != c else 0) + ab * r + (c + ab) * width_out

    for index, (name, site, width_in, width_out, before, _) in enumerate(sites):
        if site not in order:
            continue
        last = len(order) - 1 - order[::-1].index(site)  # the site's last term: its adapters' A outputs
        done = la.terms[:last + 1]
        saved = sum(t.bytes_per_token for t in done)
        local = locals_[site]
        kept_as_is = {t.module for t in done if t.kind == "linear_input"}
        if site == "qkv_input" and "qkv_input" in kept_as_is:
            local -= c * h  # (the input norm's output)
        if site in ("mlp_input", "down_input"):
            if "mlp_input" in kept_as_is:
                local -= w * h  # (the MLP norm's output)
            if input_is_saved and any(t.module == residual_norm for t in done):
                local -= w * h  # (the residual)
        if site == "down_input":
            if spec.traits.mlp_inline and "mlp_input" not in kept_as_is:
                local -= w * h  # (the MLP norm's output: the layer's local now holds the first Linear's output)
            if not any(t.module == "down_input" and t.kind in ("linear_input", "shared_input") for t in done):
                local += c * width_in  # (down_proj's argument, which only its adapter's copy saves)
        if input_is_saved and any(t.module == "input_norm" for t in done):
            saved -= w * h  # (the layer input, in the layer's kept bytes)
        copy = adapter_bytes * width_in if half_inputs_copied and site in ("o_input", "down_input") else 0
        # Where this adapter saves the layer's last tensor (down_proj's, unless a norm follows), the recompute stops
        # there (torch.utils.checkpoint's early stop): at lora_B's matmul, before its output; with DoRA at the
        # second product, before it (traced)
        stops = recompute and last == len(order) - 1
        if not dora:
            out.append((int((saved + before + local) * tokens) + weight_copies[name],
                        int(((c + (0 if stops else 2 * ab)) * width_out + copy) * tokens)))
            continue
        # DoRA: the adapters of this input's later Linears have saved nothing yet; at the weight norm this one's
        # A output and outputs do not exist either, only its base output (_dora_site)
        saved -= sum(own(later[2], later[3]) for later in sites[index + 1:] if later[1] == site)
        (_, norm), (per_token, fixed) = _dora_site(finetune, p, width_in, width_out, saving=True, stops=stops,
                                                       bias=_has_bias(spec, la, name))
        out.append((int((saved - own(width_in, width_out) + before + local) * tokens),
                    int((c * width_out + (ab * width_in if ab != c else 0)) * tokens) + norm))
        out.append((int((saved + before + local) * tokens), int(per_token * tokens) + fixed))
    return tuple(out)


def _autograd_grad_bytes(recipe: Recipe) -> int:
    """The dtype of the gradients autograd computes: the parameters' (a persistent fp32 main-grad buffer receives
    them afterwards), else the recipe's gradient dtype."""
    return recipe.weight_bytes if recipe.persistent_gradients else recipe.gradient_bytes


def _param_bytes(numel: int, per_param: float) -> int:
    return int(numel * per_param)


def _optimizer_temporaries(spec: ModelSpec, recipe: Recipe, optimizer: Optimizer, fused: bool,
                           rank: RankLayout | None = None, finetune: FineTune | None = None) -> int:
    """Temporaries of optimizer.step(): the foreach implementations (CUDA's default) compute over all of a
    group's tensors at once, so one parameter-sized intermediate exists, e.g. AdamW's
    ``torch._foreach_sqrt(exp_avg_sqs)`` (torch/optim/adamw.py, _multi_tensor_adamw); Muon runs one tensor at a
    time beside AdamW for the rest (``Optimizer.step_temporaries``, optimizers.py); fused kernels
    (``fused=True``, DeepSpeed's FusedAdam, bitsandbytes) update in place. Recipes with half gradients and fp32
    master weights make an fp32 copy of the gradients for the update. On a rank of a sharded engine the optimizer
    updates that rank's elements, and the engine's own fp32 gradient copy is one of its buffers (sharding.py)."""
    n = spec.num_parameters if rank is None else rank.optimizer_numel
    temp = 0
    if finetune is not None:  # the optimizer updates the adapters (and trained copies), in their dtype
        from .lora import trainables

        t = trainables(spec, recipe, optimizer, finetune)
        temp = (0 if fused else optimizer.foreach_temporaries * t.stepped_values) + t.masters
        # a rank steps its share of them (finetune_sharding.py; none where the step runs on the host)
        return temp if rank is None else -(-temp * rank.optimizer_numel // (t.adapters + t.copies))
    if not fused:  # the implementation's own shape (optimizers.py, Optimizer.step_temporaries)
        temp += optimizer.step_temporaries(spec.param_groups, n, recipe.state_bytes_for(optimizer.name))
    if recipe.master_weights and recipe.gradients != recipe.master_weights and (rank is None
                                                                                  or rank.gradient_cast_in_step):
        temp += n * 4
    return temp


@dataclass(frozen=True)
class _LayerBytes:
    """One decoder layer, as the backward walk needs it."""

    kept: int
    """What the layer keeps until its backward (everything saved, or its input when checkpointed)."""
    full: int
    """Its full saved activations (recreated by the recompute under full checkpointing)."""
    product: int
    """Freed when down_proj's backward has run: its input (the MLP product), under autocast the half copy of its
    weight, what a norm on the layer's output saved, and MoE's router-weighted expert outputs."""
    activation_reads: int
    """The part of ``product`` still alive at the MLP moment: a plain ReLU MLP's activation output, which
    ReluBackward0 saved (threshold_backward reads it) beside fc2, its other reader (traced: OPT, fp32, full
    checkpointing, 2 x 256: the recomputed layer's 2 MiB ReLU output alive there, the peak -5.2% without)."""
    down_grad: int
    down_weight_gradient: int
    down_gradient_cast: tuple[int, int]
    """Under autocast, a dense MLP: (what is freed, the temporaries) at the cast of down_proj's half weight
    gradient to the parameter's dtype, when its half weight copy is gone, and its input too unless the activation
    keeps it (ReLU keeps its output), while d(input), the residual's gradient, the half gradient and its cast
    exist (traced); (0, 0) otherwise."""
    """The down projection's weight gradient as its matmul makes it (the half copy's dtype under autocast)."""
    grads: int
    transient: int
    """Largest gradient temporaries inside its backward."""
    forward_transient: tuple[int, ...]
    """Its forward's own tensors alive at once when nothing is saved (checkpointed forward): in the MLP, and in
    attention."""
    experts_freed: int
    """MoE layers: what the routed experts saved beyond their gathered input (gate_up outputs, activation and
    product, expert outputs), all freed when the experts' gate_up backward runs; 0 for a dense MLP."""
    experts_transient: int
    """MoE layers: the gate_up grouped_mm backward's gradients, of its output, of its input and of its weight
    (the weight's is a temporary until autograd accumulates it into .grad)."""
    experts_weighting_transient: int
    """MoE layers: the backward of the router weighting, the experts' first, while all of the layer's activations
    are alive: beside the residual stream's gradient, the gradient of the weighted outputs in token order, its
    scatter back to expert order, and the product's two gradients (outputs' and weights'), each top-k x h.
    Qwen2-MoE's gated shared expert (``sigmoid(gate(x)) * shared_expert(x)``, computed last) has run its product's
    and its gate's backward by then: the gradient of the shared expert's output waits for its MLP's backward, and
    the MoE input's gradient holds the gate's contribution."""
    experts_weighting_freed: int
    """What the gated shared expert's product backward has freed by that moment: the shared expert's output.
    DeepSeek-V3 adds its shared experts' output last (``experts(x) + shared_experts(residuals)``), so their whole
    backward has run by then: their activations are freed, their weight gradients exist (below) and the MoE
    input's gradient holds their contribution."""
    experts_weighting_grads: int
    """The shared experts' weight gradients that exist at that moment (DeepSeek-V3), else 0."""
    output_norm_transient: int
    """Gradient temporaries of a norm on the layer's output (Gemma 2/3's post-feedforward norm), whose backward
    runs first, while all of the layer's activations are alive; 0 where the layer ends with the residual add."""
    output_norm_freed: int
    """What that norm's backward has freed of its own saved tensors by its worst moment."""
    attention_live: int
    """What the layer still holds when its attention kernel's backward runs: the attention block's saved tensors
    less those already freed (and, under checkpointing, the kept input)."""
    attention_transient: int
    """The attention kernel backward's temporaries, beside the residual stream's gradient."""
    attention_grads_pending: int
    recompute_end: int
    """Under full checkpointing, what exists at the end of the layer's recompute beyond its activations: the
    recompute stops once the last saved tensor exists (torch.utils.checkpoint's early stop), inside the
    down projection, whose output has just been written, and the layer's locals still hold the attention weights
    eager attention returned (LayerActivations.returned_extra). Under autocast the MLP's argument, the norm's
    fp32 output (its Linears keep half copies instead), is alive too: the caller's frame holds it during the
    call (``self.mlp(self.post_attention_layernorm(x))``). A dropout after the MLP has not run: its mask, part of
    the layer's activations, does not exist yet."""
    adapter_moments: tuple[tuple[int, int], ...]
    """LoRA under full checkpointing: (what the layer holds beyond its kept input, the temporaries) at each adapted
    Linear's adapter sum during the layer's recompute (_adapter_recompute_moments); for DoRA without checkpointing,
    the same moments of the layer's forward (beyond its input)."""
    recompute_attention_end: int
    """BLOOM under full checkpointing: what the layer holds when its recomputed attention returns (the attention's
    activations, its kept input, and BloomAttention's unsaved locals, LayerActivations.recompute_locals); 0
    elsewhere."""
    recompute_attention_saved: int
    """Under full checkpointing, what the recompute has saved by its attention moment (forward_transient's second)
    that the first forward does not hold there: Falcon's LayerActivations.recompute_saved with its weight cast,
    elsewhere the saves of the modules before attention (_saved_before_attention) and those inside the kernel
    (LayerActivations.recompute_kernel_saved)."""
    recompute_gradient: int
    """The temporaries the layer's backward made before its first node that needs a saved tensor started the
    recompute: beside the residual stream's gradient, under autocast its cast to the MLP output's half dtype (the
    residual add's backward)."""
    norm_moment: tuple[int, int, int]
    """RMSNorm layers: (what the layer holds, the gradients its MLP has produced, the temporaries) when the norm
    between attention and MLP runs its backward: the MLP block's activations are freed, the attention block's and
    the norm's own (less its normalised value) are alive, and LlamaRMSNorm's fp32 backward has five h-wide fp32
    gradients at once beside the residual's (traced); (0, 0, 0) for LayerNorm families."""
    matmul_live: int
    """Eager and math attention: what the layer holds when the product of the probabilities and v runs its
    backward, when of the attention only o_proj's input is freed; 0 for the fused kernels."""
    matmul_transient: int
    """The temporaries at that moment (LayerActivations.matmul_backward), beside the residual stream's gradient."""
    """Gradients of the layer not yet produced at that moment: the q/k/v projections' and the input norm's."""
    input_projections_grad: int
    """The gradients of the attention's input projections' outputs (q, k, v), while those projections run their
    backward."""
    down_transient: int
    """The down projection's backward: the gradient of its input (I wide) and of its output, beside the residual's."""
    freed_before_down: int
    """What a norm on the layer's output and MoE's weighted sum freed before the down projection's backward."""
    returned_to_model: int = 0
    """The attention probabilities the layer returns to a base model that holds them through the next layer
    (LayerActivations.returned_to_model), in bytes."""
    checkpointed: bool = False
    """Checkpointed (every layer under --checkpointing full, every second one under selective)."""
    gate_up_moments: tuple[tuple[str, int, int, int], ...] = ()
    """A fused gate/up projection's backward (GLM-4's and Phi-3's ``gate_up_proj``, then ``chunk``) and under
    autocast its weight gradient's cast, or under autocast the cast of separate gate and up projections' second
    weight gradient: (its name, what the layer has freed by then, the temporaries, gradients accumulated by then
    beyond down_proj's) each, see _gate_up_moments; none elsewhere."""
    compiled_mlp: tuple[int, int] = (0, 0)
    """--compile without checkpointing: (what the layer has freed, the temporaries) in its compiled backward's SiLU
    gradient (see _compiled_mlp_backward); (0, 0) in eager."""
    compiled_copies: int = 0
    """--compile: the layer's matrix gradients, which its compiled backward returns twice over (see
    _compiled_gradient_copies); 0 in eager."""
    down_forward: int = 0
    """A checkpointed layer's forward at its down projection under autocast (see _down_projection_forward); 0
    elsewhere."""


def casts_cached(spec: ModelSpec, p: Precision, settings: TrainingSettings) -> bool:
    """Under checkpointing, autocast's cast cache keeps every layer's half weight copies until the autocast region
    ends, even though checkpointed layers save nothing (without it, backward keeps them: in saved).
    FalconLinear computes ``input @ self.weight.T``: autocast casts the view weight.T, not a leaf, so nothing is
    cached there and each cast copy dies with its matmul (traced)."""
    return settings.checkpointing == "full" and p.autocast and spec.traits.weight_casts_cached


def expanded_layers(spec: ModelSpec, acts: ActivationEstimate, recipe: Recipe,
                     settings: TrainingSettings, finetune: FineTune | None = None) -> list[_LayerBytes]:
    if not spec.has_architecture:
        return []
    p = Precision.of(recipe)
    tokens = acts.tokens
    # (autocast caches no cast of a frozen LoRA base weight: it takes no gradient; the adapters' casts are small)
    cached = casts_cached(spec, p, settings) and finetune is None
    gradients_of = recipe
    if finetune is not None:
        # Only the adapters take gradients, in their own dtype: each Linear's tensor stands for its adapter pair.
        from dataclasses import replace as replaced

        from .lora import adapter_bytes_per_value

        from .lora import adapted_names

        ab = adapter_bytes_per_value(finetune.lora, recipe.weight_bytes)
        gradients_of = replaced(recipe, gradients={4: "fp32", 2: "bf16"}[ab], weights={4: "fp32", 2: "bf16"}[ab])
        adapted = adapted_names(spec, finetune.lora)
    out = []
    # (selective checkpointing makes a run of every layer: alike ones once)
    made: dict[tuple[object, ...], _LayerBytes] = {}
    for la in acts.layers:
        key = (la.layer, la.checkpointed, la.terms, la.constant_bytes, la.checkpoint_terms)
        if key in made:
            out.extend([made[key]] * la.count)
            continue
        tensors = layer_tensors(la.layer, spec.hidden_size, spec.norm_vectors)
        # Under LoRA and autocast the frozen down projection's half copy is kept by its matmul for its input's
        # gradient (in the layer's constant bytes) and freed by its backward, before the MLP moment (traced)
        frozen_down_copy = (p.compute * _numel(tensors, *_DOWN_PROJECTIONS)
                            if finetune is not None and p.autocast and la.layer.mlp is not None else 0)
        if finetune is not None:
            tensors = _adapter_view(tensors, adapted, finetune.lora.rank, finetune.lora.dora)
        down = _numel(tensors, *_DOWN_PROJECTIONS)
        layer = la.layer
        full = int(la.bytes_per_token * tokens) + la.constant_bytes
        kept = acts.layer_saved_bytes(la)
        # A compiled layer whose checkpoint is inside its compiled region (acts.checkpoint_compiled) recomputes
        # inside its one backward graph, each recomputed value just before its first
        # use (partitioners.py, reordering_to_mimic_autograd_engine): in backward it holds what the compiled layer
        # without a checkpoint saves, at the same moments; before, only its checkpoint_terms
        # (activations.compiled_checkpoint_terms). So it walks the uncheckpointed moments from ``kept``.
        recomputes = la.checkpointed and not acts.checkpoint_compiled
        if la.checkpointed and acts.checkpoint_compiled:
            # at its MLP's backward the attention block is not recomputed yet: what it kept stands for it (the
            # kept gate or up output is one of the MLP's own tensors; a kept o_proj output has been read by the
            # recompute of the residual after attention, its last use, and freed, as the backward graph frees
            # every saved tensor after its last use)
            mlp_kept = int(sum(t.bytes_per_token for t in la.checkpoint_terms
                               if t.module in MLP_LINEARS + ("o_proj",)) * tokens)
            full = kept - mlp_kept + int((la.bytes_per_token - la.attention_bytes_per_token) * tokens) \
                + la.constant_bytes
        # Under full checkpointing the recompute's first norm reads the kept layer input. Where it saves that
        # tensor itself (LayerNorm; RMSNorm when the stream is already fp32, so its upcast is a no-op) the
        # recomputed activations share it with what the checkpoint kept.
        shared_input = (p.residual * spec.hidden_size * tokens if recomputes
                        and (spec.norm == "layer" or p.residual == FP32) else 0)
        if spec.traits.norm_centred_twice:
            shared_input = 0  # CohereLayerNorm keeps x - mean, a new tensor, never its input
        if spec.traits.layer_norm_upcast and p.residual != FP32:
            shared_input = 0  # OlmoLayerNorm keeps its fp32 copy of a half layer input
        if spec.traits.attention_reads_layer_input and recomputes:
            # No input norm (OLMo-2, OPT's post-norms): q/k/v save the layer input itself unless autocast casts it for each of them
            shared_input = 0 if p.autocast else p.residual * spec.hidden_size * tokens
        full -= shared_input
        # --checkpointing op: the recompute takes the saved ops' outputs back from the cache (opsac.py): each is
        # then one of the recomputed activations, or dies in the recompute (q before rotary), so in backward the
        # layer holds them once, beyond its kept bytes only what full checkpointing recreates less them
        full -= int(sum(t.bytes_per_token for t in la.checkpoint_terms if t.kind == OP_SAVED) * tokens)
        # (grouped_mm experts are not autocast: their weights get no half copy)
        down_copy = p.compute * down if p.autocast and layer.mlp is not None else 0
        # A norm on the layer's output (Gemma's post-feedforward norm) has run its backward, and freed what it
        # saved, before the MLP's backward starts.
        output_norm = [t for t in la.terms if t.module == "post_feedforward_norm"]
        freed_before_mlp = int(sum(t.bytes_per_token for t in output_norm) * tokens)
        if _mlp_output_dropout(spec, layer, settings):  # the dropout after the MLP has run its backward: its mask
            freed_before_mlp += MASK * spec.hidden_size * tokens
        if layer.moe:
            # The experts' weighted outputs and each (token, expert) pair's weight and index are freed by the
            # backward of the router-weighted sum, which runs before the experts' down_proj backward (traced).
            freed_before_mlp += int(layer.moe.top_k * (p.experts * spec.hidden_size + INDEX + FP32) * tokens)
        if _shared_first(layer):  # and DeepSeek's shared experts have run their backward before the routed ones'
            freed_before_mlp += _shared_experts_freed(spec, la, p, tokens)
        # The attention moment: the MLP block has run its backward; the attention block's input projections have
        # not (their half weight copies under autocast are still held), o_proj has.
        projections = _numel(tensors, "attention_input")
        first_norm = _numel(tensors, "input_norm")
        attention_part = int(la.attention_bytes_per_token * tokens) + (p.compute * projections if p.autocast else 0)
        attention_live = attention_part - int(la.attention_released * tokens)
        if recomputes:
            attention_live += kept + (full - int(la.bytes_per_token * tokens) - la.constant_bytes)
        dora_transient, dora_freed = _dora_backward(spec, la, p, tokens, finetune) if finetune is not None else (0, 0)
        item = _LayerBytes(
            kept=kept, full=full, product=(_mlp_bytes(layer, p) * _mlp_width(layer) * tokens if finetune is None else
                                           _down_input_kept(la, tokens)) + down_copy + frozen_down_copy
            + freed_before_mlp + dora_freed,
            activation_reads=(int(_term_bytes(la.terms, "down_input", "shared_input") * tokens)
                              if layer.mlp is not None and layer.mlp.activation == "relu" and not layer.mlp.gated
                              and not dora_transient else 0),  # (DoRA's moment is fc1's, after the ReLU's backward)
            down_grad=_param_bytes(down, gradients_of.gradient_bytes),
            # Under autocast the matmul's weight gradient is first made in the half copy's dtype; its cast to the
            # parameter's comes after the layer's down-projection input is freed (traced).
            down_weight_gradient=(p.compute * down if down_copy
                                  else _param_bytes(down, _autograd_grad_bytes(gradients_of))),
            down_gradient_cast=((down_copy + (0 if layer.dense_mlp.activation == "relu" and not layer.dense_mlp.gated
                                              else _mlp_bytes(layer, p) * _mlp_width(layer) * tokens),
                                 (_mlp_bytes(layer, p) * _mlp_width(layer) + p.residual * spec.hidden_size) * tokens
                                 + p.compute * down + _param_bytes(down, gradients_of.gradient_bytes)
                                 + _attention_gradient_waiting(spec, layer, p, tokens))
                                if down_copy else (0, 0)),
            grads=_param_bytes(sum(t.numel for t in tensors), gradients_of.gradient_bytes),
            transient=_mlp_transient(spec, la, p, tokens, settings) + dora_transient,
            forward_transient=tuple(moment + extra for moment, extra in zip(
                _forward_transient(spec, la, p, tokens, _layer_casts(spec, la, p) if cached else (0, 0)),
                _op_saved_in_forward(la, tokens), strict=True))
            + (_adapter_forward_transients(spec, la, p, tokens, finetune) if finetune is not None else ()),
            experts_freed=int(_term_bytes(la.terms, "routed_experts", "intermediate") * tokens)
            + (_shared_experts_freed(spec, la, p, tokens) if _shared_first(layer) else 0),
            experts_transient=_experts_transient(spec, la, p, gradients_of, tokens, frozen=finetune is not None and
                                                 "mlp.experts.gate_up_proj" not in adapted and p.experts != FP32),
            experts_weighting_transient=_experts_weighting_transient(spec, layer, p, tokens),
            experts_weighting_freed=_experts_weighting_freed(spec, la, p, tokens),
            experts_weighting_grads=(_param_bytes(_numel(tensors, "shared_expert"), gradients_of.gradient_bytes)
                                     if _shared_first(layer) else 0),
            # Gemma's RMSNorm backward in fp32: the upcast output gradient, its product with (1 + weight), and the
            # rsqrt and input branches, five h-wide fp32 tensors at once (traced), beside the residual gradient.
            # A LayerNorm's (OPT's final_layer_norm after the residual add) makes its input's gradient only, its
            # saves alive through native_layer_norm_backward (traced).
            output_norm_transient=(0 if not output_norm else p.residual * spec.hidden_size * tokens
                                   if spec.norm == "layer" else 5 * FP32 * spec.hidden_size * tokens),
            # At that moment its rsqrt and normalised value are already freed; its fp32 input is not.
            output_norm_freed=(0 if spec.norm == "layer" else
                               int(_term_bytes(output_norm, "post_feedforward_norm", exclude=("input_fp32",)) * tokens)),
            attention_live=attention_live,
            input_projections_grad=p.compute * (projections // spec.hidden_size) * tokens,
            attention_transient=int((la.attention_backward
                                 + p.residual * spec.hidden_size * _norm_gradients_waiting(spec, la)) * tokens),
            attention_grads_pending=_param_bytes(projections + first_norm, gradients_of.gradient_bytes),
            recompute_end=_recompute_end(spec, la, p, settings, tokens)
            + (_lora_recompute_end(spec, la, p, settings, finetune) * tokens if finetune is not None else 0),
            adapter_moments=(() if finetune is None else
                                _adapter_recompute_moments(spec, la, p, tokens, finetune) if la.checkpointed else
                                _adapter_recompute_moments(spec, la, p, tokens, finetune, recompute=False)
                                if finetune.lora.dora else ()),
            recompute_attention_end=(kept + int((la.attention_bytes_per_token + la.recompute_locals) * tokens)
                                     + (p.compute * sum(t.numel for t in tensors if len(t.shape) == 2
                                                        and t.role not in MLP_ROLES) if p.autocast else 0)
                                     - shared_input if la.recompute_locals else 0),
            recompute_attention_saved=(
                int(la.recompute_saved * tokens) + (_layer_casts(spec, la, p)[0] if p.autocast and not cached else 0)
                if la.recompute_saved else
                _saved_before_attention(spec, la, p, tokens, shared_input) + int(la.recompute_kernel_saved * tokens)),
            recompute_gradient=int(_recompute_gradient(spec, layer, p, bool(output_norm),
                                                       _mlp_output_dropout(spec, layer, settings)) * tokens)
            + (int(_adapter_recompute_gradient(spec, la, p, finetune) * tokens) if finetune is not None else 0),
            norm_moment=_norm_moment(spec, la, p, gradients_of, tensors, tokens, attention_live),
            # (o_proj's backward has run: its input, the attention output, is freed)
            matmul_live=(attention_live + int(la.attention_released * tokens)
                         - p.compute * layer.attention.num_heads * layer.attention.v_head_dim * tokens
                         if la.matmul_backward else 0),
            matmul_transient=int((la.matmul_backward
                                 + p.residual * spec.hidden_size * _norm_gradients_waiting(spec, la)) * tokens),
            # The gradient reaching the MLP's output is the residual stream's own, unless a dropout (a new masked
            # copy), autocast (a half cast) or a norm on the layer's output (its input's gradient) sits between them.
            # Routed experts: the gradient of their outputs, in expert order (top-k x h), is what reaches them.
            down_transient=(_mlp_bytes(layer, p) * _mlp_width(layer) + p.residual * spec.hidden_size
                            + (layer.moe.top_k * p.experts * spec.hidden_size if layer.moe else
                               p.compute * spec.hidden_size if p.autocast or _mlp_output_dropout(spec, layer, settings)
                               or output_norm else 0)
                            # (Granite's scaled branch: its product's gradient, a tensor of its own; traced:
                            # mixed-fp16, eager, full checkpointing, 1 x 512, 1 MiB short at the backward peak)
                            + (_mlp_output_bytes(spec, layer, p) * spec.hidden_size
                               if spec.traits.residual_branches_scaled else 0)) * tokens
            + (_adapted_down_gradient(spec, la, p, finetune) * tokens if finetune is not None else 0)
            + _attention_gradient_waiting(spec, layer, p, tokens),
            freed_before_down=freed_before_mlp,
            returned_to_model=int(la.returned_to_model * tokens),
            compiled_copies=_compiled_gradient_copies(tensors, gradients_of) if settings.compile else 0,
            compiled_mlp=(_compiled_mlp_backward(spec, la, p, tokens, tensors, finetune)
                          if settings.compile and not recomputes else (0, 0)),
            down_forward=(_down_projection_forward(spec, la, p, tokens, _layer_casts(spec, la, p)[1] if cached else 0)
                          if recomputes and finetune is None and settings.checkpointing == "full"
                          else 0),
            gate_up_moments=(_gate_up_moments(spec, la, p, tokens, tensors, gradients_of)
                             if finetune is None and not settings.compile else ()),
            checkpointed=recomputes,
        )
        made[key] = item
        out.extend([item] * la.count)
    return out


MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
"""The modules of the MLP's Linears, as Terms name them (opsac.projection_order)."""


def _compiled_mlp_backward(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int,
                           tensors: list[ParamTensor], finetune: FineTune | None) -> tuple[int, int]:
    """A compiled layer's backward at its SiLU gradient (aot_eager_decomp_partition: the decomposed graph runs op by
    op and frees each saved tensor after its last use): the MLP's gate, up and product are freed; the decomposition
    upcasts the gate and the activation's gradient to fp32 and makes the sigmoid and a product of them in fp32
    (4 fp32 I-wide), beside the product's gradient, down_proj's weight gradient (a graph output until the layer's
    backward returns), the residual stream's gradient and its half copy (traced: scaled Llama, pure-bf16: within
    16 KiB of 1.23 MB of temporaries). Inductor fuses the fp32 chain into one kernel, so on a GPU this moment may
    hold less: the estimate stays on the traced (higher) side."""
    mlp = la.layer.mlp
    if mlp is None or not mlp.gated or mlp.fused_gate_up or la.layer.moe:
        return 0, 0
    c, i, h = p.compute, mlp.intermediate_size, spec.hidden_size
    down_grad = 0 if finetune is not None else c * _numel(tensors, *_DOWN_PROJECTIONS)
    upcast = 4 * FP32 * i if c != FP32 else 2 * FP32 * i
    # what the layer saved from gate_proj on (gate and up outputs; the product where down_proj keeps it)
    freed = sum(t.bytes_per_token for t in la.terms[_mlp_saves_start(la):])
    # an I-wide half gradient beside the fp32 chain where down_proj takes a gradient (full fine-tuning, or an
    # adapter on it); with a frozen down_proj the traced moment has none
    down_trained = finetune is None or bool(_adapted_down(spec, la, p, finetune))
    return int(freed * tokens), (upcast + c * i * down_trained + (p.residual + c) * h) * tokens + down_grad


def _compiled_gradient_copies(tensors: list[ParamTensor], gradients_of: Recipe) -> int:
    """A compiled layer's matrix gradients, counted twice at the end of its backward. AOTAutograd's decomposed
    backward returns each Linear's weight gradient as the transpose of an mm's output, whose strides are not the
    parameter's, so AccumulateGrad copies it into the parameter's layout (the gradient layout contract,
    accumulate_grad.h) instead of keeping it, and the graph's outputs are alive until every copy is made (traced
    with aot_eager_decomp_partition: Llama-3.2-1B and Mistral-7B, every Linear of the layer; vectors (norms) are
    kept as they are)."""
    return _param_bytes(sum(t.numel for t in tensors if len(t.shape) == 2), gradients_of.gradient_bytes)


def _interior_layers(layers: Sequence[_LayerBytes]) -> set[int]:
    """The layers whose backward moments can be left out of the walk without changing any phase's peak: layer k
    inside a stretch that repeats with period P (1, or 2 under selective checkpointing), layers[m] being
    layers[m + P] for every m from k - P to k. Along such a stretch each moment's bytes are the larger of two lines
    in the layer's position (what the layers below keep grows by one period's bytes per step, the finished
    gradients above shrink by as much), so a convex function of it: f(k) <= max(f(k - P), f(k + P)), with equality
    only where all three are equal, and then layer k + P's moment, which happens earlier, is the peak on the tie.
    By induction only a stretch's ends can hold a phase's peak (tests/test_timeline.py checks it against the
    every-layer walk)."""
    # (kept for the tuples a step model caches; a list made for one call is not worth holding)
    memo = _memo(layers) if isinstance(layers, tuple) else {}
    if "interior" in memo:
        return cast(set[int], memo["interior"])
    interior: set[int] = set()
    for period in (1, 2):
        for k in range(period, len(layers) - period):
            if all(layers[m] is layers[m + period] for m in range(k - period, k + 1)):
                interior.add(k)
    memo["interior"] = interior
    return interior


def _adapter_view(tensors: Iterable[ParamTensor], adapted: frozenset[str], rank: int,
                  dora: bool = False) -> list[ParamTensor]:
    """A layer's tensors as a LoRA step's gradients see them: each adapted Linear's weight (named in ``adapted``)
    stands for its adapter pair (rank x (in + out) elements, and with DoRA its magnitude, one per output feature),
    the rest take none."""
    from .models import ParamTensor

    return [ParamTensor(t.name, (rank * (t.shape[0] + t.shape[1]) + dora * t.shape[0],), t.role) for t in tensors
            if t.name.removesuffix(".weight") in adapted]


def _down_input_kept(la: LayerActivations, tokens: int) -> int:
    """Under LoRA, what the down projection's input leaves saved (its adapter's copy and A output), freed by its
    backward."""
    return int(sum(t.bytes_per_token for t in la.terms if t.module == "down_input") * tokens)


def tied_held_for(spec: ModelSpec, recipe: Recipe) -> int:
    """The LM head's V x h gradient contribution autograd holds through the backward for tied embeddings."""
    if not (spec.tied_embeddings and spec.has_architecture):
        return 0
    return _param_bytes(_role_numel(spec, "embedding"), _autograd_grad_bytes(recipe))


def _role_numel(spec: ModelSpec, role: str) -> int:
    """Elements of the model's tensors with ``role``, every repeat counted."""
    return sum(g.repeat * _numel(g.tensors, role) for g in spec.param_groups)


def _head_copy(acts: ActivationEstimate) -> int:
    """Autocast's half copy of the LM head weight: alive from the head's forward until its backward has run."""
    return int(_term_bytes(acts.constant_terms, "lm_head", "autocast_weight_copy"))


def _lm_head_moments(spec: ModelSpec, acts: ActivationEstimate, recipe: Recipe, p: Precision, weights: int,
                     states: int, grads_in_forward: int, saved: int, frozen: bool = False,
                     slices: int = 1, compiled_loss: bool = False) -> list[Phase]:
    """The LM head's backward, after the loss's: log_softmax's output is freed; the fp32 gradient of the logits is
    cast to the compute dtype (``logits.float()``'s backward); the head's matmuls make the gradient of its input
    (T x h) and of its weight (V x h, in the compute dtype) while the logits' gradient is alive; under autocast the
    weight's gradient is then cast to the fp32 parameter's dtype (the cast copy's backward), with the head's input
    released. A tied or accumulating weight gradient is a temporary until autograd adds it up; an untied first one
    becomes ``.grad``.

    With the head run on ``slices`` slices of the sequence (torchtune's chunked output), autograd runs every
    slice's loss backward first (they were recorded after all the head's matmuls, and it runs the latest-recorded
    ready node first), so all slices' logits gradients are alive when the head's matmuls start; then slice by
    slice the weight gradients are summed in autograd's input buffer (two V x h at once from the second slice on)
    and the input gradients wait in the split's buffer until the last one (traced)."""
    c, v, tokens = p.compute, spec.vocab_size, acts.tokens
    emb = spec.embedding_dim or spec.hidden_size
    # what the loss keeps per slice: log_softmax's fp32 output, or a compiled loss's half logits
    log_softmax = (c if compiled_loss else FP32) * v * tokens // slices
    after_logsoftmax = saved - log_softmax
    dlogits_half = c * v * tokens // slices if c != FP32 else 0
    moments = [Phase("backward", "logits gradient", weights, grads_in_forward, states, after_logsoftmax,
                     (0 if compiled_loss else log_softmax) + dlogits_half)]
    dlogits = dlogits_half or log_softmax
    # from here on every slice's log_softmax output is freed and every slice's logits gradient is waiting
    after_loss = saved - log_softmax * slices
    waiting = dlogits * slices
    d_input, d_weight = c * tokens * emb // slices, (0 if frozen else c * v * emb)
    param_bytes = recipe.weight_bytes
    held = spec.tied_embeddings or grads_in_forward > 0 or slices > 1
    cast = param_bytes != c
    moments.append(Phase("backward", "LM head weight gradient", weights,
                         grads_in_forward if held or cast else d_weight, states, after_loss,
                         waiting + d_input + (d_weight if held or cast else 0)))
    if slices > 1 and d_weight:
        moments.append(Phase("backward", "LM head weight gradient of the second slice", weights,
                             grads_in_forward, states, after_loss, waiting - dlogits + 2 * d_input + 2 * d_weight))
    if cast and not frozen:  # (a frozen head makes no weight gradient to cast)
        full = param_bytes * v * emb
        # by the cast, the head's matmuls have released their inputs: the head input and autocast's weight copy
        head_copy = _head_copy(acts)
        moments.append(Phase("backward", "LM head weight gradient cast to the parameter's dtype", weights,
                             grads_in_forward if held else full, states,
                             after_loss - d_input * slices - head_copy,
                             d_input * slices + d_weight + (full if held else 0)))
    return moments


def _head_reduce_scatter(spec: ModelSpec, acts: ActivationEstimate, p: Precision, weights: int, states: int,
                         grads_in_forward: int, saved: int, slices: int, compiled_loss: bool,
                         reduce_bytes: int) -> Phase:
    """FSDP2's post-backward of an LM head that is a group of its own (RankLayout.head_reduce_scatter_bytes): the
    head's matmuls have run (the loss's tensors and the head's input are freed; its input gradient waits for the
    final norm), the head is resharded, and its unsharded gradient is reduce-scattered: the reduce-scatter's input
    and output beside it (traced: FSDPMemTracker, a 2-layer Llama-3.2-1B on 4 fake ranks, mixed-bf16, 0.00%)."""
    c, v, tokens = p.compute, spec.vocab_size, acts.tokens
    emb = spec.embedding_dim or spec.hidden_size
    log_softmax = (c if compiled_loss else FP32) * v * tokens // slices
    head_input = int(_term_bytes(acts.head_terms, "head_input") * tokens)
    after_head = saved - log_softmax * slices - head_input
    return Phase("backward", "LM head gradient reduce-scatter", weights, grads_in_forward + c * v * emb, states,
                 after_head, c * tokens * emb + reduce_bytes)


@dataclass(frozen=True)
class _Static:
    """The step's static memory as every phase sees it."""

    weights: int
    grads: int
    states: int
    """Optimizer states and fp32 master weights."""
    grads_in_forward: int
    """Gradients alive during forward and backward before this micro-batch's own appear."""
    grads_between: int
    """Gradients alive between steps (after zero_grad)."""


def _static(static: dict[str, int], recipe: Recipe, settings: TrainingSettings,
            rank: RankLayout | None = None) -> _Static:
    grads = static["gradients"]
    # With gradient accumulation the gradients of earlier micro-batches are alive in every forward but the first;
    # a persistent fp32 main-grad buffer (Megatron) or DDP's bucket views are alive all the time.
    persistent = recipe.persistent_gradients or bool(rank and rank.persistent_gradients)
    accumulated = grads
    if rank is not None and rank.accumulated_gradients is not None:  # (FSDP1's no_sync: the unsharded ones)
        accumulated = rank.accumulated_gradients
    return _Static(static["weights"], grads, static["optimizer_states"] + static["master_weights"],
                   accumulated if settings.grad_accum > 1 or persistent else 0, grads if persistent else 0)


def _outer_phases(spec: ModelSpec, st: _Static, recipe: Recipe, optimizer: Optimizer,
                  settings: TrainingSettings, rank: RankLayout | None = None,
                  finetune: FineTune | None = None) -> tuple[Phase, Phase, Phase]:
    """load, optimizer and between_steps: the phases outside forward and backward, the same whatever models the
    activations."""
    if settings.optimizer_in_backward:  # the steps ran in backward: nothing is left for step()
        return (Phase("load", "static state", st.weights, st.grads_between, st.states, 0, 0),
                Phase("optimizer", "step() (done in backward)", st.weights, 0, st.states, 0, 0),
                Phase("between_steps", "after zero_grad", st.weights, st.grads_between, st.states, 0, 0))
    temp = _optimizer_temporaries(spec, recipe, optimizer, settings.fused_optimizer, rank, finetune)
    return (Phase("load", "static state", st.weights, st.grads_between, st.states, 0, 0),
            Phase("optimizer", "step()", st.weights, st.grads, st.states, 0, temp),
            Phase("between_steps", "after zero_grad", st.weights, st.grads_between, st.states, 0, 0))


def forward_floor(static: dict[str, int], acts: ActivationEstimate, recipe: Recipe, settings: TrainingSettings,
                  rank: RankLayout | None = None) -> int:
    """Bytes allocated at forward's moment "at the loss" (step_candidates) less what only some set-ups add there
    (the KV cache, autocast's cached casts and held hidden states, the engine's buffers): a lower bound of the
    step's peak, which a search compares with the GPU before it builds the timeline."""
    st = _static(static, recipe, settings, rank)
    return (st.weights + st.grads_in_forward + st.states + acts.saved_bytes + acts.logits_bytes
            + acts.loss_transient_bytes)


def final_hidden_bytes(spec: ModelSpec, p: Precision, tokens: int, settings: TrainingSettings,
                       finetune: FineTune | None, has_layers: bool) -> int:
    """The base model's output (the final norm's) the CausalLM forward holds while it computes the logits and the
    loss, where nothing saves that tensor: forward's moment at the loss (step_candidates; diff.py owns it to the
    final norm)."""
    if settings.loss == "chunked-output":
        return 0  # torchtune's decoder returns the list of logits: its hidden-state local is gone
    return held_hidden_bytes(spec, p, tokens, finetune, has_layers)


def held_hidden_bytes(spec: ModelSpec, p: Precision, tokens: int, finetune: FineTune | None,
                      has_layers: bool) -> int:
    """The final norm's output while the LM head runs, where the head does not save it: a local of the CausalLM
    forward (of torchtune's decoder while its chunked output makes the slices' logits)."""
    # Under autocast that fp32 tensor is not what the LM head saves (its bf16 copy), so it is extra.
    # (OPT's project_out makes the output a half tensor the head keeps)
    if finetune is not None and has_layers and "head" not in finetune.lora.trained_roles:
        # A frozen LM head keeps no input, but the CausalLM forward holds the final norm's output (its local)
        # while it computes the logits and the loss (a trained head saves that tensor: it is in saved), in the
        # residual stream's dtype (fp32 under autocast: the norm returns its input's dtype; traced).
        return p.residual * spec.hidden_size * tokens
    return (p.residual * spec.hidden_size * tokens if p.autocast and p.residual == FP32 and has_layers
            and not spec.projects_embeddings and spec.has_head else 0)


def gathers_before_first_layer(rank: RankLayout | None) -> bool:
    """Whether the step's first forward moment is before the first decoder layer: a sharded engine gathering that
    layer while the root's gather buffer is still alive (FSDP2's "forward:start" buffers). step_candidates puts that
    moment first among the forward moments; replay.step_sequence walks it before the layers."""
    return bool(rank and any("forward:start" in b.phases for b in rank.buffers))


def step_candidates(spec: ModelSpec, static: dict[str, int], acts: ActivationEstimate, recipe: Recipe,
                    optimizer: Optimizer, settings: TrainingSettings,
                    rank: RankLayout | None = None, finetune: FineTune | None = None,
                    every_layer: bool = False, layers: tuple[_LayerBytes, ...] | list[_LayerBytes] | None = None,
                    peaks_only: bool = False) -> tuple[tuple[Phase, ...], ...]:
    """Every moment that can be a phase's peak, per phase (load, forward, backward, optimizer, between_steps), in
    the order they happen. Each moment's bytes are linear in the batch for a fixed sequence length (stepmodel.py
    relies on it). ``rank``: one GPU of a data-parallel engine (sharding.py): ``static`` is then that rank's, the
    gradients of the layers backward has finished are reduce-scattered to its shard, and the engine's buffers are
    added in the phases they exist in.

    Of a stretch of alike layers, backward's moments in its end layers only, unless ``every_layer``
    (_interior_layers: the same peaks, several times faster for deep models). ``layers``: expanded_layers' answer
    for these arguments, where the caller has it. ``peaks_only``: where an engine's buffers are added, each phase
    reduced to its peak moment (with_buffers)."""
    shards = rank.gradient_shards if rank else 1
    # a finished gradient shard's bytes per element, over the recipe's (FSDP2 casts shards to the masters' dtype)
    shard_scale = (rank.gradient_shard_bytes or recipe.gradient_bytes) / recipe.gradient_bytes if rank else 1

    offloaded = bool(rank and rank.gradients_offloaded)

    def finished_shard(x: _LayerBytes) -> int:
        """A layer's gradients once its backward is done: this rank's reduce-scattered shard of them (none on the
        GPU where FSDP2's CPU offload has copied it to the host: sharding.RankLayout.gradients_offloaded)."""
        if offloaded:
            return 0
        if rank is not None and rank.gradient_shard_of is not None:
            part, whole = rank.gradient_shard_of
            return -(-x.grads * part // whole)
        return -(-x.grads // shards) if shard_scale == 1 else -(-int(x.grads * shard_scale) // shards)

    st = _static(static, recipe, settings, rank)
    weights, grads, states, grads_in_forward = st.weights, st.grads, st.states, st.grads_in_forward
    p = Precision.of(recipe)
    # (a pipeline stage before the last has no head: nothing vocabulary-wide, modelparallel.py)
    tokens, v, h = acts.tokens, spec.vocab_size if spec.has_head else 0, spec.hidden_size
    # The LM head's autocast weight copy exists from the head's forward until its backward has run.
    head_copy = _head_copy(acts)

    # Forward: the peak is at the loss, when the logits, their fp32 upcast and log_softmax's output coexist
    # (all created in forward, so counted as activations). With full checkpointing it can instead be inside the
    # last layer's forward, where that layer's activations exist until it returns.
    saved = acts.saved_bytes
    if layers is None:  # (else expanded_layers' answer for these arguments, shared by steps that differ in rank)
        layers = expanded_layers(spec, acts, recipe, settings, finetune)
    stepped = settings.optimizer_in_backward
    if stepped:
        # Each parameter is stepped, and its gradient freed, as soon as backward has made it: no gradient of a
        # finished layer (or of the LM head) waits for the others.
        from dataclasses import replace as replaced

        stepped_layers: dict[int, _LayerBytes] = {}  # (alike layers stay one object: _interior_layers)
        for x in layers:
            if id(x) not in stepped_layers:
                stepped_layers[id(x)] = replaced(x, grads=0, down_grad=0, attention_grads_pending=0,
                                                 experts_weighting_grads=0,
                                                 norm_moment=(x.norm_moment[0], 0, x.norm_moment[2]))
        layers = [stepped_layers[id(x)] for x in layers]
    # (under selective checkpointing: whether the last layer is one of the checkpointed ones)
    checkpointed = bool(layers) and layers[-1].checkpointed
    cached = checkpointed and casts_cached(spec, p, settings) and finetune is None
    cast_cache = sum(la.constant_bytes * la.count for la in acts.layers) if cached else 0
    if finetune is not None and p.autocast:
        # autocast's cache keeps the checkpointed layers' adapter half copies through forward (the others are
        # saved by their matmuls: in their layers' constant bytes)
        from .lora import adapter_half_copies

        cast_cache = sum(adapter_half_copies(spec, la.layer, finetune.lora, p) * la.count for la in acts.layers
                         if la.checkpointed)
    final_hidden = final_hidden_bytes(spec, p, tokens, settings, finetune, bool(layers))
    head_trained = finetune is not None and "head" in finetune.lora.trained_roles
    embedding_trained = finetune is not None and "embedding" in finetune.lora.trained_roles
    candidates_fw = [Phase("forward", "at the loss", weights, grads_in_forward, states,
                           saved + acts.logits_bytes + acts.loss_transient_bytes + acts.kv_cache_bytes + cast_cache
                           + final_hidden, 0)]
    # Through the layer loop the token embeddings kept as a leaf under LoRA's checkpointing are the base model's
    # inputs_embeds local, one tensor (lora.lora_activations)
    leaf = (int(sum(t.bytes_per_token for t in acts.embedding_terms if t.kind == "leaf") * tokens)
            if acts.decoder_locals_bytes and not spec.projects_embeddings else 0)
    if checkpointed:
        # (the LM head's autocast weight copy is made when the head runs, after the layers)
        # (the last layer's weight casts are counted in its forward_transient, as far as it has made them)
        kept_before_last = acts.embedding_bytes + acts.constant_bytes - head_copy \
            + (cast_cache - acts.layers[-1].constant_bytes if cached else 0) + sum(x.kept for x in layers[:-1]) \
            + acts.decoder_locals_bytes - leaf \
            + (cast_cache if finetune is not None else 0)  # (the adapters' cached half copies, the last layer's too)
        # Falcon and BLOOM: the previous layer's returned probabilities, held by the base model's loop variable.
        returned = layers[-2].returned_to_model if len(layers) > 1 else 0
        for transient in layers[-1].forward_transient:
            candidates_fw.append(Phase("forward", "inside the last layer", weights, grads_in_forward, states,
                                       kept_before_last + acts.mask_bytes + transient + returned, 0))
        if layers[-1].down_forward:
            candidates_fw.append(Phase("forward", "the last layer's down projection", weights, grads_in_forward,
                                       states, kept_before_last + acts.mask_bytes + layers[-1].down_forward + returned,
                                       0))
    elif layers:
        # The last layer's down projection: everything the layers saved, the masks they shared and the KV cache
        # are alive, and its output is being written (a large attention mask or cache can put the peak here).
        # (the LM head's autocast weight copy is made when the head runs, after the layers)
        layers_saved = (acts.embedding_bytes + acts.constant_bytes - head_copy + sum(x.kept for x in layers)
                        + acts.decoder_locals_bytes - leaf)
        last = acts.layers[-1]
        if last.softmax_extra:
            # Eager and math attention: the last layer's softmax, with its s x s input (and an fp32 upcast) beside
            # what is saved, before the MLP block and the attention's later tensors exist.
            mlp_part = (last.bytes_per_token - last.attention_bytes_per_token) * tokens
            # (of its weights' autocast copies only the attention's input projections' are made by then; traced:
            # Falcon, amp-bf16, math kernel, 1 x 1,000, +1.8% at the forward peak with all of them)
            later_casts = 0 if layers[-1].checkpointed else last.constant_bytes - last.attention_input_casts
            before = layers_saved - int(mlp_part + last.after_softmax * tokens) - later_casts
            # The last layer's input and the embedding's output (LlamaModel.forward's ``inputs_embeds``) are held
            # by the forward's locals; where the first module reading them keeps a copy instead, they are tensors of
            # their own beside what is saved (traced at the softmax: Llama in half precision, Cohere in any).
            held = (min(2, spec.num_layers) * p.residual * h * tokens // spec.sequence_shards
                    if not _layer_input_saved(spec, p) and finetune is None and spec.traits.block == "standard"
                    and spec.has_embedding else 0)
            candidates_fw.append(Phase("forward", "last layer's attention softmax", weights, grads_in_forward,
                                       states, before + acts.kv_cache_bytes + acts.mask_bytes + held
                                       + int(last.softmax_extra * tokens), 0))
            if last.math_return_extra:
                candidates_fw.append(Phase(
                    "forward", "last layer's attention kernel return", weights, grads_in_forward, states,
                    before + acts.kv_cache_bytes + acts.mask_bytes + held
                    + int((last.after_softmax + last.math_return_extra) * tokens), 0))
        returned = int(acts.layers[-1].returned_extra * tokens)
        # everything alive beside the last layer's MLP: what the layers saved, the cache, the masks and the
        # attention weights the layer holds until it returns
        beside_last_mlp = layers_saved + acts.kv_cache_bytes + acts.mask_bytes + returned
        at_down_projection = p.compute * h + _down_projection_locals(spec, last, p)
        candidates_fw.append(Phase("forward", "last layer's MLP output", weights, grads_in_forward, states,
                                   beside_last_mlp + at_down_projection * tokens, 0))
        if _mlp_output_dropout(spec, last.layer, settings) and last.layer.mlp is not None:
            # The dropout on the last layer's MLP output: its input, the down projection's output, is alive while
            # it writes the dropped copy (it keeps only its mask). Where the MLP module itself drops out
            # (Starcoder2MLP, GPT2MLP), under autocast so is the MLP norm's fp32 output, which the decoder layer's
            # ``hidden_states`` holds until the MLP returns (its Linear keeps a half cast; StableLM's inline
            # ``self.mlp(self.post_attention_layernorm(residual))`` has freed it). Traced: StarCoder2, amp-bf16,
            # eager, dropout 0.1, 4 x 1,024: -1.45% at the forward peak without it and StarCoder2's undropped
            # embeddings (FamilyTraits.decoder_locals), 1.5 kB and 1 kB per token.
            norm_held = p.residual * h // spec.sequence_shards if (
                p.autocast and spec.traits.mlp_applies_dropout and not last.layer.parallel_residual) else 0
            dropped = _mlp_output_bytes(spec, last.layer, p) * h
            candidates_fw.append(Phase("forward", "last layer's MLP output dropout", weights, grads_in_forward,
                                       states, beside_last_mlp + (at_down_projection + dropped + norm_held) * tokens,
                                       0))
        moe = last.layer.moe
        if moe is not None and moe.gate == "clamped_swiglu":
            # GptOssExperts._apply_gate's product in the last layer: what _moe_recompute_end counts at it (the
            # gathered biases and the clamped up beside what is saved; the down projection's output and inv_perm
            # not made yet), with the routing locals and, under autocast, the MLP's fp32 argument (traced: fp32,
            # 1 x 1,024, -2.5% at the forward peak without this moment)
            at_product = _clamped_swiglu_at_product(moe, p, h)
            argument = p.residual * h if p.autocast else 0
            candidates_fw.append(Phase("forward", "last layer's experts' clamped SwiGLU", weights, grads_in_forward,
                                       states, beside_last_mlp
                                       + int((at_product + _routing_locals(moe, p) + argument) * tokens), 0))
        if spec.traits.block == "standard":
            candidates_fw.append(Phase("forward", "last layer's residual sum", weights, grads_in_forward, states,
                                       beside_last_mlp + _residual_sum_locals(spec, last.layer, p) * tokens, 0))
        # DoRA: each adapted Linear's weight norm and output products in the last layer, beside everything saved
        # before it and its input (_dora_site)
        before_last = layers_saved - layers[-1].kept + p.residual * h * tokens + acts.kv_cache_bytes + acts.mask_bytes
        for held, transient in layers[-1].adapter_moments:
            candidates_fw.append(Phase("forward", "last layer's DoRA adapter", weights, grads_in_forward, states,
                                       before_last + held + transient, 0))
        if settings.compile and layers[-1].compiled_mlp[1] and p.compute != FP32:
            # The compiled layer's SiLU, decomposed (aot_eager_decomp_partition): the gate upcast to fp32 and two
            # fp32 steps of its sigmoid at once, before up and the product exist (traced: a scaled Qwen2, where
            # this is the forward's peak; inductor fuses the chain, so on a GPU it may hold less)
            # Not made yet: up's output, and the product where down_proj keeps it; held though not kept: the MLP's
            # input, where frozen gate and up projections keep nothing (LoRA)
            mlp = last.layer.dense_mlp
            not_yet: float = (1 + any(t.module == "down_input" for t in last.terms)) * p.compute \
                * mlp.intermediate_size
            held = 0 if any(t.module == "mlp_input" for t in last.terms) else p.compute * h
            if last.checkpointed:
                # inside a checkpoint (compiled_checkpoint_terms): beside what it keeps, the residual after
                # attention and the MLP's input, which its forward graph still reads (the gate's half output, where
                # not kept, is freed by its upcast)
                # (a kept up output is not made yet: up_proj runs after the SiLU)
                not_yet = sum(t.bytes_per_token for t in last.checkpoint_terms if t.module == "up_proj")
                held = (p.residual + p.compute) * h
            candidates_fw.append(Phase(
                "forward", "last layer's compiled SiLU", weights, grads_in_forward, states,
                layers_saved + acts.kv_cache_bytes + acts.mask_bytes
                + int((3 * FP32 * mlp.intermediate_size - not_yet + held) * tokens), 0))
    if (layers and spec.has_head and spec.final_norm and spec.norm == "rms" and not spec.traits.rms_norm_fp32_plus_one
            and not spec.projects_embeddings and finetune is None):
        # The final RMSNorm's forward (LlamaRMSNorm): beside what everything before it saved and what it keeps, the
        # last layer's output (its input, held by the base model's variable; under autocast it is the fp32 input it
        # keeps) and its fp32 normalised product (a local until it returns), while it writes its output. Wins over
        # the loss where the vocabulary is small against the hidden size (a tensor-parallel rank's V / T; traced).
        head_part = acts.head_bytes - int(_term_bytes(acts.head_terms, "final_norm") * tokens) \
            - int(_term_bytes(acts.head_terms, "head_input") * tokens)
        # In half precision the embedding's output is a tensor of its own too (the first norm keeps an fp32 copy),
        # held by LlamaModel.forward's ``inputs_embeds`` until it returns.
        # (with sequence parallelism the norm and the residual stream hold 1/T of the tokens)
        local = tokens // spec.sequence_shards
        layer_output = 2 * p.residual * h * local if p.residual != FP32 else 0
        candidates_fw.append(Phase("forward", "final norm", weights, grads_in_forward, states,
                                   saved - head_part - head_copy + acts.kv_cache_bytes + cast_cache
                                   + acts.decoder_locals_bytes + layer_output + FP32 * h * local, 0))
    if settings.loss == "chunked-output" and spec.has_head and layers:
        # torchtune's chunked output has made every slice's logits and no loss has run yet: the loss's saved
        # tensors do not exist, the logits do, and so does the final norm's output (a local of the decoder's
        # forward) where the head does not save it
        loss_saved = int(sum(t.bytes_per_token for t in acts.head_terms if t.owner == OwnerKind.LOSS) * tokens)
        candidates_fw.append(Phase("forward", "LM head's last slice", weights, grads_in_forward, states,
                                   saved - loss_saved + p.compute * v * tokens + acts.kv_cache_bytes + cast_cache
                                   + held_hidden_bytes(spec, p, tokens, finetune, bool(layers)), 0))
    candidates_fw.append(candidates_fw.pop(0))  # the loss comes last: on a tie the earlier moment is the peak
    starts = int(gathers_before_first_layer(rank))
    if starts:
        # A sharded engine gathering the first layer while the root's gather buffer is still alive (FSDP2): only
        # the embedding's saved tensors and its output exist yet.
        candidates_fw.insert(0, Phase("forward", "the first layer's all-gather", weights, grads_in_forward, states,
                                      acts.embedding_bytes + acts.constant_bytes - head_copy + p.residual * h * tokens,
                                      0))

    # Backward start: nll_loss's gradient and log_softmax's gradient (both fp32, V wide) beside everything saved.
    # The logits themselves are gone by then: log_softmax keeps its output, not its input, and a training loop
    # that keeps only the loss (HF Trainer's compute_loss, `loss = model(...).loss`) drops the output object.
    slices = OUTPUT_CHUNKS if settings.loss == "chunked-output" else 1
    loss_grads = 0 if settings.loss == "chunked" else 2 * FP32 * v * tokens // slices
    if spec.vocab_shards > 1 and settings.loss == "standard":
        loss_grads += FP32 * v * tokens  # loss_parallel's backward recomputes the softmax beside both (traced)
    compiled_loss = settings.loss == "chunked-output" and settings.compile
    if compiled_loss:  # inductor's fused backward: the slice's logits gradient and one fp32 value per row
        loss_grads = compiled_loss_backward_bytes(tokens // slices, v, p.compute)
    head_grad = _param_bytes(_role_numel(spec, "head"), recipe.gradient_bytes) if not spec.tied_embeddings else 0
    if finetune is not None or stepped:
        head_grad = 0  # a frozen LM head (an adapter on it is not modelled), or one stepped at once
    if head_trained and not stepped:  # peft's trained copy of the head, in the base's dtype
        from .lora import trained_copies

        assert finetune is not None  # (head_trained)
        head_grad = trained_copies(spec, finetune.lora)["head"] * recipe.weight_bytes
    if rank and rank.head_gradient_sharded:
        head_grad = -(-head_grad // shards)
    candidates = [Phase("backward", "loss gradients", weights, grads_in_forward, states, saved, loss_grads,
                        at=Owner(OwnerKind.LOSS))]
    # the moments from the LM head's matmuls on (after the loss's and the logits' gradients)
    head_matmuls = len(candidates) + 1
    if settings.loss != "chunked" and spec.has_head:
        candidates += _lm_head_moments(spec, acts, recipe, p, weights, states, grads_in_forward, saved,
                                       frozen=finetune is not None and not head_trained, slices=slices,
                                       compiled_loss=compiled_loss)
    head_end = len(candidates)
    if rank and rank.head_reduce_scatter_bytes and spec.has_head:
        candidates.append(_head_reduce_scatter(spec, acts, p, weights, states, grads_in_forward, saved, slices,
                                               compiled_loss, rank.head_reduce_scatter_bytes))
    if layers and spec.final_norm_runs and spec.has_head:
        # The final norm's backward, right after the head's: what the head kept is freed; an RMSNorm computed in
        # fp32 (LlamaRMSNorm and kin) has five h-wide fp32 gradient temporaries at once (traced), a LayerNorm the
        # gradients of its input and output. Wins for narrow MLPs and small vocabularies.
        # (the RMSNorm's weight product, which kept the normalised value, has already run its backward)
        final_norm_terms = _term_bytes(acts.head_terms, "final_norm", exclude=("normalised",))
        at_norm = saved - acts.head_bytes + int(final_norm_terms * tokens) - head_copy
        norm_temps = (5 * FP32 if spec.norm == "rms" else 2 * p.residual) * h * (tokens // spec.sequence_shards)
        candidates.append(Phase("backward", "final norm", weights, max(grads_in_forward, head_grad), states,
                                at_norm, norm_temps + (tied_held_for(spec, recipe) if finetune is None else 0)))
    # Then layer by layer, last to first. Each layer's worst moment is its MLP backward: down_proj's backward has
    # run (its input, the product, is freed; its weight gradient exists), the rest of the layer's activations
    # (recomputed, under full checkpointing) are alive, and the MLP's input gradients are being computed.
    # Layers below still hold what they keep; layers above have freed theirs and produced their gradients.
    # Once the LM head's backward has run, its autocast weight copy is gone.
    base_kept = acts.embedding_bytes + acts.constant_bytes - head_copy
    # Tied embeddings: autograd sums the LM head's and the embedding's gradient contributions before accumulating
    # into .grad, so the head's V x h contribution is held as a temporary through the whole layer backward.
    tied_held = tied_held_for(spec, recipe) if finetune is None else 0
    kept_below = [0]
    for x in layers:
        kept_below.append(kept_below[-1] + x.kept)
    # (the masks kept for the recompute die with the lowest checkpoint that keeps each: activations' constants)
    masks_freed = recompute_masks_freed(spec, settings, p, tuple((la.layer, la.checkpointed) for la in acts.layers
                                                                 for _ in range(la.count)))
    if len(masks_freed) != len(layers) + 1:
        masks_freed = (0,) * (len(layers) + 1)
    grads_above = 0
    first_layer_moment = len(candidates)
    interior = set() if every_layer else _interior_layers(layers)
    # FSDP1 with the adapters wrapped apart all-gathers the layer below while this one's input projections and input
    # norm run their backward (fsdp1._gather_buffers): a moment of its own there, only where such a buffer exists,
    # so that no other step changes (backward's "handoff" place)
    handoffs: list[int] = []
    at_handoff = rank is not None and any("backward:handoff" in b.phases for b in rank.buffers)
    # An input norm's backward in flight, at a layer's last moments: an RMSNorm computed in fp32 holds three h-wide
    # fp32 tensors and one in the residual's dtype (traced on gloo ranks, tests/fsdp1_ranks.py)
    in_norm = (3 * FP32 + p.residual) * h * tokens if spec.norm == "rms" else 0
    for index in range(len(layers) - 1, -1, -1):
        x = layers[index]
        start = len(candidates)
        base = base_kept - masks_freed[index]
        if index in interior:  # (its moments are never a phase's first peak: _interior_layers)
            grads_above += finished_shard(x)
            continue
        live_acts = base + kept_below[index] + (x.kept + x.full if x.checkpointed else x.full)
        # In the order they happen: on a tie the earlier moment is the peak, as a peak counter sees it.
        if x.checkpointed:
            if x.recompute_attention_end:
                candidates.append(Phase(
                    "backward", f"layer {index} recomputed attention's end", weights,
                    max(grads_in_forward, head_grad + grads_above), states,
                    base + kept_below[index] + x.recompute_attention_end, tied_held + x.recompute_gradient))
            # The recompute runs the layer's forward again (torch/utils/checkpoint.py, _checkpoint_hook's
            # recompute_fn) beside the gradient of its output: its locals reach at least the checkpointed forward's
            # worst moments (what it saves only adds). Falcon's eager ALiBi attention (modeling_falcon.py,
            # FalconAttention.forward: the fp32 scores, logits and softmax input, three s x s locals) holds more
            # there than the layer saves (traced: -52% at the backward peak without this moment).
            for moment, transient in enumerate(x.forward_transient):
                saved_by_then = x.recompute_attention_saved if moment == 1 else 0  # (_forward_transient's order)
                candidates.append(Phase(
                    "backward", f"layer {index} recomputing", weights, max(grads_in_forward, head_grad + grads_above),
                    states, base + kept_below[index] + transient + saved_by_then, tied_held + x.recompute_gradient))
            # The layer's forward has been recomputed (to its last saved tensor) and the gradient of its output
            # is waiting.
            for held, transient in x.adapter_moments:  # (what a recompute makes counts as activations)
                candidates.append(Phase(
                    "backward", f"layer {index} recomputed adapter", weights,
                    max(grads_in_forward, head_grad + grads_above), states,
                    base + kept_below[index] + x.kept + held + transient, tied_held + x.recompute_gradient))
            candidates.append(Phase(
                "backward", f"layer {index} recomputed", weights, max(grads_in_forward, head_grad + grads_above),
                states, base + kept_below[index] + x.kept + x.full + x.recompute_end,
                tied_held + x.recompute_gradient))
        if x.output_norm_transient:
            candidates.append(Phase(
                "backward", f"layer {index} output norm", weights, max(grads_in_forward, head_grad + grads_above),
                states, live_acts - x.output_norm_freed, tied_held + p.residual * h * tokens + x.output_norm_transient))
        if x.experts_weighting_transient:
            candidates.append(Phase(
                "backward", f"layer {index} experts' router weighting", weights,
                max(grads_in_forward, head_grad + grads_above + x.experts_weighting_grads), states,
                live_acts - x.experts_weighting_freed,
                x.experts_weighting_transient + tied_held))
        # The down projection's own backward, with its input still held and the gradients of its output and input
        # alive (the larger moment for a plain two-Linear MLP).
        candidates.append(Phase(
            "backward", f"layer {index} down projection", weights,
            max(grads_in_forward, head_grad + grads_above), states,
            live_acts - x.freed_before_down, x.down_transient + x.down_weight_gradient + tied_held))
        if x.down_gradient_cast[1]:
            freed, transient = x.down_gradient_cast
            candidates.append(Phase(
                "backward", f"layer {index} down projection's weight gradient cast", weights,
                max(grads_in_forward, head_grad + grads_above), states,
                live_acts - x.freed_before_down - freed, transient + tied_held))
        candidates.append(Phase(
            "backward", f"layer {index} MLP", weights,
            max(grads_in_forward, head_grad + grads_above + x.down_grad), states,
            live_acts - x.product + x.activation_reads, x.transient + tied_held))
        for label, freed, transient, accumulated in x.gate_up_moments:
            candidates.append(Phase(
                "backward", f"layer {index} {label}", weights,
                max(grads_in_forward, head_grad + grads_above + x.down_grad + accumulated), states,
                live_acts - freed, transient + tied_held))
        if x.compiled_mlp[1]:
            freed, transient = x.compiled_mlp
            candidates.append(Phase(
                "backward", f"layer {index} compiled MLP backward", weights,
                max(grads_in_forward, head_grad + grads_above), states, live_acts - freed, transient + tied_held))
        if x.experts_transient:
            candidates.append(Phase(
                "backward", f"layer {index} experts' gate_up", weights,
                max(grads_in_forward, head_grad + grads_above + x.down_grad), states,
                live_acts - x.experts_freed, x.experts_transient + tied_held))
        if x.norm_moment[0]:
            live, mlp_grads, temps = x.norm_moment
            candidates.append(Phase(
                "backward", f"layer {index} post-attention norm", weights,
                max(grads_in_forward, head_grad + grads_above + mlp_grads), states,
                base + kept_below[index] + live, temps + tied_held))
        if x.matmul_live:
            candidates.append(Phase(
                "backward", f"layer {index} attention's product with v", weights,
                max(grads_in_forward, head_grad + grads_above + x.grads - x.attention_grads_pending), states,
                base + kept_below[index] + x.matmul_live, x.matmul_transient + tied_held))
        candidates.append(Phase(
            "backward", f"layer {index} attention", weights,
            max(grads_in_forward, head_grad + grads_above + x.grads - x.attention_grads_pending), states,
            base + kept_below[index] + x.attention_live, x.attention_transient + tied_held))
        if x.compiled_copies and shards == 1 and not stepped:
            # AccumulateGrad's copies of the compiled backward's gradients, beside the originals, the layer's
            # activations freed, its input's gradient alive (_compiled_gradient_copies)
            candidates.append(Phase(
                "backward", f"layer {index} gradients copied (compiled)", weights,
                max(grads_in_forward, head_grad + grads_above + x.grads + x.compiled_copies), states,
                base + kept_below[index], p.residual * h * tokens + tied_held))
        if rank is not None and rank.flat_gradient is not None:
            # FSDP1: the layer's last moment, the split's backward concatenating its views' gradients (the frozen
            # ones too under use_orig_params) into the unit's flat gradient, before they are freed and it is
            # accumulated or reduce-scattered (fsdp1.py); its activations are gone, its input's gradient alive
            # (its input norm's backward is in flight: ``in_norm``, beside the input's gradient)
            views, flat = rank.flat_gradient
            candidates.append(Phase(
                "backward", f"layer {index} flat gradient (FSDP1)", weights,
                max(grads_in_forward, head_grad + grads_above) + x.grads + views, states,
                base + kept_below[index], p.residual * h * tokens + in_norm + flat + tied_held))
        if at_handoff and index > 0:
            # its q, k, v outputs' gradients and the input norm's temporaries beside the residual stream's gradient
            # and the normed input's (measured on gloo ranks)
            handoffs.append(len(candidates))
            candidates.append(Phase(
                "backward", f"layer {index} input projections and norm", weights,
                max(grads_in_forward, head_grad + grads_above + x.grads - x.attention_grads_pending), states,
                base + kept_below[index], x.input_projections_grad + 2 * p.residual * h * tokens + in_norm
                + tied_held))
        candidates[start:] = [replace(c, at=Owner(OwnerKind.LAYER, index)) for c in candidates[start:]]
        grads_above += finished_shard(x)
    # The embedding's backward, last: every other gradient is done, the gradient of the embedding output (w x h
    # per token) is alive and embedding_dense_backward creates the V x h weight gradient. With tied weights that
    # contribution exists beside the held LM-head one, into which the autograd engine then adds it in place
    # (input_buffer.cpp; the trace does the same, see trace._gradient_sum). Only a large vocabulary with
    # small activations (checkpointing, short sequences) makes this the peak, e.g. Llama-3-8B (traced).
    layer_moments = range(first_layer_moment, len(candidates))
    emb_input_grad = p.residual * h * (tokens // spec.sequence_shards) if layers else 0
    if tied_held:
        # (on a rank, the finished gradients are the reduced shards of the head and the layers)
        finished = 0 if stepped else grads - tied_held if shards == 1 else head_grad + grads_above
        candidates.append(Phase("backward", "embedding (tied weights)", weights,
                                max(grads_in_forward, finished), states,
                                base_kept - acts.embedding_bytes + acts.embedding_lookup_bytes - masks_freed[-1],
                                2 * tied_held + emb_input_grad, at=Owner(OwnerKind.EMBEDDING)))
    elif layers and (finetune is None or embedding_trained):  # (a frozen embedding runs no backward)
        emb_grad = _param_bytes(_role_numel(spec, "embedding"), _autograd_grad_bytes(recipe))
        if embedding_trained:  # peft's trained copy, in the base's dtype
            from .lora import trained_copies

            assert finetune is not None  # (embedding_trained)
            emb_grad = trained_copies(spec, finetune.lora)["embedding"] * recipe.weight_bytes
        finished = 0 if stepped else grads - emb_grad if shards == 1 else head_grad + grads_above
        candidates.append(Phase("backward", "embedding", weights, max(grads_in_forward, finished), states,
                                acts.embedding_lookup_bytes, emb_grad + emb_input_grad, at=Owner(OwnerKind.EMBEDDING)))
        if rank is not None and rank.root_flat_gradient:
            # FSDP1: the root unit's split backward, last: its views' gradients (the embedding's, the head's, the
            # final norm's) and their concatenation (fsdp1.py)
            candidates.append(Phase("backward", "root flat gradient (FSDP1)", weights,
                                    max(grads_in_forward, finished) + emb_grad, states, 0,
                                    rank.root_flat_gradient))
    load, opt, between = _outer_phases(spec, st, recipe, optimizer, settings, rank, finetune)
    phases = (load,), tuple(candidates_fw), tuple(candidates), (opt,), (between,)
    buffers = rank.buffers if rank else ()
    if finetune is not None:
        buffers += finetune.buffers(spec, p)
    if not buffers:
        return phases
    # Where each moment is: inside a decoder layer (all of forward's but the loss, which is last and after the LM
    # head; backward's layer walk), before the layers (backward's loss and LM head moments) or after them (the
    # embedding's backward).
    places: tuple[dict[str, Sequence[int]], ...] = (
              {}, {"start": range(starts), "layer": range(starts, len(candidates_fw) - 1),
                   "head": range(len(candidates_fw) - 1, len(candidates_fw))},
              {"head": range(first_layer_moment), "layer": layer_moments,
               "loss": range(min(head_matmuls, first_layer_moment)),
               "lmhead": range(min(head_matmuls, head_end), head_end),
               "prefetch": range(min(head_matmuls, first_layer_moment), first_layer_moment),
               "handoff": tuple(handoffs), "end": range(layer_moments.stop, len(candidates))}, {}, {})
    return with_buffers(phases, buffers, places, peaks_only)


def with_buffers(phases: tuple[tuple[Phase, ...], ...], buffers: tuple[Buffer, ...],
                 places: tuple[Mapping[str, Sequence[int]], ...] = ({},) * 5,
                 peaks_only: bool = False) -> tuple[tuple[Phase, ...], ...]:
    """Every candidate moment with the engine's buffers alive then added to their categories: a buffer of phase
    ``name`` is alive at each of its moments; one of ``name:layer``, ``name:head`` (backward's ``name:loss`` and
    ``name:lmhead`` within it: the loss's and logits' gradients, then the LM head's matmuls on), backward's
    ``name:handoff`` (a layer's input projections and norm, where FSDP1 all-gathers the layer below) or
    ``name:end`` only at the moments in that place (``places`` gives their positions per phase), such as the
    running layer's gathered parameters. ``peaks_only``: each phase's peak moment alone (what an evaluation needs:
    no other moment is built)."""
    out: list[tuple[Phase, ...]] = []
    memo = _memo(buffers)
    for candidates, where in zip(phases, places):
        name = candidates[0].name
        key = (name, len(candidates), tuple(where.items()))
        if key not in memo:
            everywhere = _buffer_sums(buffers, name)
            # each moment's extra: the sum over the places listing its position (backward's "head" holds its
            # "loss" and "lmhead" moments)
            added = [everywhere] * len(candidates)
            for place, positions in where.items():
                extra = _buffer_sums(buffers, f"{name}:{place}")
                if any(extra):
                    for i in positions:
                        added[i] = tuple(a + b for a, b in zip(added[i], extra))
            memo[key] = (added, [sum(add) for add in added])
        added, extra_bytes = memo[key]
        if peaks_only:  # (the first of the largest, as peak_of)
            top = max(range(len(candidates)), key=lambda i: candidates[i].allocated_bytes + extra_bytes[i])
            out.append((_plus(candidates[top], added[top]),))
        else:
            out.append(tuple(_plus(ph, add) for ph, add in zip(candidates, added)))
    return tuple(out)


_MEMO: dict[int, tuple[object, dict[Any, Any]]] = {}


def _memo(of: object) -> dict[Any, Any]:
    """A memo of answers about ``of``, kept by its identity (and ``of`` with it, so that the id is not reused): a
    step's buffers and layers are the same tuples at every batch of a search, and hashing them costs as much as
    the answers."""
    kept = _MEMO.get(id(of))
    if kept is None or kept[0] is not of:
        if len(_MEMO) >= 4096:
            _MEMO.clear()
        kept = _MEMO[id(of)] = (of, {})
    return kept[1]


def _buffer_sums(buffers: tuple[Buffer, ...], when: str) -> tuple[int, ...]:
    """The bytes of the buffers alive ``when``, per category (CATEGORIES' order)."""
    memo = _memo(buffers)
    if when not in memo:
        memo[when] = tuple(sum(b.bytes for b in buffers if when in b.phases and b.category == c) for c in CATEGORIES)
    return cast(tuple[int, ...], memo[when])


def _plus(ph: Phase, add: tuple[int, ...]) -> Phase:
    if not any(add):
        return ph
    parameters, gradients, states, activations, temporaries = add
    return Phase(ph.name, ph.moment, ph.parameters + parameters, ph.gradients + gradients,
                 ph.optimizer_states + states, ph.activations + activations, ph.temporaries + temporaries)


def peak_of(candidates: tuple[Phase, ...]) -> Phase:
    """A phase's peak: its largest candidate, the earliest on a tie (candidates are in the order they happen)."""
    return max(candidates, key=lambda ph: ph.allocated_bytes)


def step_timeline(spec: ModelSpec, static: dict[str, int], acts: ActivationEstimate,
                  recipe: Recipe, optimizer: Optimizer, settings: TrainingSettings) -> tuple[Phase, ...]:
    """The five phases, each at its peak moment."""
    return tuple(peak_of(c) for c in step_candidates(spec, static, acts, recipe, optimizer, settings))


def seed_activation_bytes(spec: ModelSpec, settings: TrainingSettings) -> int:
    """The seed article's rule of thumb: batch * seq * hidden * layers * k values of 2 bytes."""
    k = settings.activation_k or 0
    return int(settings.batch * settings.seq * spec.hidden_size * spec.num_layers * k * 2)


def seed_rule_candidates(spec: ModelSpec, static: dict[str, int], recipe: Recipe, optimizer: Optimizer,
                         settings: TrainingSettings, rank: RankLayout | None = None) -> tuple[tuple[Phase, ...], ...]:
    """The same five phases with the activations given as one number (the seed article's b*s*h*L*k*2 rule): they
    are all alive at the end of forward and, as the rule counts them, when backward starts producing gradients; the
    optimizer step and the time between steps are as in :func:`step_candidates`. One candidate per phase."""
    activation_bytes = seed_activation_bytes(spec, settings)
    st = _static(static, recipe, settings, rank)
    load, opt, between = _outer_phases(spec, st, recipe, optimizer, settings, rank)
    phases = (
        (load,),
        (Phase("forward", "end of forward (seed rule)", st.weights, st.grads_in_forward, st.states, activation_bytes,
               0),),
        # (stepped in backward, no gradient waits for the others)
        (Phase("backward", "activations and gradients (seed rule)", st.weights,
               st.grads_in_forward if settings.optimizer_in_backward else st.grads, st.states, activation_bytes, 0),),
        (opt,),
        (between,),
    )
    return with_buffers(phases, rank.buffers) if rank and rank.buffers else phases
