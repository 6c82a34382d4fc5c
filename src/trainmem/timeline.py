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

from dataclasses import dataclass

from .activations import FP32, INDEX, ActivationEstimate, LayerActivations, Precision
from .models import ModelSpec, layer_tensors
from .optimizers import Optimizer
from .recipes import Recipe
from .settings import TrainingSettings

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

    @property
    def allocated_bytes(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.temporaries

    def by_category(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in CATEGORIES}


def _mlp_width(layer) -> int:
    """I-wide tensors per token: the MLP's width, or top-k times an expert's width for MoE."""
    if layer.moe:
        return layer.moe.top_k * layer.moe.expert_intermediate_size
    return layer.mlp.intermediate_size


def _layer_transient(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int, seq: int,
                     kernel: str) -> int:
    """The largest set of gradient temporaries alive inside one layer's backward.

    MLP: while the product's backward runs, d(product), d(activation) and d(up) coexist (3 x I wide; 2 for a
    plain GELU/ReLU MLP).
    Attention: dq, dk, dv plus the flash kernel's fp32 dq accumulator and softmax rowsums; eager adds the
    s x s gradient of the scores in fp32.
    """
    h, c, r = spec.hidden_size, p.compute, p.residual
    layer = la.layer
    att = layer.attention
    # Gated (and MoE experts): d(product), d(activation) and d(up) coexist; GPT-2's Python gelu_new also chains
    # three; a plain activation (GELU, ReLU) turns one I-wide gradient into one.
    plain = layer.mlp is not None and not layer.mlp.gated and layer.mlp.activation != "gelu_new"
    mlp = (2 if plain else 3) * c * _mlp_width(layer)
    qkv = att.num_heads * att.head_dim + att.num_kv_heads * (att.head_dim + att.v_head_dim)
    attn = c * qkv + FP32 * att.num_heads * (att.head_dim + 1)
    if kernel == "eager":
        attn = c * qkv + (FP32 + c) * att.num_heads * seq
    # The residual stream's gradient is alive throughout (measured with the trace, with and without checkpointing).
    return (max(mlp, attn) + r * h) * tokens


_EXPERT_TERMS_FREED = ("expert gate_up outputs", "expert activation and product",
                       "expert outputs (weighted by the router)")


def _experts_transient(spec: ModelSpec, la: LayerActivations, p: Precision, recipe: Recipe, tokens: int) -> int:
    """The routed experts' gate_up backward (transformers' grouped_mm experts, traced): d(gate_up output),
    d(gathered input), the router weights' gradient and the gate_up weight gradient, beside the residual one."""
    moe = la.layer.moe
    if moe is None:
        return 0
    w, k, i, h = p.experts, moe.top_k, moe.expert_intermediate_size, spec.hidden_size
    weight_grad = _param_bytes(moe.num_experts * 2 * i * h, recipe.gradient_bytes)
    return (k * (2 * w * i + w * h + FP32) + p.residual * h) * tokens + weight_grad


def _forward_transient(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int) -> int:
    """A layer's forward when autograd keeps nothing (non-reentrant checkpointing): tensors die as soon as Python
    drops them, so the worst moment is the MLP product being formed from the activation and up outputs (3 I-wide
    tensors), or attention with q, k, v and its output, beside the residual stream and the norm output."""
    c, w, h = p.compute, p.residual, spec.hidden_size
    layer = la.layer
    att = layer.attention
    wide = 3  # gated: activation output, up output, product
    if layer.mlp is not None and not layer.mlp.gated:
        wide = 5 if layer.mlp.activation == "gelu_new" else 2  # gelu_new's Python intermediates
    mlp = wide * c * _mlp_width(layer)
    attn = c * (2 * att.num_heads * att.head_dim + 2 * att.num_kv_heads * att.head_dim)
    return (max(mlp, attn) + 2 * w * h) * tokens


def _param_bytes(numel: int, per_param: float) -> int:
    return int(numel * per_param)


def _optimizer_temporaries(spec: ModelSpec, recipe: Recipe, optimizer: Optimizer, fused: bool) -> int:
    """Temporaries of optimizer.step(): the foreach implementations (CUDA's default) compute over all of a
    group's tensors at once, so one parameter-sized intermediate exists, e.g. AdamW's
    ``torch._foreach_sqrt(exp_avg_sqs)`` (torch/optim/adamw.py, _multi_tensor_adamw); fused kernels
    (``fused=True``, DeepSpeed's FusedAdam, bitsandbytes) update in place. Recipes with half gradients and fp32
    master weights make an fp32 copy of the gradients for the update."""
    n = spec.num_parameters
    temp = 0
    if optimizer.name in ("adamw", "adam", "lion", "adafactor", "muon") and not fused:
        temp += n * recipe.state_bytes
    if recipe.master_weights and recipe.gradients != recipe.master_weights:
        temp += n * 4
    return temp


@dataclass(frozen=True)
class _LayerBytes:
    """One decoder layer, as the backward walk needs it."""

    kept: int
    """What the layer keeps until its backward (everything saved, or its input under full checkpointing)."""
    full: int
    """Its full saved activations (recreated by the recompute under full checkpointing)."""
    product: int
    """Freed when down_proj's backward has run: its input (the MLP product), under autocast the half copy of its
    weight, what a norm on the layer's output saved, and MoE's router-weighted expert outputs."""
    down_grad: int
    grads: int
    transient: int
    """Largest gradient temporaries inside its backward."""
    forward_transient: int
    """Largest set of its forward's own tensors alive at once when nothing is saved (checkpointed forward)."""
    experts_freed: int
    """MoE layers: what the routed experts saved beyond their gathered input (gate_up outputs, activation and
    product, expert outputs), all freed when the experts' gate_up backward runs; 0 for a dense MLP."""
    experts_transient: int
    """MoE layers: the gate_up grouped_mm backward's gradients, of its output, of its input and of its weight
    (the weight's is a temporary until autograd accumulates it into .grad)."""
    output_norm_transient: int
    """Gradient temporaries of a norm on the layer's output (Gemma 2/3's post-feedforward norm), whose backward
    runs first, while all of the layer's activations are alive; 0 where the layer ends with the residual add."""
    output_norm_freed: int
    """What that norm's backward has freed of its own saved tensors by its worst moment."""


def _expanded_layers(spec: ModelSpec, acts: ActivationEstimate, recipe: Recipe,
                     settings: TrainingSettings) -> list[_LayerBytes]:
    if not spec.has_architecture:
        return []
    p = Precision.of(recipe)
    tokens = acts.tokens
    out = []
    for la in acts.layers:
        tensors = layer_tensors(la.layer, spec.hidden_size, spec.norm_vectors)
        down = sum(t.numel for t in tensors if t.name.startswith(("mlp.down_proj", "mlp.fc2", "mlp.experts.down_proj")))
        layer = la.layer
        full = int(la.bytes_per_token * tokens) + la.constant_bytes
        kept = acts.layer_saved_bytes(la)
        if acts.checkpointing == "full":
            # Gradient checkpointing turns use_cache off, so no KV-cache copy replaces v: in fused-qkv models with
            # rotary (GPT-NeoX, Phi-3, Falcon) v stays a view of the whole q/k/v projection output.
            att = la.layer.attention
            if att.fused_qkv and spec.model_type in ("gpt_neox", "phi3", "falcon"):
                full += p.compute * (att.num_heads + att.num_kv_heads) * att.head_dim * tokens
            # The recompute's first norm reads the kept layer input. Where it saves that tensor itself (LayerNorm;
            # RMSNorm when the stream is already fp32, so its upcast is a no-op) the recomputed activations share
            # it with what the checkpoint kept.
            if spec.norm == "layer" or p.residual == FP32:
                full -= p.residual * spec.hidden_size * tokens
        # (grouped_mm experts are not autocast: their weights get no half copy)
        down_copy = p.compute * down if p.autocast and layer.mlp is not None else 0
        # A norm on the layer's output (Gemma's post-feedforward norm) has run its backward, and freed what it
        # saved, before the MLP's backward starts.
        output_norm = [t for t in la.terms if t.name.startswith("post-feedforward norm")]
        freed_before_mlp = int(sum(t.bytes_per_token for t in output_norm) * tokens)
        if layer.moe:
            # The experts' weighted outputs and each (token, expert) pair's weight and index are freed by the
            # backward of the router-weighted sum, which runs before the experts' down_proj backward (traced).
            freed_before_mlp += int(layer.moe.top_k * (p.experts * spec.hidden_size + INDEX + FP32) * tokens)
        item = _LayerBytes(
            kept=kept, full=full, product=p.compute * _mlp_width(layer) * tokens + down_copy + freed_before_mlp,
            down_grad=_param_bytes(down, recipe.gradient_bytes),
            grads=_param_bytes(sum(t.numel for t in tensors), recipe.gradient_bytes),
            transient=_layer_transient(spec, la, p, tokens, settings.seq, settings.attention),
            forward_transient=_forward_transient(spec, la, p, tokens),
            experts_freed=int(sum(t.bytes_per_token for t in la.terms if t.name in _EXPERT_TERMS_FREED) * tokens),
            experts_transient=_experts_transient(spec, la, p, recipe, tokens),
            # Gemma's RMSNorm backward in fp32: the upcast output gradient, its product with (1 + weight), and the
            # rsqrt and input branches, five h-wide fp32 tensors at once (traced), beside the residual gradient.
            output_norm_transient=(5 * FP32 * spec.hidden_size * tokens if output_norm else 0),
            # At that moment its rsqrt and normalised value are already freed; its fp32 input is not.
            output_norm_freed=int(sum(t.bytes_per_token for t in output_norm if not t.name.endswith("input in fp32"))
                                  * tokens),
        )
        out.extend([item] * la.count)
    return out


def step_timeline(spec: ModelSpec, static: dict[str, int], acts: ActivationEstimate,
                  recipe: Recipe, optimizer: Optimizer, settings: TrainingSettings) -> tuple[Phase, ...]:
    weights, grads = static["weights"], static["gradients"]
    states = static["optimizer_states"] + static["master_weights"]
    p = Precision.of(recipe)
    tokens, v, h = acts.tokens, spec.vocab_size, spec.hidden_size
    accumulating = settings.grad_accum > 1
    # With gradient accumulation the gradients of earlier micro-batches are alive in every forward but the first.
    grads_in_forward = grads if accumulating else 0

    # Forward: the peak is at the loss, when the logits, their fp32 upcast and log_softmax's output coexist
    # (all created in forward, so counted as activations). With full checkpointing it can instead be inside the
    # last layer's forward, where that layer's activations exist until it returns.
    saved = acts.saved_bytes
    layers = _expanded_layers(spec, acts, recipe, settings)
    checkpointed = acts.checkpointing == "full" and bool(layers)
    # Under checkpointing, autocast's cast cache keeps every layer's half weight copies until the autocast
    # region ends, even though checkpointed layers save nothing (without it, backward keeps them: in saved).
    cast_cache = sum(la.constant_bytes * la.count for la in acts.layers) if checkpointed and p.autocast else 0
    # The CausalLM forward holds the base model's output (the final norm's) while it computes the logits and the
    # loss. Under autocast that fp32 tensor is not what the LM head saves (its bf16 copy), so it is extra.
    final_hidden = p.residual * h * tokens if p.autocast and p.residual == FP32 and layers else 0
    candidates_fw = [Phase("forward", "at the loss", weights, grads_in_forward, states,
                           saved + acts.logits_bytes + acts.loss_transient_bytes + acts.kv_cache_bytes + cast_cache
                           + final_hidden, 0)]
    if checkpointed:
        kept_before_last = acts.embedding_bytes + acts.constant_bytes + cast_cache + sum(x.kept for x in layers[:-1])
        candidates_fw.append(Phase("forward", "inside the last layer", weights, grads_in_forward, states,
                                   kept_before_last + layers[-1].forward_transient, 0))
    forward = max(candidates_fw, key=lambda ph: ph.allocated_bytes)

    # Backward start: nll_loss's gradient and log_softmax's gradient (both fp32, V wide) beside everything saved.
    # The logits themselves are gone by then: log_softmax keeps its output, not its input, and a training loop
    # that keeps only the loss (HF Trainer's compute_loss, `loss = model(...).loss`) drops the output object.
    loss_grads = 0 if settings.loss == "chunked" else 2 * FP32 * v * tokens
    head_grad = _param_bytes(spec.param_groups[-1].numel, recipe.gradient_bytes) if not spec.tied_embeddings else 0
    candidates = [Phase("backward", "loss gradients", weights, grads_in_forward, states, saved, loss_grads)]
    if settings.loss != "chunked":
        # The LM head's backward: log_softmax's output is freed, the fp32 gradient of the logits (and its cast
        # to the compute dtype) is alive while the head's weight gradient (V x h, tied or not) is created.
        head_weight_grad = _param_bytes(v * (spec.embedding_dim or spec.hidden_size), recipe.gradient_bytes)
        dlogits = FP32 * v * tokens + (p.compute * v * tokens if p.compute != FP32 else 0)
        candidates.append(Phase("backward", "LM head", weights, max(grads_in_forward, head_weight_grad), states,
                                saved - FP32 * v * tokens, dlogits))
    # Then layer by layer, last to first. Each layer's worst moment is its MLP backward: down_proj's backward has
    # run (its input, the product, is freed; its weight gradient exists), the rest of the layer's activations
    # (recomputed, under full checkpointing) are alive, and the MLP's input gradients are being computed.
    # Layers below still hold what they keep; layers above have freed theirs and produced their gradients.
    # Once the LM head's backward has run, its autocast weight copy is gone.
    head_copy = int(sum(t.bytes_per_token for t in acts.constant_terms if "LM head weight" in t.name))
    base_kept = acts.embedding_bytes + acts.constant_bytes - head_copy
    # Tied embeddings: autograd sums the LM head's and the embedding's gradient contributions before accumulating
    # into .grad, so the head's V x h contribution is held as a temporary through the whole layer backward.
    tied_numel = spec.param_groups[0].tensors[0].numel if spec.tied_embeddings and spec.has_architecture else 0
    tied_held = _param_bytes(tied_numel, recipe.gradient_bytes)
    kept_below = [0]
    for x in layers:
        kept_below.append(kept_below[-1] + x.kept)
    grads_above = 0
    for index in range(len(layers) - 1, -1, -1):
        x = layers[index]
        live_acts = base_kept + kept_below[index] + (x.kept + x.full if acts.checkpointing == "full" else x.full)
        candidates.append(Phase(
            "backward", f"layer {index} MLP", weights,
            max(grads_in_forward, head_grad + grads_above + x.down_grad), states,
            live_acts - x.product, x.transient + tied_held))
        if x.experts_transient:
            candidates.append(Phase(
                "backward", f"layer {index} experts' gate_up", weights,
                max(grads_in_forward, head_grad + grads_above + x.down_grad), states,
                live_acts - x.experts_freed, x.experts_transient + tied_held))
        if x.output_norm_transient:
            candidates.append(Phase(
                "backward", f"layer {index} output norm", weights, max(grads_in_forward, head_grad + grads_above),
                states, live_acts - x.output_norm_freed, tied_held + p.residual * h * tokens + x.output_norm_transient))
        if acts.checkpointing == "full":
            # Just before the layer's backward: its forward has been recomputed whole (nothing freed yet) and
            # the gradient of its output is waiting.
            candidates.append(Phase(
                "backward", f"layer {index} recomputed", weights, max(grads_in_forward, head_grad + grads_above),
                states, base_kept + kept_below[index] + x.kept + x.full, tied_held + p.residual * h * tokens))
        grads_above += x.grads
    # The embedding's backward, last: every other gradient is done, the gradient of the embedding output (w x h
    # per token) is alive and embedding_dense_backward creates the V x h weight gradient. With tied weights its
    # contribution and the sum of both exist beside the held LM-head one (3 x V x h). Only a large vocabulary
    # with small activations (checkpointing, short sequences) makes this the peak, e.g. Llama-3-8B (traced).
    emb_input_grad = p.residual * h * tokens if layers else 0
    if tied_held:
        candidates.append(Phase("backward", "embedding (tied weights)", weights,
                                max(grads_in_forward, grads - tied_held), states, base_kept,
                                3 * tied_held + emb_input_grad))
    elif layers:
        emb_grad = _param_bytes(spec.param_groups[0].tensors[0].numel, recipe.gradient_bytes)
        candidates.append(Phase("backward", "embedding", weights, max(grads_in_forward, grads - emb_grad), states,
                                acts.embedding_bytes, emb_grad + emb_input_grad))
    backward = max(candidates, key=lambda ph: ph.allocated_bytes)

    temp = _optimizer_temporaries(spec, recipe, optimizer, settings.fused_optimizer)
    opt = Phase("optimizer", "step()", weights, grads, states, 0, temp)
    load = Phase("load", "static state", weights, 0, states, 0, 0)
    between = Phase("between_steps", "after zero_grad", weights,
                    grads if accumulating else 0, states, 0, 0)
    return (load, forward, backward, opt, between)
