"""``trainmem diff``: what is alive at each traced phase's peak that the estimate lacks or adds, group by group.

A group is (phase, category, owner): the traced side is every storage alive at the phase's traced peak
(tracelive.py), by the owner it belongs to; the estimate side is the estimate's peak moment of the same phase,
split by owner where the estimate says whose its bytes are:

- parameters, gradients and optimizer states (with fp32 masters): each parameter tensor's bytes at its owner
  (models.parameter_groups, optimizers.Optimizer.state_bytes), where the moment holds all of them (a backward peak
  before the last gradient exists holds only some: one "all" row then);
- forward's activations when its peak is the moment "at the loss" (timeline.step_candidates' last forward moment):
  each layer's saved tensors, the embedding's, the final norm's, the head's (its input, the logits), the loss's, the
  shared constants, the base model's output the CausalLM forward holds; what that moment holds beyond them is one
  "rest of the moment" row;
- backward's activations and gradients where its peak is a moment the timeline places (``Phase.at``: the loss's
  backward, inside a layer, the embedding's backward): what is kept below, what is done above, the rest the
  layer's own;
- the optimizer step's temporaries at the optimizer;
- anything else as one "all" row of its category, against the traced tensors of that category together.

Each group's difference is estimated - traced ("lacks" below zero, "adds" above); a phase's groups sum to the
estimate's phase total less the trace's, the error ``trainmem validate`` reports. No torch at import.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from .models import ModelSpec, ParamGroup
from .owners import Owner, OwnerKind
from .timeline import CATEGORIES, Phase

if TYPE_CHECKING:
    from .activations import ActivationEstimate, Term
    from .estimate import Estimate
    from .lora import FineTune
    from .settings import TrainingSettings
    from .timeline import _LayerBytes
    from .tracelive import TracedTensor

PHASES = ("forward", "backward", "optimizer")
"""The phases whose peak a trace's tracker measures (load and between_steps are the static state)."""
TOP_TENSORS = 3
ALL = Owner(OwnerKind.ALL)
REST = Owner(OwnerKind.REST)


@dataclass(frozen=True)
class TensorGroup:
    """Traced tensors alike (same op, dtype, shape, making module) within a group."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    module: str
    count: int
    nbytes: int


@dataclass(frozen=True)
class DiffRow:
    phase: str
    category: str
    owner: Owner
    traced: int
    estimated: int
    tensors: tuple[TensorGroup, ...] = ()
    """The traced side's largest alike tensors (TOP_TENSORS of them)."""

    @property
    def difference(self) -> int:
        return self.estimated - self.traced

    @property
    def verdict(self) -> str:
        return "lacks" if self.difference < 0 else "adds" if self.difference > 0 else ""


@dataclass(frozen=True)
class PhaseDiff:
    phase: str
    traced: Phase
    estimated: Phase
    rows: tuple[DiffRow, ...]

    @property
    def difference(self) -> int:
        """The estimate's total less the trace's: ``trainmem validate``'s error of this phase, in bytes."""
        return self.estimated.allocated_bytes - self.traced.allocated_bytes

    @property
    def relative_error(self) -> float:
        t = self.traced.allocated_bytes
        return self.difference / t if t else 0.0


def check_diffable(settings: TrainingSettings, finetune: FineTune | None = None) -> None:
    """Refuse, before torch is imported, what diff does not run (trace.trace_step runs the rest)."""
    from .errors import ConfigError

    if settings.compile:
        raise ConfigError("diff does not run --compile yet (its pack hook, which finds who saves each tensor, is not "
                          "run inside compiled graphs); trace does")
    if finetune is not None and finetune.base_quant:
        raise ConfigError("diff runs LoRA on a full-precision base: bitsandbytes' quantized kernels cannot run on "
                          "fake tensors")


# -- the estimate's side --------------------------------------------------------------------------------------


def _group_owner(group: ParamGroup) -> Owner | None:
    """The owner of a non-layer parameter group, by its tensors' roles (None where they are not known)."""
    roles = {t.role for t in group.tensors}
    if roles & {"embedding", "position_embedding"}:
        return Owner(OwnerKind.EMBEDDING)
    if "head" in roles:
        return Owner(OwnerKind.HEAD)
    if roles and roles <= {"norm", "input_norm"}:
        return Owner(OwnerKind.FINAL_NORM)
    return None


def _owned_groups(spec: ModelSpec) -> list[tuple[Owner, ParamGroup]] | None:
    """Each parameter group's tensors once per owner (a run of layers: one per layer)."""
    out, first = [], 0
    for group in spec.param_groups:
        if group.is_layer:
            out += [(Owner(OwnerKind.LAYER, first + i), replace(group, repeat=1)) for i in range(group.repeat)]
            first += group.repeat
            continue
        owner = _group_owner(group)
        if owner is None:
            return None
        out.append((owner, group))
    return out


def static_by_owner(spec: ModelSpec, settings: TrainingSettings,
                    finetune: FineTune | None = None) -> dict[str, dict[Owner, int]]:
    """Parameters, gradients and optimizer states (masters included) of the whole step, by owner; {} where the
    owners are not known (a model counted by transformers, LoRA's frozen base)."""
    from .optimizers import get_optimizer
    from .recipes import get_recipe

    owned = _owned_groups(spec) if finetune is None else None
    if not owned:
        return {}
    recipe, optimizer = get_recipe(settings.recipe), get_optimizer(settings.optimizer)
    state_bytes = recipe.state_bytes_for(optimizer.name)
    out: dict[str, dict[Owner, int]] = {c: defaultdict(int) for c in ("parameters", "gradients", "optimizer_states")}
    for owner, group in owned:
        out["parameters"][owner] += group.numel * recipe.weight_bytes
        out["gradients"][owner] += group.numel * recipe.gradient_bytes
        states = (optimizer.state_bytes((group,), state_bytes) - optimizer.fixed_bytes
                  - optimizer.paged_bytes((group,), state_bytes))
        out["optimizer_states"][owner] += states + group.numel * recipe.master_bytes
    if optimizer.fixed_bytes:
        out["optimizer_states"][Owner(OwnerKind.OPTIMIZER)] += optimizer.fixed_bytes
    return {c: dict(v) for c, v in out.items()}


def _term_owner(term: Term, default: OwnerKind) -> Owner:
    if term.owner is not None:
        return Owner(term.owner)
    if term.module == "final_norm":
        return Owner(OwnerKind.FINAL_NORM)
    if term.module == "lm_head":
        return Owner(OwnerKind.HEAD)
    return Owner(default)


def saved_by_owner(acts: ActivationEstimate) -> dict[Owner, int]:
    """What the forward pass saved for backward (ActivationEstimate.saved_bytes), by owner: each layer's, the
    embedding's, the final norm's, the head's and the loss's terms, the shared constants."""
    out: dict[Owner, int] = defaultdict(int)
    index = 0
    for la in acts.layers:
        for _ in range(la.count):
            out[Owner(OwnerKind.LAYER, index)] += acts.layer_saved_bytes(la)
            index += 1
    if acts.embedding_terms:
        out[Owner(OwnerKind.EMBEDDING)] += acts.embedding_bytes
    for term in acts.head_terms:
        out[_term_owner(term, OwnerKind.HEAD)] += int(term.bytes_per_token * acts.tokens)
    for term in acts.constant_terms:
        out[_term_owner(term, OwnerKind.MODEL)] += int(term.bytes_per_token)
    return out


def forward_activations_by_owner(spec: ModelSpec, acts: ActivationEstimate,
                                 settings: TrainingSettings) -> dict[Owner, int]:
    """The activations of forward's moment "at the loss" (timeline.step_candidates) by owner: what was saved
    (saved_by_owner), the KV cache each layer returns, autocast's cached casts of checkpointed layers, the logits,
    the loss's fp32 upcast and the base model's output the CausalLM forward holds."""
    from .activations import Precision
    from .recipes import get_recipe
    from .timeline import casts_cached, final_hidden_bytes

    p = Precision.of(get_recipe(settings.recipe))
    cached = bool(acts.layers) and acts.layers[-1].checkpointed and casts_cached(spec, p, settings)
    out = saved_by_owner(acts)
    index = 0
    for la in acts.layers:
        for _ in range(la.count):
            out[Owner(OwnerKind.LAYER, index)] += int(la.cache_extra * acts.tokens) + (la.constant_bytes if cached
                                                                                         else 0)
            index += 1
    # the logits the model returns: the LM head's output, or the CausalLM forward's softcapped ones (Gemma 2)
    out[Owner(OwnerKind.LOSS if spec.final_logit_softcap else OwnerKind.HEAD)] += acts.logits_bytes
    out[Owner(OwnerKind.LOSS)] += acts.loss_transient_bytes
    out[Owner(OwnerKind.FINAL_NORM)] += final_hidden_bytes(spec, p, acts.tokens, settings, None, bool(acts.layers))
    return out


def _backward_moment(acts: ActivationEstimate, layers: Sequence[_LayerBytes], at: Owner, moment: Phase,
                     static: dict[str, dict[Owner, int]]) -> dict[str, dict[Owner, int]]:
    """A backward moment inside layer ``at.layer`` or the embedding's backward (step_candidates' walk from the
    last layer to the embedding): the embedding's and the constants' activations (but the LM head's autocast
    copy, gone by then) and those the layers below keep; the gradients of what backward has finished (the layers
    above, the head, the final norm); the rest of the moment's activations and gradients are the layer's own (the
    embedding's). Temporaries stay one row: the trace's module stack in backward (ModTracker's) is too loose to own
    them."""
    kept: dict[Owner, int] = defaultdict(int)
    kept[Owner(OwnerKind.EMBEDDING)] += acts.embedding_bytes if acts.embedding_terms else 0
    for term in acts.constant_terms:
        if term.module != "lm_head":
            kept[_term_owner(term, OwnerKind.MODEL)] += int(term.bytes_per_token)
    for below in range(at.layer or 0):
        kept[Owner(OwnerKind.LAYER, below)] += layers[below].kept
    if at.layer is None and sum(kept.values()) > moment.activations:
        kept.clear()  # (an untied embedding's backward holds its own saved tensors only; a tied one's, the constants)
    first_done = 0 if at.layer is None else at.layer + 1
    done: dict[Owner, int] = {Owner(OwnerKind.LAYER, above): layers[above].grads
                              for above in range(first_done, len(layers))}
    for owner in (Owner(OwnerKind.HEAD), Owner(OwnerKind.FINAL_NORM)):
        done[owner] = static.get("gradients", {}).get(owner, 0)
    out: dict[str, dict[Owner, int]] = {}
    for category, parts in (("activations", kept), ("gradients", done)):
        rest = getattr(moment, category) - sum(parts.values())
        if rest >= 0:
            out[category] = {**parts, at: parts.get(at, 0) + rest}
    return out


def moment_by_owner(spec: ModelSpec, settings: TrainingSettings, est: Estimate, static: dict[str, dict[Owner, int]],
                    finetune: FineTune | None = None) -> dict[str, dict[str, dict[Owner, int]]]:
    """Per phase and category, the owners of the estimate's peak moment where step_candidates says whose its
    bytes are: forward's at the loss; backward's at the loss's backward, inside a layer or at the embedding's
    backward (``Phase.at``). A
    phase's moment is the first of its candidates equal to the estimate's phase in every category, as peak_of
    picks the earliest of equal moments."""
    from .stepmodel import compile_step

    if finetune is not None or est.rank is not None or est.per_rank or est.activations is None:
        return {}
    step = compile_step(spec, settings, est.device, est.parallel, finetune)
    acts, candidates = step.candidates(settings.batch, settings.seq)
    assert acts is not None  # (est.activations is not None: not the seed rule, the one that gives no activations)
    phases = {p.name: p for p in est.phases}
    out: dict[str, dict[str, dict[Owner, int]]] = {}
    if candidates[1] and candidates[1][-1].by_category() == phases["forward"].by_category():
        out["forward"] = {"activations": forward_activations_by_owner(spec, acts, settings)}
    moment = next((c for c in candidates[2] if c.by_category() == phases["backward"].by_category()), None)
    at = moment.at if moment is not None else None
    if at is not None and at.kind is OwnerKind.LOSS:
        out["backward"] = {"activations": saved_by_owner(acts)}
    elif moment is not None and at is not None:
        _, layers = step.activations_and_layers(step.settings_at(settings.batch, settings.seq))
        assert layers is not None  # (activations_and_layers makes the layers' bytes)
        out["backward"] = _backward_moment(acts, layers, at, moment, static)
    return out


def _category_parts(name: str, category: str, phase: Phase, static: dict[str, dict[Owner, int]],
                    moment: dict[str, dict[Owner, int]]) -> dict[Owner, int]:
    total = getattr(phase, category)
    parts: dict[Owner, int] | None = None
    split = moment.get(category)
    if category in static and sum(static[category].values()) == total:
        parts = dict(static[category])
    elif split is not None and sum(split.values()) <= total:
        parts = dict(split)
        if total > sum(split.values()):
            parts[REST] = total - sum(split.values())
    elif name == "optimizer" and category == "temporaries":
        parts = {Owner(OwnerKind.OPTIMIZER): total}
    if parts is None:
        parts = {ALL: total}
    return {o: b for o, b in parts.items() if b}


def estimated_groups(spec: ModelSpec, settings: TrainingSettings, est: Estimate,
                     finetune: FineTune | None = None) -> dict[str, dict[tuple[str, Owner], int]]:
    """Per phase, the estimate's peak moment by (category, owner)."""
    phases = {p.name: p for p in est.phases}
    static = static_by_owner(spec, settings, finetune)
    moments = moment_by_owner(spec, settings, est, static, finetune)
    return {name: {(c, o): b for c in CATEGORIES
                   for o, b in _category_parts(name, c, phases[name], static, moments.get(name, {})).items()}
            for name in PHASES}


# -- the match ------------------------------------------------------------------------------------------------


def _top(tensors: Iterable[TracedTensor]) -> tuple[TensorGroup, ...]:
    alike: dict[tuple[str, str, tuple[int, ...], str], list[int]] = defaultdict(lambda: [0, 0])
    for t in tensors:
        entry = alike[(t.op, t.dtype, t.shape, t.module)]
        entry[0] += 1
        entry[1] += t.nbytes
    ranked = sorted(alike.items(), key=lambda kv: -kv[1][1])[:TOP_TENSORS]
    return tuple(TensorGroup(op, dtype, shape, module, n, b) for (op, dtype, shape, module), (n, b) in ranked)


def match(phase: str, traced_phase: Phase, estimated_phase: Phase, tensors: Iterable[TracedTensor],
          estimated: dict[tuple[str, Owner], int]) -> PhaseDiff:
    """One phase's rows: the traced tensors grouped as the estimate's side is (a category the estimate gives as one
    "all" row is one on the traced side too)."""
    whole = {c for (c, o) in estimated if o == ALL}
    whole |= {c for c in CATEGORIES if not any(k[0] == c for k in estimated)}
    by_key: dict[tuple[str, Owner], list[TracedTensor]] = defaultdict(list)
    for t in tensors:
        by_key[(t.category, ALL if t.category in whole else t.owner)].append(t)
    keys = set(by_key) | set(estimated)
    rows = [DiffRow(phase, c, o, sum(t.nbytes for t in by_key.get((c, o), ())), estimated.get((c, o), 0),
                    _top(by_key.get((c, o), ()))) for c, o in keys]
    rows.sort(key=lambda r: (CATEGORIES.index(r.category), r.owner.sort_key()))
    return PhaseDiff(phase, traced_phase, estimated_phase, tuple(rows))


def diff_step(config: dict[str, Any], spec: ModelSpec, settings: TrainingSettings, est: Estimate,
              round_to_cuda: bool = False, finetune: FineTune | None = None) -> tuple[PhaseDiff, ...]:
    """Trace ``config``'s step (tracelive.live_sets) and match it with the estimate ``est`` of the same set-up."""
    from .tracelive import live_sets

    result, live = live_sets(config, settings, spec, round_to_cuda=round_to_cuda, finetune=finetune)
    return diff_of(result.phases, live, spec, settings, est, finetune)


def diff_of(traced_phases: Iterable[Phase], live: dict[str, tuple[TracedTensor, ...]], spec: ModelSpec,
            settings: TrainingSettings, est: Estimate, finetune: FineTune | None = None) -> tuple[PhaseDiff, ...]:
    """The match of a trace already made (its phases and live tensors) with the estimate ``est``."""
    groups = estimated_groups(spec, settings, est, finetune)
    traced = {p.name: p for p in traced_phases}
    estimated = {p.name: p for p in est.phases}
    return tuple(match(name, traced[name], estimated[name], live.get(name, ()), groups[name]) for name in PHASES)


# -- output ---------------------------------------------------------------------------------------------------


def _signed(n: int, unit: str) -> str:
    """A difference in ``unit``, with its bytes where the unit rounds it away."""
    from .units import format_bytes

    text = ("+" if n > 0 else "-" if n < 0 else "") + format_bytes(abs(n), unit)
    if n and format_bytes(abs(n), unit) == format_bytes(0, unit):
        text += f" ({n:+,} B)"
    return text


def _tensor_text(g: TensorGroup) -> str:
    shape = "x".join(str(n) for n in g.shape) or "-"
    count = f"{g.count} x " if g.count > 1 else ""
    return f"{count}{g.op or 'registered'} {g.dtype} [{shape}]"


def to_dict(diffs: tuple[PhaseDiff, ...]) -> list[dict[str, Any]]:
    def owner(o: Owner) -> dict[str, Any]:
        return {"kind": o.kind.value, "layer": o.layer}

    return [{"phase": d.phase, "traced_bytes": d.traced.allocated_bytes, "estimated_bytes": d.estimated.allocated_bytes,
             "difference_bytes": d.difference, "relative_error": d.relative_error,
             "groups": [{"category": r.category, "owner": owner(r.owner), "traced_bytes": r.traced,
                         "estimated_bytes": r.estimated, "difference_bytes": r.difference, "verdict": r.verdict,
                         "traced_tensors": [{"op": g.op, "dtype": g.dtype, "shape": list(g.shape),
                                             "module": g.module, "count": g.count, "bytes": g.nbytes}
                                            for g in r.tensors]} for r in d.rows]} for d in diffs]


def render(diffs: tuple[PhaseDiff, ...], unit: str, console: Any, every: bool = False) -> None:
    """One table per phase: its groups (those that differ, or ``every`` one) and the total line."""
    from rich.table import Table

    from .units import format_bytes

    for d in diffs:
        table = Table(title=f"{d.phase}: traced peak vs the estimate's", title_justify="left")
        for col, justify in (("category", "left"), ("owner", "left"), ("traced", "right"), ("estimated", "right"),
                             ("difference", "right"), ("", "left"), ("traced tensors (largest)", "left")):
            table.add_column(col, justify=justify)  # type: ignore[arg-type]
        shown = [r for r in d.rows if every or r.difference]
        for r in shown:
            table.add_row(r.category, r.owner.label(), format_bytes(r.traced, unit),
                          format_bytes(r.estimated, unit), _signed(r.difference, unit), r.verdict,
                          "; ".join(_tensor_text(g) for g in r.tensors))
        table.add_row("total", f"{len(d.rows) - len(shown)} groups equal" if not every else "",
                      format_bytes(d.traced.allocated_bytes, unit), format_bytes(d.estimated.allocated_bytes, unit),
                      _signed(d.difference, unit), f"{d.relative_error:+.2%}", "", style="bold")
        console.print(table)
