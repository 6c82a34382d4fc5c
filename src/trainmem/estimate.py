"""The estimator: model spec + training settings -> where every byte of a training step goes.

Pure functions over frozen dataclasses; no torch. ``estimate("llama-2-7b")`` is the library entry point.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .activations import ActivationEstimate, estimate_activations
from .hardware import DEFAULT_CUDA_OVERHEAD_MIB, DEFAULT_FRAGMENTATION, GPUS, MIB, GPU
from .models import ModelSpec
from .optimizers import get_optimizer
from .recipes import get_recipe
from .settings import TrainingSettings, make_settings
from .timeline import Phase, step_timeline

DEFAULT_HEADROOM = 1.25
"""The seed article's advice: pick a GPU with 1.2-1.3x the estimate."""


@dataclass(frozen=True)
class StaticComponent:
    """One part of the memory that lives for the whole run (weights, gradients, master weights, states)."""

    name: str
    dtype: str
    bytes: int
    bytes_per_param: float
    note: str = ""


@dataclass(frozen=True)
class DeviceOptions:
    """How allocated bytes become what the GPU must hold."""

    headroom: float = DEFAULT_HEADROOM
    fragmentation: float = DEFAULT_FRAGMENTATION
    cuda_overhead_bytes: int = DEFAULT_CUDA_OVERHEAD_MIB * MIB


@dataclass(frozen=True)
class Peak:
    phase: str
    moment: str
    allocated_bytes: int
    """Comparable to torch.cuda.max_memory_allocated()."""
    reserved_bytes: int
    """Comparable to torch.cuda.max_memory_reserved(): allocated + the caching allocator's fragmentation."""
    device_bytes: int
    """Comparable to nvidia-smi: reserved + CUDA context and library workspaces."""
    required_bytes: int
    """device_bytes x headroom: what to look for in a GPU."""


@dataclass(frozen=True)
class Estimate:
    model: ModelSpec
    settings: TrainingSettings
    static: tuple[StaticComponent, ...]
    activations: ActivationEstimate | None = None
    activation_k_bytes: int | None = None
    """Set when --activation-k replaced the architecture model with the seed's b*s*h*L*k*2 rule."""
    phases: tuple[Phase, ...] = ()
    peak: Peak | None = None
    device: DeviceOptions = field(default_factory=DeviceOptions)
    notes: tuple[str, ...] = ()

    @property
    def static_bytes(self) -> int:
        return sum(c.bytes for c in self.static)

    def component(self, name: str) -> StaticComponent:
        return next(c for c in self.static if c.name == name)

    @property
    def activation_bytes(self) -> int | None:
        """Saved for backward at the end of forward, logits included (the JSON's activations.bytes)."""
        if self.activation_k_bytes is not None:
            return self.activation_k_bytes
        if self.activations is None:
            return None
        return self.activations.saved_bytes + self.activations.logits_bytes

    def fits(self, gpu: GPU) -> bool:
        return self.peak is not None and self.peak.required_bytes <= gpu.memory_bytes

    def fit_table(self) -> dict[str, bool]:
        return {name: self.fits(gpu) for name, gpu in GPUS.items()}


def static_components(model: ModelSpec, settings: TrainingSettings) -> tuple[StaticComponent, ...]:
    """Weights, gradients, master weights and optimizer states, each in bytes.

    Gradients have the size of the trainable parameters in the recipe's gradient dtype (``param.grad`` is
    allocated like its parameter; Megatron's fp32 main-grad buffer replaces it). The optimizer keeps its
    states for the tensors it updates: the fp32 master copy where the recipe has one, else the parameters.
    """
    recipe = get_recipe(settings.recipe)
    optimizer = get_optimizer(settings.optimizer)
    n = model.num_parameters
    state_bytes = recipe.state_bytes_for(optimizer.name)
    states = optimizer.state_bytes(model.param_groups, state_bytes)
    state_dtype = "uint8+fp32" if optimizer.name.endswith("8bit") else \
        recipe.optimizer_states if state_bytes == recipe.state_bytes else recipe.weights
    note = optimizer.states + (" (paged: evictable to CPU)" if optimizer.paged else "")
    return (
        StaticComponent("weights", recipe.weights, n * recipe.weight_bytes, recipe.weight_bytes, "model parameters"),
        StaticComponent("gradients", recipe.gradients, n * recipe.gradient_bytes, recipe.gradient_bytes,
                        "param.grad, same shape as the parameters"),
        StaticComponent("master_weights", recipe.master_weights or "-", n * recipe.master_bytes, recipe.master_bytes,
                        "fp32 copy the optimizer updates" if recipe.master_weights else "none in this recipe"),
        StaticComponent("optimizer_states", state_dtype, states, states / n, note),
    )


def _peak(phases: tuple[Phase, ...], device: DeviceOptions) -> Peak:
    top = max(phases, key=lambda ph: ph.allocated_bytes)
    dynamic = top.activations + top.temporaries + (top.gradients if top.name == "backward" else 0)
    reserved = top.allocated_bytes + int(device.fragmentation * dynamic)
    device_bytes = reserved + device.cuda_overhead_bytes
    return Peak(top.name, top.moment, top.allocated_bytes, reserved, device_bytes,
                int(device_bytes * device.headroom))


def seed_activation_bytes(model: ModelSpec, settings: TrainingSettings) -> int:
    """The seed article's rule of thumb: batch * seq * hidden * layers * k values of 2 bytes."""
    k = settings.activation_k or 0
    return int(settings.batch * settings.seq * model.hidden_size * model.num_layers * k * 2)


def estimate_model(model: ModelSpec, settings: TrainingSettings | None = None,
                   device: DeviceOptions | None = None) -> Estimate:
    settings = settings or TrainingSettings()
    device = device or DeviceOptions()
    static = static_components(model, settings)
    if not model.has_architecture:
        note = ("activations need the architecture: give a model config, not only --params"
                if model.model_type == "nominal" else
                f"model_type {model.model_type!r} was counted by transformers; activations need an analytic spec")
        if settings.activation_k is None:
            return Estimate(model, settings, static, device=device, notes=(note,))
    recipe = get_recipe(settings.recipe)
    optimizer = get_optimizer(settings.optimizer)
    if settings.activation_k is not None:
        k_bytes = seed_activation_bytes(model, settings)
        weights = {c.name: c.bytes for c in static}
        base = weights["weights"] + weights["master_weights"] + weights["optimizer_states"]
        phases = (
            Phase("load", "static memory", weights["weights"], 0,
                  weights["master_weights"] + weights["optimizer_states"], 0, 0),
            Phase("forward", "end of forward (seed rule of thumb)", weights["weights"], 0,
                  base - weights["weights"], k_bytes, 0),
            Phase("optimizer", "optimizer.step()", weights["weights"], weights["gradients"],
                  base - weights["weights"], 0, 0),
        )
        notes = [f"activations from the seed's rule b*s*h*L*k*2 with k={settings.activation_k:g}"]
        if model.has_architecture:
            acts = estimate_activations(model, recipe, settings)
            per_layer_values = settings.batch * settings.seq * model.hidden_size * model.num_layers * 2
            notes.append(
                f"the architecture model ({settings.attention} attention, {settings.recipe}) gives "
                f"{acts.layers_bytes / 2**30:.2f} GiB for the decoder layers (k = {acts.layers_bytes / per_layer_values:.1f}) "
                f"and {(acts.saved_bytes + acts.logits_bytes) / 2**30:.2f} GiB with embedding, head, loss and logits")
        return Estimate(model, settings, static, activation_k_bytes=k_bytes, phases=phases,
                        peak=_peak(phases, device), device=device, notes=tuple(notes))
    acts = estimate_activations(model, recipe, settings)
    phases = step_timeline(model, {c.name: c.bytes for c in static}, acts, recipe, optimizer, settings)
    notes = []
    if optimizer.paged:
        notes.append("paged optimizer states live in CUDA unified memory: max_memory_allocated() does not count them")
    return Estimate(model, settings, static, activations=acts, phases=phases, peak=_peak(phases, device),
                    device=device, notes=tuple(notes))


def estimate(model: str | ModelSpec, device: DeviceOptions | None = None, **settings) -> Estimate:
    """Estimate the memory of training ``model`` (a catalog name, Hub id, config path or ModelSpec).

    >>> e = estimate("llama-2-7b", recipe="pure-bf16", optimizer="adamw")
    >>> e.static_bytes == 12 * e.model.num_parameters
    True
    """
    from .catalog import resolve_model

    spec = resolve_model(model) if isinstance(model, str) else model
    return estimate_model(spec, make_settings(**settings), device)
