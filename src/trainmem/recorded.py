"""The traced path: a peak for any causal LM transformers can build, from a recorded slice of its real step.

For a model_type without a hand-written description (its spec was counted by transformers, meta_count.py), the
estimate traces the real training step (trace.trace_step: the transformers model under FakeTensorMode, every
allocation counted by MemTracker) on reduced copies of the config, and extrapolates to the real layer count:

- **The layer pattern.** The full model is built on the meta device and each decoder layer gets a signature: its
  parameters' names and shapes, the plain attributes of its modules (sliding_window, is_sliding, attention_type,
  ...; not layer_idx) and the config's per-layer list values at its index (layer_types, mlp_layer_types, ...), plus
  whether selective checkpointing checkpoints it. The smallest period ``p`` after a prefix ``s`` (DeepSeek's
  first_k_dense_replace dense layers) such that the signatures repeat is the model's pattern: 1 for Llama-like
  models, 4 for OLMo-3's three sliding + one full, 8 for Jamba's attention period.
- **Two traces, a line.** The step is traced with ``n1`` and ``n1 + p`` layers at the real widths, batch and
  sequence (fake tensors cost no memory and time is per operation, not per byte), where ``n1 >= s + p`` (every kind
  of layer is present, so the masks the model builds per kind are the same as in the full model), ``n1 >= 2``
  (the bottom layer is not the top one: their module moments extrapolate apart) and ``n1 = L (mod p)`` (the real
  layer count is ``n1`` plus whole periods). Every phase's every category is then
  ``v(n1) + m * (v(n1 + p) - v(n1))`` with ``m = (L - n1) / p``: each period adds the same tensors, saved for
  backward and freed in the same order, and each phase's peak moment (end of forward, start or end of backward,
  the optimizer step) moves by one period's bytes (checked against full traces: tests/test_recorded.py and
  benchmarks/every_model_type.py). Where ``n1 + p >= L`` the real count is traced directly.
- **The cache.** The recorded phases are kept on disk (``$TRAINMEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/trainmem``,
  else ``~/.cache/trainmem``) under a hash of the config, every training setting (batch and sequence included: an
  estimate records its own batch; a search answers other batches on the line through two recorded ones,
  tracedstep.py) and the torch, transformers and
  trainmem versions; the parameter tensors the spec counts (meta_count.spec_by_building) are kept the same way.
  A second estimate of the same set-up imports neither torch nor transformers.

- **Other heads** (``--task``, tasks.py): an encoder's masked-LM or classifier step is reduced over its one stack
  of layers the same way; an encoder-decoder's (seq2seq-lm) over its two stacks apart (``record_seq2seq``: one
  more period of the encoder, then of the decoder, each extrapolated by its own count; docs/method.md 7b).

Needs torch and transformers (``pip install 'trainmem[trace]'``); without them the estimate is the static memory
and one line naming the extra.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable, Sequence

from .diskcache import cache_dir, cache_path, canonical_config, read_cached, write_cached
from .timeline import CATEGORIES, Phase

if TYPE_CHECKING:
    from .lora import FineTune
    from .models import ModelSpec
    from .settings import TrainingSettings

TRACE_EXTRA = "pip install 'trainmem[trace]'"
_NOT_PER_LAYER = re.compile(r"rope|section|token_id|limit|multiplier")
"""Config lists whose length can equal the layer count without being per layer (mrope_section, time_step_limit)."""
_LAYER_INDEX = frozenset({"layer_idx", "layer_id", "layer_number", "layer_index", "idx", "block_idx"})
"""Module attributes that number the layers: different in every layer by design, not part of its kind."""


# -- the layer pattern ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerPlan:
    """Which layer counts to trace for a model of ``layers`` decoder layers whose pattern repeats every ``period``
    layers after the first ``prefix`` ones (module docstring)."""

    layers: int
    prefix: int
    period: int
    counts: tuple[int, ...]
    """One count (the real one, traced directly) or two (n1 and n1 + period)."""

    @property
    def periods_added(self) -> int:
        """m: how many periods the real model has past the first traced count."""
        return 0 if len(self.counts) == 1 else (self.layers - self.counts[0]) // self.period


def plan_layers(layers: int, prefix: int, period: int) -> LayerPlan:
    n1 = prefix + period + (layers - prefix - period) % period
    if n1 == 1:
        # (at least two layers, so that the bottom layer is not the top one too: _anchored)
        n1 = 2
    if n1 + period >= layers:
        return LayerPlan(layers, prefix, period, (layers,))
    return LayerPlan(layers, prefix, period, (n1, n1 + period))


def find_period(signatures: Sequence[Hashable]) -> tuple[int, int]:
    """The smallest (period, then prefix) after which ``signatures`` repeat: (prefix, period)."""
    kinds: dict[Hashable, int] = {}
    signatures = [kinds.setdefault(s, len(kinds)) for s in signatures]  # (ints compare faster than signatures)
    n = len(signatures)
    for period in range(1, n + 1):
        for prefix in range(0, n - period + 1):
            if all(signatures[i] == signatures[i - period] for i in range(prefix + period, n)):
                if prefix + 2 * period < n:  # a reduction worth tracing twice for
                    return prefix, period
                break
    return 0, n


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str)) or (
        isinstance(value, tuple) and all(_plain(v) for v in value))


def layer_signature(layer: Any, index: int, per_layer: dict[str, list[Any]],
                    checkpoint_every: int) -> tuple[Any, ...]:
    """What makes decoder layer ``index`` the kind of layer it is (module docstring)."""
    params = tuple((name, tuple(p.shape), str(p.dtype)) for name, p in layer.named_parameters())
    attrs = tuple((path, key, value) for path, module in layer.named_modules()
                  for key, value in sorted(vars(module).items())
                  if not key.startswith("_") and key not in _LAYER_INDEX and _plain(value))
    listed = tuple((key, json.dumps(values[index], default=str)) for key, values in sorted(per_layer.items()))
    checkpointed = checkpoint_every > 1 and index % checkpoint_every == 0
    return params, attrs, listed, checkpointed


def per_layer_lists(hf_config: dict[str, Any], layers: int) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """The config's lists with one value per layer, and its lists of layer indices (mlp_only_layers)."""
    per_layer, indices = {}, {}
    for key, value in hf_config.items():
        if not isinstance(value, list) or _NOT_PER_LAYER.search(key):
            continue
        if "layer" in key and _layer_indices(value, layers):  # (first: a list of every index is one too)
            indices[key] = value
        elif len(value) == layers:
            per_layer[key] = value
    return per_layer, indices


def _layer_indices(value: list[Any], layers: int) -> bool:
    """Whether ``value`` lists distinct layer indices (mlp_only_layers). One as long as the layer count does only
    where it lists every layer in order: Llama 4's moe_layers where every layer is MoE, which read as one value per
    layer made each layer a kind of its own (no period found)."""
    if not value or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value):
        return False
    return len(set(value)) == len(value) and (len(value) < layers or value == list(range(layers)))


def layer_plan(config: dict[str, Any], checkpoint_every: int = 1, task: str = "causal-lm",
               num_labels: int | None = None) -> tuple[LayerPlan, str, dict[str, Any]]:
    """The layer plan of ``config``, the config key of its layer count and its full config (transformers' to_dict,
    with every per-layer list the config class derives), from the model of ``task`` built on the meta device."""
    from .meta_count import build_meta_model, decoder_layers

    model = build_meta_model(config, task=task, num_labels=num_labels)
    hf = model.config
    key = type(hf).attribute_map.get("num_hidden_layers", "num_hidden_layers")
    layers = getattr(hf, "num_hidden_layers", None)
    full = hf.to_dict()
    nested = hasattr(hf, "get_text_config") and _text_config_is_nested(hf)
    found = None if nested or not isinstance(layers, int) else decoder_layers(model, layers)
    if found is None:  # no layer list to reduce: trace the model as it is
        return LayerPlan(int(layers or 0), 0, 1, (int(layers or 0),)), key, full
    assert isinstance(layers, int)
    per_layer, indices = per_layer_lists(full, layers)
    for name, values in indices.items():
        per_layer[name] = [i in values for i in range(layers)]
    signatures = [layer_signature(layer, i, per_layer, checkpoint_every) for i, layer in enumerate(found)]
    prefix, period = find_period(signatures)
    return plan_layers(layers, prefix, period), key, full


def _text_config_is_nested(hf: Any) -> bool:
    try:
        return hf.get_text_config() is not hf
    except ValueError:  # several text configs (an encoder-decoder): not one decoder to reduce
        return True


def reduced_config(config: dict[str, Any], full: dict[str, Any], key: str, layers: int,
                   count: int) -> dict[str, Any]:
    """``config`` with its first ``count`` of ``layers`` layers: the layer count set, each per-layer list cut to
    its first ``count`` values, each list of layer indices to those below ``count``."""
    if count == layers:
        return dict(config)
    text = config.get("text_config")
    if isinstance(text, dict) and full.get("model_type") != config.get("model_type"):
        # a multimodal config whose causal LM is its text model (Emu3, Qwen3.5, Mllama): the text config's layers
        # (the top-level count was read by no one: both traces had every layer)
        return {**config, "text_config": reduced_config(text, full, key, layers, count)}
    out = {k: v for k, v in config.items() if k not in ("num_hidden_layers", key)}
    own_counts = [name for name, value in full.items()  # the decoder's own count where the layer count names the
                  if name != key and re.search(r"(^|_)(layers|n_layer)$", name) and value == layers]  # encoder's (BART)
    if key in config or not own_counts:  # (ProphetNet's config refuses a num_hidden_layers: its two counts say it)
        out[key] = count
    for name in own_counts:
        out[name] = count
    per_layer, indices = per_layer_lists(full, layers)
    for name, values in per_layer.items():
        out[name] = values[:count]
    for name, values in indices.items():
        out[name] = [i for i in values if i < count]
    overrides = config.get("per_layer_config")
    if isinstance(overrides, dict):  # {layer index: that layer's own sizes} (Gemma 4, dots3): the first count's
        out["per_layer_config"] = {k: v for k, v in overrides.items() if str(k).isdigit() and int(k) < count}
    return out


# -- recording and extrapolating -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recorded:
    """A step's phases recorded on the traced path."""

    phases: tuple[Phase, ...]
    plan: LayerPlan
    seconds: float
    """How long recording took (0 when read from the cache)."""
    cache: str
    """The cache file, or why it was not kept."""
    from_cache: bool
    places: tuple[tuple[str, Phase], ...] = ()
    """Forward's and backward's largest moment in each place (record_places), where an engine's buffers are added."""
    decoder_plan: LayerPlan | None = None
    """An encoder-decoder's decoder (``plan`` is then its encoder's)."""
    task: str = "causal-lm"

    def note(self) -> str:
        where = (f"read from the cache at {self.cache}" if self.from_cache else
                 f"recorded in {self.seconds:.1f} s, cached at {self.cache}" if self.cache.endswith(".json") else
                 f"recorded in {self.seconds:.1f} s, not cached ({self.cache})")
        why = ("no hand-written description of this model_type" if self.task == "causal-lm" else
               f"--task {self.task} runs transformers' own head and loss")
        stacks = (_plan_words(self.plan, "layers") if self.decoder_plan is None else
                  f"{_plan_words(self.plan, 'encoder layers')}; {_plan_words(self.decoder_plan, 'decoder layers')}")
        return f"traced path: {why}, so its step was traced under FakeTensorMode (recorded {stacks}); {where}"

    def as_dict(self) -> dict[str, Any]:
        out = {"layers": self.plan.layers, "recorded_layers": list(self.plan.counts), "period": self.plan.period,
               "prefix": self.plan.prefix, "cache": self.cache, "from_cache": self.from_cache,
               "seconds": round(self.seconds, 3)}
        if self.decoder_plan is not None:
            out["decoder"] = _plan_doc(self.decoder_plan)
        if self.task != "causal-lm":
            out["task"] = self.task
        return out


def _plan_words(plan: LayerPlan, what: str) -> str:
    counts = " and ".join(str(n) for n in plan.counts)
    how = ("traced directly" if len(plan.counts) == 1 else
           f"period {plan.period}{f' after {plan.prefix}' if plan.prefix else ''}, extrapolated linearly")
    return f"{counts} of {plan.layers} {what}, {how}"


def extrapolate(first: tuple[Phase, ...], second: tuple[Phase, ...], periods: int) -> tuple[Phase, ...]:
    """Each phase at ``periods`` more periods than ``first``, ``second`` being one more (module docstring)."""
    out = []
    for a, b in zip(first, second, strict=True):
        values = {c: getattr(a, c) + periods * (getattr(b, c) - getattr(a, c)) for c in CATEGORIES}
        if any(v < 0 for v in values.values()):
            raise ValueError(f"the {a.name} phase shrinks with the layers ({a.by_category()} -> {b.by_category()})")
        out.append(Phase(a.name, b.moment, **values))
    return tuple(out)


def record(config: dict[str, Any], settings: TrainingSettings, spec: ModelSpec | None = None, progress: bool = True,
           finetune: FineTune | None = None) -> tuple[tuple[Phase, ...], LayerPlan]:
    """Trace ``config``'s step (peft's LoRA step with ``finetune``) at the plan's layer counts and extrapolate to its
    real count."""
    phases, plan, _ = record_places(config, settings, spec, progress, finetune)
    return phases, plan


def record_places(config: dict[str, Any], settings: TrainingSettings, spec: ModelSpec | None = None,
                  progress: bool = True, finetune: FineTune | None = None
                  ) -> tuple[tuple[Phase, ...], LayerPlan, tuple[tuple[str, Phase], ...]]:
    """:func:`record`, and forward's and backward's largest moment in each place (``_places``)."""
    from .progress import Progress
    from .settings import SELECTIVE_EVERY
    from .trace import trace_step

    plan, key, full = layer_plan(config, SELECTIVE_EVERY if settings.checkpointing == "selective" else 1,
                                 settings.task, settings.num_labels)
    traced, peaks = [], []
    with Progress(f"tracing {' and '.join(map(str, plan.counts))} of {plan.layers} layers", total=len(plan.counts),
                  force=None if progress else False) as bar:
        for count in plan.counts:
            result = trace_step(reduced_config(config, full, key, plan.layers, count), settings, spec,
                                finetune=finetune, module_peaks=True)
            traced.append(result.phases)
            peaks.append(result.module_peaks)
            bar.advance()
    if len(traced) == 1:
        return traced[0], plan, _places([_anchored(peaks[0], plan.counts[0])], list(peaks[0]), 0)
    phases = tuple(_extrapolated_phase(a, b, plan.periods_added) for a, b in zip(traced[0], traced[1], strict=True))
    first, second = _anchored(peaks[0], plan.counts[0]), _anchored(peaks[1], plan.counts[1])
    places = _places([first, second], list(peaks[0]), plan.periods_added)
    return _with_module_moments(phases, peaks, plan), plan, places


PLACES = {"forward": ("start", "layer", ""), "backward": ("end", "layer", "head")}
"""Where a moment is, per phase, as sharding.Buffer names the places an engine's buffers are alive in: before the
decoder layers, inside one, after them ("" in forward: the loss, where no layer's buffers are alive)."""


def _places(anchored: list[dict[tuple[Any, ...], tuple[Phase | None, Phase | None]]], names: list[str],
            periods: int) -> tuple[tuple[str, Phase], ...]:
    """Forward's and backward's largest moment in each place (PLACES), as (``phase:place``, Phase), each module's
    peak extrapolated over ``periods`` as in _with_module_moments. A module outside the layers is before them when
    the model registers it before the first layer (the embedding), else after (final norm, LM head); the model and
    the modules that hold the layers are left out (their peak is the phase's own, which rank_phases places at the
    loss)."""
    first_layer = next((i for i, n in enumerate(names) if any(part.isdigit() for part in n.split("."))), len(names))
    order = {n: i for i, n in enumerate(names)}
    layered = [n for n in names[first_layer:] if any(part.isdigit() for part in n.split("."))]
    best: dict[str, Phase] = {}
    for key, pair in anchored[0].items():
        if key[0] == "module" and (key[1] == "" or any(n.startswith(key[1] + ".") for n in layered)):
            continue  # (the model and the modules holding the layers: their peak is the phase's own)
        for which, phase in enumerate(("forward", "backward")):
            a = pair[which]
            b = anchored[1].get(key, (None, None))[which] if len(anchored) == 2 else a
            if a is None or b is None:
                continue
            try:
                (moment,) = extrapolate((a,), (b,), periods)
            except ValueError:
                continue
            before, inside, after = PLACES[phase]
            place = inside if key[0] != "module" else after if order[key[1]] > first_layer else before
            label = f"{phase}:{place}" if place else phase
            if label not in best or moment.allocated_bytes > best[label].allocated_bytes:
                best[label] = moment
    return tuple(sorted(best.items()))


def _extrapolated_phase(a: Phase, b: Phase, periods: int) -> Phase:
    """One phase extrapolated; forward's or backward's that shrinks in a category with the layers (its peak moment
    is a different one at the two traced counts: with --grad-accum, the end of backward at one layer, its start at
    two) is left at nothing, for the largest of the modules' extrapolated moments to replace
    (``_with_module_moments``); another phase that shrinks is an error."""
    try:
        return extrapolate((a,), (b,), periods)[0]
    except ValueError:
        if a.name not in ("forward", "backward"):
            raise
        return Phase(a.name, b.moment, *(0 for _ in CATEGORIES))


# -- encoder-decoders ----------------------------------------------------------------------------------------------

_DECODER_LAYER_KEYS = ("num_decoder_layers", "decoder_layers")
"""Where an encoder-decoder's config counts its decoder layers (T5's num_decoder_layers; BART's, mBART's,
Marian's, Pegasus' decoder_layers); the encoder's count is the key ``num_hidden_layers`` maps to (T5's
num_layers, BART's encoder_layers)."""


@dataclass(frozen=True)
class Stack:
    """One of an encoder-decoder's two stacks of layers: the config key of its layer count and its layer plan."""

    key: str
    plan: LayerPlan


def seq2seq_plans(config: dict[str, Any], checkpoint_every: int = 1) -> tuple[Stack, Stack, dict[str, Any]]:
    """The encoder's and the decoder's layer plans (each stack's own pattern: T5's first layer holds the relative
    position bias, so each has a prefix of one), from the Seq2Seq LM built on the meta device, and its full config."""
    from .errors import ModelError
    from .meta_count import build_meta_model, decoder_layers

    model = build_meta_model(config, task="seq2seq-lm")
    hf = model.config
    full = hf.to_dict()
    encoder_key = type(hf).attribute_map.get("num_hidden_layers", "num_hidden_layers")
    decoder_key = next((k for k in _DECODER_LAYER_KEYS if isinstance(full.get(k), int)), None)
    if decoder_key is None or not isinstance(full.get(encoder_key), int):
        raise ModelError(f"model_type {config.get('model_type')!r}: no encoder and decoder layer counts "
                         f"({encoder_key}, {' or '.join(_DECODER_LAYER_KEYS)}) to trace a seq2seq-lm step by")
    stacks = []
    for key, part in ((encoder_key, model.get_encoder()), (decoder_key, model.get_decoder())):
        layers = int(full[key])
        found = decoder_layers(part, layers) if layers else None
        if found is None:
            stacks.append(Stack(key, LayerPlan(layers, 0, 1, (layers,))))
            continue
        prefix, period = find_period([layer_signature(layer, i, {}, checkpoint_every)
                                      for i, layer in enumerate(found)])
        stacks.append(Stack(key, plan_layers(layers, prefix, period)))
    return stacks[0], stacks[1], full


def extrapolate_stacks(base: tuple[Phase, ...], moved: list[tuple[tuple[Phase, ...], int]]) -> tuple[Phase, ...]:
    """Each phase at ``base`` plus, for each stack, ``periods`` times what one more period of that stack added
    (``moved``: the phases with one more period of one stack, the other at its base count, and the periods to add):
    the stacks' layers add their tensors independently (the encoder's activations are saved in the encoder, the
    decoder's in the decoder; the encoder's output, which every cross-attention reads, does not grow with either)."""
    out = []
    for index, phase in enumerate(base):
        values = {c: getattr(phase, c) for c in CATEGORIES}
        for phases, periods in moved:
            for c in CATEGORIES:
                values[c] += periods * (getattr(phases[index], c) - getattr(phase, c))
        if any(v < 0 for v in values.values()):
            raise ValueError(f"the {phase.name} phase shrinks with the layers")
        out.append(Phase(phase.name, phase.moment, **values))
    return tuple(out)


def record_seq2seq(config: dict[str, Any], settings: TrainingSettings, spec: ModelSpec | None = None,
                   progress: bool = True) -> tuple[tuple[Phase, ...], LayerPlan, LayerPlan]:
    """An encoder-decoder's step: traced at the base counts (each stack's first), then with one more period of the
    encoder, then of the decoder, and extrapolated over both (``extrapolate_stacks``)."""
    from .progress import Progress
    from .trace import trace_step

    encoder, decoder, _ = seq2seq_plans(config)  # (--checkpointing selective is refused for seq2seq-lm: settings)
    base = {encoder.key: encoder.plan.counts[0], decoder.key: decoder.plan.counts[0]}
    runs = [dict(base)]
    for stack in (encoder, decoder):
        if len(stack.plan.counts) == 2:
            runs.append({**base, stack.key: stack.plan.counts[1]})
    traced = []
    with Progress(f"tracing {len(runs)} encoder-decoder sizes of {encoder.plan.layers} + {decoder.plan.layers} "
                  "layers", total=len(runs), force=None if progress else False) as bar:
        for counts in runs:
            traced.append(trace_step({**config, **counts}, settings, spec).phases)
            bar.advance()
    moved, at = [], 1
    for stack in (encoder, decoder):
        if len(stack.plan.counts) == 2:
            moved.append((traced[at], stack.plan.periods_added))
            at += 1
    return extrapolate_stacks(traced[0], moved), encoder.plan, decoder.plan


def _anchored(peaks: dict[str, tuple[Phase | None, Phase | None]],
              count: int) -> dict[tuple[Any, ...], tuple[Phase | None, Phase | None]]:
    """Module peaks keyed so that the same moment has the same key at every layer count: a module outside the layers
    by its name; one inside layer i both from the bottom (i) and from the top (count - 1 - i)."""
    out: dict[tuple[Any, ...], tuple[Phase | None, Phase | None]] = {}
    for name, pair in peaks.items():
        parts = name.split(".")
        at = next((j for j, part in enumerate(parts) if part.isdigit()), None)
        if at is None:
            out[("module", name)] = pair
            continue
        path, index, rest = ".".join(parts[:at]), int(parts[at]), ".".join(parts[at + 1:])
        # The top layer's moment from the bottom is the top's moment too (the head's gradient beside it, ...), the
        # bottom layer's from the top the bottom's: neither is the same moment at another count (traced: a one-layer
        # Pegasus decoder's layer 0, extrapolated as "the bottom layer", +4.0% at the backward peak).
        if index < count - 1:
            out[("bottom", path, index, rest)] = pair
        if index > 0:
            out[("top", path, count - 1 - index, rest)] = pair
    return out


def _with_module_moments(phases: tuple[Phase, ...], peaks: list[dict[str, tuple[Phase | None, Phase | None]]],
                         plan: LayerPlan) -> tuple[Phase, ...]:
    """Forward's and backward's peaks as the largest of every module's extrapolated peak and the phase's own.

    Why: a phase's peak is the largest of many moments, each a line in the number of periods (the backward of the
    top layer holds every layer's activations, that of the bottom layer every layer's gradients), and which line is
    largest can change between the traced counts and the real one (OLMo-7B at 2,048 tokens: the top at 1 and 2
    layers, the bottom at 32). Each module's peak at the same place from the top or the bottom is one moment, so
    it extrapolates; the real peak is the largest of them."""
    first, second = _anchored(peaks[0], plan.counts[0]), _anchored(peaks[1], plan.counts[1])
    out = []
    for index, phase in enumerate(phases):
        if phase.name not in ("forward", "backward"):
            out.append(phase)
            continue
        which = 0 if phase.name == "forward" else 1
        best = phase
        for key, pair in first.items():
            a, b = pair[which], second.get(key, (None, None))[which]
            if a is None or b is None:
                continue
            try:
                (moment,) = extrapolate((a,), (b,), plan.periods_added)
            except ValueError:
                continue  # (a moment that shrinks with the layers is not one that repeats)
            if moment.allocated_bytes > best.allocated_bytes:
                best = Phase(phase.name, phase.moment, *(getattr(moment, c) for c in CATEGORIES))
        out.append(best)
    return tuple(out)


def _phase_doc(phase: Phase) -> dict[str, Any]:
    return {"name": phase.name, "moment": phase.moment, **phase.by_category()}


def _plan_doc(plan: LayerPlan) -> dict[str, Any]:
    return {"layers": plan.layers, "prefix": plan.prefix, "period": plan.period, "counts": list(plan.counts)}


def recorded_phases(config: dict[str, Any], settings: TrainingSettings, spec: ModelSpec | None = None,
                    progress: bool = True, finetune: FineTune | None = None) -> Recorded:
    """The step's phases on the traced path (peft's LoRA step with ``finetune``), from the cache when this set-up
    was recorded before."""
    payload = {"config": canonical_config(config), "settings": asdict(settings)}
    if finetune is not None:
        payload["finetune"] = asdict(finetune)
    path = cache_path("phases", payload)
    doc = read_cached(path)
    task = settings.task
    if doc is not None:
        try:
            phases = tuple(Phase(**p) for p in doc["phases"])
            plan = _read_plan(doc["plan"])
            places = tuple((p.pop("place"), Phase(**p)) for p in map(dict, doc["places"]))
            decoder = _read_plan(doc["decoder_plan"]) if doc.get("decoder_plan") else None
            return Recorded(phases, plan, 0.0, str(path), True, places, decoder, task)
        except (KeyError, TypeError):
            pass  # an entry of another shape: recorded again below
    started = time.perf_counter()
    decoder_plan, places = None, ()
    if task == "seq2seq-lm":
        if finetune is not None:
            raise ValueError("LoRA on an encoder-decoder is not traced")  # (settings refuse --lora with --task)
        phases, plan, decoder_plan = record_seq2seq(config, settings, spec, progress)
    else:
        phases, plan, places = record_places(config, settings, spec, progress, finetune)
    seconds = time.perf_counter() - started
    doc = {"phases": [_phase_doc(p) for p in phases], "plan": _plan_doc(plan),
           "places": [{"place": place, **_phase_doc(p)} for place, p in places], "seconds": seconds}
    if decoder_plan is not None:
        doc["decoder_plan"] = _plan_doc(decoder_plan)
    why_not = write_cached(path, doc)
    return Recorded(phases, plan, seconds, why_not or str(path), False, places, decoder_plan, task)


def _read_plan(doc: dict[str, Any]) -> LayerPlan:
    return LayerPlan(**{**doc, "counts": tuple(doc["counts"])})


def missing_extra() -> str | None:
    """One line naming the extra to install when torch or transformers is missing, else None."""
    from importlib.util import find_spec

    missing = [name for name in ("torch", "transformers") if find_spec(name) is None]
    if not missing:
        return None
    return (f"no peak: the traced path that gives a peak for this model_type needs {' and '.join(missing)} "
            f"({TRACE_EXTRA})")
