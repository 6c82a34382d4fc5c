"""`trainmem measure`: real training steps measured by phase beside the estimate."""

from __future__ import annotations

import contextlib
from typing import Any

import click

from ..cli import (_console, _header, _model_dict, _emit_json, _workload, _refuse_fit_only_flags, _one_process,
                   _workload_options, _Whole, _MAX_STEP)
from ..errors import ConfigError


@click.command()
@_workload_options
@click.option("--batch", type=_Whole(_MAX_STEP), default=1, show_default=True, help="Micro-batch size per GPU.")
@click.option("--seq", type=_Whole(_MAX_STEP), default=512, show_default=True, help="Sequence length in tokens.")
@click.option("--device", default="auto", show_default=True, help="cuda, cuda:N, cpu or auto.")
@click.option("--steps", type=_Whole(1000), default=2, show_default=True,
              help="Steps to run; the last one is measured.")
@click.option("--snapshot", type=click.Path(dir_okay=False), help="CUDA only: write a memory snapshot for "
              "pytorch.org/memory_viz.")
def measure(batch: int, seq: int, device: str, steps: int, snapshot: str | None, **options: Any) -> None:
    """Build MODEL for real (random weights), run training steps on a device and report each phase's peak:
    torch.cuda.max_memory_allocated()/max_memory_reserved() on CUDA, the allocator's own events on the CPU.

    \b
    Example: trainmem measure gpt2 --batch 2 --seq 256 --recipe fp32 --device cpu
    """
    from ..stepmodel import estimate_model
    from ..measure import measure_steps, recipe_for_cpu, refuse_unmeasurable, resolve_device
    from ..units import format_bytes

    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    _refuse_fit_only_flags("measure runs the step and compares allocated bytes")
    snapshot_path = None
    if snapshot is not None:
        from ..outputs import check_output_file

        snapshot_path = check_output_file(snapshot, "--snapshot")
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not device.startswith("cuda"):
            raise ConfigError("--snapshot records the CUDA caching allocator's history: it needs --device cuda "
                              f"(here the device is {device})")
    w = _workload(options, batch, seq, need_config="measure")
    from ..models import check_learned_positions

    check_learned_positions(w.spec, w.settings.seq, "measure")
    refuse_unmeasurable(w.finetune)
    for flag, on in (("--optimizer-in-backward", w.settings.optimizer_in_backward), ("--compile", w.settings.compile),
                     ("--offload-activations", w.settings.offload_activations)):
        if on:
            raise ConfigError(f"measure does not run {flag} yet (trace does)")
    _one_process(w, "measure")
    from ..step import check_runnable

    check_runnable(w.settings, device)
    from ..meta_count import check_transformers_config

    check_transformers_config(w.model_config, w.spec.source or w.spec.name)
    from rich.console import Console

    errors = Console(stderr=True, highlight=False, soft_wrap=True)  # progress on stderr: --json keeps stdout
    device = resolve_device(device)
    recipe_given = click.get_current_context().get_parameter_source("recipe") not in (
        click.core.ParameterSource.DEFAULT, None)
    settings, changed = recipe_for_cpu(w.settings, device, recipe_given)
    if changed:
        errors.print(f"measure: {changed}")
    spec, unit, as_json = w.spec, w.unit, options["as_json"]
    config = w.model_config
    est = estimate_model(spec, settings, w.device, finetune=w.finetune)
    from ..outputs import replacing

    def progress(step: int, total: int, seconds: float | None) -> None:
        if step == 0 and seconds is None:
            what = (f"building {spec.name} ({spec.num_parameters:,} parameters, random weights) on {device}, "
                    f"{settings.recipe}, batch {settings.batch} x seq {settings.seq:,} ...")
        elif step == 0:
            what = f"built in {seconds:.1f} s"
        else:
            what = f"step {step} of {total} ({'measured' if step == total else 'warm-up'}) " + (
                "..." if seconds is None else f"done in {seconds:.1f} s")
        errors.print(f"measure: {what}")

    try:
        with replacing(snapshot_path) if snapshot_path else contextlib.nullcontext() as temporary:
            result = measure_steps(config, settings, device, steps, str(temporary) if temporary else None,
                                   finetune=w.finetune, progress=progress)
    except (RuntimeError, ValueError) as exc:  # device not available, out of memory, unsupported recipe
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"measure failed on {device}: {first[:300]}") from None
    estimated = {p.name: p.allocated_bytes for p in est.phases}
    if as_json:
        doc = result.as_dict()
        for row in doc["phases"]:
            row["estimate_allocated_bytes"] = estimated.get(row["name"])
        lora = {"finetune": w.finetune.as_dict(spec)} if w.finetune is not None else {}
        _emit_json({**_header("measure"), "model": _model_dict(spec), "settings": settings.as_dict(), **lora, **doc})
        return
    from rich.table import Table

    table = Table(title=f"{spec.name}: measured on {result.device} vs estimate ({unit})")
    for col in ("phase", "measured allocated", "measured reserved", "estimate", "error"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for p in result.phases:
        e = estimated.get(p.name)
        table.add_row(p.name, format_bytes(p.allocated_bytes, unit),
                      format_bytes(p.reserved_bytes, unit) if p.reserved_bytes is not None else "-",
                      format_bytes(e, unit) if e is not None else "",
                      f"{(e - p.allocated_bytes) / p.allocated_bytes:+.2%}" if e and p.allocated_bytes else "")
    console = _console()
    console.print(table)
    if snapshot and result.device == "cuda":
        console.print(f"snapshot written to {snapshot} (open it at pytorch.org/memory_viz)")
