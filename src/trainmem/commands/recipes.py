"""`trainmem recipes`: bytes per parameter of every recipe and optimizer."""

from __future__ import annotations

from typing import Optional

import click

from ..cli import _console, _emit_json


@click.command()
@click.option("--optimizer", help="Show one optimizer only.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def recipes(optimizer: Optional[str], as_json: bool) -> None:
    """Bytes per parameter of each component for every recipe and optimizer.

    \b
    Example: trainmem recipes --optimizer adamw
    """
    from ..recipes_table import recipes_document, render_recipes

    document = recipes_document(optimizer)
    if as_json:
        _emit_json(document)
    else:
        render_recipes(document["recipes"], _console())
