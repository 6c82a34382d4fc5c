"""The `trainmem recipes` table: bytes per parameter of each component, for every recipe x optimizer."""

from __future__ import annotations

from typing import Any

from .optimizers import OPTIMIZERS, get_optimizer
from .recipes import RECIPES

# Shape-dependent optimizers (Adafactor, Muon) are shown for this model, and the table says so.
REFERENCE_MODEL = "llama-2-7b"


def recipes_rows(optimizer: str | None = None) -> list[dict[str, Any]]:
    names = [get_optimizer(optimizer).name] if optimizer else list(OPTIMIZERS)
    reference = None
    rows = []
    for recipe in RECIPES.values():
        for name in names:
            opt = OPTIMIZERS[name]
            state_bytes = recipe.state_bytes_for(name)
            per_param = opt.bytes_per_param(state_bytes)
            note = ""
            if per_param is None:
                if reference is None:
                    from .catalog import catalog_spec

                    reference = catalog_spec(REFERENCE_MODEL)
                per_param = opt.state_bytes(reference.param_groups, state_bytes) / reference.num_parameters
                note = f"shape-dependent; shown for {REFERENCE_MODEL}"
            rows.append({
                "recipe": recipe.name,
                "optimizer": name,
                "weights": recipe.weight_bytes,
                "gradients": recipe.gradient_bytes,
                "master_weights": recipe.master_bytes,
                "optimizer_states": round(per_param, 4),
                "total": round(recipe.weight_bytes + recipe.gradient_bytes + recipe.master_bytes + per_param, 4),
                "note": note,
                "description": recipe.description,
            })
    return rows


def render_recipes(rows: list[dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    table = Table(title="Bytes per parameter (static memory; activations come on top)")
    for col in ("recipe", "optimizer", "weights", "gradients", "master", "states", "total", "note"):
        table.add_column(col, justify="left" if col in ("recipe", "optimizer", "note") else "right")
    previous = None
    for r in rows:
        table.add_row(
            r["recipe"] if r["recipe"] != previous else "", r["optimizer"], str(r["weights"]), str(r["gradients"]),
            str(r["master_weights"]), f"{r['optimizer_states']:g}", f"{r['total']:g}", r["note"],
            end_section=False,
        )
        previous = r["recipe"]
    console.print(table)


def recipes_document(optimizer: str | None = None) -> dict[str, Any]:
    """``trainmem recipes --json`` (and GET /api/recipes): every recipe x optimizer's bytes per parameter."""
    from .report import header

    return {**header("recipes"), "recipes": recipes_rows(optimizer)}
