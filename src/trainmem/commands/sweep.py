"""`trainmem sweep`: the estimate over a grid of batches, sequences, GPU counts and ZeRO stages."""

from __future__ import annotations

from typing import Any

import click

from ..cli import _console, _header, _emit_json, _workload, _int_list, _gpu_memory_option, _workload_options
from ..errors import ConfigError


@click.command()
@_workload_options
@_gpu_memory_option
@click.option("--batch", "batches", default="1,2,4,8", show_default=True, help="Micro-batch sizes, comma-separated.")
@click.option("--seq", "seqs", default="1024,2048,4096", show_default=True, help="Sequence lengths, comma-separated.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG: the bytes needed against the batch or the "
              "sequence, with GPU capacities and where each runs out.")
def sweep(batches: str, seqs: str, plot: str | None, **options: Any) -> None:
    """Estimate a grid of micro-batch sizes x sequence lengths.

    \b
    Example: trainmem sweep llama-2-7b --batch 1,2,4,8 --seq 1024,2048,4096 --gpu A100-80GB
             trainmem sweep llama-3-8b --batch 1,2,4,8,16,32 --seq 2048 --plot batch.png
    """
    from ..planner import sweep as run_sweep
    from ..report import render_sweep, to_dict

    from dataclasses import replace

    from ..settings import check_grid

    batch_list, seq_list = _int_list(batches, "--batch"), _int_list(seqs, "--seq")
    check_grid(batch_list, seq_list, names=("--batch", "--seq"))
    if plot is not None:
        from ..outputs import check_output_file

        plot_path = check_output_file(plot, "--plot", ".png")
        if len(set(batch_list)) < 2 and len(set(seq_list)) < 2:
            raise ConfigError("--plot draws memory against the batch or the sequence: give more than one --batch or "
                              "--seq value")
    gpu_list = _int_list(options["gpus"], "--gpus")
    zero_list = [None] if options["zero"] is None else _int_list(options["zero"], "--zero", minimum=0)
    sharded = next((g for g in gpu_list if g > 1), None)
    w = _workload(options, batch_list[0], seq_list[0], gpus=sharded or 1, zero=zero_list[0] if sharded else None)
    spec, settings, device, target, unit, as_json = w.spec, w.settings, w.device, w.gpu, w.unit, options["as_json"]
    layouts = []
    for g in gpu_list:
        for z in zero_list:
            try:  # (one GPU has nothing to shard: its row is the single-GPU one, once)
                layout = replace(w.parallel, gpus=g, zero=z if g > 1 else None,
                                 fsdp=w.parallel.fsdp if g > 1 else None, offload=w.parallel.offload if g > 1 else
                                 "none", gpus_per_node=min(w.parallel.gpus_per_node, g))
            except ConfigError as exc:
                raise ConfigError(f"--gpus {g} --zero {z}: {exc}") from None
            if layout not in layouts:
                layouts.append(layout)
    check_grid(batch_list, seq_list, len(layouts), names=("--batch", "--seq"))
    estimates = run_sweep(spec, settings, batch_list, seq_list, device, layouts, w.finetune)
    if any(e.peak is None for e in estimates):
        why = ("this LoRA set-up's activations are not modelled yet" if w.finetune
               else "give a model config, not --params")
        raise ConfigError(f"a sweep needs activations: {why}")
    if plot is not None:
        from ..outputs import replacing
        from ..plots import plot_sweep

        with replacing(plot_path) as temporary:
            plot_sweep(estimates, temporary, unit, target)
    if as_json:
        _emit_json({**_header("sweep"), "sweep": [to_dict(e, target, search_batch=False) for e in estimates]})
    else:
        render_sweep(estimates, unit, _console(), target)
        if plot:
            _console().print(f"plot written to {plot}")
