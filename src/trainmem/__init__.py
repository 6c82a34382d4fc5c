"""trainmem: how much GPU memory a training run needs, where every byte goes, and whether it fits.

The core (estimate, models, recipes, timeline, planner, report, cli) imports neither torch nor transformers;
``trace``, ``measure``, ``probe``, ``precision`` and ``amp_demo`` import them when a command needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from .measure import Tracker

__version__ = "0.1.0"

from .dataclass_cache import install as _install_dataclass_cache  # noqa: E402

_install_dataclass_cache()  # (before the modules below define their dataclasses: dataclass_cache.py)

from .catalog import catalog_names, resolve_model  # noqa: E402
from .errors import ConfigError, ModelError, TrainmemError  # noqa: E402
from .estimate import Estimate  # noqa: E402
from .models import ModelSpec, spec_from_config  # noqa: E402
from .recipes import RECIPES, Recipe  # noqa: E402
from .optimizers import OPTIMIZERS, Optimizer  # noqa: E402
from .settings import TrainingSettings  # noqa: E402
from .request import Request, estimate, make_request  # noqa: E402
from .stepmodel import StepModel, compile_step, estimate_model, evaluate  # noqa: E402
from .planner import find_max_batch as max_batch, find_max_seq as max_seq, sweep_grid as sweep  # noqa: E402
from .factory import record_module, trace_module  # noqa: E402  (torch is imported when one runs)


def track(model: Any, optimizer: Any, device: Any = None) -> AbstractContextManager[Tracker]:
    """Measure the per-phase memory peaks of your own training loop (see trainmem.measure.track)."""
    from .measure import track as _track

    return _track(model, optimizer, device)


def trainer_callback() -> Any:
    """A transformers TrainerCallback measuring each Trainer step by phase (see trainmem.measure.trainer_callback)."""
    from .measure import trainer_callback as _trainer_callback

    return _trainer_callback()


__all__ = [
    "ConfigError", "Estimate", "ModelError", "ModelSpec", "OPTIMIZERS", "Optimizer", "RECIPES", "Recipe", "Request",
    "StepModel", "TrainingSettings", "TrainmemError", "__version__", "catalog_names", "compile_step", "estimate",
    "estimate_model", "evaluate", "make_request", "max_batch", "max_seq", "resolve_model", "spec_from_config",
    "sweep", "record_module", "trace_module", "track", "trainer_callback",
]
