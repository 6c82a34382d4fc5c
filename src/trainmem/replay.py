"""The estimate's step as a sequence of allocations and frees, for the caching allocator model (allocator.py).

The estimate knows what is alive at every moment of the step (timeline.step_candidates: each moment's parameters,
gradients, optimizer states, activations and temporaries) and the sizes of the tensors behind them: the parameter
tensors (models.parameter_groups), the gradients backward makes for them in reverse order, the optimizer's states,
and every saved activation term of every layer (activations.py). This module walks those moments in the order
PyTorch runs the step and emits, between one moment and the next, the frees and allocations that take the live
bytes of each category from the one to the other:

- setup: the weights (and an fp32 master copy, made when the optimizer is built), gradients that live across steps;
- forward, layer by layer: the layer's saved tensors are allocated and kept, its output a transient;
- the timeline's forward moments (the last layer, the final norm, the loss and logits);
- backward, last layer first: gradients allocated on first touch in backward order, saved tensors freed last
  allocated first, each moment's temporaries allocated and freed;
- optimizer.step(): the states created lazily in the first step, the foreach temporaries one per parameter;
- zero_grad(set_to_none=True): the gradients freed; then the second step, alike.

At each moment the structural tensors (parameters, gradients, states, saved activations) are allocated from their
queue while they fit under the moment's bytes of their category and freed last-in-first-out while above it; what
remains of the category at that moment (a recomputed layer, the logits, a kernel's gradients) is one transient
allocation freed at the next moment. So the sequence's peak of live bytes is the estimate's peak allocated exactly
(tests/test_replay.py), and what the allocator model adds on top of it is the segments' slack: reserved memory.
The transient blocks are coarser than the real step's many small temporaries; docs/accuracy.md (Reserved memory)
compares the replay with the replay of the traced step's own allocations (trainmem trace --allocator).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from .allocator import DEFAULT_CONFIG, AllocationLog, AllocatorConfig, AllocEvent, ReplayReport, replay
from .hardware import DEFAULT_FRAGMENTATION
from .timeline import CATEGORIES, Phase, gathers_before_first_layer, step_candidates
from .units import format_bytes

if TYPE_CHECKING:  # (names for the annotations only)
    from .activations import ActivationEstimate
    from .estimate import DeviceOptions, Estimate
    from .models import ModelSpec
    from .stepmodel import StepModel
    from .timeline import _LayerBytes

_event = partial(tuple.__new__, AllocEvent)
"""AllocEvent((key, nbytes, label)) without the named tuple's Python-level __new__ (7,000 events an estimate)."""
MAX_TENSORS = 4096
"""Models with more parameter tensors than this (DeepSeek-V3: 47,000, one per expert matrix) are not replayed: the
Python allocator model handles about 50,000 events a second, and their estimate keeps the flat factor."""
STEPS = 2
"""Two steps: the first creates the optimizer states, the second is the steady state the figures are taken from."""


@dataclass(frozen=True)
class StepSequence:
    """The synthetic allocation log of two steps, and the estimate's figures it was built from."""

    log: AllocationLog
    peak_live: int
    """The largest sum of live (unrounded) bytes over the log: the estimate's peak allocated."""
    moments: int


def _split(total: int, weights: list[int]) -> list[int]:
    """``total`` bytes split in proportion to ``weights``, summing to ``total`` exactly (no zero sizes)."""
    whole = sum(weights)
    if total <= 0 or whole <= 0:
        return []
    out, acc, given = [], 0, 0
    for w in weights:
        acc += w
        size = total * acc // whole - given
        if size > 0:
            out.append(size)
            given += size
    return out


def _pieces(total: int, sizes: list[int]) -> list[int]:
    """``total`` bytes as the tensors ``sizes`` in order while they fit, and what is left as one more."""
    out, left = [], total
    for size in sizes:
        if 0 < size <= left:
            out.append(size)
            left -= size
    return out + ([left] if left > 0 else [])


def parameter_numels(spec: ModelSpec) -> list[int]:
    """Every parameter tensor's element count, in the order the model registers them (embedding first)."""
    return [t.numel for g in spec.param_groups for _ in range(g.repeat) for t in g.tensors]


class _Walker:
    """Emits the events that take each category's live bytes from moment to moment (module docstring)."""

    def __init__(self) -> None:
        self.events: list[AllocEvent] = []
        self.live: dict[str, list[tuple[int, int]]] = {c: [] for c in CATEGORIES}
        self.queue: dict[str, deque[int]] = {c: deque() for c in CATEGORIES}
        self.transients: dict[str, list[tuple[int, int]]] = {c: [] for c in CATEGORIES}
        self.held = dict.fromkeys(CATEGORIES, 0)
        self.temp = dict.fromkeys(CATEGORIES, 0)
        """The bytes of each category's live structural tensors and transients."""
        self.key = 0
        self.total = 0
        self.peak = 0
        self.moments = 0

    def _alloc(self, size: int, label: str) -> int:
        self.key = key = self.key + 1
        self.events.append(_event((key, size, label)))
        self.total = total = self.total + size
        if total > self.peak:
            self.peak = total
        return key

    def _free_down_to(self, tensors: list[tuple[int, int]], held: int, target: int) -> int:
        """Free ``tensors`` last made first while ``held`` (their bytes) is above ``target``; what is held then."""
        events = self.events
        while tensors and held > target:
            key, size = tensors.pop()
            events.append(_event((key, 0, "")))
            self.total -= size
            held -= size
        return held

    def to(self, phase: Phase, splits: dict[str, list[int]] | None = None,
           pieces: dict[str, list[int]] | None = None) -> None:
        """Reach ``phase``'s bytes. First the frees: each category's structural tensors down to its bytes, then
        its transients (last made first) down to what the structural tensors its queue can now add leave; then
        the allocations: those structural tensors, and what is still missing as one transient (or, per
        ``splits``, transients in those proportions; per ``pieces``, tensors of those sizes: _pieces). A transient
        that still fits is kept, as the tensor it stands for (the logits, a recomputed layer) lives on from moment
        to moment."""
        self.moments += 1
        targets = phase.by_category()
        fills: dict[str, list[int]] = {}
        for c in CATEGORIES:
            target, queue = targets[c], self.queue[c]
            self.held[c] = held = self._free_down_to(self.live[c], self.held[c], target)
            fill = fills[c] = []
            while queue and held + queue[0] <= target:
                fill.append(queue.popleft())
                held += fill[-1]
            keep = 0 if splits and c in splits else target - held
            self.temp[c] = self._free_down_to(self.transients[c], self.temp[c], keep)
        label = f"{phase.name}: {phase.moment}"
        for c in CATEGORIES:
            if fills[c]:
                structural, live = f"{c} ({phase.name})", self.live[c]
                for size in fills[c]:
                    live.append((self._alloc(size, structural), size))
                self.held[c] += sum(fills[c])
            rest = targets[c] - self.held[c] - self.temp[c]
            parts = (_split(rest, splits[c]) if splits and c in splits else
                     _pieces(rest, pieces[c]) if pieces and c in pieces and rest > 0 else [rest] if rest > 0 else [])
            if parts:
                transient, temps = f"{c} at {label}", self.transients[c]
                for size in parts:
                    temps.append((self._alloc(size, transient), size))
                self.temp[c] += sum(parts)


def _layer_terms(acts: ActivationEstimate) -> list[list[int]]:
    """Each decoder layer's saved tensors in bytes, in the order its forward makes them."""
    out = []
    for la in acts.layers:
        terms = la.checkpoint_terms if la.checkpointed else la.terms
        sizes = [int(t.bytes_per_token * acts.tokens) for t in terms]
        if la.constant_bytes and not la.checkpointed:
            sizes.insert(0, la.constant_bytes)  # (autocast's half weight copies are made as the layer starts)
        sizes = [s for s in sizes if s > 0]
        if la.checkpointed and acts.offloaded:
            sizes = []
        out.extend([sizes] * la.count)
    return out


def _forward_moments(step: StepModel, acts: ActivationEstimate, layers: tuple[_LayerBytes, ...],
                     first: Phase) -> list[Phase]:
    """A moment at the end of every decoder layer but the last (whose moments the timeline has): what the layers so
    far keep, with the layer's output being written (p.compute x h per token) or, checkpointed, its forward's own
    tensors."""
    from .activations import Precision

    p = Precision.of(step.recipe)
    base = acts.embedding_bytes + acts.constant_bytes + acts.decoder_locals_bytes + acts.mask_bytes
    out, kept = [], 0
    for index, x in enumerate(layers[:-1]):
        kept += x.kept
        transient = max(x.forward_transient, default=0) if x.checkpointed else \
            p.compute * step.spec.hidden_size * acts.tokens
        out.append(Phase("forward", f"layer {index}", first.parameters, first.gradients, first.optimizer_states,
                         base + kept + transient, 0))
    return out


def _queues(step: StepModel, acts: ActivationEstimate) -> dict[str, list[int]]:
    """The structural tensors of each category in the order they are made (gradients: backward's order)."""
    numels = parameter_numels(step.spec)
    static = step._static_bytes
    state_parts = 2 if "adam" in step.optimizer.name else 1  # (exp_avg and exp_avg_sq: torch.optim.adamw)
    states = _split(static["optimizer_states"], [n for n in numels for _ in range(state_parts)])
    # (the constants' "bytes per token" are bytes: rotary tables, the head's autocast copy; ActivationEstimate)
    activations = [int(t.bytes_per_token) for t in acts.constant_terms]
    activations += [int(t.bytes_per_token * acts.tokens) for t in acts.embedding_terms]
    for sizes in _layer_terms(acts):
        activations += sizes
    activations += [int(t.bytes_per_token * acts.tokens) for t in acts.head_terms]
    return {"parameters": _split(static["weights"], numels),
            "masters": _split(static["master_weights"], numels),
            "gradients": _split(static["gradients"], numels[::-1]),
            "optimizer_states": states,
            "activations": [a for a in activations if a > 0]}


def _patterns(step: StepModel, acts: ActivationEstimate) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The tensors a moment's transients are made of (_pieces): in a layer's moments, a layer's saved tensors
    (a recomputed layer, its gradients), largest first; at the loss (forward's last moment, backward's first),
    the logits, their fp32 upcast, and the two V-wide fp32 gradients of log_softmax and nll_loss
    (timeline.step_candidates)."""
    from .activations import FP32

    la = max(acts.layers, key=lambda la: la.bytes_per_token, default=None)
    sizes = sorted((int(t.bytes_per_token * acts.tokens) for t in la.terms), reverse=True) if la else []
    vocab = FP32 * step.spec.vocab_size * acts.tokens if step.spec.has_head else 0
    head = [acts.logits_bytes, acts.loss_transient_bytes, vocab, vocab]
    return ({"activations": sizes, "temporaries": sizes},
            {"activations": head + sizes, "temporaries": head + sizes})


def too_many_tensors(spec: ModelSpec) -> bool:
    """Whether ``spec`` has more parameter tensors than a replay takes (MAX_TENSORS)."""
    return sum(g.repeat * len(g.tensors) for g in spec.param_groups) > MAX_TENSORS


def step_sequence(step: StepModel, batch: int, seq: int) -> StepSequence | None:
    """The allocation log of two steps of ``step`` (a stepmodel.StepModel) at (batch, seq); None where the estimate
    has no layer-by-layer timeline (no architecture, the seed's activation rule)."""
    settings = step.settings_at(batch, seq)
    if not step.spec.has_architecture or settings.activation_k is not None or too_many_tensors(step.spec):
        return None
    acts, layers = step.activations_and_layers(settings)
    assert layers is not None  # (activations_and_layers makes the layers)
    load, forward, backward, optimizer, between = step_candidates(
        step.spec, step._static_bytes, acts, step.recipe, step.optimizer, settings, step.rank, step.finetune,
        every_layer=True, layers=layers)
    queues = _queues(step, acts)
    early = int(gathers_before_first_layer(step.rank))  # (the moment before the first layer comes first)
    forward = forward[:early] + tuple(_forward_moments(step, acts, layers, forward[-1])) + forward[early:]
    temps = {"temporaries": parameter_numels(step.spec)}  # (the foreach step's: one per parameter tensor)
    layer, loss = _patterns(step, acts)
    w = _Walker()
    w.queue["parameters"].extend(queues["parameters"])
    w.queue["optimizer_states"].extend(queues["masters"])
    masters = step._static_bytes["master_weights"]
    # (the fp32 masters are made with the optimizer, before the first step; its states in the first step)
    w.to(Phase("load", "model built", load[0].parameters, load[0].gradients, masters, 0, 0))
    starts = []
    for first in (True, False):
        starts.append(len(w.events))
        made = len(w.live["gradients"])  # (gradients that live across steps)
        w.queue["gradients"] = deque(queues["gradients"][made:])
        w.queue["activations"] = deque(queues["activations"])
        for index, ph in enumerate(forward + backward):
            w.to(Phase(ph.name, ph.moment, ph.parameters, ph.gradients, masters if first else ph.optimizer_states,
                       ph.activations, ph.temporaries), pieces=loss if index in (len(forward) - 1, len(forward))
                 else layer)
        w.queue["optimizer_states"].extend(queues["optimizer_states"] if first else ())
        for ph in optimizer:
            w.to(ph, temps)
        for ph in between:
            w.to(ph)
    last = between[-1]
    w.to(Phase("end", "steps done", last.parameters, last.gradients, last.optimizer_states, 0, 0))
    return StepSequence(AllocationLog(tuple(w.events), tuple(starts)), w.peak, w.moments)


def replay_step(step: StepModel, batch: int, seq: int, config: AllocatorConfig = DEFAULT_CONFIG,
                capacity: int | None = None, sequence: StepSequence | None = None) -> ReplayReport | None:
    """The caching allocator's figures for the estimate's sequence (``step_sequence``, or the one given), None
    where it has none."""
    sequence = sequence or step_sequence(step, batch, seq)
    if sequence is None:
        return None
    return replay(sequence.log, config, capacity=capacity, steps=STEPS)


def replayed_max_reserved(step: StepModel, batch: int, seq: int,
                          config: AllocatorConfig = DEFAULT_CONFIG) -> int | None:
    """The replay's max_memory_reserved() alone (allocator.max_reserved: one pass), None without a sequence."""
    from .allocator import max_reserved

    sequence = step_sequence(step, batch, seq)
    return None if sequence is None else max_reserved(sequence.log, config, STEPS)


def reserved_basis(est: Estimate) -> str:
    """How an estimate's reserved line was found, in words (report.py prints it beside the figure)."""
    dev, peak = est.device, est.peak
    assert peak is not None  # (the reserved line is printed under a peak)
    settings = (dev.alloc_config.describe() if dev.alloc_config is not None else "PyTorch's defaults")
    if peak.reserved_from == "replay" and est.allocator is not None:
        r = est.allocator
        return (f"the step replayed through torch 2.13's CUDACachingAllocator ({settings}): max_memory_reserved(), "
                f"{format_bytes(r.fragmentation, 'GiB')} fragmentation at the peak")
    if peak.reserved_from == "ratio":
        return (f"allocated + the fragmentation of this step replayed at micro-batch 1 through torch 2.13's "
                f"CUDACachingAllocator, as a fraction of the dynamic memory ({settings}); max_memory_reserved()")
    if dev.fragmentation is not None:
        return f"+ {dev.fragmentation:.0%} of the dynamic memory (--fragmentation); max_memory_reserved()"
    why = (f"over {MAX_TENSORS:,} parameter tensors to replay" if too_many_tensors(est.model) else
           "no layer-by-layer step to replay")
    return f"+ {DEFAULT_FRAGMENTATION:.0%} of the dynamic memory (flat: {why}); max_memory_reserved()"


def plan_reserved_note(device: DeviceOptions) -> str:
    """The line under a plan's table: how its "needed" column counts reserved memory (plan.search_ratio)."""
    settings = device.alloc_config.describe() if device.alloc_config is not None else "PyTorch's defaults"
    if device.fragmentation is not None:
        return f"reserved = allocated + {device.fragmentation:.0%} of the dynamic memory (--fragmentation)"
    if device.reserved_ratio is None:
        return ("reserved = allocated + the fragmentation of each layout's step replayed at micro-batch 1, as a "
                f"fraction of the dynamic memory ({settings}), as `trainmem estimate` counts a rank; "
                f"+ {DEFAULT_FRAGMENTATION:.0%} where a pipeline or tensor-parallel stage is also data-parallel")
    return (f"reserved = allocated + {device.reserved_ratio:.0%} of the dynamic memory: the fragmentation of the "
            f"model's one-GPU step replayed through the caching allocator ({settings}); `trainmem estimate` "
            "replays a layout's own step")


def reserved_dict(est: Estimate) -> dict[str, Any]:
    """The JSON's peak keys on reserved memory (the schema's peak.reserved_from, alloc_conf, allocator)."""
    dev = est.device
    assert est.peak is not None  # (the peak's keys)
    out = {"reserved_from": est.peak.reserved_from,
           "alloc_conf": dev.alloc_config.settings if dev.alloc_config is not None else "",
           "allocator": None}
    if est.peak.reserved_from == "replay" and est.allocator is not None:
        out["allocator"] = est.allocator.to_dict()
    return out


EXPLAIN_SEGMENTS = 12
"""--explain-reserved lists the largest segments at the peak, then sums the rest."""
EXPLAIN_POINTS = 16


def explain_reserved_lines(est: Estimate, unit: str) -> list[str]:
    """--explain-reserved: the replay's figures, the segments at the peak (size, used, largest free block: a
    split block the allocator cannot hand back) and allocated vs reserved through the two steps."""
    from .allocator import render_lines

    r = est.allocator
    b: Callable[[int], str] = lambda n: format_bytes(n, unit)  # noqa: E731
    lines = render_lines(r, None, unit)
    segments = sorted(r.segments_at_peak, key=lambda s: -s.total_size)
    lines.append(f"segments at the peak ({len(segments):,}; the largest {min(EXPLAIN_SEGMENTS, len(segments))}):")
    lines.append(f"  {'size':>12} {'used':>12} {'largest free':>12}  pool")
    for seg in segments[:EXPLAIN_SEGMENTS]:
        free = max((size for size, allocated in seg.blocks if not allocated), default=0)
        pool = "large" if seg.is_large else "small"
        lines.append(f"  {b(seg.total_size):>12} {b(seg.allocated_size):>12} {b(free):>12}  {pool}"
                     + (" (expandable)" if seg.is_expandable else ""))
    rest = segments[EXPLAIN_SEGMENTS:]
    if rest:
        lines.append(f"  {b(sum(s.total_size for s in rest)):>12} {b(sum(s.allocated_size for s in rest)):>12} "
                     f"{'':>12}  the other {len(rest):,} segments")
    lines.append(f"allocated vs reserved through the replay ({r.steps} steps; the peak is event {r.peak_event:,}, "
                 f"step {r.peak_step}):")
    lines.append(f"  {'event':>8} {'allocated':>12} {'reserved':>12}")
    stride = max(1, len(r.timeline) // EXPLAIN_POINTS)
    for event, allocated, reserved in r.timeline[::stride]:
        lines.append(f"  {event:>8,} {b(allocated):>12} {b(reserved):>12}")
    return lines
