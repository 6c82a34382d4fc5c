"""trainmem trace: a real training step of the real transformers model, every allocation counted, no memory.

The model is built from its config under ``FakeTensorMode`` (tensors carry shapes and dtypes, no storage), so a
70B model costs a few hundred MB of Python objects. One warm-up step creates the optimizer states; the second,
tracked step (forward, loss, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``) runs under
``torch.distributed._tools.mem_tracker.MemTracker``, which follows every storage's lifetime and tags it as
parameter, buffer, gradient, activation, temporary or optimizer state. Sizes are rounded to 512 bytes as the CUDA
caching allocator does (``--no-round`` keeps raw sizes).

What differs from a GPU run: the CPU kernels' fake implementations stand in for CUDA's (the SDPA CPU flash kernel
saves the same output and logsumexp as CUDA's flash kernel); CPU autocast's op lists are close to, not identical
with, CUDA's. Where the CPU would run something a GPU does not, the trace runs what the GPU runs: with dropout,
the flash kernel and the fused bool-mask dropout instead of the CPU's math-path fallback and float masks
(``_cuda_dropout_kernels``). Two corrections to a plain MemTracker run: the whole of a checkpointed layer's
recompute is tagged as activations (``_recompute_aware_tracker``), and transformers' packed-sequence check, which
fake tensors cannot answer, is answered as a real run with one sequence per row does (``_unpacked_batches``).
docs/accuracy.md lists the estimate-vs-trace differences.

Needs torch and transformers (``pip install 'trainmem[trace]'``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .models import ModelSpec
from .recipes import get_recipe
from .settings import TrainingSettings
from .timeline import CATEGORIES, Phase

_CATEGORY_OF = {
    "Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients", "Optstate": "optimizer_states",
    "Activation": "activations", "Temp": "temporaries", "Other": "optimizer_states",
}


@dataclass(frozen=True)
class TraceResult:
    phases: tuple[Phase, ...]
    seconds: float
    rounded: bool

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.allocated_bytes)


def _phase(name: str, moment: str, snapshot: dict[str, int]) -> Phase:
    values = dict.fromkeys(CATEGORIES, 0)
    for key, nbytes in snapshot.items():
        if key in _CATEGORY_OF:
            values[_CATEGORY_OF[key]] += nbytes
    return Phase(name, moment, **values)


def _device_snapshot(snapshot: dict) -> dict[str, int]:
    """MemTracker snapshots are {device: {category: bytes}}; trace runs on one device."""
    merged: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, nbytes in per_device.items():
            merged[key] = merged.get(key, 0) + nbytes
    return merged


@contextlib.contextmanager
def _unpacked_batches():
    """Without a KV cache (use_cache is off under checkpointing) transformers checks position_ids for packed
    sequences, a data-dependent check that fake tensors cannot answer, so it would build a dense causal mask (and
    SDPA would then repeat k and v to every head) where a real run with one sequence per row builds none. The
    trace's batches are one sequence per row, which is what the real check finds."""
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # older transformers: no packed-sequence detection
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _cuda_dropout_kernels():
    """With dropout the CPU runs what no GPU does: SDPA falls back to the math kernel (s x s scores, probabilities
    and a float mask kept) and F.dropout keeps a float mask. On CUDA, SDPA keeps the flash kernel (output and
    logsumexp; the RNG seed and offset are a few bytes) and dropout is the fused native_dropout with a bool mask.
    The trace calls those same kernels (the CPU flash op takes dropout_p; native_dropout returns a bool mask); under
    FakeTensorMode only their shapes and dtypes matter."""
    import torch
    import torch.nn.functional as F

    original_sdpa, original_dropout = F.scaled_dot_product_attention, F.dropout

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        if dropout_p > 0 and attn_mask is None:
            device = query.device.type
            if torch.is_autocast_enabled(device):  # SDPA is on autocast's lower-precision list; the raw op is not
                half = torch.get_autocast_dtype(device)
                query, key, value = (t.to(half) for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, scale=scale)[0]
        return original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and p > 0 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return original_dropout(input, p, training, inplace)

    F.scaled_dot_product_attention, F.dropout = scaled_dot_product_attention, dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = original_sdpa, original_dropout


def _recompute_aware_tracker(mem_tracker, run):
    """A MemTracker that tags what a checkpointed layer's recompute allocates as activations, as MemTracker
    documents (its own ``_in_ac`` flag is set only inside the submodules the recompute calls: the layer's own ops,
    e.g. the residual adds, were tagged as temporaries, and an early-stopped recompute left it set for the rest
    of backward)."""

    class RecomputeAwareTracker(mem_tracker.MemTracker):
        @property
        def _in_ac(self) -> bool:
            return run.recomputing

        @_in_ac.setter
        def _in_ac(self, value: bool) -> None:
            pass  # MemTracker's own marker is replaced by the step's

    return RecomputeAwareTracker()


def trace_step(config: dict[str, Any], settings: TrainingSettings, spec: ModelSpec | None = None,
               round_to_cuda: bool = True) -> TraceResult:
    """Trace one steady-state training step; returns the peak of each phase by category."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools import mem_tracker

    from .step import TrainingStep

    recipe = get_recipe(settings.recipe)
    if spec is not None and spec.is_moe and recipe.weights != "bf16":
        # transformers' grouped_mm experts path needs bf16 inputs under FakeTensorMode on the CPU.
        raise ConfigError("trace of MoE models needs bf16 weights (recipes mixed-bf16, pure-bf16*)")
    started = time.perf_counter()
    # MemTracker rounds to the CUDA allocator's 512-byte blocks only for CUDA tensors; the trace's tensors live
    # on the fake CPU device, so the rounding is applied here for the duration of the trace.
    original_size = mem_tracker._WeakRefInfo._calculate_mem_consumed
    if round_to_cuda:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = lambda self: -(-self.size * self.element_size // 512) * 512
    try:
        with FakeTensorMode(), _unpacked_batches(), _cuda_dropout_kernels():
            run = TrainingStep(config, settings, "cpu", spec)
            run.forward_backward()  # warm-up: creates the optimizer states
            run.step()

            tracker = _recompute_aware_tracker(mem_tracker, run)
            tracker.track_external(*run.tracked_objects())
            with tracker:
                load = _device_snapshot(tracker.get_tracker_snapshot("current"))
                run.forward_backward()
            stats = tracker.memory_tracking[run.model].snapshots
            forward = _device_snapshot(stats[mem_tracker._ModState.PEAK_FW][-1])
            backward = _device_snapshot(stats[mem_tracker._ModState.PEAK_BW][-1])

            step_tracker = mem_tracker.MemTracker()
            step_tracker.track_external(*run.tracked_objects())
            with step_tracker:
                run.step()
            optimizer_peak = _device_snapshot(step_tracker.get_tracker_snapshot("peak"))
            between = _device_snapshot(step_tracker.get_tracker_snapshot("current"))
    finally:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = original_size
    load_phase = _phase("load", "static state", load)
    step_phase = _phase("optimizer", "step()", optimizer_peak)
    # MemTracker tags what optimizer.step() allocates as optimizer state and the fp32 gradient copies made
    # before it as activations; trainmem calls both temporaries, keeping "optimizer_states" for the steady state.
    extra_states = step_phase.optimizer_states - load_phase.optimizer_states
    step_phase = Phase("optimizer", "step()", step_phase.parameters, step_phase.gradients,
                       load_phase.optimizer_states, 0,
                       step_phase.temporaries + step_phase.activations + max(extra_states, 0))
    phases = (
        load_phase,
        _phase("forward", "peak of forward", forward),
        _phase("backward", "peak of backward", backward),
        step_phase,
        _phase("between_steps", "after zero_grad", between),
    )
    return TraceResult(phases, time.perf_counter() - started, round_to_cuda)
