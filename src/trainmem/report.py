"""Rendering an :class:`~trainmem.estimate.Estimate`: the versioned JSON document and the rich tables.

The JSON schema is documented in docs/json-schema.md. Memory figures in JSON are always integers in bytes,
whatever unit the table uses.
"""

from __future__ import annotations

from typing import Any

from . import __version__
from .estimate import Estimate
from .units import format_bytes, format_count

SCHEMA_VERSION = 1


def to_dict(est: Estimate) -> dict[str, Any]:
    m = est.model
    static: dict[str, Any] = {
        c.name: {"dtype": c.dtype, "bytes": c.bytes, "bytes_per_param": round(c.bytes_per_param, 6), "note": c.note}
        for c in est.static
    }
    static["total_bytes"] = est.static_bytes
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "trainmem", "version": __version__},
        "engine": "estimate",
        "model": {
            "name": m.name,
            "model_type": m.model_type,
            "source": m.source,
            "parameters": m.num_parameters,
            "active_parameters": m.num_active_parameters,
            "largest_layer_parameters": m.largest_layer_parameters,
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "vocab_size": m.vocab_size,
            "analytic": m.has_architecture or m.model_type == "nominal",
        },
        "settings": est.settings.as_dict(),
        "static": static,
    }


def render_estimate(est: Estimate, unit: str, console) -> None:
    """Print the breakdown table to a rich console."""
    from rich.table import Table

    m = est.model
    title = f"{m.name} ({m.model_type}): {m.num_parameters:,} parameters"
    if m.num_active_parameters != m.num_parameters:
        title += f", {m.num_active_parameters:,} active per token"
    s = est.settings
    table = Table(title=title, caption=f"recipe {s.recipe}, optimizer {s.optimizer}; unit {unit}")
    table.add_column("component")
    table.add_column("dtype")
    table.add_column("bytes/param", justify="right")
    table.add_column(f"total ({unit})", justify="right")
    table.add_column("what", style="dim")
    for c in est.static:
        table.add_row(c.name, c.dtype, f"{c.bytes_per_param:.2f}", format_bytes(c.bytes, unit), c.note)
    per_param = est.static_bytes / m.num_parameters
    table.add_row("static total", "", f"{per_param:.2f}", format_bytes(est.static_bytes, unit), "", style="bold")
    console.print(table)


def render_models(rows: list[tuple[str, str, str, int, int]], console) -> None:
    from rich.table import Table

    table = Table(title="trainmem catalog")
    for col, justify in (("name", "left"), ("Hub id", "left"), ("model_type", "left"),
                         ("parameters", "right"), ("active", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, repo, model_type, params, active in rows:
        table.add_row(name, repo, model_type, f"{params:,} ({format_count(params)})",
                      format_count(active) if active != params else "")
    console.print(table)
