"""`trainmem dtypes`: the floating-point formats, and how a value is stored in each."""

from __future__ import annotations

from typing import Any, Optional

import click

from ..cli import _console, _header, _emit_json


@click.command()
@click.option("--value", type=float, help="Show how this number is stored in each format.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def dtypes(value: Optional[float], as_json: bool) -> None:
    """Floating-point formats computed from their bit layouts: range, precision, bytes.

    \b
    Example: trainmem dtypes --value 1e-8
    """
    from ..dtypes import FORMATS, describe

    rows: list[dict[str, Any]] = [
        {"format": f.name, "sign": 1, "exponent_bits": f.exponent_bits, "mantissa_bits": f.mantissa_bits,
         "max": f.max, "smallest_normal": f.smallest_normal, "smallest_subnormal": f.smallest_subnormal,
         "eps": f.eps, "decimal_digits": f.decimal_digits, "bytes": f.storage_bytes} for f in FORMATS.values()]
    stored = describe(value) if value is not None else None
    if as_json:
        _emit_json({**_header("dtypes"), "formats": rows, **({"value": value, "stored": stored} if stored else {})})
        return
    from rich.table import Table

    table = Table(title="Floating-point formats (computed from sign/exponent/mantissa bits)")
    for col in ("format", "s/e/m bits", "max", "smallest normal", "smallest subnormal", "eps", "digits", "bytes"):
        table.add_column(col, justify="left" if col == "format" else "right")
    for r in rows:
        table.add_row(r["format"], f"1/{r['exponent_bits']}/{r['mantissa_bits']}", f"{r['max']:.6g}",
                      f"{r['smallest_normal']:.4g}", f"{r['smallest_subnormal']:.4g}", f"{r['eps']:.4g}",
                      str(r["decimal_digits"]), str(r["bytes"]))
    console = _console()
    console.print(table)
    if stored:
        t = Table(title=f"{value!r} stored in each format")
        for col in ("format", "stored value", "relative error", "outcome"):
            t.add_column(col, justify="left" if col in ("format", "outcome") else "right")
        for r in stored:
            err = "" if r["relative_error"] is None else f"{r['relative_error']:.3e}"
            t.add_row(r["format"], f"{r['stored']:.10g}", err, r["outcome"])
        console.print(t)
