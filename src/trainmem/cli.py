"""The ``trainmem`` command: a thin layer that parses flags, calls the library and renders.

Every :class:`~trainmem.errors.TrainmemError` and every usage error becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import click

from . import __version__
from .errors import ConfigError, TrainmemError
from .units import DEFAULT_UNIT, parse_unit

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="trainmem")
def app() -> None:
    """How much GPU memory a training run needs, where every byte goes, and whether it fits."""


def _console():
    from rich.console import Console

    return Console(width=max(120, Console().width))


def _emit_json(document: dict) -> None:
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


def _parse_params(text: str) -> int:
    """'7e9', '7B', '6738415616', '13b', '405B' -> an int."""
    t = text.strip().replace(",", "").replace("_", "")
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}.get(t[-1:].lower(), 1)
    try:
        value = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise ConfigError(f"--params: {text!r} is not a number; give e.g. 7e9, 7B or 6738415616") from None
    if value <= 0 or value != value:
        raise ConfigError(f"--params must be positive, got {text!r}")
    return int(value)


@app.command()
@click.argument("model", required=False)
@click.option("--params", help="Nominal parameter count instead of a model: 7e9, 7B.")
@click.option("--recipe", default="mixed-bf16", show_default=True, help="Precision recipe (trainmem recipes).")
@click.option("--optimizer", default="adamw", show_default=True, help="Optimizer (trainmem recipes).")
@click.option("--batch", type=int, default=1, show_default=True, help="Micro-batch size per GPU.")
@click.option("--seq", type=int, default=2048, show_default=True, help="Sequence length in tokens.")
@click.option("--units", default=DEFAULT_UNIT, show_default=True, help="GiB, GB, MiB, ...")
@click.option("--json", "as_json", is_flag=True, help="Print the versioned JSON document (bytes as integers).")
def estimate(
    model: Optional[str], params: Optional[str], recipe: str, optimizer: str, batch: int, seq: int, units: str,
    as_json: bool,
) -> None:
    """Estimate the memory of training MODEL: a catalog name (trainmem models), a Hub repo id, or a path to a
    config.json or its folder.

    \b
    Example: trainmem estimate meta-llama/Llama-2-7b-hf --recipe mixed-bf16 --optimizer adamw
             trainmem estimate --params 7e9 --recipe pure-bf16 --units GB
    """
    from .estimate import estimate_model
    from .models import nominal_spec
    from .report import render_estimate, to_dict
    from .settings import make_settings

    unit = parse_unit(units)
    if (model is None) == (params is None):
        raise ConfigError("give a model (catalog name, Hub id or config path) or --params, not both")
    settings = make_settings(recipe=recipe, optimizer=optimizer, batch=batch, seq=seq)
    if params is not None:
        spec = nominal_spec(_parse_params(params))
    else:
        from .catalog import resolve_model

        spec = resolve_model(model)
    from .optimizers import get_optimizer

    if not spec.has_architecture and spec.model_type == "nominal" and get_optimizer(settings.optimizer).needs_shapes:
        raise ConfigError(f"optimizer {settings.optimizer!r} needs tensor shapes; give a model instead of --params")
    est = estimate_model(spec, settings)
    if as_json:
        _emit_json(to_dict(est))
    else:
        render_estimate(est, unit, _console())


@app.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def models(as_json: bool) -> None:
    """List the built-in catalog with exact parameter counts.

    \b
    Example: trainmem models
    """
    from .catalog import catalog_names, catalog_spec
    from .report import render_models

    rows = []
    for name in catalog_names():
        spec = catalog_spec(name)
        rows.append((name, spec.source, spec.model_type, spec.num_parameters, spec.num_active_parameters))
    if as_json:
        _emit_json({"models": [dict(zip(("name", "hub_id", "model_type", "parameters", "active_parameters"), r))
                               for r in rows]})
    else:
        render_models(rows, _console())


@app.command()
@click.option("--optimizer", help="Show one optimizer only.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def recipes(optimizer: Optional[str], as_json: bool) -> None:
    """Bytes per parameter of each component for every recipe and optimizer.

    \b
    Example: trainmem recipes --optimizer adamw
    """
    from .recipes_table import recipes_rows, render_recipes

    rows = recipes_rows(optimizer)
    if as_json:
        _emit_json({"recipes": rows})
    else:
        render_recipes(rows, _console())


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: one line and exit 2 for any bad input, never a traceback."""
    try:
        app.main(args=argv, prog_name="trainmem", standalone_mode=False)
    except TrainmemError as exc:
        print(f"trainmem: error: {exc}", file=sys.stderr)
        return 2
    except click.exceptions.UsageError as exc:
        where = f"{exc.ctx.command_path}: " if exc.ctx and exc.ctx.parent else ""
        print(f"trainmem: error: {where}{exc.format_message()}", file=sys.stderr)
        return 2
    except click.exceptions.Abort:
        print("trainmem: aborted", file=sys.stderr)
        return 130
    except click.exceptions.Exit as exc:
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
