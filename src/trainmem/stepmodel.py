"""Compile once, evaluate fast: a training step's memory as a function of the micro-batch, for searches.

``compile_step(spec, settings)`` does everything that does not depend on the batch or the sequence length once
(static memory, the optimizer step, the notes). For each sequence length it is asked about, it then finds every
moment that can be a phase's peak (timeline.step_candidates) as lines in the batch: a moment's bytes in each
category are a constant plus a slope times the batch. ``evaluate(step, batch, seq)`` looks up, by bisection, which
moment is each phase's peak at that batch and computes its bytes: a few arithmetic operations, no timeline.

Why lines are exact, not fitted: for a fixed sequence every activation term is bytes per token times
tokens = batch x seq (activations.py), and every other byte is constant. The lines are taken from batches 2 and 3
and used only where that argument holds, checked at compile time for each sequence length:
- the per-token values of every term and layer are the same at both batches, and the other terms constant or
  proportional to the batch (masks with a batch dimension). Some values depend on the batch itself: the math
  kernel's causal mask (one per call, counted per token), and everything at batch 1, where batched matmuls copy
  less; batch 1 is always computed directly;
- every per-token value is a whole number of bytes, so the floating-point products and sums are exact (the flash
  kernel's rows padded to 128 are fractional per token unless the sequence is a multiple of 128);
- the lines reproduce the direct computation at four more batches.
Where a check fails, that sequence length is evaluated directly (the full estimate, same result, ~1 ms).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any

from .activations import ActivationEstimate, estimate_activations
from .errors import ConfigError
from .allocator import DEFAULT_CONFIG as DEFAULT_ALLOC, ReplayReport
from .estimate import (NO_PEAK, DeviceOptions, Estimate, Peak, StaticComponent, dynamic_bytes, paged_state_bytes,
                       peak_of_phases, position_warning, static_components, validation_notes)
from .models import ModelSpec
from .optimizers import get_optimizer
from .recipes import get_recipe
from .settings import TrainingSettings
from .activations import Precision
from .sharding import Parallel, RankLayout, rank_layout
from .timeline import (Phase, expanded_layers, forward_floor, peak_of, seed_activation_bytes, seed_rule_candidates,
                       step_candidates)
from .estimate import fits_at_least  # (beside peak_of_phases, where modelparallel finds it too)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .hardware import GPU
    from .modelparallel import LayoutStep
    from .optimizers import Optimizer
    from .recipes import Recipe
    from .replay import StepSequence
    from .timeline import _LayerBytes
    from .lora import FineTune  # (lora.py is imported where a step has adapters: a full fine-tune never loads it)

PAGED_NOTE = ("paged optimizer states (paged_bytes) live in CUDA unified memory (cudaMallocManaged): "
              "max_memory_allocated() does not count them, so they are out of the allocated and reserved peaks and "
              "of whether the step fits; the driver evicts them to host memory under pressure, so the device total "
              "may still include them while they are resident")

_SAMPLES = (2, 3)
"""The batches the lines are taken from (batch 1 differs: see the module docstring)."""
_CHECKS = (4, 5, 8, 61)
"""More batches the lines must reproduce exactly."""
_DIRECT = "direct"
COMPILE_AFTER = 6
"""A sequence length's forms are compiled when it is asked for the sixth time: compiling costs about six direct
evaluations (two samples, four checks), which a plan's one or two probes of a step never earn back and a max-batch
search or a long sweep does (benchmarks/plan_speed.py on 2026-12-01: 9,600 layouts/s compiling at the third
request, 11,300 at the sixth, 11,800 never)."""


@dataclass(frozen=True)
class _Moment:
    """One moment of a phase as a line in the batch: bytes(b) = at_2 + slope * (b - 2), per category."""

    moment: str
    at_2: tuple[int, ...]
    slope: tuple[int, ...]
    total_at_2: int
    total_slope: int

    def total(self, batch: int) -> int:
        return self.total_at_2 + self.total_slope * (batch - 2)

    def phase(self, name: str, batch: int) -> Phase:
        d = batch - 2
        a, s = self.at_2, self.slope
        return Phase(name, self.moment, a[0] + s[0] * d, a[1] + s[1] * d, a[2] + s[2] * d, a[3] + s[3] * d,
                     a[4] + s[4] * d)


@dataclass(frozen=True)
class _PhaseForm:
    """A phase's peak moment for every batch >= 2: ``moments[i]`` is the peak from batch ``starts[i]`` on."""

    name: str
    starts: tuple[int, ...]
    moments: tuple[_Moment, ...]

    def phase(self, batch: int) -> Phase:
        return self.moments[bisect_right(self.starts, batch) - 1].phase(self.name, batch)


@dataclass(frozen=True)
class Evaluation:
    """A step at one (batch, seq): each phase at its peak moment, and the step's peak."""

    phases: tuple[Phase, ...]
    peak: Peak | None


class StepModel:
    """A model and its settings, less batch and sequence length, compiled for fast evaluation (module docstring).

    Built by :func:`compile_step`; its per-sequence forms are made the COMPILE_AFTER-th time a sequence length is
    asked for, so a single estimate costs one timeline and a search over batches costs a few.
    """

    def __init__(self, spec: ModelSpec, settings: TrainingSettings, device: DeviceOptions | None = None,
                 parallel: Parallel | None = None, finetune: FineTune | None = None):
        self.spec = spec
        self.settings = settings
        self.device = device or DeviceOptions()
        self.parallel = parallel or Parallel()
        self.recipe = get_recipe(settings.recipe)
        self.optimizer = get_optimizer(settings.optimizer)
        single = static_components(spec, settings)
        self.paged_bytes = paged_state_bytes(spec, settings)
        """Optimizer states in unified memory on this GPU (estimate.Estimate.paged_bytes), out of every phase."""
        self._paged_note = ("paged optimizer: no trained tensor here has 1e5+ elements, so bitsandbytes pages none "
                            "of its states (get_state_buffer): all are ordinary device memory, counted above")
        self.rank: RankLayout | None = None
        if finetune is not None and not spec.has_architecture and spec.built_config and (
                finetune.base_quant or self.parallel.engine != "single"):
            raise ConfigError("LoRA on the traced path (a model_type without a hand-written description) runs on one "
                              "GPU with an unquantized base: give --gpus 1 and no --base-quant / --qlora")
        if finetune is not None and self.parallel.engine == "fsdp1":
            from .fsdp1 import fsdp1_rank_layout

            self.rank = fsdp1_rank_layout(spec, self.recipe, self.optimizer, 0, self.parallel, finetune)
        elif finetune is not None and self.parallel.engine != "single":
            from .finetune_sharding import engine_finetune, finetune_rank_layout

            finetune = engine_finetune(finetune, self.recipe, self.parallel)
            self.rank = finetune_rank_layout(spec, self.recipe, self.optimizer, finetune, self.parallel)
        elif self.parallel.engine == "fsdp1":
            from .fsdp1 import fsdp1_rank_layout

            self.rank = fsdp1_rank_layout(spec, self.recipe, self.optimizer, single[3].bytes, self.parallel)
            single = rank_static_components(single, self.rank, spec.num_parameters)
            self.paged_bytes = -(-self.paged_bytes * self.rank.optimizer_numel // spec.num_parameters)
        elif self.parallel.engine != "single":
            states, offloaded = single[3].bytes, self.parallel.offload != "none"
            if offloaded and self.paged_bytes:  # (on the host bitsandbytes pages nothing: get_state_buffer's CPU
                states, self.paged_bytes = states + self.paged_bytes, 0  # fallback; the offload keeps them there)
                self._paged_note = ("paged optimizer under --offload: its states are in host memory with the rest "
                                    "(bitsandbytes pages nothing for CPU tensors), none on the GPU")
            self.rank = rank_layout(spec, self.recipe, self.optimizer, states, self.parallel)
            single = rank_static_components(single, self.rank, spec.num_parameters)
            # the paged states follow the rank's share of what the optimizer updates, as its other states do
            self.paged_bytes = -(-self.paged_bytes * self.rank.optimizer_numel // spec.num_parameters)
        self.finetune = finetune
        if finetune is not None:
            single, self.paged_bytes = finetune_static_components(spec, settings, finetune), 0
            if self.optimizer.paged:
                self.paged_bytes = finetune_paged_bytes(spec, self.optimizer, finetune)
            if self.rank is not None:  # this rank's share of the model states (finetune_sharding.py)
                from .lora import trainables

                t = trainables(spec, self.recipe, self.optimizer, finetune)
                trained = t.adapters + t.copies
                self.paged_bytes = -(-self.paged_bytes * self.rank.optimizer_numel // trained)
                single = rank_static_components(single, self.rank, spec.num_parameters)
            if self.paged_bytes:
                single = tuple(replace(c, bytes=c.bytes - self.paged_bytes,
                                       bytes_per_param=(c.bytes - self.paged_bytes) / spec.num_parameters,
                                       note=c.note + " (the states of tensors of 1e5+ elements are paged, reported "
                                       "apart)") if c.name == "optimizer_states" else c for c in single)
        if settings.compile and spec.has_architecture:
            from .activations import compile_modelled

            reason = compile_modelled(spec, self.recipe, settings)
            if reason:
                raise ConfigError(f"--compile is not modelled for {reason}")
        if settings.checkpointing == "op" and finetune is not None:
            raise ConfigError("checkpointing 'op' is modelled for full fine-tuning (LoRA's adapter matmuls are "
                              "aten.mm calls too and move which ones the policy saves); give --checkpointing full")
        if settings.checkpointing == "op" and spec.has_architecture:
            from .activations import op_checkpointing_unmodelled

            reason = op_checkpointing_unmodelled(spec, settings)
            if reason:
                raise ConfigError(reason)
        self.static = single
        self._static_bytes = {c.name: c.bytes for c in self.static}
        self.unchecked = validation_notes(spec, settings) + (self.rank.notes if self.rank else ())
        if finetune is not None:
            self.unchecked += ("not validated for every LoRA set-up, only on a matrix: traced within 0.2% for "
                               "Llama-family and Phi-3 models at full vocabulary (bf16, fp32 and autocast), and on "
                               "hidden-128 configs, where adapters weigh most, 176 of 176 rows (8 families; q,v, "
                               "all-linear, q,k,v,o with dropout, DoRA; with and without checkpointing) within 3% "
                               "(docs/accuracy.md, Matrix: LoRA), and GPT-NeoX, Falcon, BLOOM, Gemma 2/3, Mixtral, "
                               "Qwen-MoE and DeepSeek-V3 in 4 set-ups each (eager, model and lora dropout, autocast) "
                               "within 3% but one at -3.2% (docs/accuracy.md, LoRA in every family)",)
        if finetune is not None and finetune.base_quant:
            self.unchecked += ("not validated on a GPU: bitsandbytes' 4-bit kernels cannot run under the trace's "
                               "fake tensors; a real step with them on the CPU (Llama, nf4 with double quantization, "
                               "no checkpointing) matched every phase within 0.1% (docs/accuracy.md, QLoRA on the "
                               "CPU); the dequantized weight is counted as a layer's largest Linear throughout",)
        if settings.activation_k is not None and not spec.has_architecture:
            raise ConfigError("--activation-k needs the hidden size and layer count of a model config; "
                              f"{spec.source or spec.name} has none (give a model name or config.json)")
        self._replays: dict[tuple[int, int], ReplayReport | None] = {}
        self._sequences: dict[tuple[int, int], StepSequence | None] = {}
        self._reserved: dict[tuple[int, int], int | None] = {}
        self._ratio: dict[int, float | None] = {}
        """replayed_ratio's answers per sequence length."""
        self._forms: dict[int, tuple[_PhaseForm, ...] | str | int] = {}
        """Per sequence length: its compiled phases, or _DIRECT, or the number of times it was asked for."""

    # -- the direct computation (the reference the forms reproduce) -------------------------------------------

    def settings_at(self, batch: int, seq: int) -> TrainingSettings:
        return self.settings.at(batch, seq)

    def candidates(self, batch: int, seq: int,
                   peaks_only: bool = False) -> tuple[ActivationEstimate | None, tuple[tuple[Phase, ...], ...]]:
        """The activations (None under the seed rule) and every phase's candidate moments at (batch, seq) (or fewer
        of them, the peaks among them: ``peaks_only``)."""
        settings = self.settings_at(batch, seq)
        if settings.activation_k is not None:
            return None, seed_rule_candidates(self.spec, self._static_bytes, self.recipe, self.optimizer, settings,
                                              self.rank)
        acts, layers = _activations_at(self.spec, self.recipe, settings, self.finetune)
        return acts, step_candidates(self.spec, self._static_bytes, acts, self.recipe, self.optimizer, settings,
                                     self.rank, self.finetune, layers=layers, peaks_only=peaks_only)

    def activations(self, settings: TrainingSettings) -> ActivationEstimate:
        """The activations at ``settings`` (this step's, at some batch and seq)."""
        return _activations_at(self.spec, self.recipe, settings, self.finetune, layers=False)[0]

    def activations_and_layers(self, settings: TrainingSettings
                               ) -> tuple[ActivationEstimate, tuple[_LayerBytes, ...] | None]:
        """The activations at ``settings`` and the timeline's per-layer bytes made from them (what replay.py walks)."""
        return _activations_at(self.spec, self.recipe, settings, self.finetune)

    # -- compiled forms ----------------------------------------------------------------------------------------

    def form(self, batch: int, seq: int, count: bool = True) -> tuple[_PhaseForm, ...] | None:
        """The compiled phases that answer for (batch, seq), or None where it is computed directly: batch 1, a
        sequence length asked for fewer than COMPILE_AFTER times (``count``: this asking counts), or one whose
        bytes are not lines in the batch."""
        if batch < 2:
            return None
        form = self._forms.get(seq, 0)
        if isinstance(form, int) and not count:
            return None
        if isinstance(form, int) and form + 1 < COMPILE_AFTER:
            self._forms[seq] = form + 1
            return None
        if isinstance(form, int):
            form = self._forms[seq] = _compile_seq(self, seq) or _DIRECT
        return form if isinstance(form, tuple) else None

    @property
    def traced(self) -> bool:
        """Whether the step's activations come from the traced path (recorded.py): a spec counted by transformers."""
        return not self.spec.has_architecture and bool(self.spec.built_config)

    def phases(self, batch: int, seq: int) -> tuple[Phase, ...]:
        """Each phase at its peak moment."""
        if self.traced:
            from .tracedstep import rank_phases, single_phases

            return rank_phases(*single_phases(self, batch, seq), self, self.settings_at(batch, seq))
        form = self.form(batch, seq)
        if form is not None:
            return tuple(f.phase(batch) for f in form)
        return tuple(peak_of(c) for c in self.candidates(batch, seq, peaks_only=True)[1])

    def floor(self, batch: int, seq: int) -> int:
        """A lower bound of the bytes allocated at the step's peak (timeline.forward_floor), for a search to rule
        out a batch before it computes the timeline; 0 where it has none to offer."""
        settings = self.settings_at(batch, seq)
        if not self.spec.has_architecture or settings.activation_k is not None or self.form(batch, seq, count=False):
            return 0  # (a compiled form answers in less time than the bound takes)
        return forward_floor(self._static_bytes, self.activations(settings), self.recipe, settings, self.rank)

    def fitting_peak(self, batch: int, seq: int, gpu: GPU, exact: bool = False) -> Peak | None:
        """The peak at (batch, seq) if it fits ``gpu``, else None (what a search asks). Reserved memory: with
        ``exact`` (--max-batch, --max-seq: a few probes) on one GPU the step's own replay, as its estimate has it;
        else (plan: thousands of probes, a replay costs 50-200 ms; and a data-parallel rank, whose estimate applies
        it) the allocated peak plus the replayed fragmentation ratio of a reference step (replayed_ratio). A step
        whose allocated bytes alone do not fit is not replayed."""
        if not fits_at_least(self.floor(batch, seq), self.device, gpu):
            return None
        phases = self.phases(batch, seq)
        if self.device.fragmentation is not None:
            peak = peak_of_phases(phases, self.device)
        elif not peak_of_phases(phases, self.device, reserved=0).fits(gpu):
            return None
        elif exact and self.rank is None:
            peak = peak_of_phases(phases, self.device, reserved=self.replayed_reserved(batch, seq))
            if not peak.fits(gpu) and peak.reserved_from == "replay":
                from .allocator import runs_within

                capacity = int(gpu.memory_bytes / self.device.headroom) - self.device.cuda_overhead_bytes
                sequence = self.sequence(batch, seq)
                runs = (sequence is not None and capacity >= peak.allocated_bytes
                        and runs_within(sequence.log, capacity, self.device.alloc_config or DEFAULT_ALLOC))
                return peak if runs else None  # (the allocator frees its cache before an allocation fails)
        else:
            peak = peak_of_phases(phases, self.device, ratio=self.replayed_ratio(batch, seq))
        return peak if peak.fits(gpu) else None

    def replayed_reserved(self, batch: int, seq: int) -> int | None:
        """The replay's max_memory_reserved() at (batch, seq) (allocator.max_reserved of ``sequence``; memoised)."""
        from .allocator import max_reserved
        from .replay import STEPS

        key = (batch, seq)
        if self.traced:  # (a traced step has no timeline to replay: the flat factor)
            return None
        if key in self._replays:
            report = self._replays[key]
            return None if report is None else report.max_reserved
        if key not in self._reserved:
            sequence = self.sequence(batch, seq)
            self._reserved[key] = (None if sequence is None else
                                   max_reserved(sequence.log, self.device.alloc_config or DEFAULT_ALLOC, STEPS))
        return self._reserved[key]

    def replay(self, batch: int, seq: int) -> ReplayReport | None:
        """The caching allocator's replay of this step at (batch, seq) (replay.py; memoised), None without one
        (a traced step: the flat factor)."""
        from .replay import replay_step

        key = (batch, seq)
        if self.traced:
            return None
        if key not in self._replays:
            self._replays[key] = replay_step(self, batch, seq, self.device.alloc_config or DEFAULT_ALLOC,
                                             sequence=self.sequence(batch, seq))
        return self._replays[key]

    def sequence(self, batch: int, seq: int) -> StepSequence | None:
        """replay.step_sequence at (batch, seq) (memoised: a fit check on a card replays it again), None on a
        traced step (see ``replay``)."""
        from .replay import step_sequence

        key = (batch, seq)
        if self.traced:
            return None
        if key not in self._sequences:
            self._sequences[key] = step_sequence(self, batch, seq)
        return self._sequences[key]

    def replayed_ratio(self, batch: int, seq: int) -> float | None:
        """The replay's fragmentation over the dynamic memory at its peak (max_memory_reserved() less the
        allocated peak, over estimate.dynamic_bytes): the search's (DeviceOptions.reserved_ratio, one replay per
        plan search: plan.search_ratio), else this step's at micro-batch 1 and ``seq`` (so that a search and an
        estimate of the same layout, whatever batch each asks first, apply the same ratio). A data-parallel rank's
        estimate applies this ratio too, as a model-parallel stage's does (modelparallel.py), so that a plan's
        search and its estimate agree: its replay at micro-batch 1 gives the ratio (docs/method.md §6)."""
        if self.traced:  # (no timeline to replay: the flat factor)
            return None
        if self.device.reserved_ratio is not None:
            return self.device.reserved_ratio
        if seq not in self._ratio:
            reserved = self.replayed_reserved(1, seq)
            top = max(self.phases(1, seq), key=lambda ph: ph.allocated_bytes)
            dynamic = dynamic_bytes(top)
            self._ratio[seq] = (None if reserved is None or dynamic <= 0 else
                                max(0, reserved - top.allocated_bytes) / dynamic)
        return self._ratio[seq]

    def reserved_peak(self, phases: tuple[Phase, ...], batch: int, seq: int) -> Peak:
        """The peak of ``phases`` (this step's at (batch, seq)) with reserved memory as its estimate counts it:
        --fragmentation's flat factor where given; on a data-parallel rank its step's replayed ratio
        (replayed_ratio); else the step's own replay (replayed_reserved); the flat factor where neither exists."""
        if self.device.fragmentation is not None:
            return peak_of_phases(phases, self.device)
        if self.rank is not None:
            return peak_of_phases(phases, self.device, ratio=self.replayed_ratio(batch, seq))
        return peak_of_phases(phases, self.device, self.replayed_reserved(batch, seq))

    def estimate(self, batch: int, seq: int) -> Estimate:
        """The full estimate at (batch, seq), activations and notes included."""
        spec, settings = self.spec, self.settings_at(batch, seq)
        warning = position_warning(spec, seq)
        warnings = (warning,) if warning else ()
        unmodelled = None
        if self.finetune is not None and not self.traced:  # (the trace runs peft's step)
            from .lora import activations_modelled

            unmodelled = activations_modelled(spec, self.recipe, settings, self.finetune)
        if unmodelled is not None:
            note = (f"not modelled yet: the activations of a LoRA step with {unmodelled}, so this is the static "
                    "memory only")
            return Estimate(spec, settings, self.static, device=self.device, notes=(note, NO_PEAK, *self.unchecked),
                            warnings=warnings, finetune=self.finetune, paged_bytes=self.paged_bytes)
        if not spec.has_architecture and spec.built_config:
            from .tracedstep import traced_estimate  # (imports torch only when it records)

            traced: Estimate = traced_estimate(self, batch, seq, warnings)
            return traced
        if not spec.has_architecture:
            note = ("activations need the architecture: give a model config, not only --params"
                    if spec.is_nominal else
                    f"model_type {spec.model_type!r} was counted by transformers; activations need an analytic spec")
            return Estimate(spec, settings, self.static, parallel=self.parallel, rank=self.rank, device=self.device,
                            notes=(note, NO_PEAK, *self.unchecked), warnings=warnings, paged_bytes=self.paged_bytes)
        if settings.activation_k is not None:
            phases = tuple(peak_of(c) for c in self.candidates(batch, seq)[1])
            acts = estimate_activations(spec, self.recipe, settings)
            per_layer_values = batch * seq * spec.hidden_size * spec.num_layers * 2
            seed_notes = (
                f"activations from the seed's rule b*s*h*L*k*2 with k={settings.activation_k:g}",
                f"the architecture model ({settings.attention} attention, {settings.recipe}) gives "
                f"{acts.layers_bytes / 2**30:.2f} GiB for the decoder layers "
                f"(k = {acts.layers_bytes / per_layer_values:.1f}) and "
                f"{(acts.saved_bytes + acts.logits_bytes) / 2**30:.2f} GiB with embedding, head, loss and logits",
                *self.unchecked,
            )
            return Estimate(spec, settings, self.static, parallel=self.parallel, rank=self.rank,
                            activation_k_bytes=seed_activation_bytes(spec, settings),
                            phases=phases, peak=peak_of_phases(phases, self.device), device=self.device,
                            notes=seed_notes,
                            warnings=warnings, paged_bytes=self.paged_bytes)
        form = self.form(batch, seq)
        if form is not None:
            acts = self.activations(settings)
            phases = tuple(f.phase(batch) for f in form)
        else:
            found, candidates = self.candidates(batch, seq, peaks_only=True)
            assert found is not None  # (activation_k is None here: the architecture's activations)
            acts = found
            phases = tuple(peak_of(c) for c in candidates)
        notes = list(self.unchecked)
        if self.paged_bytes:
            notes.append(PAGED_NOTE)
        elif self.optimizer.paged:
            notes.append(self._paged_note)
        # (one replay for the reserved line and the report behind it, Estimate.allocator: reserved_peak reads the
        # memoised report; a data-parallel rank applies its step's replayed ratio instead)
        report = self.replay(batch, seq) if self.device.fragmentation is None and self.rank is None else None
        peak = self.reserved_peak(phases, batch, seq)
        # (a reserved line from the replay has its step's sequence)
        sequence = self.sequence(batch, seq) if peak.reserved_from == "replay" else None
        return Estimate(spec, settings, self.static, parallel=self.parallel, rank=self.rank, finetune=self.finetune,
                        activations=acts, phases=phases, peak=peak,
                        device=self.device, notes=tuple(notes), warnings=warnings, paged_bytes=self.paged_bytes,
                        allocation_log=sequence.log if sequence is not None else None,
                        replayed=report)


_ACTIVATIONS: OrderedDict[tuple[object, ...], list[Any]] = OrderedDict()
_ACTIVATIONS_KEPT = 2048
"""The most recently used are kept (a plan of a MoE model over 32 GPUs asks for about 1,200; each is a few kB)."""


def _activations_at(spec: ModelSpec, recipe: Recipe, settings: TrainingSettings, finetune: FineTune | None,
                    layers: bool = True) -> tuple[ActivationEstimate, tuple[_LayerBytes, ...] | None]:
    """The activations at ``settings`` and (``layers``) the timeline's per-layer bytes made from them (the layers'
    gradient sizes included). They depend on the recipe's dtypes only, not on where the optimizer keeps its states
    or masters, and not on the optimizer, the accumulation steps or how the model states are sharded: a search's
    steps that differ in those (mixed-bf16, pure-bf16 and pure-bf16-bf16states; DDP and FSDP2; a pipeline role
    asking for its phases and its in-flight micro-batches) compute them once."""
    key = (spec, recipe.weights, recipe.gradients, recipe.compute, recipe.autocast, settings.activation_key,
           finetune)
    found = _ACTIVATIONS.get(key)
    if found is None:
        acts = estimate_activations(spec, recipe, settings)
        if finetune is not None:
            from .lora import lora_activations

            acts = lora_activations(acts, spec, Precision.of(recipe), finetune)
        if len(_ACTIVATIONS) >= _ACTIVATIONS_KEPT:
            _ACTIVATIONS.popitem(last=False)
        found = _ACTIVATIONS[key] = [acts, None]
    else:
        _ACTIVATIONS.move_to_end(key)
    if layers and found[1] is None:
        found[1] = tuple(expanded_layers(spec, found[0], recipe, settings, finetune))
    return found[0], found[1]


def rank_static_components(single: tuple[StaticComponent, ...], rank: RankLayout,
                           n: int) -> tuple[StaticComponent, ...]:
    """The four model-state components as one rank holds them (padding included)."""
    per_rank = {"weights": rank.weights, "gradients": rank.gradients, "master_weights": rank.master_weights,
                "optimizer_states": rank.optimizer_states}
    return tuple(replace(c, bytes=per_rank[c.name], bytes_per_param=per_rank[c.name] / n,
                         note=c.note + (" (this GPU's shard)" if per_rank[c.name] < c.bytes else ""))
                 for c in single)


def finetune_static_components(spec: ModelSpec, settings: TrainingSettings,
                               finetune: FineTune) -> tuple[StaticComponent, ...]:
    """LoRA's static memory: the frozen base as stored (quantized or in the recipe's dtype) and the adapters, which
    alone have gradients and optimizer states, in the adapters' dtype (lora.py)."""
    from .lora import base_weight_bytes, trainables

    recipe, optimizer = get_recipe(settings.recipe), get_optimizer(settings.optimizer)
    n = spec.num_parameters
    t = trainables(spec, recipe, optimizer, finetune)
    base = base_weight_bytes(spec, recipe.weight_bytes, finetune)
    quant = f"{finetune.base_quant}{' + double quant' if finetune.double_quant else ''}" if finetune.base_quant \
        else recipe.weights
    adapter_dtype = {4: "fp32", 2: recipe.compute if recipe.compute != "fp32" else "bf16"}[t.adapter_bytes]
    copies = f" and {t.copies:,} in trained copies of {', '.join(finetune.lora.train_modules)}" if t.copies else ""
    trained = "the adapters'" + (" and the trained copies'" if t.copies else "")
    weights = base + t.trainable_bytes
    return (
        StaticComponent("weights", f"{quant} base + {adapter_dtype} adapters", weights, weights / n,
                        f"frozen base ({n:,} parameters), {t.adapters:,} adapter parameters{copies}"),
        StaticComponent("gradients", adapter_dtype if not t.copies or t.copy_bytes == t.adapter_bytes else
                        f"{adapter_dtype} + {recipe.weights} copies", t.trainable_bytes,
                        t.trainable_bytes / n, f"{trained} only: the base is frozen"),
        StaticComponent("master_weights", "fp32" if t.masters else "-", t.masters, t.masters / n,
                        "fp32 copy of what trains (its half-precision tensors)" if t.masters else
                        "none: the adapters are updated in place"),
        StaticComponent("optimizer_states", {4: "fp32", 2: "bf16", 1: "uint8+fp32"}.get(t.state_bytes, "fp32") +
                        (" + bf16 (copies)" if t.copies and t.stepped_values != (t.adapters + t.copies) * t.state_bytes
                         else ""),
                        t.states, t.states / n,
                        f"{optimizer.states} of the adapters" + (" and the trained copies" if t.copies else "")),
    )


def finetune_paged_bytes(spec: ModelSpec, optimizer: Optimizer, finetune: FineTune) -> int:
    """Of a LoRA step's optimizer states, those a paged optimizer keeps in unified memory: the adapters' and the
    trained copies' tensors of 1e5+ elements (optimizers.py; an r=16 adapter of a 4096-wide layer, 65,536
    elements, is not paged)."""
    from .lora import adapter_groups, copy_groups

    return optimizer.paged_bytes((*adapter_groups(spec, finetune.lora), *copy_groups(spec, finetune.lora)), 1)


def _is_whole(value: object) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


_FRACTIONS = frozenset({"input_share"})
"""Term fields that are fractions of its bytes, not bytes per token (activations.Term.input_share)."""


def _per_token_values(acts: ActivationEstimate) -> Iterator[float]:
    """Every per-token number in the activations (terms and layer fields), recursively."""

    def walk(obj: object) -> Iterator[float]:
        if isinstance(obj, (int, float)) and not isinstance(obj, bool):
            yield obj
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                yield from walk(item)
        elif is_dataclass(obj):
            for f in fields(obj):
                if f.name not in _FRACTIONS:
                    yield from walk(getattr(obj, f.name))

    for group in (acts.layers, acts.embedding_terms, acts.head_terms, acts.constant_terms):
        yield from walk(group)


def _compile_seq(step: StepModel, seq: int) -> tuple[_PhaseForm, ...] | None:
    if not step.spec.has_architecture or step.settings.activation_k is not None:
        return None  # nothing to search (no peak), or the seed rule, whose k makes its bytes fractional
    (acts_a, cands_a), (acts_b, cands_b) = (step.candidates(b, seq) for b in _SAMPLES)
    assert acts_a is not None and acts_b is not None  # (activation_k is None: the architecture's activations)
    batch_free = (acts_a.layers == acts_b.layers and acts_a.embedding_terms == acts_b.embedding_terms
                  and acts_a.head_terms == acts_b.head_terms)
    # the terms outside the per-token ones are constant, or proportional to the batch (masks with a batch dim)
    constants = all(a.name == b.name and (a.bytes_per_token == b.bytes_per_token or
                                          a.bytes_per_token * _SAMPLES[1] == b.bytes_per_token * _SAMPLES[0])
                    for a, b in zip(acts_a.constant_terms, acts_b.constant_terms, strict=True))
    if not (batch_free and constants and all(_is_whole(v) for v in _per_token_values(acts_a))):
        return None
    if [[c.moment for c in p] for p in cands_a] != [[c.moment for c in p] for p in cands_b]:
        return None
    step_b = _SAMPLES[1] - _SAMPLES[0]
    forms = []
    for phase_a, phase_b in zip(cands_a, cands_b):
        moments = []
        for ca, cb in zip(phase_a, phase_b):
            at_2 = (ca.parameters, ca.gradients, ca.optimizer_states, ca.activations, ca.temporaries)  # (CATEGORIES)
            diff = [b - a for a, b in zip(at_2, (cb.parameters, cb.gradients, cb.optimizer_states, cb.activations,
                                                 cb.temporaries))]
            if any(d % step_b for d in diff):
                return None
            slope = tuple(d // step_b for d in diff)
            moments.append(_Moment(ca.moment, at_2, slope, sum(at_2), sum(slope)))
        forms.append(_envelope(phase_a[0].name, moments))
    compiled = tuple(forms)
    for batch in _CHECKS:  # the argument above, checked
        direct = tuple(peak_of(c) for c in step.candidates(batch, seq, peaks_only=True)[1])
        if tuple(f.phase(batch) for f in compiled) != direct:
            return None
    return compiled


def _envelope(name: str, moments: list[_Moment]) -> _PhaseForm:
    """Which moment is the peak at each batch >= 2: the largest, the earliest on a tie (as ``peak_of``). Walks up
    the batches from 2, jumping to the first batch at which another moment overtakes the current peak; each jump
    goes to a steeper line, so there are at most as many as distinct slopes."""
    def winner(batch: int) -> int:
        return max(range(len(moments)), key=lambda i: (moments[i].total(batch), -i))

    starts, chosen = [], []
    batch = 2
    while True:
        w = winner(batch)
        starts.append(batch)
        chosen.append(moments[w])
        top = moments[w]
        next_batch = None
        for i, m in enumerate(moments):
            rise = m.total_slope - top.total_slope
            if rise <= 0:
                continue  # never catches up
            gap = top.total(batch) - m.total(batch)  # >= 0, and > 0 when m is earlier: top is the peak here
            # the first step d >= 1 at which m is ahead, or level and earlier (rise * d - gap > 0, or >= 0)
            d = gap // rise + 1 if i > w else max(-(-gap // rise), 1)
            if next_batch is None or batch + d < next_batch:
                next_batch = batch + d
        if next_batch is None:
            return _PhaseForm(name, tuple(starts), tuple(chosen))
        batch = next_batch


def compile_step(spec: ModelSpec, settings: TrainingSettings | None = None,
                 device: DeviceOptions | None = None, parallel: Parallel | None = None,
                 finetune: FineTune | None = None, cache: dict[Any, Any] | None = None) -> StepModel:
    """Compile ``spec`` trained with ``settings`` (whose batch and seq are ignored) on ``parallel``'s GPUs, fully or
    with ``finetune``'s adapters, for :func:`evaluate`. A model-parallel layout compiles each rank role
    (modelparallel.LayoutStep).

    ``cache`` (a search's dict) shares one compiled step between the layouts that ask for the same one, so its
    forms are compiled once and earned back over the whole search. Its key counts the accumulation steps only as
    one or more than one, the only difference they make to a step's memory (timeline._static: the gradients live
    through forward); the step it returns may therefore carry another count in its settings, which only a
    search, which asks for phases and peaks, may ignore."""
    settings = settings or TrainingSettings()
    key = (spec, settings.step_key, device, parallel, finetune)
    if cache is not None and key in cache:
        cached: StepModel = cache[key]
        return cached
    if parallel is not None and parallel.is_model_parallel:
        from .modelparallel import LayoutStep

        step: StepModel | LayoutStep = LayoutStep(spec, settings, device, parallel, finetune, cache,
                                                  compile_stage=compile_step)
    else:
        step = StepModel(spec, settings, device, parallel, finetune)
    if cache is not None:
        cache[key] = step
    return step  # type: ignore[return-value]


def evaluate(step: StepModel, batch: int, seq: int) -> Evaluation:
    """The phases and the peak at (batch, seq): byte for byte what :func:`estimate_model` gives."""
    if not step.spec.has_architecture:
        return Evaluation((), None)
    phases = step.phases(batch, seq)
    if not isinstance(step, StepModel):  # (a model-parallel layout: each stage applies its replayed ratio)
        return Evaluation(phases, step.peak(batch, seq))
    return Evaluation(phases, step.reserved_peak(phases, batch, seq))


def estimate_model(model: ModelSpec, settings: TrainingSettings | None = None,
                   device: DeviceOptions | None = None, parallel: Parallel | None = None,
                   finetune: FineTune | None = None) -> Estimate:
    """The estimate of one set-up: the step model compiled and evaluated at its batch and seq, for one GPU of
    ``parallel`` (sharding.Parallel; default one GPU)."""
    settings = settings or TrainingSettings()
    return compile_step(model, settings, device, parallel, finetune).estimate(settings.batch, settings.seq)
