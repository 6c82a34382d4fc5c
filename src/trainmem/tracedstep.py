"""The traced path's switches (recorded.py): the micro-batch as an affine model, and a rank of a data-parallel engine.

- **The micro-batch.** For a fixed sequence length, every tensor the step allocates either has a batch dimension
  (the activations, the logits, the loss's upcasts: bytes proportional to the batch) or none (the model states,
  the optimizer's temporaries, RoPE's cos/sin tables, masks broadcast over the batch): each phase's every category
  is a constant plus a slope times the batch. A search (``--max-batch``, ``fits`` at other batches) therefore
  records the step at batches 2 and 3 and answers every batch ``b >= 4`` as ``v(2) + (b - 2) * (v(3) - v(2))``,
  per phase and category (no trace per candidate); batches 1 to 3 are recorded directly (at batch 1 a batched
  matmul can view where a larger batch copies: stepmodel.py's note). The line is checked against a third traced
  batch in tests/test_tracedstep.py; the trace's 512-byte rounding of small tensors makes it exact to a few kB.
- **A rank of DDP, ZeRO 1-3 or FSDP2.** The activations of a micro-batch are the same on every rank; what changes
  is the model states and the engine's buffers. Each recorded phase keeps its activations and temporaries and has
  one GPU's model states replaced by the rank's, as timeline.py lays them out for a hand-written family
  (``timeline._static``: weights, gradients alive in forward and between steps, states and masters; the optimizer's
  temporaries, ``timeline._optimizer_temporaries``), from sharding.rank_layout over the model's parameter tensors
  grouped per decoder layer (meta_count._grouped: FSDP2's one group per layer and the root). The gradients backward
  has finished are the rank's shard of them where the engine reduce-scatters as backward goes (ZeRO-2/3, FSDP2:
  the recorded bytes times the rank's gradient bytes over one GPU's). The engine's buffers (sharding.Buffer) are
  added where they are alive; a recorded phase does not say whether its peak is inside a decoder layer, before the
  layers or after them, so each phase takes the largest of its places' buffers (at most one layer's gathered
  parameters above the exact figure under FSDP2).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, TrainmemError
from .timeline import CATEGORIES, Phase, peak_of, with_buffers

if TYPE_CHECKING:
    from .estimate import Estimate
    from .recorded import Recorded
    from .settings import TrainingSettings
    from .stepmodel import StepModel
    from .timeline import _Static

BATCH_SAMPLES = (2, 3)
"""The batches the affine model is recorded at (module docstring); batches up to the last are recorded directly."""


def recorded_at(step: StepModel, batch: int, seq: int, progress: bool = True) -> Recorded:
    """recorded.recorded_phases for ``step`` at (batch, seq); a ConfigError naming why where the model's step cannot
    run on fake tensors."""
    from .recorded import missing_extra, recorded_phases

    reason = missing_extra()
    if reason is not None:
        raise ConfigError(reason)
    try:
        return recorded_phases(json.loads(step.spec.built_config), step.settings_at(batch, seq), step.spec,
                               progress, step.finetune)
    except TrainmemError:
        raise
    except Exception as exc:  # noqa: BLE001 (whatever the model's forward raises on fake tensors is its own)
        text = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise ConfigError(f"no peak: the traced path could not run this model's step on fake tensors ({text})") \
            from None


def affine(low: tuple[Phase, ...], high: tuple[Phase, ...], low_batch: int, high_batch: int,
           batch: int) -> tuple[Phase, ...]:
    """Each phase at ``batch``, on the line through its bytes at ``low_batch`` and ``high_batch``, per category."""
    out = []
    for a, b in zip(low, high, strict=True):
        values = {}
        for c in CATEGORIES:
            slope, rest = divmod(getattr(b, c) - getattr(a, c), high_batch - low_batch)
            values[c] = max(0, getattr(a, c) + slope * (batch - low_batch)
                            + rest * (batch - low_batch) // (high_batch - low_batch))
        out.append(Phase(a.name, a.moment, **values))
    return tuple(out)


def single_phases(step: StepModel, batch: int, seq: int,
                  progress: bool = False) -> tuple[tuple[Phase, ...], tuple[tuple[str, Phase], ...]]:
    """One GPU's phases at (batch, seq) and their moments by place (recorded.Recorded.places): recorded directly up
    to the last of BATCH_SAMPLES, else on the line through them (module docstring)."""
    low, high = BATCH_SAMPLES
    if batch <= high:
        found = recorded_at(step, batch, seq, progress)
        return found.phases, found.places
    a, b = recorded_at(step, low, seq, progress), recorded_at(step, high, seq, progress)
    at_high = dict(b.places)
    both = [(label, p) for label, p in a.places if label in at_high]
    places = affine(tuple(p for _, p in both), tuple(at_high[label] for label, _ in both), low, high, batch)
    return (affine(a.phases, b.phases, low, high, batch),
            tuple((label, p) for (label, _), p in zip(both, places, strict=True)))


def _on_rank(ph: Phase, one: _Static, mine: _Static, scale: float, temp: int) -> Phase:
    """One GPU's phase ``ph`` with the rank's model states in place of one GPU's (module docstring)."""
    grads = {"forward": ph.gradients - one.grads_in_forward + mine.grads_in_forward,
             "backward": max(mine.grads_in_forward, int(ph.gradients * scale)),
             "optimizer": ph.gradients - one.grads + mine.grads}.get(
        ph.name, ph.gradients - one.grads_between + mine.grads_between)
    return replace(ph, parameters=ph.parameters - one.weights + mine.weights, gradients=max(0, grads),
                   optimizer_states=ph.optimizer_states - one.states + mine.states,
                   temporaries=ph.temporaries + (temp if ph.name == "optimizer" else 0))


def rank_phases(phases: tuple[Phase, ...], places: tuple[tuple[str, Phase], ...], step: StepModel,
                settings: TrainingSettings) -> tuple[Phase, ...]:
    """``phases`` (one GPU's, recorded) on a rank of ``step``'s data-parallel engine: each phase the largest of its
    moments (its own peak, at the loss, and its largest in each place) with the buffers alive there (module
    docstring)."""
    from .estimate import static_components
    from .timeline import _optimizer_temporaries, _static

    rank = step.rank
    if rank is None:
        return phases
    one = _static({c.name: c.bytes for c in static_components(step.spec, settings)}, step.recipe, settings)
    mine = _static(step._static_bytes, step.recipe, settings, rank)
    fused = settings.fused_optimizer
    temp = (_optimizer_temporaries(step.spec, step.recipe, step.optimizer, fused, rank)
            - _optimizer_temporaries(step.spec, step.recipe, step.optimizer, fused))
    scale = (0.0 if rank.gradients_offloaded else mine.grads / one.grads if rank.gradient_shards > 1 and one.grads
             else 1.0)
    candidates, where = [], []
    for ph in phases:
        own = "head" if ph.name == "backward" else ""  # (the phase's own peak, where no module has it: the loss)
        moments = [(own, ph)] + [(label.partition(":")[2], p) for label, p in places
                                 if label.partition(":")[0] == ph.name]
        candidates.append(tuple(_on_rank(p, one, mine, scale, temp) for _, p in moments))
        at: dict[str, list[int]] = {}
        for i, (place, _) in enumerate(moments):
            if place:
                at.setdefault(place, []).append(i)
        where.append({place: tuple(ix) for place, ix in at.items()})
    return tuple(peak_of(c) for c in with_buffers(tuple(candidates), rank.buffers, tuple(where)))


def traced_estimate(step: StepModel, batch: int, seq: int, warnings: tuple[str, ...]) -> Estimate:
    """StepModel.estimate for a spec counted by transformers (``spec.built_config``): the traced path's phases and
    peak; the static memory and one line why not where it cannot answer."""
    from .estimate import NO_PEAK, Estimate, peak_of_phases
    from .recorded import missing_extra, recorded_phases

    spec, settings = step.spec, step.settings_at(batch, seq)
    common: dict[str, Any] = dict(parallel=step.parallel, rank=step.rank, device=step.device, warnings=warnings,
                                  paged_bytes=step.paged_bytes)
    reason = missing_extra()
    if reason is None:
        try:
            recorded = recorded_phases(json.loads(spec.built_config), settings, spec, finetune=step.finetune)
        except TrainmemError:
            raise
        except Exception as exc:  # noqa: BLE001 (whatever the model's forward raises on fake tensors is its own)
            text = " ".join(str(exc).split())[:160] or type(exc).__name__
            reason = f"no peak: the traced path could not run this model's step on fake tensors ({text})"
    if reason is not None:
        return Estimate(spec, settings, step.static, notes=(reason, NO_PEAK, *step.unchecked), **common)
    phases = rank_phases(recorded.phases, recorded.places, step, settings)  # (one GPU's, or a rank's)
    notes: tuple[str, ...] = (recorded.note(),)
    if step.rank is not None:
        notes += (RANK_NOTE,)
    return Estimate(spec, settings, step.static, phases=phases, peak=peak_of_phases(phases, step.device),
                    notes=(*notes, *step.unchecked), traced=recorded, finetune=step.finetune, **common)


RANK_NOTE = ("data parallel on the traced path: one GPU's recorded step with this rank's model states and the "
             "engine's buffers in place of one GPU's (tracedstep.py); against FSDP2 traced on a fake process group, "
             "every phase within 1% but backward, up to 12% above at tiny widths (docs/accuracy.md)")
