"""The estimator: model spec + training settings -> where every byte of a training step goes.

Pure functions over frozen dataclasses; no torch. ``estimate("llama-2-7b")`` is the library entry point.
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import ModelSpec
from .optimizers import get_optimizer
from .recipes import get_recipe
from .settings import TrainingSettings, make_settings


@dataclass(frozen=True)
class StaticComponent:
    """One part of the memory that lives for the whole run (weights, gradients, master weights, states)."""

    name: str
    dtype: str
    bytes: int
    bytes_per_param: float
    note: str = ""


@dataclass(frozen=True)
class Estimate:
    model: ModelSpec
    settings: TrainingSettings
    static: tuple[StaticComponent, ...]

    @property
    def static_bytes(self) -> int:
        return sum(c.bytes for c in self.static)

    def component(self, name: str) -> StaticComponent:
        return next(c for c in self.static if c.name == name)


def static_components(model: ModelSpec, settings: TrainingSettings) -> tuple[StaticComponent, ...]:
    """Weights, gradients, master weights and optimizer states, each in bytes.

    Gradients have the size of the trainable parameters in the recipe's gradient dtype (``param.grad`` is
    allocated like its parameter; Megatron's fp32 main-grad buffer replaces it). The optimizer keeps its
    states for the tensors it updates: the fp32 master copy where the recipe has one, else the parameters.
    """
    recipe = get_recipe(settings.recipe)
    optimizer = get_optimizer(settings.optimizer)
    n = model.num_parameters
    states = optimizer.state_bytes(model.param_groups, recipe.state_bytes)
    state_dtype = "uint8+fp32" if optimizer.name.endswith("8bit") else recipe.optimizer_states
    note = optimizer.states + (" (paged: evictable to CPU)" if optimizer.paged else "")
    return (
        StaticComponent("weights", recipe.weights, n * recipe.weight_bytes, recipe.weight_bytes, "model parameters"),
        StaticComponent("gradients", recipe.gradients, n * recipe.gradient_bytes, recipe.gradient_bytes,
                        "param.grad, same shape as the parameters"),
        StaticComponent("master_weights", recipe.master_weights or "-", n * recipe.master_bytes, recipe.master_bytes,
                        "fp32 copy the optimizer updates" if recipe.master_weights else "none in this recipe"),
        StaticComponent("optimizer_states", state_dtype, states, states / n, note),
    )


def estimate_model(model: ModelSpec, settings: TrainingSettings | None = None) -> Estimate:
    settings = settings or TrainingSettings()
    return Estimate(model=model, settings=settings, static=static_components(model, settings))


def estimate(model: str | ModelSpec, **settings) -> Estimate:
    """Estimate the memory of training ``model`` (a catalog name, Hub id, config path or ModelSpec).

    >>> e = estimate("llama-2-7b", recipe="pure-bf16", optimizer="adamw")
    >>> e.static_bytes == 12 * e.model.num_parameters
    True
    """
    from .catalog import resolve_model

    spec = resolve_model(model) if isinstance(model, str) else model
    return estimate_model(spec, make_settings(**settings))
