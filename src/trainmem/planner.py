"""Searches over settings: the largest micro-batch or sequence that fits a GPU, and grids of estimates.

Every candidate is evaluated exactly (not extrapolated from one point) on the model compiled once
(stepmodel.py): memory is monotone in batch and sequence length, so a doubling phase and a bisection find the
boundary in O(log n) evaluations, each a few microseconds once a sequence length is compiled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .errors import ConfigError
from .estimate import DeviceOptions, Estimate
from .hardware import GPU
from .models import ModelSpec
from .settings import TrainingSettings
from .sharding import Parallel
from .stepmodel import compile_step

if TYPE_CHECKING:
    from .lora import FineTune
    from .request import Request

MAX_SEARCH = 1 << 24


def _largest(fits: Callable[[int], bool | None], limit: int = MAX_SEARCH) -> int:
    """The largest n in [1, limit] with fits(n), or 0 if even 1 does not fit (fits must be monotone)."""
    if not fits(1):
        return 0
    if fits(limit):
        return limit
    low, high = 1, 2
    while high < limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _require_architecture(model: ModelSpec, seq: bool = False) -> None:
    if model.has_architecture:
        return
    if not model.built_config:
        raise ConfigError("--max-batch/--max-seq need the model's architecture: give a config, not --params")
    if seq:  # (the traced path's affine model is in the batch: tracedstep.py)
        raise ConfigError("--max-seq is not available on the traced path (a model_type without a hand-written "
                          "description): its step is not linear in the sequence length; give --seq and --max-batch")


def max_batch(model: ModelSpec, settings: TrainingSettings, gpu: GPU, device: DeviceOptions,
              parallel: Parallel | None = None, finetune: FineTune | None = None) -> int:
    _require_architecture(model)
    step = compile_step(model, settings, device, parallel, finetune)
    return _largest(lambda b: step.fitting_peak(b, settings.seq, gpu, exact=True) is not None)


def estimate_searched(model: ModelSpec, settings: TrainingSettings, device: DeviceOptions, gpu: GPU | None,
                      parallel: Parallel | None = None, finetune: FineTune | None = None, find_batch: bool = False,
                      find_seq: bool = False) -> tuple[Estimate, dict[str, Any]]:
    """What ``trainmem estimate`` answers (and the web page's /api/estimate): the estimate, after --max-batch and
    --max-seq have replaced the batch or the sequence by the largest that fits ``gpu``, and those answers
    (``max_batch``, ``max_seq``, ``max_seq_is_position_limit``; 0 when nothing fits)."""
    from dataclasses import replace

    from .stepmodel import estimate_model

    extra: dict[str, Any] = {}
    if find_batch or find_seq:
        if gpu is None:
            raise ConfigError("--max-batch and --max-seq need --gpu NAME")
        if finetune is not None and estimate_model(model, settings, device, parallel, finetune).peak is None:
            raise ConfigError("--max-batch and --max-seq need the step's activations, which trainmem does not model "
                              "for this LoRA set-up yet (estimate without them says why)")
        if find_batch:
            best = max_batch(model, settings, gpu, device, parallel, finetune)
            extra["max_batch"] = best
            if best:
                settings = replace(settings, batch=best)
        if find_seq:
            best = max_seq(model, settings, gpu, device, parallel, finetune)
            extra["max_seq"] = best
            extra["max_seq_is_position_limit"] = bool(best) and best == seq_limit(model)
            if best:
                settings = replace(settings, seq=best)
    return estimate_model(model, settings, device, parallel, finetune), extra


def seq_limit(model: ModelSpec) -> int:
    """The longest sequence worth searching: the model's position limit, unless RoPE scaling extends it."""
    return model.position_limit or MAX_SEARCH


def max_seq(model: ModelSpec, settings: TrainingSettings, gpu: GPU, device: DeviceOptions,
            parallel: Parallel | None = None, finetune: FineTune | None = None) -> int:
    """The longest sequence that fits, capped at :func:`seq_limit` (a longer one would fit memory, not the model)."""
    _require_architecture(model, seq=True)
    step = compile_step(model, settings, device, parallel, finetune)
    return _largest(lambda s: step.fitting_peak(settings.batch, s, gpu, exact=True) is not None, seq_limit(model))


def sweep(model: ModelSpec, settings: TrainingSettings, batches: list[int], seqs: list[int],
          device: DeviceOptions, layouts: list[Parallel] | None = None, finetune: FineTune | None = None) -> list[Estimate]:
    """One estimate per (layout, batch, seq), layout-major, then batch-major."""
    out = []
    each: list[Parallel | None] = list(layouts) if layouts else [None]
    for parallel in each:
        step = compile_step(model, settings, device, parallel, finetune)
        out += [step.estimate(b, s) for b in batches for s in seqs]
    return out


def _searchable(model: Any, gpu: str | GPU | None, options: dict[str, Any]) -> Request:
    from .request import make_request

    if gpu is None:
        raise ConfigError("a search needs a GPU: gpu=NAME")
    req = make_request(model, gpu=gpu, **options)
    _require_architecture(req.model)
    return req


def find_max_batch(model: Any, gpu: str | GPU | None, **options: Any) -> int:
    """The largest micro-batch of ``model`` that fits ``gpu`` (0 if none); ``options`` as trainmem.estimate's."""
    req = _searchable(model, gpu, options)
    assert req.gpu is not None  # (_searchable refused gpu=None; make_request looked the card up)
    return max_batch(req.model, req.settings, req.gpu, req.device, req.parallel, req.finetune)


def find_max_seq(model: Any, gpu: str | GPU | None, **options: Any) -> int:
    """The longest sequence of ``model`` that fits ``gpu`` (0 if none), capped at its position limit."""
    req = _searchable(model, gpu, options)
    assert req.gpu is not None  # (_searchable refused gpu=None; make_request looked the card up)
    return max_seq(req.model, req.settings, req.gpu, req.device, req.parallel, req.finetune)


def sweep_grid(model: Any, batches: Any, seqs: Any, **options: Any) -> list[Estimate]:
    """One estimate per (batch, seq) pair, batch-major; ``options`` as trainmem.estimate's."""
    from dataclasses import replace as with_gpu

    from .request import make_request

    from .settings import check_grid

    check_grid(batches, seqs)  # (lists of whole numbers in the settings' bounds, at most MAX_SWEEP_CELLS pairs)
    req = make_request(model, batch=batches[0], seq=seqs[0], **options)
    _require_architecture(req.model)
    return [with_gpu(e, gpu=req.gpu)
            for e in sweep(req.model, req.settings, list(batches), list(seqs), req.device, [req.parallel],
                           req.finetune)]
