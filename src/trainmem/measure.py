"""trainmem measure: real training steps on a real device, the peak of each phase from the allocator itself.

On CUDA the peaks are ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()``, with the peak counter
reset at each phase boundary (forward, backward, optimizer step, between steps). On the CPU, which has no such
counter, the allocator's own events are read from ``torch.profiler.profile(profile_memory=True)``: every
allocation and free with its exact size, replayed in order to find each phase's peak (RSS and tracemalloc are
not measures of tensor memory). ``track()`` does the same around a user's own training loop, and
``TrainmemCallback`` inside the Hugging Face Trainer.

Needs torch (and transformers for MODEL arguments).
"""

from __future__ import annotations

import contextlib
import platform
import subprocess
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from .estimate import Estimate
    from .lora import FineTune
    from .settings import TrainingSettings

PHASES = ("load", "forward", "backward", "optimizer", "between_steps")


@dataclass
class PhasePeak:
    name: str
    allocated_bytes: int
    reserved_bytes: int | None = None
    """CUDA only: max_memory_reserved() in the phase."""


@dataclass
class Measurement:
    device: str
    phases: list[PhasePeak] = field(default_factory=list)
    seconds: float = 0.0

    def peak(self) -> PhasePeak:
        return max(self.phases, key=lambda p: p.allocated_bytes)

    def compare(self, estimate: Estimate) -> list[dict[str, Any]]:
        """Each measured phase beside the estimate's (an ``Estimate`` of the same set-up): bytes and the
        estimate's relative error."""
        estimated = {p.name: p.allocated_bytes for p in estimate.phases}
        rows: list[dict[str, Any]] = []
        for p in self.phases:
            e = estimated.get(p.name)
            rows.append({"phase": p.name, "measured_bytes": p.allocated_bytes, "estimate_bytes": e,
                         "error": (e - p.allocated_bytes) / p.allocated_bytes if e is not None and p.allocated_bytes
                         else None})
        return rows

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "seconds": round(self.seconds, 3),
                "phases": [{"name": p.name, "allocated_bytes": p.allocated_bytes,
                            **({"reserved_bytes": p.reserved_bytes} if p.reserved_bytes is not None else {})}
                           for p in self.phases]}


# ---------------------------------------------------------------------------------------------------------
# Phase recorders: CUDA counters, or the CPU allocator's events
# ---------------------------------------------------------------------------------------------------------


class _CudaRecorder:
    def __init__(self, torch: Any, device: Any) -> None:
        self.torch, self.device = torch, device
        self.peaks: dict[str, PhasePeak] = {}
        self.current = "load"

    def start(self) -> None:
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def switch(self, phase: str) -> None:
        cuda = self.torch.cuda
        cuda.synchronize(self.device)
        allocated, reserved = cuda.max_memory_allocated(self.device), cuda.max_memory_reserved(self.device)
        old = self.peaks.get(self.current)
        if old is None or allocated > old.allocated_bytes:
            self.peaks[self.current] = PhasePeak(self.current, allocated, reserved)
        cuda.reset_peak_memory_stats(self.device)
        self.current = phase

    def finish(self) -> list[PhasePeak]:
        self.switch(self.current)
        return [self.peaks[p] for p in PHASES if p in self.peaks]


class _CpuRecorder:
    """Replays the CPU allocator's events recorded by the profiler. ``baseline`` is what was allocated before
    recording started (the profiler sees only later events)."""

    def __init__(self, torch: Any, baseline: int) -> None:
        self.torch, self.baseline = torch, baseline
        self.marks: list[tuple[int, str]] = []
        self.profiler: Any = None
        self.current = "load"

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()
        self._range = self.torch.autograd.profiler.record_function(f"trainmem::{self.current}")
        self._range.__enter__()

    def switch(self, phase: str) -> None:
        self._range.__exit__(None, None, None)
        self.current = phase
        self._range = self.torch.autograd.profiler.record_function(f"trainmem::{phase}")
        self._range.__enter__()

    def finish(self) -> list[PhasePeak]:
        self._range.__exit__(None, None, None)
        self.profiler.__exit__(None, None, None)
        # The raw kineto events: "[memory]" records carry each allocation (+) and free (-) with its size.
        events = self.profiler.profiler.kineto_results.events()
        ranges = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name().split("::", 1)[1]) for e in events
                        if e.name().startswith("trainmem::"))
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.nbytes())
        live, peaks = self.baseline, dict[str, int]()
        index = 0
        for start, end, name in ranges:
            peak = live
            while index < len(memory) and memory[index][0] <= end:
                live += memory[index][1]
                peak = max(peak, live)
                index += 1
            peaks[name] = max(peaks.get(name, 0), peak)
        return [PhasePeak(p, peaks[p]) for p in PHASES if p in peaks]


def _storage_bytes(torch: Any, tensors: Iterable[Any]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------------------
# track(): around a user's own loop
# ---------------------------------------------------------------------------------------------------------


class Tracker:
    """Splits a training loop into phases with hooks: the model's forward pre-hook starts "forward", its forward
    hook starts "backward" (the loss and backward follow), the optimizer's step pre-hook starts "optimizer" and
    ``optimizer.zero_grad()`` returning starts "between_steps". With ``hook_optimizer=False`` the caller marks
    the optimizer phases itself with ``switch()`` (the Trainer callback does, from the Trainer's events)."""

    def __init__(self, model: Any, optimizer: Any, device: Any = None, hook_optimizer: bool = True) -> None:
        import torch

        self.torch, self.model, self.optimizer = torch, model, optimizer
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.measurement = Measurement(self.device.type)
        self.hook_optimizer = hook_optimizer
        self._handles: list[Any] = []
        self._restore: Callable[[], None] = lambda: None

    def switch(self, phase: str) -> None:
        """Start ``phase`` (one of PHASES) now."""
        self.recorder.switch(phase)

    def _baseline(self) -> int:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for group in self.optimizer.param_groups:  # fp32 master weights are the optimizer's own parameters
            tensors += list(group["params"])
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if hasattr(v, "untyped_storage")]
        return _storage_bytes(self.torch, tensors)

    def __enter__(self) -> "Tracker":
        torch = self.torch
        if self.device.type == "cuda":
            self.recorder: _CudaRecorder | _CpuRecorder = _CudaRecorder(torch, self.device)
        else:
            self.recorder = _CpuRecorder(torch, self._baseline())
        switch = self.recorder.switch
        self._handles = [
            self.model.register_forward_pre_hook(lambda m, a: switch("forward")),
            self.model.register_forward_hook(lambda m, a, o: switch("backward")),
        ]
        if self.hook_optimizer:
            self._handles.append(self.optimizer.register_step_pre_hook(lambda o, a, k: switch("optimizer")))
            # "between_steps" starts when the gradients are released: after zero_grad, not right after step().
            original_zero_grad = self.optimizer.zero_grad

            def zero_grad(*args: Any, **kwargs: Any) -> Any:
                result = original_zero_grad(*args, **kwargs)
                switch("between_steps")
                return result

            self.optimizer.zero_grad = zero_grad
            self._restore = lambda: delattr(self.optimizer, "zero_grad")
        self._started = time.perf_counter()
        self.recorder.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._restore()
        self.measurement.phases = self.recorder.finish()
        self.measurement.seconds = time.perf_counter() - self._started

    def report(self) -> Measurement:
        return self.measurement


@contextlib.contextmanager
def track(model: Any, optimizer: Any, device: Any = None) -> Iterator[Tracker]:
    """Measure the per-phase peaks of your own training loop::

        with trainmem.track(model, optimizer) as t:
            for batch in loader:
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        print(t.report().as_dict())
    """
    tracker = Tracker(model, optimizer, device)
    with tracker:
        yield tracker


def trainer_callback() -> Any:
    """A ``transformers.TrainerCallback`` that measures each optimizer step of the Hugging Face Trainer by phase,
    as ``track()`` does around a plain loop: CUDA's peak counters, or the CPU allocator's events::

        callback = trainmem.trainer_callback()
        Trainer(model, args, train_dataset=data, callbacks=[callback]).train()
        print(callback.report().compare(trainmem.estimate("my-model", batch=8, seq=1024)))

    Forward and backward are split by hooks on the model; the optimizer phase runs from the Trainer's
    ``on_pre_optimizer_step`` (after gradient clipping) to ``on_optimizer_step``, and "between_steps" is the
    memory left at ``on_step_end``, after the Trainer's ``model.zero_grad()``."""
    from transformers import TrainerCallback

    # (transformers is not followed, so its class is Any, which strict mypy refuses to subclass)
    class TrainmemCallback(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.steps: list[Measurement] = []
            """One Measurement per optimizer step, in order."""
            self._tracker: Tracker | None = None

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                          **kwargs: Any) -> None:
            self._close()
            # accelerate wraps the torch optimizer (AcceleratedOptimizer.optimizer); its states live in the inner one.
            inner = getattr(optimizer, "optimizer", optimizer)
            self._tracker = Tracker(model, inner, hook_optimizer=False)
            self._tracker.__enter__()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._tracker is not None:
                self._tracker.switch("optimizer")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._tracker is not None:
                self._tracker.switch("between_steps")
            self._close()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._close()

        def _close(self) -> None:
            if self._tracker is not None:
                self._tracker.__exit__(None, None, None)
                self.steps.append(self._tracker.report())
                self._tracker = None

        def report(self) -> Measurement:
            """The last complete step (the first one creates the optimizer states and is not steady)."""
            if not self.steps:
                raise ValueError("no training step has been measured yet")
            return self.steps[-1]

    return TrainmemCallback()


# ---------------------------------------------------------------------------------------------------------
# measure(): build the model for real and run steps
# ---------------------------------------------------------------------------------------------------------


def refuse_unmeasurable(finetune: FineTune | None) -> None:
    """One line for a fine-tune measure cannot run: LoRA on a quantized base, whose bitsandbytes kernels it does
    not drive."""
    from .errors import ConfigError

    if finetune is not None and finetune.base_quant:
        raise ConfigError("measure runs LoRA on a full-precision base (--base-quant/--qlora need bitsandbytes' "
                          "kernels, which measure does not drive; the estimate counts their bytes)")


def _cpuinfo_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux: x86 "flags", aarch64 "Features"); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_bf16_native() -> bool | None:
    """Whether this CPU computes bf16 natively, None when it cannot be told. x86: AVX512-BF16 or AMX, which oneDNN's
    bf16 kernels need; without them PyTorch runs every bf16 operation through fp32 conversions, many times slower
    than fp32 (issue 24: GPT-2's two README steps took 19.5 minutes on an AVX2 CPU). aarch64: FEAT_BF16 ("bf16" in
    /proc/cpuinfo, hw.optional.arm.FEAT_BF16 on macOS)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        try:
            import torch

            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        except (ImportError, AttributeError):  # (private helpers of torch 2.x: /proc/cpuinfo otherwise)
            flags = _cpuinfo_flags()
            return bool({"avx512_bf16", "amx_bf16"} & flags) if flags else None
    if machine in ("aarch64", "arm64"):
        flags = _cpuinfo_flags()
        if flags:
            return "bf16" in flags
        if platform.system() == "Darwin":
            try:
                out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                                     timeout=5).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                return None
            return out == "1" if out in ("0", "1") else None
    return None


def resolve_device(device: str) -> str:
    """``auto``: cuda when torch sees a GPU, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def recipe_for_cpu(settings: TrainingSettings, device: str,
                   recipe_given: bool) -> tuple[TrainingSettings, str | None]:
    """The settings measure runs on ``device`` and a line saying what changed (None when nothing did). On a CPU
    without native bf16 (:func:`cpu_bf16_native`) a bf16 recipe runs emulated, for minutes a step: the default
    recipe becomes fp32 (said in the line); one the user chose is refused in one line (ConfigError)."""
    from dataclasses import replace

    from .errors import ConfigError
    from .recipes import get_recipe

    recipe = get_recipe(settings.recipe)
    uses_bf16 = "bf16" in (recipe.weights, recipe.compute)
    if not str(device).startswith("cpu") or not uses_bf16 or cpu_bf16_native() is not False:
        return settings, None
    why = ("this CPU has no native bf16 (no AVX512-BF16 or AMX), so PyTorch emulates every bf16 operation and a "
           "step can take many minutes")
    if recipe_given:
        raise ConfigError(f"--recipe {settings.recipe} computes in bf16 and {why}: use --recipe fp32 on this CPU, "
                          "or --device cuda")
    return replace(settings, recipe="fp32"), (f"measuring --recipe fp32 instead of the default {settings.recipe}: "
                                              f"{why} (give --recipe to choose)")


def measure_steps(config: dict[str, Any], settings: TrainingSettings, device: str = "auto", steps: int = 2,
                  snapshot: str | None = None, finetune: FineTune | None = None,
                  progress: Callable[[int, int, float | None], None] | None = None) -> Measurement:
    """Build the model for real (random weights; with ``finetune``, peft's LoRA adapters on its frozen base, as the
    trace builds them), run ``steps`` training steps and measure the last one. ``progress(step, steps, seconds)``
    is called as each step starts (``seconds`` None) and ends (the step's wall time); step 0 is building the
    model, once the device is known to be there."""
    import torch

    from .step import Fp32StateAdamW, TrainingStep

    device = resolve_device(device)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device is available (this torch build or machine has none); use --device cpu")
    refuse_unmeasurable(finetune)
    report = progress or (lambda step, total, seconds: None)
    report(0, steps, None)
    started = time.perf_counter()
    run = TrainingStep(config, settings, str(dev), finetune=finetune)
    if isinstance(run.optimizer, Fp32StateAdamW):
        raise ValueError("measure runs torch optimizers; pure-bf16 (fp32 states, no master) is trace-only")
    report(0, steps, time.perf_counter() - started)
    for i in range(1, steps):
        report(i, steps, None)
        started = time.perf_counter()
        run.forward_backward()
        run.step()
        report(i, steps, time.perf_counter() - started)
    if snapshot and dev.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    report(steps, steps, None)
    started = time.perf_counter()
    with track(run.model, run.optimizer, dev) as tracker:
        run.forward_backward()
        run.step(on_optimizer_start=lambda: tracker.recorder.switch("optimizer"))
    report(steps, steps, time.perf_counter() - started)
    if snapshot and dev.type == "cuda":
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    return tracker.report()
