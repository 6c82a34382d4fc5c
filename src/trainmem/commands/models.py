"""`trainmem models`: the built-in catalog."""

from __future__ import annotations

import click

from ..cli import _console, _emit_json


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def models(as_json: bool) -> None:
    """List the built-in catalog with exact parameter counts.

    \b
    Example: trainmem models
    """
    from ..report import models_document, render_models

    document = models_document()
    if as_json:
        _emit_json(document)
    else:
        render_models([tuple(m.values()) for m in document["models"]], _console())
