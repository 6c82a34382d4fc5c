"""`trainmem amp-demo`: a small model trained in each precision, with and without a scaler."""

from __future__ import annotations

import click

from ..cli import _console, _header, _emit_json, _Whole, _Real
from ..errors import ConfigError


@click.command(name="amp-demo")
@click.option("--steps", type=_Whole(100_000), default=200, show_default=True)
@click.option("--batch", type=_Whole(4096), default=8, show_default=True)
@click.option("--grad-scale-down", type=_Real(1e-12, 1e12), default=1.0, show_default=True,
              help="Shrink the gradients fp16 sees by this factor (e.g. 1e-6) to reproduce a deep model's regime.")
@click.option("--runs", default=",".join(("fp32", "fp16-autocast", "fp16-autocast+scaler", "bf16-autocast",
                                           "pure-bf16", "pure-bf16+master")), show_default=True)
@click.option("--plot", type=click.Path(dir_okay=False), help="Write the loss curves as a PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def amp_demo(steps: int, batch: int, grad_scale_down: float, runs: str, plot: str | None, as_json: bool) -> None:
    """Train a tiny GPT on a text shipped with trainmem under fp32, fp16 autocast (with and without GradScaler),
    bf16 autocast, pure bf16 and bf16 with fp32 master weights, on the CPU, and compare.

    \b
    Example: trainmem amp-demo --grad-scale-down 1e-6 --plot amp.png
    """
    from ..amp_demo import RUNS, plot as plot_runs, run_all

    names = [r.strip() for r in runs.split(",") if r.strip()]
    if not names:
        raise ConfigError(f"--runs is empty; accepted: {', '.join(RUNS)}")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ConfigError(f"unknown run {unknown[0]!r}; accepted: {', '.join(RUNS)}")
    if steps <= 0 or batch <= 0 or not grad_scale_down > 0:
        raise ConfigError("--steps, --batch and --grad-scale-down must be positive")
    if plot is not None:
        from ..outputs import check_output_file, replacing

        plot_path = check_output_file(plot, "--plot", ".png")
    from ..progress import Progress

    with Progress("amp-demo", total=steps * len(names), as_json=as_json) as bar:
        results, seconds = run_all(steps=steps, grad_scale_down=grad_scale_down, runs=names, batch=batch,
                                   on_step=lambda name, _: bar.advance(description=f"amp-demo: {name}"))
    reference = next((r for r in results if r.name == "fp32"), None)
    if plot is not None:
        with replacing(plot_path) as temporary:
            plot_runs(results, str(temporary))
    if as_json:
        _emit_json({**_header("amp-demo"), "steps": steps, "grad_scale_down": grad_scale_down,
                    "seconds": round(seconds, 1), "runs": [
            {"name": r.name, "losses": r.losses, "final_loss": r.final_loss, "zero_grad_fraction": r.zero_grad_fraction,
             "skipped_steps": r.skipped_steps,
             "gap_to_fp32": None if reference is None else r.final_loss - reference.final_loss} for r in results]})
        return
    from rich.table import Table

    marks = sorted({0, steps // 4, steps // 2, 3 * steps // 4, steps - 1})
    table = Table(title=f"Tiny GPT, {steps} steps, gradients fp16 sees x{grad_scale_down:g} "
                        f"({seconds:.0f} s on the CPU)")
    table.add_column("run")
    for m in marks:
        table.add_column(f"loss @{m}", justify="right")
    for col in ("final (last 10)", "gap to fp32", "zero gradients", "skipped steps"):
        table.add_column(col, justify="right")
    for r in results:
        gap = "" if reference is None else f"{r.final_loss - reference.final_loss:+.3f}"
        table.add_row(r.name, *(f"{r.losses[m]:.3f}" for m in marks), f"{r.final_loss:.3f}", gap,
                      f"{r.zero_grad_fraction:.2%}", str(r.skipped_steps))
    console = _console()
    console.print(table)
    if plot:
        console.print(f"loss curves written to {plot}")
