"""Model parallelism: the memory of one GPU when tensor (TP), sequence (SP), pipeline (PP), context (CP) and expert
(EP) parallelism split the model, combined with the data-parallel engines of sharding.py.

Each distinct rank role (the first pipeline stage, the most loaded middle one, the last) is estimated as the model
that rank holds, a :class:`~trainmem.models.ModelSpec` of its own, run through the same step model as one GPU:
- TP (Megatron-LM's ColumnParallelLinear/RowParallelLinear, PyTorch's ColwiseParallel/RowwiseParallel): q/k/v,
  gate/up and the experts' first matmul split their outputs, o/down their inputs, so a rank holds heads / T, kv
  heads / T and MLP width / T; norms and the row-parallel biases are replicated; the embedding and the LM head are
  split over the vocabulary (VocabParallelEmbedding; ``loss_parallel``), ceil(V / T) rows each. Activations follow
  from the rank's shapes: the split tensors are 1/T, the replicated ones (norms, residual, the Linear inputs) whole.
- SP (Korthikanti et al. 2022, arXiv:2205.05198): the norms, the residual dropouts and the layer input hold 1/T of
  the sequence (activations._sequence_sharded).
- PP: the layers are split into P stages (V chunks per rank interleaved); the first stage holds the embedding,
  the last the final norm, the LM head and the loss (with tied embeddings it holds its own copy of the embedding
  as the head, as Megatron does). A stage keeps the activations of the micro-batches in flight: min(P - s, M) on
  stage s with 1F1B; with the interleaved schedule, (P - s - 1) x 2 + (V - 1) x P + 1 model chunks' worth, at
  most M x V (megatron/core/pipeline_parallel/schedules.py, forward_backward_pipelining_with_interleaving's
  num_warmup_microbatches): on the first stage L x (1 + (P - 1) / (P V)) layers' worth, Megatron's factor.
- CP: each rank holds seq / C tokens and the keys/values gathered from the others (activations.py).
- EP: each rank holds num_experts / E routed experts, the router whole; the all-to-all dispatch and combine
  buffers (every routed copy of the rank's tokens, sent and received) exist while a MoE layer runs.
The data-parallel engine (DDP, ZeRO, FSDP2) then shards what each rank holds across the dp x cp ranks that hold
the same part (sharding.Parallel.data_parallel_view).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from .errors import ConfigError
from .activations import Precision
from .estimate import DeviceOptions, Estimate, Peak, fits_at_least, peak_of_phases
from .models import Layer, ModelSpec, runs_of
from .recipes import get_recipe
from .settings import TrainingSettings
from .sharding import Parallel
from .timeline import Phase

if TYPE_CHECKING:
    from .estimate import StaticComponent
    from .hardware import GPU
    from .lora import FineTune
    from .sharding import RankLayout

_STEP_PHASES = ("forward", "backward")


def check_layout(spec: ModelSpec, parallel: Parallel, seq: int | None = None) -> None:
    """One line for a layout the model cannot be split into (exit 2 in the CLI)."""
    tp, pp, v, cp, ep = parallel.tp, parallel.pp, parallel.virtual_stages, parallel.cp, parallel.ep
    if not parallel.is_model_parallel:
        return
    if not spec.has_architecture and spec.built_config:  # (the traced path: recorded.py, tracedstep.py)
        raise ConfigError(f"--tp, --pp, --cp and --ep are not available on the traced path (model_type "
                          f"{spec.model_type!r} has no hand-written description, and the trace has no tensor-parallel "
                          "plan or layer split for an arbitrary type): give data parallelism (--gpus N with DDP, "
                          "--zero or --fsdp)")
    if not spec.has_architecture:
        raise ConfigError("--tp, --pp, --cp and --ep split the model's layers: give a model config, not --params")
    for layer, _ in spec.layer_runs:
        att = layer.attention
        if att.num_heads % tp:
            raise ConfigError(f"--tp {tp} must divide the attention heads ({att.num_heads})")
        if att.kind == "mha" and att.num_kv_heads % tp:
            raise ConfigError(f"--tp {tp} must divide the key/value heads ({att.num_kv_heads}); accepted: "
                              + ", ".join(str(t) for t in divisors(math.gcd(att.num_heads, att.num_kv_heads))))
        widths = [("MLP width (intermediate_size)", layer.mlp.intermediate_size)] if layer.mlp else [
            ("expert width", layer.moe.expert_intermediate_size),  # type: ignore[union-attr]
            ("shared expert width", layer.moe.shared_intermediate_size)]  # type: ignore[union-attr]
        for what, width in widths:
            if width % tp:
                raise ConfigError(f"--tp {tp} must divide the {what} ({width})")
        if ep > 1 and layer.moe is None and spec.is_moe is False:
            raise ConfigError(f"--ep {ep} splits routed experts; {spec.name or spec.model_type} has none")
        if layer.moe is not None and layer.moe.num_experts % ep:
            raise ConfigError(f"--ep {ep} must divide the routed experts ({layer.moe.num_experts})")
    chunks = pp * v
    if parallel.pp_layers:
        if sum(parallel.pp_layers) != spec.num_layers:
            raise ConfigError(f"--pp-layers {','.join(map(str, parallel.pp_layers))} adds up to "
                              f"{sum(parallel.pp_layers)} layers; {spec.name} has {spec.num_layers}")
    elif spec.num_layers % chunks or spec.num_layers < chunks:
        raise ConfigError(f"the {spec.num_layers} layers must split evenly into pp x virtual stages = {pp} x {v} = "
                          f"{chunks} chunks, or give --pp-layers (per stage, or torchtitan for its split)")
    if seq is not None:
        if seq % cp:
            raise ConfigError(f"--cp {cp} must divide the sequence length ({seq:,})")
        if parallel.sp and (seq // cp) % tp:
            raise ConfigError(f"--sp splits each rank's {seq // cp:,} tokens across --tp {tp}: give a sequence "
                              f"length that is a multiple of {tp * cp}")


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tensor_parallel_spec(spec: ModelSpec, parallel: Parallel) -> ModelSpec:
    """The model as one tensor/sequence/context/expert-parallel rank holds it (module docstring)."""
    tp, ep = parallel.tp, parallel.ep

    def split(layer: Layer) -> Layer:
        att = layer.attention
        att = replace(att, num_heads=att.num_heads // tp,
                      num_kv_heads=att.num_kv_heads // tp if att.kind == "mha" else att.num_kv_heads // tp or 1)
        mlp = replace(layer.mlp, intermediate_size=layer.mlp.intermediate_size // tp) if layer.mlp else None
        moe = replace(layer.moe, expert_intermediate_size=layer.moe.expert_intermediate_size // tp,
                      shared_intermediate_size=layer.moe.shared_intermediate_size // tp,
                      expert_shards=ep) if layer.moe else None
        return replace(layer, attention=att, mlp=mlp, moe=moe)

    return replace(spec, layer_runs=tuple((split(layer), count) for layer, count in spec.layer_runs),
                   vocab_size=-(-spec.vocab_size // tp), vocab_shards=tp, sequence_shards=tp if parallel.sp else 1,
                   context_shards=parallel.cp)


def in_flight_chunks(parallel: Parallel, stage: int) -> int:
    """Model chunks' worth of one micro-batch's activations stage ``stage`` keeps at its fullest (module docstring):
    with 1F1B a chunk is the stage, with the interleaved schedule one of its V chunks."""
    p, v, m = parallel.pp, parallel.virtual_stages, parallel.in_flight_micro_batches
    if v == 1:
        return min(p - stage, m)
    return min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)


@dataclass(frozen=True)
class RankRole:
    """One kind of rank: which pipeline stages it stands for, and its estimate (every figure per GPU)."""

    name: str
    stages: tuple[int, ...]
    in_flight: int
    """Model chunks' worth of micro-batch activations held (in_flight_chunks)."""
    estimate: Estimate

    def as_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {"role": self.name, "stages": list(self.stages), "in_flight_chunks": self.in_flight,
                "num_parameters": e.model.num_parameters, "static_bytes": e.static_bytes,
                "activation_bytes": e.activation_bytes,
                "peak": None if e.peak is None else {"phase": e.peak.phase, "allocated_bytes": e.peak.allocated_bytes,
                                                     "required_bytes": e.peak.required_bytes}}


def stage_spec(rank: ModelSpec, parallel: Parallel, stage: int) -> ModelSpec:
    """The layers pipeline stage ``stage`` holds (its V chunks), with the embedding on the first and the head on the
    last; a tied embedding becomes two tensors, one on each end."""
    if parallel.pp == 1:
        return rank
    layers = rank.layers
    p, v = parallel.pp, parallel.virtual_stages
    if parallel.pp_layers:  # an uneven 1F1B split (pipeline_split)
        start = sum(parallel.pp_layers[:stage])
        held = list(layers[start:start + parallel.pp_layers[stage]])
    else:
        size = len(layers) // (p * v)
        held = [layer for chunk in range(v)
                for layer in layers[(chunk * p + stage) * size:(chunk * p + stage + 1) * size]]
    first, last = stage == 0, stage == p - 1
    return replace(rank, layer_runs=runs_of(held), has_embedding=first, has_head=last,
                   tied_embeddings=rank.tied_embeddings and not (first or last))


def pipeline_split(num_layers: int, pp: int, given: object) -> tuple[int, ...]:
    """``--pp-layers``: the decoder layers of each stage, given as "15,16,...,15" (or a list), or ``torchtitan``
    for torchtitan's split (torchtitan/distributed/pipeline_parallel.py, ``generate_llm_fqn_per_model_part`` with
    its default input_weight = output_weight = 1): the embedding and the norm + output each count as one layer, the
    L + 2 are spread over the P stages with the remainder going to the first stages, and the first and last stages
    hold one layer fewer for them (Llama-3.1-405B's 126 layers over 8 stages: 15, 16 x 6, 15)."""
    if isinstance(given, str) and given.strip() == "torchtitan":
        effective = num_layers + 2
        each, extra = divmod(effective, pp)
        if pp < 2 or each < 1:
            raise ConfigError(f"--pp-layers torchtitan: {pp} stages cannot split {num_layers} layers plus the "
                              "embedding and the output")
        out = [each + (s < extra) - (s == 0) - (s == pp - 1) for s in range(pp)]
        out[-1] = num_layers - sum(out[:-1])  # (torchtitan's last stage takes what is left: no layer is lost)
        if min(out) < 1:
            raise ConfigError(f"--pp-layers torchtitan leaves a stage without layers ({out})")
        return tuple(out)
    if isinstance(given, str):
        try:
            return tuple(int(part) for part in given.split(","))
        except ValueError:
            raise ConfigError(f"--pp-layers takes layers per stage such as 15,16,16,15 or torchtitan, got {given!r}") \
                from None
    if isinstance(given, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) for n in given):
        return tuple(given)
    raise ConfigError(f"--pp-layers takes layers per stage such as 15,16,16,15 or torchtitan, got {given!r}")


def _role_stages(parallel: Parallel) -> list[tuple[str, tuple[int, ...]]]:
    p = parallel.pp
    if p == 1:
        return [("every rank", (0,))]
    roles: list[tuple[str, tuple[int, ...]]] = [("first stage", (0,))]
    if p > 2:
        roles.append(("middle stages", tuple(range(1, p - 1))))
    return roles + [("last stage", (p - 1,))]


def _distinct_stages(spec: ModelSpec, parallel: Parallel,
                     cache: dict[Any, Any] | None = None) -> list[tuple[str, int, ModelSpec]]:
    """(role, stage, what it holds) of each stage a layout is evaluated on: of a role's stages that hold the same,
    the first (the most loaded: in flight falls with the stage). Kept in a search's ``cache`` by the degrees, which
    alone decide it."""
    key = ("stages", spec, parallel.tp, parallel.sp, parallel.pp, parallel.virtual_stages, parallel.cp, parallel.ep,
           parallel.pp_layers)
    if cache is not None and key in cache:
        cached: list[tuple[str, int, ModelSpec]] = cache[key]
        return cached
    rank = tensor_parallel_spec(spec, parallel)
    out = []
    for name, stages in _role_stages(parallel):
        held: set[ModelSpec] = set()
        for stage in stages:
            s = stage_spec(rank, parallel, stage)
            if s not in held:
                held.add(s)
                out.append((name, stage, s))
    if cache is not None:
        cache[key] = out
    return out


class _Stage(NamedTuple):
    """One pipeline stage a LayoutStep evaluates: the role it stands for, its compiled step and what it holds."""

    role: str
    number: int
    """The stage's place in the pipeline (not ``index``, which would shadow tuple.index)."""
    in_flight: int
    step: Any
    spec: ModelSpec


class LayoutStep:
    """A model-parallel layout compiled for searches: quacks like stepmodel.StepModel (``spec``, ``device``,
    ``phases``, ``estimate``) and answers for the most loaded rank."""

    def __init__(self, spec: ModelSpec, settings: TrainingSettings, device: DeviceOptions | None,
                 parallel: Parallel, finetune: FineTune | None = None, cache: dict[Any, Any] | None = None, *,
                 compile_stage: Callable[..., Any]) -> None:
        compile_step = compile_stage  # stepmodel.compile_step, handed in by it: this module imports no stepmodel

        if finetune is not None:
            raise ConfigError("LoRA with --tp, --pp, --cp or --ep is not modelled yet: give data parallelism "
                              "(--gpus N with DDP, --zero or --fsdp)")
        check_layout(spec, parallel)
        self.spec, self.settings, self.parallel = spec, settings, parallel
        self.device = device or DeviceOptions()
        self._precision = Precision.of(get_recipe(settings.recipe))
        view = parallel.data_parallel_view()
        micro = parallel.in_flight_micro_batches if parallel.pp > 1 else 1
        # a pipeline's micro-batches accumulate their gradients as --grad-accum does
        stage_settings = (settings if settings.grad_accum >= micro else  # (a search builds hundreds: no copy to
                          replace(settings, grad_accum=micro))            # make where nothing changes)
        self._stages: list[_Stage] = []
        compiled: dict[ModelSpec, Any] = {}
        for name, stage, s in _distinct_stages(spec, parallel, cache):
            if s not in compiled:
                compiled[s] = compile_step(s, stage_settings, self.device, view, cache=cache)
            in_flight = in_flight_chunks(parallel, stage) if parallel.pp > 1 else 1
            self._stages.append(_Stage(name, stage, in_flight, compiled[s], s))
        self._tightest = 0
        """The stage that last did not fit (fitting_peak tries it first)."""

    @property
    def static(self) -> tuple[StaticComponent, ...]:
        """The model states of the rank that holds the most (the search's floor)."""
        return max((stage.step.static for stage in self._stages), key=lambda st: sum(c.bytes for c in st))

    @property
    def rank(self) -> RankLayout | None:
        """The data-parallel engine's layout on the first stage's rank (its buffers, its host memory)."""
        rank: RankLayout | None = self._stages[0].step.rank
        return rank

    def _local_seq(self, seq: int) -> int:
        return -(-seq // self.parallel.cp)

    def _extras(self, stage: _Stage, batch: int, local: int) -> tuple[int, int, int]:
        """What a stage's rank holds beyond its layers' own step at (batch, local tokens): the other micro-batches'
        activations in flight, the all-to-all buffers, the pipeline's receive buffers."""
        return (self._held_extra(stage.step, stage.in_flight, batch, local),
                self._all_to_all(stage.spec, batch, local), self._receive_buffers(stage.number, batch, local))

    def _stage_phases(self, stage: _Stage, batch: int, seq: int,
                      extras: tuple[int, int, int] | None = None) -> tuple[Phase, ...]:
        local = self._local_seq(seq)
        phases: tuple[Phase, ...] = stage.step.phases(batch, local)
        held, buffers, received = extras or self._extras(stage, batch, local)
        if not held and not buffers and not received:
            return phases
        return tuple(Phase(ph.name, ph.moment, ph.parameters, ph.gradients, ph.optimizer_states,
                           ph.activations + (held if ph.name in _STEP_PHASES else 0),
                           ph.temporaries + (buffers if ph.name in _STEP_PHASES else 0)
                           + (received if ph.name != "load" else 0))
                     for ph in phases)

    def _receive_buffers(self, stage: int, batch: int, seq: int) -> int:
        """torch.distributed.pipelining's receive buffers on this stage's rank (torchtitan's pipeline; torch 2.13
        stage.py, PipelineStage._setup_forward_recv_info and _create_grad_recv_info): at the first step each of its
        model chunks allocates, for every micro-batch, a buffer for the activations it receives (but the first
        chunk of all) and one for the gradient it receives (but the last), and keeps them from step to step
        (pytorch#136380, open). One micro-batch's hidden states in the residual stream's dtype, 1/T of the tokens
        under sequence parallelism. DeepSpeed's pipeline engine (ZeRO) receives into the buffers of the
        micro-batches in flight, which are their activations: nothing more is counted there."""
        parallel = self.parallel
        if parallel.pp == 1 or parallel.zero is not None:
            return 0
        p, v = parallel.pp, parallel.virtual_stages
        buffers = 2 * v - (stage == 0) - (stage == p - 1)
        tokens = batch * (seq // parallel.tp if parallel.sp else seq)
        return buffers * parallel.in_flight_micro_batches * tokens * self.spec.hidden_size * self._precision.residual

    def _held_extra(self, step: Any, in_flight: int, batch: int, seq: int) -> int:
        """Activations of the other micro-batches in flight on this stage: (in_flight - V) chunks' worth."""
        chunks = self.parallel.virtual_stages
        if in_flight <= chunks:
            return 0
        acts = step.activations(step.settings.at(batch, seq))
        per_micro: int = acts.layers_bytes + acts.embedding_bytes  # (the head's is in flight once: 1F1B's last stage)
        return per_micro * (in_flight - chunks) // chunks

    def _all_to_all(self, s: ModelSpec, batch: int, seq: int) -> int:
        """EP's dispatch and combine buffers: each routed copy of the rank's tokens, sent and received, in the
        compute dtype, while a MoE layer runs (Megatron's MoEAlltoAllTokenDispatcher; torchtitan's all_to_all)."""
        if self.parallel.ep == 1:
            return 0
        k = max((layer.moe.top_k for layer, _ in s.layer_runs if layer.moe), default=0)
        return 2 * k * batch * seq * s.hidden_size * self._precision.compute

    def fitting_peak(self, batch: int, seq: int, gpu: GPU, exact: bool = False) -> Peak | None:
        """The layout's peak at (batch, seq) (that of :meth:`phases`) if every stage's fits ``gpu``, else None.
        A search asks this: it stops at the first stage that does not fit, trying first the one that last did
        not. Reserved memory is each stage's replayed ratio whether or not ``exact`` (as in :meth:`estimate`)."""
        order = list(range(len(self._stages)))
        order.insert(0, order.pop(self._tightest))
        top = None
        local = self._local_seq(seq)
        for i in order:
            stage = self._stages[i]
            extras = self._extras(stage, batch, local)
            floor = stage.step.floor(batch, local)
            if floor and not fits_at_least(floor + sum(extras), self.device, gpu):
                self._tightest = i
                return None
            phases = self._stage_phases(stage, batch, seq, extras)
            if not peak_of_phases(phases, self.device, ratio=self._ratio(stage, batch, local)).fits(gpu):
                self._tightest = i
                return None
            load = max(ph.allocated_bytes for ph in phases)
            # (the most loaded stage as phases() picks it: the first of the largest, in stage order)
            if top is None or (load, -i) > (top[0], -top[1]):
                top = (load, i, phases)
        assert top is not None  # (a layout has at least one stage)
        return peak_of_phases(top[2], self.device, ratio=self._ratio(self._stages[top[1]], batch, local))

    def _ratio(self, stage: _Stage, batch: int, local: int) -> float | None:
        """The stage's replayed fragmentation ratio (StepModel.replayed_ratio): its in-flight micro-batches and
        receive buffers are not in its replayed step, so the ratio, not the replay, carries over. A stage that is
        also a rank of a data-parallel engine keeps the flat factor: no published reserved figure of a
        model-parallel run checks its replay (docs/accuracy.md), and a search would replay each of them (plan_speed:
        16 times slower)."""
        if self.device.fragmentation is not None or stage.step.rank is not None:
            return None
        ratio: float | None = stage.step.replayed_ratio(batch, local)
        return ratio

    def _most_loaded(self, batch: int, seq: int) -> tuple[tuple[Phase, ...], _Stage]:
        """The phases of the most loaded stage (the first of the largest), and that stage."""
        return max(((self._stage_phases(stage, batch, seq), stage) for stage in self._stages),
                   key=lambda pair: max(ph.allocated_bytes for ph in pair[0]))

    def peak(self, batch: int, seq: int) -> Peak:
        """The peak of the most loaded stage, its reserved memory by that stage's replayed ratio (as
        :meth:`estimate` and :meth:`fitting_peak` count it)."""
        phases, stage = self._most_loaded(batch, seq)
        return peak_of_phases(phases, self.device, ratio=self._ratio(stage, batch, self._local_seq(seq)))

    def phases(self, batch: int, seq: int) -> tuple[Phase, ...]:
        """The phases of the most loaded stage."""
        return self._most_loaded(batch, seq)[0]

    def estimate(self, batch: int, seq: int) -> Estimate:
        check_layout(self.spec, self.parallel, seq)
        settings = replace(self.settings, batch=batch, seq=seq)
        local = self._local_seq(seq)
        roles: list[RankRole] = []
        by_role: dict[str, tuple[int, _Stage, tuple[Phase, ...]]] = {}  # (its most loaded stage)
        for stage in self._stages:
            phases = self._stage_phases(stage, batch, seq)
            load = max(ph.allocated_bytes for ph in phases)
            if stage.role not in by_role or load > by_role[stage.role][0]:
                by_role[stage.role] = (load, stage, phases)
        for name, stages in _role_stages(self.parallel):
            _, stage, phases = by_role[name]
            in_flight = stage.in_flight
            base = stage.step.estimate(batch, local)
            held, _, received = self._extras(stage, batch, local)
            acts_note = (f"{name}: the activations of {in_flight} micro-batches in flight"
                         if self.parallel.virtual_stages == 1 else
                         f"{name}: the activations of {in_flight} model chunks x micro-batches in flight") \
                if in_flight > self.parallel.virtual_stages else ""
            received_note = (f"{name}: {received / 2**30:.2f} GiB of pipeline receive buffers (one per micro-batch "
                             "for the activations and gradients it receives, allocated at the first step by "
                             "torch.distributed.pipelining and kept), in temporaries") if received else ""
            e = replace(base, settings=settings, phases=phases,
                        peak=peak_of_phases(phases, self.device, ratio=self._ratio(stage, batch, local)),
                        in_flight_bytes=held, parallel=self.parallel, rank_model=stage.spec,
                        notes=base.notes + tuple(n for n in (acts_note, received_note) if n))
            roles.append(RankRole(name, stages if name != "middle stages" else (stage.number,), in_flight, e))
        top = max(roles, key=lambda r: r.estimate.peak.allocated_bytes if r.estimate.peak else 0)
        notes = top.estimate.notes + layout_notes(self.parallel)
        return replace(top.estimate, model=self.spec, per_rank=tuple(roles), notes=notes)


def layout_notes(parallel: Parallel) -> tuple[str, ...]:
    notes = []
    if parallel.tp > 1:
        notes.append("tensor parallel traced with DTensor (ColwiseParallel/RowwiseParallel"
                     + (", SequenceParallel" if parallel.sp else "") + ") under the fake process group: "
                     "docs/accuracy.md")
    if parallel.sp:
        notes.append("sequence parallel as PyTorch's DTensor keeps it: the all-gathered input of each column-"
                     "parallel Linear is saved whole (Megatron-LM saves the 1/T shard and gathers it again)")
    if parallel.pp > 1:
        notes.append("not validated: the micro-batches in flight follow Megatron-LM's schedules, untraced (a stage "
                     "as the transformers layers it holds is traced within 2%); the receive buffers are "
                     "torch.distributed.pipelining's as its source allocates them (one per micro-batch), untraced"
                     if parallel.zero is None else
                     "not validated: the micro-batches in flight follow DeepSpeed's pipeline schedule, untraced (a "
                     "stage as the transformers layers it holds is traced within 2%); its receive buffers are the "
                     "in-flight micro-batches' own activations")
    if parallel.cp > 1:
        notes.append("not validated: context parallel (no trace; the all-gather variant, which keeps the gathered "
                     "keys and values)")
    if parallel.ep > 1:
        notes.append("not validated: expert parallel (no trace; tokens assumed evenly routed)")
    return tuple(notes)
