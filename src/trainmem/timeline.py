"""The memory of one training step as it runs, phase by phase, as ``torch.cuda.max_memory_allocated()`` sees it.

A steady-state step (the second and later: optimizer states exist) of the usual loop::

    loss = model(**batch).loss        # forward: activations saved layer by layer, then logits and the loss
    loss.backward()                   # backward: activations freed layer by layer while gradients appear
    optimizer.step()                  # states updated; foreach implementations allocate temporaries
    optimizer.zero_grad(set_to_none=True)

Each phase's peak is the static memory alive in it plus what that phase allocates at its worst moment.
Backward's memory is linear in how far it has got (one layer's activations freed, one layer's gradients
created), so its peak is at its start (all activations, the loss gradients) or its end (all gradients), plus the
largest transient of one layer's backward. The numbers are checked against PyTorch by ``trainmem trace``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import FP32, ActivationEstimate, LayerActivations, Precision
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


def _layer_transient(spec: ModelSpec, la: LayerActivations, p: Precision, tokens: int, seq: int,
                     kernel: str) -> int:
    """The largest set of gradient temporaries alive inside one layer's backward.

    MLP: while the product's backward runs, d(product), d(activation) and d(up) coexist (3 x I wide).
    Attention: dq, dk, dv plus the flash kernel's fp32 dq accumulator and softmax rowsums; eager adds the
    s x s gradient of the scores in fp32. The residual-stream gradient (h wide) is alive throughout.
    """
    h, c, r = spec.hidden_size, p.compute, p.residual
    layer = la.layer
    att = layer.attention
    if layer.moe:
        mlp = 3 * c * layer.moe.top_k * layer.moe.expert_intermediate_size
    else:
        mlp = 3 * c * layer.mlp.intermediate_size  # type: ignore[union-attr]
    qkv = att.num_heads * att.head_dim + att.num_kv_heads * (att.head_dim + att.v_head_dim)
    attn = c * qkv + FP32 * att.num_heads * (att.head_dim + 1)
    if kernel == "eager":
        attn = c * qkv + (FP32 + c) * att.num_heads * seq
    return (max(mlp, attn) + r * h) * tokens


def _param_bytes(numel: int, per_param: float) -> int:
    return int(numel * per_param)


def _optimizer_temporaries(spec: ModelSpec, recipe: Recipe, optimizer: Optimizer,
                           fused: bool) -> tuple[int, str]:
    """Temporaries of optimizer.step(): the foreach implementations (CUDA's default) compute over all of a
    group's tensors at once, so one parameter-sized intermediate exists, e.g. AdamW's
    ``torch._foreach_sqrt(exp_avg_sqs)`` (torch/optim/adamw.py, _multi_tensor_adamw); fused kernels
    (``fused=True``, DeepSpeed's FusedAdam, bitsandbytes) update in place. Recipes with half gradients and fp32
    master weights make an fp32 copy of the gradients for the update."""
    n = spec.num_parameters
    state = recipe.state_bytes
    temp, what = 0, []
    if optimizer.name in ("adamw", "adam", "lion", "adafactor", "muon") and not fused:
        temp += n * state
        what.append("foreach intermediate (one parameter-sized buffer)")
    if recipe.master_weights and recipe.gradients != recipe.master_weights:
        temp += n * 4
        what.append("fp32 copy of the gradients for the master update")
    return temp, ", ".join(what) or "none (in-place kernels)"


def step_timeline(spec: ModelSpec, static: dict[str, int], acts: ActivationEstimate,
                  recipe: Recipe, optimizer: Optimizer, settings: TrainingSettings) -> tuple[Phase, ...]:
    weights, grads = static["weights"], static["gradients"]
    states = static["optimizer_states"] + static["master_weights"]
    p = Precision.of(recipe)
    tokens, v = acts.tokens, spec.vocab_size
    accumulating = settings.grad_accum > 1
    # With gradient accumulation the gradients of earlier micro-batches are alive in every forward but the first.
    grads_in_forward = grads if accumulating else 0

    # Forward: the peak is at the loss, when the logits, their fp32 upcast and log_softmax's output coexist.
    saved = acts.saved_bytes
    forward = Phase("forward", "at the loss", weights, grads_in_forward,
                    states, saved, acts.logits_bytes + acts.loss_transient_bytes)

    # Backward start: nll_loss's gradient and log_softmax's gradient (both fp32, V wide) beside everything saved.
    # The logits themselves are gone by then: log_softmax keeps its output, not its input, and a training loop
    # that keeps only the loss (HF Trainer's compute_loss, `loss = model(...).loss`) drops the output object.
    loss_grads = 0 if settings.loss == "chunked" else 2 * FP32 * v * tokens
    head_grad = _param_bytes(spec.param_groups[-1].numel, recipe.gradient_bytes) if not spec.tied_embeddings else 0
    start = Phase("backward", "loss gradients", weights, grads_in_forward, states, saved, loss_grads)
    candidates = [start]
    if spec.has_architecture and acts.layers:
        # The last layer's MLP backward (its largest transient): down_proj's backward has run, so its input (the
        # product) is freed and the MLP's weight gradients exist; the rest of the layer is still saved.
        last = acts.layers[-1]
        transient = _layer_transient(spec, last, p, tokens, settings.seq, settings.attention)
        recompute = acts.recompute_bytes
        mlp_numel = sum(t.numel for t in layer_tensors(last.layer, spec.hidden_size, spec.norm_vectors)
                        if t.name.startswith("mlp."))
        mlp_grads = _param_bytes(mlp_numel, recipe.gradient_bytes)
        width = (last.layer.moe.top_k * last.layer.moe.expert_intermediate_size if last.layer.moe
                 else last.layer.mlp.intermediate_size)  # type: ignore[union-attr]
        product = 0 if acts.checkpointing == "full" else p.compute * width * tokens
        candidates.append(Phase(
            "backward", "last layer's MLP", weights, max(grads_in_forward, head_grad + mlp_grads), states,
            saved - acts.head_bytes + recompute - product, transient))
        # The end: every gradient exists, the first layer's backward still runs.
        first = acts.layers[0]
        first_saved = acts.embedding_bytes + acts.constant_bytes + acts.layer_saved_bytes(first)
        transient_first = _layer_transient(spec, first, p, tokens, settings.seq, settings.attention)
        candidates.append(Phase("backward", "first layer", weights, grads, states,
                                first_saved + recompute, transient_first))
    backward = max(candidates, key=lambda ph: ph.allocated_bytes)

    temp, _ = _optimizer_temporaries(spec, recipe, optimizer, settings.fused_optimizer)
    opt = Phase("optimizer", "step()", weights, grads, states, 0, temp)
    load = Phase("load", "static state", weights, 0, states, 0, 0)
    between = Phase("between_steps", "after zero_grad", weights,
                    grads if accumulating else 0, states, 0, 0)
    return (load, forward, backward, opt, between)


def optimizer_temporaries_note(spec: ModelSpec, recipe: Recipe, optimizer: Optimizer, fused: bool) -> str:
    return _optimizer_temporaries(spec, recipe, optimizer, fused)[1]
