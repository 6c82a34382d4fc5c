"""trainmem trace: a real training step of the real transformers model, every allocation counted, no memory.

The model is built from its config under ``FakeTensorMode`` (tensors carry shapes and dtypes, no storage), so a
70B model costs a few hundred MB of Python objects. One warm-up step creates the optimizer states; the second,
tracked step (forward, loss, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``) runs under
``torch.distributed._tools.mem_tracker.MemTracker``, which follows every storage's lifetime and tags it as
parameter, buffer, gradient, activation, temporary or optimizer state. Sizes are rounded to 512 bytes as the CUDA
caching allocator does (``--no-round`` keeps raw sizes).

What differs from a GPU run: the CPU executes the step, so where a CPU kernel differs from CUDA's in what it keeps
the trace runs CUDA's (``trainmem.cuda_emulation``): CUDA's autocast op lists and weight-cast cache, the SDPA kernel
CUDA would select (flash, memory-efficient or math, by PyTorch's rules in ``trainmem.kernels``) and the fused
bool-mask dropout. Three corrections to a plain MemTracker run: the whole of a checkpointed layer's recompute is
tagged as activations (``_recompute_aware_tracker``); backward runs in place what a GPU runs in place, where the
active dispatch mode would turn it out of place (``_plain_tensor_overload``, ``_gradient_sum``); and
transformers' packed-sequence check, which fake tensors cannot answer, is answered as a real run with one
sequence per row does (``cuda_emulation.unpacked_batches``). docs/accuracy.md lists the estimate-vs-trace differences.

Needs torch and transformers (``pip install 'trainmem[trace]'``).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, cast

from .errors import ConfigError
from .models import ModelSpec
from .recipes import get_recipe
from .settings import TrainingSettings
from .timeline import CATEGORIES, Phase
from .cuda_emulation import fake_gpu  # (there with the rest of the fake GPU; re-exported for the tests)

if TYPE_CHECKING:
    from .allocator import AllocationLog, AllocEvent
    from .lora import FineTune
    from .sharding import Parallel

_CATEGORY_OF = {
    "Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients", "Optstate": "optimizer_states",
    "Activation": "activations", "Temp": "temporaries", "Other": "optimizer_states",
}


@dataclass(frozen=True)
class TraceResult:
    phases: tuple[Phase, ...]
    seconds: float
    rounded: bool
    host_bytes: int = 0
    """--offload-activations: the most bytes the offload hook held in host memory at once."""
    allocations: Any = None
    """``trace_step(record_allocations=True)``: the step's allocations and frees (an allocator.AllocationLog)."""
    module_peaks: Any = None
    """``trace_step(module_peaks=True)``: {module name: (its forward peak, its backward peak)} as Phases, the
    moments the traced path (recorded.py) extrapolates beside each phase's own peak."""

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.allocated_bytes)


def _phase(name: str, moment: str, snapshot: dict[str, int]) -> Phase:
    values: dict[str, Any] = dict.fromkeys(CATEGORIES, 0)  # (Phase's byte fields, as keywords)
    for key, nbytes in snapshot.items():
        if key in _CATEGORY_OF:
            values[_CATEGORY_OF[key]] += nbytes
    return Phase(name, moment, **values)


def _device_snapshot(snapshot: dict[Any, dict[str, int]]) -> dict[str, int]:
    """MemTracker snapshots are {device: {category: bytes}}; trace runs on one device."""
    merged: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, nbytes in per_device.items():
            merged[key] = merged.get(key, 0) + nbytes
    return merged


@contextlib.contextmanager
def _cuda_block_sizes(enabled: bool = True) -> Iterator[None]:
    """MemTracker rounds to the CUDA allocator's 512-byte blocks only for CUDA tensors; the trace's tensors live
    on the fake CPU device, so the rounding is applied here for the duration of a trace."""
    from torch.distributed._tools import mem_tracker

    original = mem_tracker._WeakRefInfo._calculate_mem_consumed
    if enabled:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = lambda self: -(-self.size * self.element_size // 512) * 512
    try:
        yield
    finally:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = original


class _AllocationRecorder:
    """The order in which the traced program allocates and frees its storages, for the caching allocator replay
    (trainmem.allocator). A storage is allocated when a MemTracker first sees it (its ``_WeakRefInfo`` is made: an
    op's output, or the model and optimizer handed to ``track_external``) and freed when it dies (a weak reference,
    as MemTracker's own ``_delete_callback``), whether a tracker is active then or not; ``resize_`` (MemTracker's
    ``update_mem_consumed``) is a new allocation, then the free of the old one, as a CUDA storage resize copies.
    Storages are labelled with the category MemTracker gave them first. Sizes are the storages' bytes before
    rounding: the allocator model rounds them."""

    def __init__(self) -> None:
        from .allocator import AllocEvent

        self._event = AllocEvent
        self.events: list[AllocEvent] = []
        self.step_starts: list[int] = []
        self._live: dict[int, list[Any]] = {}  # id(storage) -> [weakref, key (None for 0 bytes), nbytes, label]
        self._next_key = 0
        self.active = True

    def _died(self, ident: int, key: int | None, _ref: weakref.ref[Any]) -> None:
        entry = self._live.get(ident)
        if entry is not None and entry[1] == key:
            del self._live[ident]
            if self.active and key is not None:
                self.events.append(self._event(key))

    def _allocate(self, nbytes: int, label: str) -> int | None:
        if nbytes <= 0:
            return None  # CUDACachingAllocator::allocate makes no block for 0 bytes
        key = self._next_key
        self._next_key += 1
        self.events.append(self._event(key, nbytes, label))
        return key

    def see(self, storage: Any, nbytes: int, reftype: Any) -> None:
        if not self.active:
            return
        ident = id(storage)
        entry = self._live.get(ident)
        if entry is not None and entry[0]() is storage:
            return
        label = _CATEGORY_OF.get(getattr(reftype, "value", str(reftype))) or _FSDP_CATEGORY.get(
            getattr(reftype, "name", ""), "other")  # (MemTracker's reference types, or FSDPMemTracker's)
        key = self._allocate(nbytes, label)
        ref = weakref.ref(storage, functools.partial(self._died, ident, key))
        self._live[ident] = [ref, key, nbytes, label]

    def resized(self, storage: Any, nbytes: int) -> None:
        entry = self._live.get(id(storage))
        if not self.active or entry is None or entry[0]() is not storage or entry[2] == nbytes:
            return
        _, old, _, label = entry
        new = self._allocate(nbytes, label)
        if old is not None:
            self.events.append(self._event(old))
        entry[1], entry[2] = new, nbytes
        # the weak reference's callback frees the key it was made for: one for the new key (not holding the storage)
        ident = id(storage)
        entry[0] = weakref.ref(storage, functools.partial(self._died, ident, new))

    def begin_step(self) -> None:
        self.step_starts.append(len(self.events))

    def log(self) -> AllocationLog:
        from .allocator import AllocationLog

        self.active = False
        return AllocationLog(tuple(self.events), tuple(self.step_starts) or (0,))


@contextlib.contextmanager
def _recording(recorder: _AllocationRecorder | None) -> Iterator[None]:
    """Route every ``_WeakRefInfo`` MemTracker makes, and every size change it sees, to ``recorder``."""
    if recorder is None:
        yield
        return
    from torch.distributed._tools import mem_tracker

    info = mem_tracker._WeakRefInfo
    create, update = info.__dict__["create_winfo"], info.__dict__["update_mem_consumed"]

    def create_winfo(cls: Any, st: Any, device: Any, reftype: Any, callback: Any = None) -> tuple[Any, Any]:
        winfo, w_st = create.__func__(cls, st, device, reftype, callback)
        recorder.see(st, winfo.size * winfo.element_size, reftype)
        return winfo, w_st

    def update_mem_consumed(self: Any, st: Any) -> Any:
        consumed = update(self, st)
        recorder.resized(st, self.size * self.element_size)
        return consumed

    info.create_winfo = classmethod(create_winfo)
    info.update_mem_consumed = update_mem_consumed
    try:
        yield
    finally:
        info.create_winfo = create
        info.update_mem_consumed = update


@contextlib.contextmanager
def _real_cpu(emulate: str) -> Iterator[None]:
    """The trace's environment on real CPU tensors: the same experts path (and CUDA's policies if asked)."""
    from .cuda_emulation import emulate_cuda, grouped_mm_fallback_for_non_bf16

    with grouped_mm_fallback_for_non_bf16(), (emulate_cuda() if emulate == "cuda" else contextlib.nullcontext()):
        yield


class _NoHook:
    def remove(self) -> None:
        pass


def _track(tracker: Any, mem_tracker: Any, run: Any) -> None:
    """Register the step's long-lived tensors with a MemTracker: model, optimizer states, fp32 masters, and the
    fp32 main-grad buffers of ``mixed-bf16-fp32grads`` as gradients. Frozen parameters (a LoRA base) get no
    gradient hooks, which torch refuses on a tensor that takes no gradient."""
    for param in run.frozen_parameters():
        tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
    tracker.trainmem_step = run  # (what tracelive.py reads the owners of parameters, masters and states from)
    tracker.track_external(*run.tracked_objects())
    for main in run.main_grads or ():
        tracker._update_and_maybe_create_winfos(main, mem_tracker._MemRefType.GRAD)


def _recompute_aware_tracker(mem_tracker: Any, run: Any, base: Any = None, temporary: Any = None,
                             **kwargs: Any) -> Any:
    """A MemTracker that tags what a checkpointed layer's recompute allocates as activations, as MemTracker
    documents (its own ``_in_ac`` flag is set only inside the submodules the recompute calls: the layer's own ops,
    e.g. the residual adds, were tagged as temporaries, and an early-stopped recompute left it set for the rest
    of backward)."""

    import torch

    base = base or mem_tracker.MemTracker
    temporary = temporary or mem_tracker._MemRefType.TEMP

    # (base is torch's MemTracker or FSDPMemTracker, chosen at run time: mypy cannot check a class on it)
    class RecomputeAwareTracker(base):  # type: ignore[misc]
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            # Otherwise torch.compile falls back to eager under the tracker (a dispatch mode); with this it
            # compiles with the tracker off and runs the compiled graphs with it on (--compile).
            return True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._fresh_zeros: dict[int, weakref.ref[Any]] = {}

        @property
        def _in_ac(self) -> bool:
            return cast(bool, run.recomputing)

        @_in_ac.setter
        def _in_ac(self, value: bool) -> None:
            pass  # MemTracker's own marker is replaced by the step's

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            in_backward = torch._C._current_autograd_node() is not None
            if in_backward:
                func = _plain_tensor_overload(self._fresh_zeros, func, args)
                if _gradient_sum(self, temporary, func, args):
                    func = torch.ops.aten.add_.Tensor
            result = super().__torch_dispatch__(func, types, args, kwargs)
            if in_backward and str(func) in _ZEROS:
                self._fresh_zeros[id(result)] = weakref.ref(result)
            return result

    return RecomputeAwareTracker(**kwargs)


_ZEROS = frozenset({"aten.new_zeros.default", "aten.zeros.default", "aten.zeros_like.default"})
_IN_PLACE_OF = {"aten.index_put.default": ("index_put_", "default"),
                "aten.scatter_add.default": ("scatter_add_", "default"), "aten.scatter.src": ("scatter_", "src"),
                "aten.scatter.value": ("scatter_", "value"), "aten.index_add.default": ("index_add_", "default")}


def _plain_tensor_overload(fresh_zeros: dict[int, weakref.ref[Any]], func: Any, args: Any) -> Any:
    """The overload a backward formula calls on plain tensors, where fake tensors make it call another.

    Several autograd formulas (torch/csrc/autograd/FunctionsManual.cpp: ``index_backward``, ``gather_backward``,
    ``value_selecting_reduction_backward``) fill a fresh zero tensor in place (``_index_put_impl_``,
    ``scatter_add_``, ``scatter_``) unless a tensor is a subclass (``areAnyTensorSubclassLike``), when they call
    the out-of-place op instead. A FakeTensor is a subclass, so under the trace the gradient of an index (MoE's
    token gathers) would exist twice. Inside backward, an out-of-place fill of a zero tensor that backward just
    created runs in place, as it does on a GPU."""
    import torch

    in_place = _IN_PLACE_OF.get(str(func))
    if in_place and args:
        ref = fresh_zeros.pop(id(args[0]), None)
        if ref is not None and ref() is args[0]:
            packet, overload = in_place
            return getattr(getattr(torch.ops.aten, packet), overload)
    return func


def _gradient_sum(tracker: Any, temporary: Any, func: Any, args: Any) -> bool:
    """Whether this is the autograd engine summing two gradients of one tensor used twice (the residual stream,
    tied embeddings: the LM head's contribution and the embedding's), which it does in place into one that
    nothing else references (torch/csrc/autograd/input_buffer.cpp, ``can_accumulate_inplace``), but out of place
    while a dispatch mode is active (``isTensorSubclassLike``), as one is for any trace. Both operands must be
    gradients (made in this backward, outside a recompute), so nothing saved for backward is changed."""
    if str(func) != "aten.add.Tensor" or len(args) != 2:
        return False
    old, new = args
    if not (isinstance(old, type(new)) and hasattr(old, "shape") and old.shape == new.shape
            and old.dtype == new.dtype and old.is_contiguous()):
        return False
    for tensor in (old, new):
        winfo = tracker._WINFO.get(tensor.untyped_storage(), (None, None))[0]
        if winfo is None or winfo.reftype != temporary:
            return False
    return True


def trace_step(config: dict[str, Any], settings: TrainingSettings, spec: ModelSpec | None = None,
               round_to_cuda: bool = True, emulate: str = "cuda", fake: bool = True, finetune: FineTune | None = None,
               record_allocations: bool = False, module_peaks: bool = False) -> TraceResult:
    """Trace one steady-state training step; returns the peak of each phase by category.

    ``record_allocations=True`` also records the order of the allocations and frees of the first step (the
    warm-up, which creates the optimizer states) and of the traced one (``TraceResult.allocations``, two steps), for
    the caching allocator replay (``trainmem trace --allocator``); the phases are the same either way.

    ``emulate="cuda"`` (the default) runs CUDA's autocast policy, SDPA kernel choice and dropout
    (:mod:`trainmem.cuda_emulation`); ``emulate="cpu"`` runs what the CPU runs. ``fake=False`` runs the same
    step on real CPU tensors (real memory, small models only) and tracks its tensors the same way: the tensors
    of a real CPU step, without the CPU kernels' own scratch buffers, which vary with the processor."""
    from torch.distributed._tools import mem_tracker

    from .step import TrainingStep

    started = time.perf_counter()
    recorder = _AllocationRecorder() if record_allocations else None
    with _cuda_block_sizes(round_to_cuda), (fake_gpu(emulate) if fake else _real_cpu(emulate)), _recording(recorder):
        run = TrainingStep(config, settings, "cpu", spec, finetune)
        if recorder is None:
            run.forward_backward()  # warm-up: creates the optimizer states
            run.step()
        else:  # the warm-up is the first of the two recorded steps: each part under a tracker, as the second's
            _track(mem_tracker.MemTracker(), mem_tracker, run)  # the model (and masters): the state before step 1
            recorder.begin_step()
            for _ in range(settings.grad_accum):
                _recorded_micro_batch(mem_tracker, run)
            warm_up_tracker = mem_tracker.MemTracker()
            _track(warm_up_tracker, mem_tracker, run)
            with warm_up_tracker:
                run.step()
            recorder.begin_step()

        load_tracker = mem_tracker.MemTracker()
        _track(load_tracker, mem_tracker, run)
        with load_tracker:
            load = _device_snapshot(load_tracker.get_tracker_snapshot("current"))
        # With gradient accumulation the last micro-batch is the steady state: the gradients of the earlier ones
        # are alive through its forward and its backward adds to them. (MemTracker follows one forward per
        # tracker.)
        for _ in range(settings.grad_accum - 1):
            if recorder is None:
                run.micro_batch()
            else:
                _recorded_micro_batch(mem_tracker, run)
        forward, backward, peaks = tracked_micro_batch(mem_tracker, run, module_peaks)

        step_tracker = mem_tracker.MemTracker()
        _track(step_tracker, mem_tracker, run)
        with step_tracker:
            run.step()
        optimizer_peak = _device_snapshot(step_tracker.get_tracker_snapshot("peak"))
        between = _device_snapshot(step_tracker.get_tracker_snapshot("current"))
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
    return TraceResult(phases, time.perf_counter() - started, round_to_cuda, run.offloaded_peak_bytes,
                       recorder.log() if recorder is not None else None, peaks)


def tracked_micro_batch(mem_tracker: Any, run: Any, module_peaks: bool = True
                        ) -> tuple[dict[str, int], dict[str, int], dict[str, tuple[Phase | None, Phase | None]] | None]:
    """One micro-batch of ``run`` under a recompute-aware MemTracker: the device's bytes at the forward and the
    backward peak, and each module's peaks (None unless ``module_peaks``)."""
    tracker = _recompute_aware_tracker(mem_tracker, run)
    _track(tracker, mem_tracker, run)
    with tracker:
        run.micro_batch()
    stats = tracker.memory_tracking[run.model].snapshots
    forward = _device_snapshot(stats[mem_tracker._ModState.PEAK_FW][-1])
    backward = _device_snapshot(stats[mem_tracker._ModState.PEAK_BW][-1])
    return forward, backward, _module_peaks(tracker, mem_tracker, run.model) if module_peaks else None


def _module_peaks(tracker: Any, mem_tracker: Any, model: Any) -> dict[str, tuple[Phase | None, Phase | None]]:
    """Each module's forward and backward peak snapshots (the largest where it ran more than once)."""
    out = {}
    for name, module in model.named_modules():
        info = tracker.memory_tracking.get(module)
        if info is None:
            continue
        pair = []
        for state, phase in ((mem_tracker._ModState.PEAK_FW, "forward"), (mem_tracker._ModState.PEAK_BW, "backward")):
            snaps = [_phase(phase, f"peak in {name or 'the model'}", _device_snapshot(s))
                     for s in info.snapshots.get(state, ())]
            pair.append(max(snaps, key=lambda ph: ph.allocated_bytes) if snaps else None)
        out[name] = (pair[0], pair[1])
    return out


def _recorded_micro_batch(mem_tracker: Any, run: Any) -> None:
    """A micro-batch the trace does not measure, under a tracker all the same so that its allocations are recorded
    with the corrections a measured one gets (what a GPU runs in place)."""
    tracker = _recompute_aware_tracker(mem_tracker, run)
    _track(tracker, mem_tracker, run)
    with tracker:
        run.micro_batch()


@contextlib.contextmanager
def _fake_process_group(world: int) -> Iterator[Any]:
    """Rank 0 of ``world`` ranks on PyTorch's fake process group, whose collectives move no data, and its 1-D device
    mesh (made outside FakeTensorMode: it computes the rank's coordinates)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def _tracked_optimizer_step(tracker: Any, optimizer: Any) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """What ``tracker`` sees before ``optimizer.step()``, at its peak, and after ``zero_grad(set_to_none=True)``."""
    with tracker:
        before = _device_snapshot(tracker.get_tracker_snapshot("current"))
        optimizer.step()
        peak = _device_snapshot(tracker.get_tracker_snapshot("peak"))
        optimizer.zero_grad(set_to_none=True)
        after = _device_snapshot(tracker.get_tracker_snapshot("current"))
    return before, peak, after


def _rank_phases(load: Phase, forward: Phase, backward: Phase, before: dict[str, int], peak: dict[str, int],
                 after: dict[str, int]) -> tuple[Phase, ...]:
    """The five phases of one traced rank: the optimizer step's peak holds the gradients it started with and the
    states it ends with; the rest of what it allocated is its temporaries."""
    states, gradients = after.get("Optstate", 0), before.get("Gradient", 0)
    step = _phase("optimizer", "step()", peak)
    step = Phase("optimizer", "step()", step.parameters, gradients, states, 0,
                 step.allocated_bytes - step.parameters - gradients - states)
    return load, forward, backward, step, _phase("between_steps", "after zero_grad", after)


FSDP_TRACE_RECIPES = {"fp32": None, "amp-bf16": None, "mixed-bf16": "bfloat16", "mixed-fp16": "float16",
                      "pure-bf16-bf16states": None}
"""The recipes an FSDP2 trace runs, with MixedPrecisionPolicy's param_dtype: the mixed recipes keep fp32 shards
(the masters) and compute in half precision; the others compute in the dtype of their parameters."""

_FSDP_CATEGORY = {"SHARDED_PARAM": "parameters", "UNSHARDED_PARAM": "parameters", "BUFFER": "parameters",
                  "SHARDED_GRAD": "gradients", "UNSHARDED_GRAD": "gradients", "ACT": "activations",
                  "INP": "activations", "TEMP": "temporaries", "ALL_GATHER": "temporaries",
                  "REDUCE_SCATTER": "temporaries", "OPT": "optimizer_states"}


def _fsdp_phase(name: str, moment: str, snapshot: dict[Any, dict[Any, int]]) -> Phase:
    values: dict[str, Any] = dict.fromkeys(CATEGORIES, 0)  # (Phase's byte fields, as keywords)
    for per_device in snapshot.values():
        for key, nbytes in per_device.items():
            category = _FSDP_CATEGORY.get(str(key).rsplit(".", 1)[-1])
            if category:
                values[category] += nbytes
    return Phase(name, moment, **values)


def check_fsdp_traceable(settings: TrainingSettings, parallel: Parallel) -> None:
    """Refuse, before torch is imported, what the FSDP2 trace does not run."""
    if parallel.fsdp not in ("full", "grad-op") or parallel.offload != "none":
        raise ConfigError("trace runs FSDP2 as --fsdp full or grad-op, without offload")
    if settings.recipe not in FSDP_TRACE_RECIPES:
        raise ConfigError(f"trace --fsdp runs the recipes {', '.join(FSDP_TRACE_RECIPES)}; got {settings.recipe!r}")
    if settings.optimizer not in ("adamw", "adam", "sgd") or settings.grad_accum != 1:
        raise ConfigError("trace --fsdp runs adamw, adam or sgd, without gradient accumulation")
    if settings.attention == "flash" or settings.loss != "standard":
        raise ConfigError("trace --fsdp runs sdpa or eager attention and the standard loss")
    if settings.checkpointing == "selective":
        raise ConfigError("trace --fsdp runs --checkpointing none, op or full; selective is traced on one GPU")
    for flag, on in (("--optimizer-in-backward", settings.optimizer_in_backward), ("--compile", settings.compile),
                     ("--offload-activations", settings.offload_activations)):
        if on:
            raise ConfigError(f"trace --fsdp does not run {flag} yet (the single-GPU trace does)")


def _fsdp_model(config: dict[str, Any], settings: TrainingSettings, parallel: Parallel, mesh: Any,
                spec: ModelSpec | None, finetune: FineTune | None) -> tuple[Any, Any]:
    """The model ``fully_shard``-ed as torchtitan and torchtune wrap it (every decoder layer, then the root) and the
    optimizer over what trains. Full fine-tuning under a mixed recipe builds fp32 shards (the masters) computed in
    half precision (MixedPrecisionPolicy); LoRA builds peft's model as the one-GPU trace does (a base in the recipe's
    weights, fp32 adapters) and shards each parameter in its own dtype, as torchtune's LoRA recipes (no policy)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .probe import build_lora_model, build_model
    from .step import causal_lm, enable_checkpointing

    recipe = get_recipe(settings.recipe)
    half = FSDP_TRACE_RECIPES[settings.recipe] if finetune is None else None
    if finetune is None:
        model = build_model(config, get_recipe("fp32") if half else recipe, settings.attention, settings.dropout)
    else:
        model = build_lora_model(config, recipe, settings.attention, settings.dropout, finetune, spec)
    if settings.checkpointing in ("full", "op"):
        enable_checkpointing(model, op_sac=settings.checkpointing == "op")
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, half), reduce_dtype=torch.float32) if half \
        else MixedPrecisionPolicy()
    lm = causal_lm(model)
    if parallel.fsdp_embedding_groups:  # torchtune's shard_model: modules in reverse order, the head first
        fully_shard(lm.get_output_embeddings(), mesh=mesh, mp_policy=policy)
    for layer in reversed(lm.model.layers) if parallel.fsdp_embedding_groups else lm.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=parallel.fsdp == "full")
    if parallel.fsdp_embedding_groups:
        fully_shard(lm.get_input_embeddings(), mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer_class = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    fused = settings.fused_optimizer
    trained = [p for p in model.parameters() if p.requires_grad]
    if finetune is not None and any(p.dtype != torch.float32 for p in trained) and recipe.master_weights:
        raise ConfigError("trace --fsdp with --lora runs adapters without master copies: give fp32 adapters "
                          "(--adapter-dtype auto or fp32) or a recipe without masters")
    optimizer = optimizer_class[settings.optimizer](trained, lr=1e-4, foreach=not fused, fused=fused or None)
    return model, optimizer


def trace_fsdp_step(config: dict[str, Any], settings: TrainingSettings, parallel: Parallel,
                    spec: ModelSpec | None = None, round_to_cuda: bool = True, finetune: FineTune | None = None,
                    record_allocations: bool = False) -> TraceResult:
    """One rank of an FSDP2 run (``fully_shard`` on every decoder layer and the root), traced under FakeTensorMode
    with PyTorch's fake process group, whose collectives move no data: rank 0, which holds the largest shards.
    PyTorch's FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker) follows every storage, collective
    buffers included, with the trace's corrections (what a GPU runs in place); a warm-up step first creates the
    sharded optimizer states, as torchtitan's estimation script does. ``record_allocations`` records the
    allocations and frees of both steps, as trace_step's (the sharded model and optimizer seen as the tracker
    starts, before the first step), and keeps the second (AllocationLog.from_step), on the one stream the fake process group runs: FSDP2's all-gather and
    reduce-scatter buffers, which a GPU allocates on their own streams, share the default stream's pool here."""
    import torch
    from torch.distributed._tools import fsdp2_mem_tracker, mem_tracker

    from .step import vocab_size

    check_fsdp_traceable(settings, parallel)
    started = time.perf_counter()
    recorder = _AllocationRecorder() if record_allocations else None
    with _fake_process_group(parallel.gpus) as mesh, _cuda_block_sizes(round_to_cuda), fake_gpu(), \
            _recording(recorder):
        recipe = get_recipe(settings.recipe)
        model, optimizer = _fsdp_model(config, settings, parallel, mesh, spec, finetune)
        ids = torch.randint(0, vocab_size(config, model), (settings.batch, settings.seq))
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if recipe.autocast else contextlib.nullcontext()

        class Run:  # what the corrections need to know (no recompute marker: every checkpointed op is tagged)
            recomputing = False

        tracker = _recompute_aware_tracker(mem_tracker, Run, fsdp2_mem_tracker.FSDPMemTracker,
                                           fsdp2_mem_tracker._FSDPRefType.TEMP, mod=model, optm=optimizer)
        tracker.track_inputs((ids,))
        with tracker:
            for iteration in range(2):
                if recorder is not None:
                    recorder.begin_step()
                with autocast:
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                del loss
                if iteration == 0:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()
            snapshots = tracker.memory_tracking[model].snapshots
            forward = snapshots[fsdp2_mem_tracker._FSDPModState.PEAK_FW][-1]
            backward = max(snapshots[fsdp2_mem_tracker._FSDPModState.PEAK_BW],
                           key=lambda s: sum(v for d in s.values() for k, v in d.items() if str(k) == "Total"))
        step_tracker = mem_tracker.MemTracker()
        step_tracker.track_external(model, optimizer)
        before, peak, after = _tracked_optimizer_step(step_tracker, optimizer)
    phases = _rank_phases(_phase("load", "static state", after), _fsdp_phase("forward", "peak of forward", forward),
                          _fsdp_phase("backward", "peak of backward", backward), before, peak, after)
    # (the log from the second step: the first, on the fake process group, allocates full-size fp32 optimizer
    # temporaries of the embedding and the head that the second does not, and a GPU's steady state is the
    # second step's; replay() repeats it to make two)
    return TraceResult(phases, time.perf_counter() - started, round_to_cuda,
                       allocations=recorder.log().from_step(1) if recorder is not None else None)


TP_TRACE_RECIPES = ("fp32", "pure-bf16-bf16states")
"""The recipes a tensor-parallel trace runs: one dtype throughout (DTensor and CPU autocast do not mix here)."""


def check_tp_traceable(settings: TrainingSettings, parallel: Parallel, spec: ModelSpec | None) -> None:
    """Refuse, before torch is imported, what the tensor-parallel trace does not run."""
    if parallel.pp > 1 or parallel.cp > 1 or parallel.ep > 1 or parallel.gpus != parallel.tp:
        raise ConfigError("trace runs tensor parallelism alone: give --gpus equal to --tp, without --pp, --cp, --ep")
    if parallel.zero is not None or parallel.fsdp is not None:
        raise ConfigError("trace --tp runs without --zero or --fsdp")
    if settings.recipe not in TP_TRACE_RECIPES:
        raise ConfigError(f"trace --tp runs the recipes {', '.join(TP_TRACE_RECIPES)}; got {settings.recipe!r}")
    if settings.optimizer not in ("adamw", "adam", "sgd") or settings.grad_accum != 1:
        raise ConfigError("trace --tp runs adamw, adam or sgd, without gradient accumulation")
    if settings.attention == "flash" or settings.loss != "standard" or settings.checkpointing != "none":
        raise ConfigError("trace --tp runs sdpa or eager attention, the standard loss, no checkpointing")
    for flag, on in (("--optimizer-in-backward", settings.optimizer_in_backward), ("--compile", settings.compile),
                     ("--offload-activations", settings.offload_activations)):
        if on:
            raise ConfigError(f"trace --tp does not run {flag}")
    if spec is not None and (spec.traits.block != "standard" or spec.is_moe or not spec.layer_runs
                             or any(layer.attention.fused_qkv or layer.attention.kind != "mha"
                                    or (layer.mlp and not layer.mlp.gated) for layer, _ in spec.layer_runs)):
        raise ConfigError("trace --tp runs Llama-style models (separate q/k/v, gated MLP, no MoE): "
                          "llama, mistral, qwen2, qwen3, gemma families")


def _tp_plan(sp: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """torchtitan's Llama plan (torchtitan/models/llama3/infra/parallelize.py, apply_tp) on transformers' module
    names: the root's (vocabulary-parallel embedding and LM head, sequence-parallel final norm) and each layer's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    seq = Shard(1) if sp else Replicate()
    root = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    layer = {f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    layer |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
              "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
              "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
    if sp:
        root["model.norm"] = SequenceParallel()
        layer |= {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                  "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                  desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                  "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    return root, layer


@contextlib.contextmanager
def _sharding_propagation_untracked() -> Iterator[list[bool]]:
    """DTensor works out each op's global output shape by running the op on fake global-shape tensors
    (ShardingPropagator._propagate_tensor_meta_non_cached); a GPU run does that on fake tensors too, so it holds no
    memory, but under the trace's FakeTensorMode MemTracker would count those tensors. Yields a flag the trace's
    tracker reads to let them pass untracked."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    flag = [False]
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(self: Any, op_schema: Any) -> Any:
        flag[0] = True
        try:
            return original(self, op_schema)
        finally:
            flag[0] = False

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked
    try:
        yield flag
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def _tp_tracker(mem_tracker: Any, propagating: list[bool]) -> Any:
    # (mem_tracker is torch's module, passed in: trace imports torch only when it runs)
    class ShardingAwareTracker(mem_tracker.MemTracker):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if propagating[0]:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return ShardingAwareTracker()


def trace_tp_step(config: dict[str, Any], settings: TrainingSettings, parallel: Parallel, spec: ModelSpec | None = None,
                  round_to_cuda: bool = True) -> TraceResult:
    """One rank of a tensor-parallel (and sequence-parallel with ``parallel.sp``) run: the transformers model split
    with PyTorch's DTensor plans as torchtitan splits Llama (``_tp_plan``), under FakeTensorMode and the fake
    process group, the loss computed on the vocabulary-sharded logits under ``loss_parallel`` (transformers' loss
    cannot take a DTensor). MemTracker follows rank 0's local tensors; a warm-up step creates the states."""
    import torch
    import torch.nn.functional as F
    from torch.distributed._tools import mem_tracker
    from torch.distributed.tensor import DTensor

    from .step import vocab_size
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from .probe import build_model

    check_tp_traceable(settings, parallel, spec)
    started = time.perf_counter()
    with (_fake_process_group(parallel.tp) as mesh, _cuda_block_sizes(round_to_cuda), fake_gpu(),
          _sharding_propagation_untracked() as propagating):
        model = build_model(config, get_recipe(settings.recipe), settings.attention, settings.dropout)
        root, layer_plan = _tp_plan(parallel.sp)
        for layer in model.model.layers:
            parallelize_module(layer, mesh, layer_plan)
        parallelize_module(model, mesh, root)
        optimizer_class = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
        fused = settings.fused_optimizer
        # foreach kernels take DTensors or plain tensors, not both: the replicated norms (plain tensors without
        # sequence parallelism) are a second parameter group, stepped after the split weights
        split = [p for p in model.parameters() if isinstance(p, DTensor)]
        whole = [p for p in model.parameters() if not isinstance(p, DTensor)]
        optimizer = optimizer_class[settings.optimizer](
            [g for g in ({"params": split}, {"params": whole}) if g["params"]], lr=1e-4, foreach=not fused,
            fused=fused or None)
        ids = torch.randint(0, vocab_size(config, model), (settings.batch, settings.seq))
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)

        # (with sequence parallelism the layers see 1/T of the sequence: the positions are given whole)
        positions = torch.arange(settings.seq).unsqueeze(0)

        class WithLoss(torch.nn.Module):  # type: ignore[misc]
            """The model and torchtitan's loss in one module, so that MemTracker's forward and backward
            peaks take the loss in, as the one-GPU trace's ``model(labels=...)`` does."""

            def __init__(self, model: Any) -> None:
                super().__init__()
                self.model = model

            def forward(self) -> Any:
                logits = self.model(input_ids=ids, position_ids=positions, use_cache=False).logits
                return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1), ignore_index=-100)

        step_module = WithLoss(model)

        def micro_batch() -> None:
            with loss_parallel():
                step_module().backward()

        micro_batch()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker = _tp_tracker(mem_tracker, propagating)
        tracker.track_external(step_module, optimizer)
        with tracker:
            load = _device_snapshot(tracker.get_tracker_snapshot("current"))
            micro_batch()
            stats = tracker.memory_tracking[step_module].snapshots
            forward = _device_snapshot(stats[mem_tracker._ModState.PEAK_FW][-1])
            backward = _device_snapshot(stats[mem_tracker._ModState.PEAK_BW][-1])
        step_tracker = _tp_tracker(mem_tracker, propagating)
        step_tracker.track_external(model, optimizer)
        before, peak, after = _tracked_optimizer_step(step_tracker, optimizer)
    phases = _rank_phases(_phase("load", "static state", load), _phase("forward", "peak of forward", forward),
                          _phase("backward", "peak of backward", backward), before, peak, after)
    return TraceResult(phases, time.perf_counter() - started, round_to_cuda)
