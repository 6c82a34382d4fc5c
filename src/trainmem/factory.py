"""A user's own model, not a transformers one: trace its training step from a function that builds it.

``trainmem trace --factory pkg.module:build_model`` (and :func:`trace_module` in Python) calls ``build_model()``
under FakeTensorMode, so every parameter it creates is a fake tensor (no memory; a 70B model builds in seconds),
makes a batch (``--batch-fn pkg.module:make_batch``, called as ``make_batch(batch, seq)``: a tensor, a tuple of
positional arguments or a dict of keyword arguments; without one, ``input_ids`` of ``batch x seq`` tokens below the
model's ``vocab_size`` attribute or ``config.vocab_size``), and runs the step trace.py runs for transformers models:
a warm-up step (forward, loss, backward, ``optimizer.step()``, ``zero_grad``) that creates the optimizer states,
then a second one under MemTracker, which tags every storage as parameter, gradient, optimizer state, activation or
temporary, with the trace's corrections (trace.py). The loss is the model output's ``loss`` (an attribute or a
key), the output itself when it is a scalar, else the output's ``sum()`` (whose backward saves nothing).

**Other batch sizes and sequence lengths.** :func:`record_module` traces the step four times, at micro-batch 1 and
sequence s, 2s, 3s, and at micro-batch 2 and sequence s, and fits, per phase and per category,
``v(b, s) = c0 + b * q(s)`` with ``q`` quadratic in ``s``: the static tensors (parameters, gradients, states) are
the constant ``c0``; what a sample saves is linear in the tokens (``b * s``: Linear inputs, norms, MLP activations)
plus, for attention that materialises its scores (eager, SDPA's math kernel), ``b * s^2``; the three sequence
lengths determine the quadratic exactly and the second batch the split between ``c0`` and ``q``. Where it does not
hold, the recorded program says nothing true: a step whose tensors depend on the data (MoE routing, which fake
tensors cannot run anyway), a kernel chosen by size (SDPA picks flash, memory-efficient or math by the shapes:
kernels.py), a model that reshapes by the sequence in steps (chunked attention, padding to a block), and a
phase whose peak moves from one moment to another between the recorded sizes and the asked one; so
:meth:`ModuleProgram.phases` is checked against direct traces (tests/test_factory.py) and trace them directly when
in doubt (fake tensors make any size cost the same time).

Needs torch (``pip install 'trainmem[trace]'``); transformers only where the model uses it.
"""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, cast

from .errors import ConfigError
from .timeline import CATEGORIES, Phase

if TYPE_CHECKING:
    from .settings import TrainingSettings
    from .trace import TraceResult

_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
FACTORY_RECIPES = ("fp32", "amp-bf16", "amp-fp16", "pure-bf16-bf16states")
"""The recipes a user's model is traced under: one dtype for weights, gradients and states (built in it), or
autocast over fp32 weights; master copies need trainmem's own step (step.py), which knows transformers' layers."""


def load_factory(path: str, flag: str = "--factory") -> Callable[..., Any]:
    """The callable at ``pkg.module:function`` (a dotted attribute after the colon), or one line why not."""
    if not isinstance(path, str) or not _PATH.match(path.strip()):
        raise ConfigError(f"{flag} {path!r} is not pkg.module:function (a module path, a colon, a function name)")
    module_name, _, attribute = path.strip().partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 (whatever the user's module raises on import is its own)
        text = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise ConfigError(f"{flag} {path}: cannot import module {module_name!r} ({text})") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{flag} {path}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{flag} {path}: {attribute!r} is a {type(target).__name__}, not a function")
    function: Callable[..., Any] = target
    return function


def check_module_settings(settings: TrainingSettings) -> None:
    """Refuse, before torch is imported, what a user's model is not traced with."""
    if settings.recipe not in FACTORY_RECIPES:
        raise ConfigError(f"trace --factory runs the recipes {', '.join(FACTORY_RECIPES)}; got {settings.recipe!r}")
    unrun = [flag for flag, on in (("--checkpointing", settings.checkpointing != "none"),
                                   ("--compile", settings.compile), ("--offload-activations",
                                                                     settings.offload_activations),
                                   ("--optimizer-in-backward", settings.optimizer_in_backward),
                                   ("--loss", settings.loss != "standard"), ("--task", settings.task != "causal-lm"),
                                   ("--grad-accum", settings.grad_accum != 1)) if on]
    if unrun:
        raise ConfigError(f"trace --factory runs your model's own forward and loss as it is: {', '.join(unrun)} "
                          "need trainmem's transformers step (build checkpointing into your module instead)")


def _default_batch(model: Any, batch: int, seq: int, torch: Any) -> dict[str, Any]:
    vocab = getattr(model, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError("trace --factory: the model has no vocab_size (nor config.vocab_size) to make token ids "
                          "from; give --batch-fn pkg.module:make_batch (called as make_batch(batch, seq))")
    return {"input_ids": torch.randint(0, vocab, (batch, seq))}


def _loss_of(output: Any, torch: Any) -> Any:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        output = output[0]
    if loss is None and isinstance(output, torch.Tensor):
        loss = output if output.dim() == 0 else output.sum()
    if loss is None:
        raise ConfigError(f"trace --factory: the model returned a {type(output).__name__}; it must return a loss "
                          "(a scalar tensor, or an object with .loss or ['loss']) or a tensor, which is summed")
    return loss


class _ModuleRun:
    """What trace.py's trackers need of a step (trace._track, trace._recompute_aware_tracker)."""

    recomputing = False
    main_grads = None

    def __init__(self, torch: Any, model: Any, optimizer: Any, inputs: Any, autocast_dtype: Any) -> None:
        self.torch, self.model, self.optimizer, self.inputs = torch, model, optimizer, inputs
        self.autocast_dtype = autocast_dtype

    def micro_batch(self) -> None:
        import contextlib

        torch = self.torch
        ctx = torch.autocast("cpu", dtype=self.autocast_dtype) if self.autocast_dtype else contextlib.nullcontext()
        args, kwargs = ((self.inputs, {}) if isinstance(self.inputs, tuple) else
                        ((), self.inputs) if isinstance(self.inputs, dict) else ((self.inputs,), {}))
        with ctx:
            loss = _loss_of(self.model(*args, **kwargs), torch)
        loss.backward()
        del loss

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def tracked_objects(self) -> list[Any]:
        return [self.model, self.optimizer] if isinstance(self.optimizer, self.torch.optim.Optimizer) else \
            [self.model, *(t for st in self.optimizer.state.values() for t in st.values())]

    def frozen_parameters(self) -> list[Any]:
        return [p for p in self.model.parameters() if not p.requires_grad]


def _build_run(torch: Any, build: Callable[[], Any], make_batch: Callable[..., Any] | None,
               optimizer: str | Callable[..., Any] | None, settings: TrainingSettings) -> _ModuleRun:
    from .recipes import get_recipe
    from .step import make_optimizer

    recipe = get_recipe(settings.recipe)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[recipe.weights]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # (the weights in the recipe's dtype: .to() cannot move fake parameters)
    try:
        model = build()
    finally:
        torch.set_default_dtype(previous)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"trace --factory: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad and p.numel() > 0]
    if callable(optimizer):
        opt = optimizer(params)
    else:
        half = any(p.dtype != torch.float32 for p in params)
        opt = make_optimizer(torch, optimizer or settings.optimizer, params, settings.fused_optimizer,
                             fp32_states_for_half=half and recipe.optimizer_states == "fp32")
    inputs = (make_batch(settings.batch, settings.seq) if make_batch is not None
              else _default_batch(model, settings.batch, settings.seq, torch))
    half_compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.compute)
    return _ModuleRun(torch, model, opt, inputs, half_compute if recipe.autocast else None)


def trace_module(build: Callable[[], Any], settings: TrainingSettings | None = None,
                 make_batch: Callable[..., Any] | None = None, optimizer: str | Callable[..., Any] | None = None,
                 round_to_cuda: bool = True) -> TraceResult:
    """One steady-state training step of the module ``build()`` makes, traced under FakeTensorMode: a
    trace.TraceResult (the five phases by category). ``optimizer`` is a trainmem optimizer name (default: the
    settings') or a function of the trained parameters that returns a torch optimizer."""
    from torch.distributed._tools import mem_tracker

    from .settings import TrainingSettings
    from .cuda_emulation import fake_gpu
    from .trace import TraceResult, _cuda_block_sizes, _device_snapshot, _phase, _rank_phases, _track, \
        tracked_micro_batch

    settings = settings or TrainingSettings(recipe="fp32")
    check_module_settings(settings)
    import torch

    started = time.perf_counter()
    with _cuda_block_sizes(round_to_cuda), fake_gpu():
        run = _build_run(torch, build, make_batch, optimizer, settings)
        run.micro_batch()  # warm-up: creates the optimizer states
        run.step()
        load_tracker = mem_tracker.MemTracker()
        _track(load_tracker, mem_tracker, run)
        with load_tracker:
            load = _device_snapshot(load_tracker.get_tracker_snapshot("current"))
        forward, backward, peaks = tracked_micro_batch(mem_tracker, run)
        step_tracker = mem_tracker.MemTracker()
        _track(step_tracker, mem_tracker, run)
        with step_tracker:
            before = _device_snapshot(step_tracker.get_tracker_snapshot("current"))
            run.optimizer.step()
            peak = _device_snapshot(step_tracker.get_tracker_snapshot("peak"))
            run.optimizer.zero_grad(set_to_none=True)
            after = _device_snapshot(step_tracker.get_tracker_snapshot("current"))
    phases = _rank_phases(_phase("load", "static state", load), _phase("forward", "peak of forward", forward),
                          _phase("backward", "peak of backward", backward), before, peak, after)
    return TraceResult(phases, time.perf_counter() - started, round_to_cuda, module_peaks=peaks)


# -- other batch sizes and sequence lengths ------------------------------------------------------------------------

def _fit(points: list[Phase], x: float, batch: int) -> Phase:
    """One moment at (batch, x times the recorded sequence): ``c0 + batch * q(x)`` per category (module
    docstring), ``q`` Lagrange's quadratic through the batch-1 values at x = 1, 2, 3; ``points`` are the moment
    at (1, s), (1, 2s), (1, 3s) and (2, s)."""
    one, two, three, doubled = points
    values = {}
    for c in CATEGORIES:
        y1, y2, y3 = getattr(one, c), getattr(two, c), getattr(three, c)
        q = y1 * (x - 2) * (x - 3) / 2 - y2 * (x - 1) * (x - 3) + y3 * (x - 1) * (x - 2) / 2
        constant = y1 - (getattr(doubled, c) - y1)
        values[c] = max(0, round(constant + batch * (q - constant)))
    return Phase(one.name, one.moment, **values)


@dataclass(frozen=True)
class ModuleProgram:
    """A user's model's step recorded at four sizes, estimable at any (module docstring)."""

    seq: int
    """s: recorded at micro-batch 1 and s, 2s, 3s, and at micro-batch 2 and s."""
    recorded: tuple[tuple[Phase, ...], ...]
    """The phases at (1, s), (1, 2s), (1, 3s), (2, s)."""
    moments: tuple[dict[str, tuple[Phase | None, Phase | None]], ...] = ()
    """At the same four sizes, each module's forward and backward peaks (trace._module_peaks)."""

    def phases(self, batch: int, seq: int) -> tuple[Phase, ...]:
        """Each phase at (batch, seq). Forward's and backward's are the largest of the phase's own fitted peak and
        every module's (why: the moment of a phase's peak can move between sizes, the end of backward, where the
        gradients are, at short sequences, its start, where the activations are, at long ones; each module's
        peak is one moment, so it fits: recorded._with_module_moments does the same over layers)."""
        x = seq / self.seq
        out = []
        for index, phase in enumerate(self.recorded[0]):
            own = [p[index] for p in self.recorded]
            which = {"forward": 0, "backward": 1}.get(phase.name)
            moments = self._module_moments(which) if which is not None else {}
            # the phase's own peak is one moment only where the same module (or none) holds it at every size
            owners = {next((n for n, at in moments.items() if at[i].allocated_bytes == own[i].allocated_bytes),
                           None) for i in range(len(own))}
            best = _fit(own, x, batch) if len(owners) == 1 or not moments else None
            for at in moments.values():
                moment = _fit(at, x, batch)
                if best is None or moment.allocated_bytes > best.allocated_bytes:
                    best = Phase(phase.name, phase.moment, *(getattr(moment, c) for c in CATEGORIES))
            assert best is not None
            out.append(best)
        return tuple(out)

    def _module_moments(self, which: int) -> dict[str, list[Phase]]:
        """Each submodule's forward (0) or backward (1) peak at the four recorded sizes."""
        out = {}
        for name in self.moments[0] if self.moments else ():
            at = [m.get(name, (None, None))[which] for m in self.moments]
            if name and all(p is not None for p in at):
                out[name] = cast("list[Phase]", at)  # (none is None: the test above)
        return out

    def peak(self, batch: int, seq: int) -> Phase:
        return max(self.phases(batch, seq), key=lambda p: p.allocated_bytes)


def record_module(build: Callable[[], Any], settings: TrainingSettings | None = None,
                  make_batch: Callable[..., Any] | None = None, optimizer: str | Callable[..., Any] | None = None,
                  seq: int | None = None) -> ModuleProgram:
    """The module's step traced at micro-batch 1 and ``seq`` (default: the settings' sequence), 2 x and 3 x ``seq``,
    and at micro-batch 2 and ``seq``: a ModuleProgram for any batch and sequence (module docstring)."""
    from .settings import TrainingSettings

    settings = settings or TrainingSettings(recipe="fp32")
    seq = seq or settings.seq
    sizes = ((1, seq), (1, 2 * seq), (1, 3 * seq), (2, seq))
    traced = [trace_module(build, settings.at(b, s), make_batch, optimizer) for b, s in sizes]
    return ModuleProgram(seq, tuple(t.phases for t in traced), tuple(t.module_peaks for t in traced))
