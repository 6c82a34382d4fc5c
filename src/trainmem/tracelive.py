"""What is alive at each traced phase's peak, tensor by tensor: the trace side of ``trainmem diff``.

``trace.trace_step`` measures a step with torch's MemTracker (torch/distributed/_tools/mem_tracker.py), which sums
storages by category. :func:`live_sets` runs the same ``trace_step`` with :class:`LiveRecorder` watching the
trackers it makes: every storage MemTracker sees gets a record (the ATen op whose output it is, the deepest module
running then, its dtype and shape, the module that first saved it for backward), and at each moment a tracker
raises a peak the recorder copies the tracker's live storages with the category and the bytes MemTracker counts for
each. The peaks kept are the ones ``trace_step`` reports: the model's forward and backward peaks
(``_ModState.PEAK_FW`` / ``PEAK_BW`` of the root module) of the measured micro-batch, and the global peak of the
tracker around ``optimizer.step()``. The recorder only reads, so the trace's numbers are the same with it.

Owners: every module is classified once (:func:`_module_owners`): the decoder layer it is in, the token/position
embeddings, the LM head, the other modules of the base model with parameters of their own (the final norm), the
root (what the CausalLM forward computes itself: the loss), the rest of the base model (rotary tables, masks).
A tensor belongs to the parameter it is (parameters, their gradients, fp32 masters, optimizer states), else to the
owner of the modules that saved it for backward (a pack hook: ``torch.autograd.graph.saved_tensors_hooks``; a
checkpointed layer keeps its input) or to the model where several owners save it (the rotary tables every layer
keeps), else to the module that made it.

Needs torch and transformers.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from .owners import Owner, OwnerKind

if TYPE_CHECKING:
    from .lora import FineTune
    from .models import ModelSpec
    from .settings import TrainingSettings
    from .step import TrainingStep
    from .trace import TraceResult

_CATEGORY_OF = {
    "Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients", "Optstate": "optimizer_states",
    "Activation": "activations", "Temp": "temporaries", "Other": "optimizer_states",
}
"""MemTracker's reference types as trainmem's categories (trace._CATEGORY_OF)."""


@dataclass
class _Record:
    """One storage as the trace saw it."""

    seq: int
    op: str = ""
    """The ATen op whose output it is ("" for what was registered from outside: parameters, states)."""
    module: str = ""
    """ModTracker's name of the deepest module running when it was made ("" outside every module)."""
    savers: set[str] = field(default_factory=set)
    """ModTracker's names of the modules running when autograd saved it for backward."""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    owner: Owner | None = None
    """Set for parameters, their gradients, masters and optimizer states (the parameter's owner)."""


@dataclass(frozen=True)
class TracedTensor:
    """A storage alive at a traced peak."""

    category: str
    owner: Owner
    nbytes: int
    """What MemTracker counts for it (rounded to 512 B unless the trace keeps raw sizes)."""
    op: str
    dtype: str
    shape: tuple[int, ...]
    module: str
    """The module that made it (ModTracker's name), "" outside every module."""


@dataclass
class _Snapshot:
    entered: int
    """The record sequence number when its tracker was entered (what the tracker made is newer)."""
    live: list[tuple[_Record, str, int]] = field(default_factory=list)
    """[(record, MemTracker reference type value, bytes)]."""


class LiveRecorder:
    """Records every storage the trace's MemTrackers see and their live sets at the trace's peaks."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[Any, _Record]] = {}  # id(storage) -> (weakref to it, record)
        self._seq = itertools.count()
        self.op = ""
        self.tracker: Any = None
        self._entered: dict[int, int] = {}
        self.forward: _Snapshot | None = None
        self.backward: _Snapshot | None = None
        self.optimizer: _Snapshot | None = None
        self._optimizer_tracker: int | None = None
        self.owners: dict[str, Owner] = {}
        """ModTracker's module names -> owners, filled as trackers exit."""

    # -- records ------------------------------------------------------------------------------------------------

    def record(self, storage: Any) -> _Record:
        ident = id(storage)
        entry = self._records.get(ident)
        if entry is not None and entry[0]() is storage:
            return entry[1]
        rec = _Record(next(self._seq), self.op, _deepest(self.tracker))
        self._records[ident] = (weakref.ref(storage), rec)
        return rec

    def describe(self, tensor: Any) -> None:
        from torch.distributed._tools.common_utils import get_untyped_storages

        for st in get_untyped_storages(tensor):
            rec = self.record(st)
            if not rec.shape and not rec.dtype:
                rec.shape, rec.dtype = tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")

    def saved(self, tensor: Any, by: str | None = None) -> None:
        rec = self.record(tensor.untyped_storage())
        rec.savers.add(_deepest(self.tracker) if by is None else by)

    def own(self, tensor: Any, owner: Owner) -> None:
        self.describe(tensor)
        self.record(tensor.untyped_storage()).owner = owner

    # -- peaks --------------------------------------------------------------------------------------------------

    def entered(self, tracker: Any) -> None:
        self._entered[id(tracker)] = next(self._seq)
        self._global_peak(tracker)

    def _snapshot(self, tracker: Any) -> _Snapshot:
        snap = _Snapshot(self._entered.get(id(tracker), 0))
        for st, (winfo, _) in tracker._WINFO.items():
            snap.live.append((self.record(st), getattr(winfo.reftype, "value", str(winfo.reftype)),
                              winfo.mem_consumed))
        return snap

    def peak_updated(self, tracker: Any, root_peaks: tuple[int, int], before: tuple[int, int],
                     global_before: int) -> None:
        """After MemTracker's ``_update_peak_stats``: copy the live set where the root's forward or backward peak, or
        the tracker's global peak, rose."""
        if root_peaks[0] > before[0]:
            self.forward = self._snapshot(tracker)
        if root_peaks[1] > before[1]:
            self.backward = self._snapshot(tracker)
        if sum(tracker._peak_mem.values()) > global_before:
            self._global_peak(tracker)

    def _global_peak(self, tracker: Any) -> None:
        self.optimizer = self._snapshot(tracker)
        self._optimizer_tracker = id(tracker)

    def exited(self, tracker: Any) -> None:
        """While the tracker's modules and optimizers are alive: name their owners and their parameters'."""
        known = dict(tracker._mod_tracker._known_modules.items())
        run = getattr(tracker, "trainmem_step", None)
        roots = [run.model] if run is not None else [m for m, name in known.items() if "." not in name]
        for root in roots:
            by_module = _module_owners(root)
            for module, name in known.items():
                owner = by_module.get(id(module))
                if owner is not None:
                    self.owners[name] = owner
            self._own_parameters(root, by_module, run)

    def _own_parameters(self, root: Any, by_module: dict[int, Owner], run: TrainingStep | None) -> None:
        """Parameters, buffers and gradients by the module they are in; the fp32 masters, main-grad buffers and
        optimizer states of ``run`` (step.TrainingStep, as trace._track hands it over) by their parameter's."""
        import torch

        of_param: dict[int, Owner] = {}
        for module in root.modules():
            owner = by_module.get(id(module), Owner(OwnerKind.MODEL))
            for param in module.parameters(recurse=False):
                of_param.setdefault(id(param), owner)
            for buffer in module.buffers(recurse=False):
                self.own(buffer, owner)
        for param in root.parameters():
            self.own(param, of_param[id(param)])
            if param.grad is not None:
                self.own(param.grad, of_param[id(param)])
        if run is None:
            return
        for copies in (run.masters, run.main_grads):
            for copy, param in zip(copies or (), run.params):
                of_param[id(copy)] = of_param.get(id(param), Owner(OwnerKind.MODEL))
                self.own(copy, of_param[id(copy)])
        optimizers = list(run.optimizers.values()) if run.optimizers is not None else [run.optimizer]
        for optimizer in (part for opt in optimizers for part in getattr(opt, "parts", (opt,))):
            for param, states in optimizer.state.items():
                owner = of_param.get(id(param), Owner(OwnerKind.OPTIMIZER))
                for value in states.values():
                    if isinstance(value, torch.Tensor):
                        self.own(value, owner)

    # -- the answer ---------------------------------------------------------------------------------------------

    def tensors(self) -> dict[str, tuple[TracedTensor, ...]]:
        """The live tensors of forward, backward and the optimizer step at their traced peaks."""
        out = {}
        for phase, snap in (("forward", self.forward), ("backward", self.backward), ("optimizer", self.optimizer)):
            if snap is not None:
                out[phase] = tuple(self._traced(phase, snap, rec, ref, nbytes) for rec, ref, nbytes in snap.live
                                   if nbytes > 0)
        return out

    def _traced(self, phase: str, snap: _Snapshot, rec: _Record, reftype: str, nbytes: int) -> TracedTensor:
        category = _CATEGORY_OF.get(reftype, "temporaries")
        if phase == "optimizer" and (category == "activations"
                                     or (category == "optimizer_states" and rec.seq > snap.entered)):
            category = "temporaries"  # as trace_step re-tags what optimizer.step() and its fp32 copies allocate
        return TracedTensor(category, self._owner(rec, phase), nbytes, rec.op, rec.dtype, rec.shape, rec.module)

    def _owner(self, rec: _Record, phase: str) -> Owner:
        if rec.owner is not None:
            return rec.owner
        savers = {owner for owner in map(self.owners.get, rec.savers) if owner is not None}
        if len(savers) > 1:  # (the rotary tables every layer keeps)
            return Owner(OwnerKind.MODEL)
        if savers:
            return savers.pop()
        made = self.owners.get(rec.module)
        if made is not None:
            return made
        return Owner(OwnerKind.OPTIMIZER) if phase == "optimizer" else Owner(OwnerKind.MODEL)


def _deepest(tracker: Any) -> str:
    if tracker is None:
        return ""
    names = [n for n in tracker._mod_tracker.parents if n != "Global"]
    return max(names, key=lambda n: (n.count("."), n)) if names else ""


def _module_owners(root: Any) -> dict[int, Owner]:
    """id(module) -> its owner, for every module of ``root`` (a transformers model, or a wrapper of one)."""
    import torch

    base = getattr(root, "base_model", root)
    owners: dict[int, Owner] = {id(m): Owner(OwnerKind.LOSS) for m in root.modules()}
    for m in base.modules():
        owners[id(m)] = Owner(OwnerKind.MODEL)
    count = getattr(getattr(root, "config", None), "num_hidden_layers", None)
    layers = next((m for m in base.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count), None)
    in_layers: set[int] = set()
    for i, layer in enumerate(layers or ()):
        for m in layer.modules():
            owners[id(m)] = Owner(OwnerKind.LAYER, i)
            in_layers.add(id(m))
    for m in base.modules():
        if id(m) in in_layers or m is base:
            continue
        if isinstance(m, torch.nn.Embedding):
            owners[id(m)] = Owner(OwnerKind.EMBEDDING)
        elif any(True for _ in m.parameters(recurse=False)):
            owners[id(m)] = Owner(OwnerKind.FINAL_NORM)
    head = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
    if head is not None:
        for m in head.modules():
            owners[id(m)] = Owner(OwnerKind.HEAD)
    return owners


@contextlib.contextmanager
def recording(recorder: LiveRecorder) -> Iterator[LiveRecorder]:
    """Route what every MemTracker sees to ``recorder`` (class-level patches, undone on exit)."""
    from torch.distributed._tools import mem_tracker

    cls, info = mem_tracker.MemTracker, mem_tracker._WeakRefInfo
    saved = {name: cls.__dict__[name] for name in ("__enter__", "__exit__", "__torch_dispatch__",
                                                   "_update_peak_stats", "_pre_fw_hook")}
    create = info.__dict__["create_winfo"]

    def create_winfo(klass: Any, st: Any, device: Any, reftype: Any, callback: Any = None) -> Any:
        recorder.record(st)
        return create.__func__(klass, st, device, reftype, callback)

    info.create_winfo = classmethod(create_winfo)
    for name, fn in {**_lifecycle_patches(recorder, saved), **_counting_patches(recorder, saved)}.items():
        setattr(cls, name, fn)
    try:
        yield recorder
    finally:
        info.create_winfo = create
        for name, fn in saved.items():
            setattr(cls, name, fn)


def _lifecycle_patches(recorder: LiveRecorder, saved: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """A tracker's ``__enter__`` and ``__exit__`` (the pack hook around what it tracks; the owners named while its
    modules are alive) and ``_pre_fw_hook`` (what a checkpointed layer keeps)."""
    import torch

    pushed: list[Any] = []

    def enter(self: Any) -> Any:
        depth = self._depth
        result = saved["__enter__"](self)
        if depth == 0:
            recorder.tracker = self
            recorder.entered(self)
            hooks = torch.autograd.graph.saved_tensors_hooks(_pack(recorder), lambda x: x)
            hooks.__enter__()
            pushed.append(hooks)
        return result

    def exit_(self: Any, *args: Any) -> Any:
        if self._depth == 1:
            pushed.pop().__exit__(None, None, None)
            recorder.exited(self)
        return saved["__exit__"](self, *args)

    def pre_fw_hook(self: Any, module: Any, inputs: Any) -> None:
        saved["_pre_fw_hook"](self, module, inputs)
        if getattr(module, "gradient_checkpointing", False) and module.training and not self._mod_tracker.is_bw:
            # a checkpointed layer keeps its input for the recompute (torch.utils.checkpoint holds the arguments)
            name = self._mod_tracker.get_known_fqn(module) or ""
            for arg in inputs:
                if isinstance(arg, torch.Tensor):
                    recorder.saved(arg, name)

    return {"__enter__": enter, "__exit__": exit_, "_pre_fw_hook": pre_fw_hook}


def _counting_patches(recorder: LiveRecorder, saved: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """A tracker's ``__torch_dispatch__`` (the op that makes each output; the outputs' dtypes and shapes) and
    ``_update_peak_stats`` (the live set where a peak rose)."""
    import torch
    from torch.distributed._tools import mem_tracker
    from torch.utils._pytree import tree_map_only

    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        outer, recorder.op = recorder.op, str(func).removeprefix("aten.").removesuffix(".default")
        try:
            result = saved["__torch_dispatch__"](self, func, types, args, kwargs)
        finally:
            recorder.op = outer
        if result is not NotImplemented:
            tree_map_only(torch.Tensor, recorder.describe, result)
        return result

    def update_peak_stats(self: Any, peak_state: Any) -> None:
        root = _root_stats(self)
        before = _root_peaks(root, mem_tracker)
        global_before = sum(self._peak_mem.values())
        saved["_update_peak_stats"](self, peak_state)
        recorder.peak_updated(self, _root_peaks(root, mem_tracker), before, global_before)

    return {"__torch_dispatch__": dispatch, "_update_peak_stats": update_peak_stats}


def _pack(recorder: LiveRecorder) -> Callable[[Any], Any]:
    def pack(tensor: Any) -> Any:
        recorder.saved(tensor)
        return tensor

    return pack


def _root_stats(tracker: Any) -> Any:
    for stats in tracker.memory_tracking.values():
        if "." not in stats.mod_fqn:
            return stats
    return None


def _root_peaks(stats: Any, mem_tracker: Any) -> tuple[int, int]:
    """The root module's current forward and backward peak totals (0 before it has one)."""
    if stats is None:
        return (0, 0)
    out = []
    for state in (mem_tracker._ModState.PEAK_FW, mem_tracker._ModState.PEAK_BW):
        snaps = stats.snapshots.get(state)
        out.append(sum(d.get("Total", 0) for d in snaps[-1].values()) if snaps else 0)
    return out[0], out[1]


def live_sets(config: dict[str, Any], settings: TrainingSettings, spec: ModelSpec | None = None,
              round_to_cuda: bool = False, finetune: FineTune | None = None
              ) -> tuple[TraceResult, dict[str, tuple[TracedTensor, ...]]]:
    """``trace.trace_step`` with a :class:`LiveRecorder` watching: (its TraceResult, the live tensors at the
    forward, backward and optimizer peaks)."""
    from .trace import trace_step

    recorder = LiveRecorder()
    with recording(recorder):
        result = trace_step(config, settings, spec, round_to_cuda=round_to_cuda, finetune=finetune)
    return result, recorder.tensors()
