"""trainmem trace: a real training step of the real transformers model, every allocation counted, no memory.

The model is built from its config under ``FakeTensorMode`` (tensors carry shapes and dtypes, no storage), so a
70B model costs a few hundred MB of Python objects. One warm-up step creates the optimizer states; the second,
tracked step (forward, loss, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``) runs under
``torch.distributed._tools.mem_tracker.MemTracker``, which follows every storage's lifetime and tags it as
parameter, buffer, gradient, activation, temporary or optimizer state. Sizes are rounded to 512 bytes as the CUDA
caching allocator does (``--no-round`` keeps raw sizes).

What differs from a GPU run: the CPU kernels' fake implementations stand in for CUDA's (the SDPA CPU flash kernel
saves the same output and logsumexp as CUDA's flash kernel; with attention dropout the CPU takes the math path);
CPU autocast's op lists are close to, not identical with, CUDA's; dropout masks are float on CPU, bool on CUDA.
docs/accuracy.md lists the estimate-vs-trace differences.

Needs torch and transformers (``pip install 'trainmem[trace]'``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .models import ModelSpec
from .recipes import get_recipe
from .settings import TrainingSettings
from .timeline import CATEGORIES, Phase

_CATEGORY_OF = {
    "Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients", "Optstate": "optimizer_states",
    "Activation": "activations", "Temp": "temporaries", "Other": "optimizer_states",
}
TRACEABLE_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor")


@dataclass(frozen=True)
class TraceResult:
    phases: tuple[Phase, ...]
    seconds: float
    rounded: bool

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.allocated_bytes)


def _phase(name: str, moment: str, snapshot: dict[str, int]) -> Phase:
    values = dict.fromkeys(CATEGORIES, 0)
    for key, nbytes in snapshot.items():
        if key in _CATEGORY_OF:
            values[_CATEGORY_OF[key]] += nbytes
    return Phase(name, moment, **values)


def _device_snapshot(snapshot: dict) -> dict[str, int]:
    """MemTracker snapshots are {device: {category: bytes}}; trace runs on one device."""
    merged: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, nbytes in per_device.items():
            merged[key] = merged.get(key, 0) + nbytes
    return merged


class _Fp32StateAdamW:
    """AdamW keeping fp32 states for half-precision parameters, with no master copy (the pure-bf16 recipe,
    as torchao's and DeepSpeed's bf16-without-master optimizers do). foreach-style: one fp32
    parameter-sized temporary (the denominator) at a time, like torch's _multi_tensor_adamw."""

    def __init__(self, torch, params: list, lr: float = 1e-5, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        self.torch, self.params, self.lr, self.betas, self.eps, self.wd = torch, params, lr, betas, eps, weight_decay
        self.state: dict = {}
        self.param_groups = [{"params": params}]

    def step(self):
        torch = self.torch
        params = [p for p in self.params if p.grad is not None]
        if not self.state:
            self.state = {p: {"exp_avg": torch.zeros_like(p, dtype=torch.float32),
                              "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)} for p in params}
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        grads = [p.grad for p in params]
        with torch.no_grad():
            torch._foreach_mul_(params, 1 - self.lr * self.wd)
            torch._foreach_mul_(exp_avgs, self.betas[0])
            torch._foreach_add_(exp_avgs, grads, alpha=1 - self.betas[0])
            torch._foreach_mul_(exp_avg_sqs, self.betas[1])
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - self.betas[1])
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denom, self.eps)
            torch._foreach_reciprocal_(denom)
            torch._foreach_mul_(denom, exp_avgs)
            for p, update in zip(params, denom):
                p.add_(update, alpha=-self.lr)
            del denom

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    def state_dict(self):
        return {"state": self.state}


def _make_optimizer(torch, name: str, params: list, fused: bool, fp32_states_for_half: bool = False):
    if name == "adamw" and fp32_states_for_half:
        return _Fp32StateAdamW(torch, params)
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(params, lr=1e-5, foreach=not fused, fused=fused or None)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=True)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-3, foreach=True)
    raise ConfigError(f"trace supports the optimizers {', '.join(TRACEABLE_OPTIMIZERS)}, not {name!r}")


def trace_step(config: dict[str, Any], settings: TrainingSettings, spec: ModelSpec | None = None,
               round_to_cuda: bool = True) -> TraceResult:
    """Trace one steady-state training step; returns the peak of each phase by category."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools import mem_tracker

    from .probe import build_model

    recipe = get_recipe(settings.recipe)
    if settings.loss == "chunked":
        raise ConfigError("trace runs transformers' standard loss; --loss chunked is estimate-only")
    if spec is not None and spec.is_moe and recipe.weights != "bf16":
        # transformers' grouped_mm experts path needs bf16 inputs under FakeTensorMode on the CPU.
        raise ConfigError("trace of MoE models needs bf16 weights (recipes mixed-bf16, pure-bf16*)")
    started = time.perf_counter()
    previous_min = mem_tracker._PYTORCH_MIN_ALLOCATE
    mem_tracker._PYTORCH_MIN_ALLOCATE = 512 if round_to_cuda else 1
    try:
        with FakeTensorMode():
            from .activations import effective_kernel
            from .models import spec_from_config

            kernel = effective_kernel(spec or spec_from_config(config), settings.attention)
            model = build_model(config, recipe, kernel, settings.dropout)
            if settings.checkpointing == "full":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            elif settings.checkpointing == "selective":
                raise ConfigError("trace supports checkpointing none and full (selective is Megatron's, not HF's)")
            params = [p for p in model.parameters() if p.requires_grad]
            masters = None
            if recipe.master_weights:
                masters = [p.detach().float().requires_grad_(True) for p in params]
            fp32_states = recipe.optimizer_states == "fp32" and recipe.weights != "fp32" and masters is None
            optimizer = _make_optimizer(torch, settings.optimizer, masters or params, settings.fused_optimizer,
                                        fp32_states)
            ids = torch.randint(0, int(config["vocab_size"]), (settings.batch, settings.seq))
            autocast = (torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[recipe.compute])
                        if recipe.autocast else contextlib.nullcontext())

            def forward_backward():
                for _ in range(settings.grad_accum):
                    with autocast:
                        loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    del loss

            def step():
                if masters is not None:  # fp32 copies of the half gradients for the master update
                    for m, p in zip(masters, params):
                        m.grad = p.grad.float()
                optimizer.step()
                if masters is not None:
                    with torch.no_grad():
                        for m, p in zip(masters, params):
                            p.copy_(m)
                optimizer.zero_grad(set_to_none=True)
                model.zero_grad(set_to_none=True)
                if masters is not None:
                    for m in masters:
                        m.grad = None

            forward_backward()  # warm-up: creates the optimizer states
            step()

            def externals():
                states = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else [
                    t for st in optimizer.state.values() for t in st.values()]
                return [model, *states, *(masters or [])]

            tracker = mem_tracker.MemTracker()
            tracker.track_external(*externals())
            with tracker:
                load = _device_snapshot(tracker.get_tracker_snapshot("current"))
                forward_backward()
            stats = tracker.memory_tracking[model].snapshots
            forward = _device_snapshot(stats[mem_tracker._ModState.PEAK_FW][-1])
            backward = _device_snapshot(stats[mem_tracker._ModState.PEAK_BW][-1])

            step_tracker = mem_tracker.MemTracker()
            step_tracker.track_external(*externals())
            with step_tracker:
                step()
            optimizer_peak = _device_snapshot(step_tracker.get_tracker_snapshot("peak"))
            between = _device_snapshot(step_tracker.get_tracker_snapshot("current"))
    finally:
        mem_tracker._PYTORCH_MIN_ALLOCATE = previous_min
    load_phase = _phase("load", "static state", load)
    step_phase = _phase("optimizer", "step()", optimizer_peak)
    # MemTracker tags what optimizer.step() allocates as optimizer state and the fp32 gradient copies made
    # before it as activations; trainmem calls both temporaries, keeping "optimizer_states" for the steady state.
    extra_states = step_phase.optimizer_states - load_phase.optimizer_states
    step_phase = Phase("optimizer", "step()", step_phase.parameters, step_phase.gradients,
                       load_phase.optimizer_states, 0,
                       step_phase.temporaries + step_phase.activations + max(extra_states, 0))
    phases = (
        load_phase,
        _phase("forward", "peak of forward", forward),
        _phase("backward", "peak of backward", backward),
        step_phase,
        _phase("between_steps", "after zero_grad", between),
    )
    return TraceResult(phases, time.perf_counter() - started, round_to_cuda)
