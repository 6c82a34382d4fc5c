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

from .allocator import DEFAULT_CONFIG, AllocationLog, AllocatorConfig, AllocEvent, ReplayReport, replay
from .timeline import CATEGORIES, Phase, step_candidates

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


def parameter_numels(spec) -> list[int]:
    """Every parameter tensor's element count, in the order the model registers them (embedding first)."""
    return [t.numel for g in spec.param_groups for _ in range(g.repeat) for t in g.tensors]


class _Walker:
    """Emits the events that take each category's live bytes from moment to moment (module docstring)."""

    def __init__(self) -> None:
        self.events: list[AllocEvent] = []
        self.live: dict[str, list[tuple[int, int]]] = {c: [] for c in CATEGORIES}
        self.queue: dict[str, deque[int]] = {c: deque() for c in CATEGORIES}
        self.transients: list[tuple[int, int]] = []
        self.key = 0
        self.total = 0
        self.peak = 0
        self.moments = 0

    def _alloc(self, size: int, label: str) -> int:
        self.key += 1
        self.events.append(AllocEvent(self.key, size, label))
        self.total += size
        self.peak = max(self.peak, self.total)
        return self.key

    def _free(self, key: int, size: int) -> None:
        self.events.append(AllocEvent(key))
        self.total -= size

    def held(self, category: str) -> int:
        return sum(size for _, size in self.live[category])

    def to(self, phase: Phase, splits: dict[str, list[int]] | None = None) -> None:
        """Reach ``phase``'s bytes: transients of the last moment freed, each category freed down to or filled up
        to its bytes, the rest of it a transient (or, per ``splits``, transients in those proportions)."""
        self.moments += 1
        for key, size in self.transients:
            self._free(key, size)
        self.transients = []
        targets = phase.by_category()
        for c in CATEGORIES:
            while self.live[c] and self.held(c) > targets[c]:
                self._free(*self.live[c].pop())
        label = f"{phase.name}: {phase.moment}"
        for c in CATEGORIES:
            held, queue = self.held(c), self.queue[c]
            while queue and held + queue[0] <= targets[c]:
                size = queue.popleft()
                self.live[c].append((self._alloc(size, f"{c} ({phase.name})"), size))
                held += size
            rest = targets[c] - held
            parts = _split(rest, splits[c]) if splits and c in splits else ([rest] if rest > 0 else [])
            for size in parts:
                self.transients.append((self._alloc(size, f"{c} at {label}"), size))


def _layer_terms(acts) -> list[list[int]]:
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


def _forward_moments(step, acts, layers, first: Phase) -> list[Phase]:
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


def _queues(step, acts) -> dict[str, list[int]]:
    """The structural tensors of each category in the order they are made (gradients: backward's order)."""
    numels = parameter_numels(step.spec)
    static = step._static_bytes
    state_parts = 2 if "adam" in step.optimizer.name else 1  # (exp_avg and exp_avg_sq: torch.optim.adamw)
    states = _split(static["optimizer_states"], [n for n in numels for _ in range(state_parts)])
    activations = [int(t.bytes_per_token * acts.tokens) for t in acts.constant_terms + acts.embedding_terms]
    for sizes in _layer_terms(acts):
        activations += sizes
    activations += [int(t.bytes_per_token * acts.tokens) for t in acts.head_terms]
    return {"parameters": _split(static["weights"], numels) + _split(static["master_weights"], numels),
            "gradients": _split(static["gradients"], numels[::-1]),
            "optimizer_states": states,
            "activations": [a for a in activations if a > 0]}


def step_sequence(step, batch: int, seq: int) -> StepSequence | None:
    """The allocation log of two steps of ``step`` (a stepmodel.StepModel) at (batch, seq); None where the estimate
    has no layer-by-layer timeline (no architecture, the seed's activation rule)."""
    from .stepmodel import _activations_at

    settings = step.settings_at(batch, seq)
    if not step.spec.has_architecture or settings.activation_k is not None:
        return None
    acts, layers = _activations_at(step.spec, step.recipe, settings, step.finetune)
    load, forward, backward, optimizer, between = step_candidates(
        step.spec, step._static_bytes, acts, step.recipe, step.optimizer, settings, step.rank, step.finetune,
        every_layer=True, layers=layers)
    queues = _queues(step, acts)
    forward = tuple(_forward_moments(step, acts, layers, forward[-1])) + forward
    temps = {"temporaries": parameter_numels(step.spec)}  # (the foreach step's: one per parameter tensor)
    w = _Walker()
    w.queue["parameters"].extend(queues["parameters"])
    setup = Phase("load", "model built", load[0].parameters, load[0].gradients, 0, 0, 0)
    w.to(setup)
    w.queue["parameters"].clear()  # (the masters are allocated with the weights: what the load phase holds)
    starts = []
    for first in (True, False):
        starts.append(len(w.events))
        made = len(w.live["gradients"])
        w.queue["gradients"] = deque(queues["gradients"][made:])
        w.queue["activations"] = deque(queues["activations"])
        for ph in forward + backward:
            w.to(Phase(ph.name, ph.moment, ph.parameters, ph.gradients, 0 if first else ph.optimizer_states,
                       ph.activations, ph.temporaries))
        w.queue["optimizer_states"].extend(queues["optimizer_states"] if first else ())
        for ph in optimizer:
            w.to(ph, temps)
        for ph in between:
            w.to(ph)
    w.to(Phase("end", "steps done", *(getattr(between[-1], c) for c in CATEGORIES[:3]), 0, 0))
    return StepSequence(AllocationLog(tuple(w.events), tuple(starts)), w.peak, w.moments)


def replay_step(step, batch: int, seq: int, config: AllocatorConfig = DEFAULT_CONFIG,
                capacity: int | None = None) -> ReplayReport | None:
    """The caching allocator's figures for the estimate's sequence (``step_sequence``), None where it has none."""
    sequence = step_sequence(step, batch, seq)
    if sequence is None:
        return None
    return replay(sequence.log, config, capacity=capacity, steps=STEPS)
