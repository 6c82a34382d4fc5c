"""`trainmem estimate`: the memory of training a model, phase by phase."""

from __future__ import annotations

from typing import Any

import click

from ..cli import _console, _emit_json, _workload, _gpu_memory_option, _workload_options, _Whole, _MAX_STEP
from ..errors import ConfigError


@click.command()
@_workload_options
@_gpu_memory_option
@click.option("--batch", type=_Whole(_MAX_STEP), default=1, show_default=True, help="Micro-batch size per GPU.")
@click.option("--seq", type=_Whole(_MAX_STEP), default=2048, show_default=True, help="Sequence length in tokens.")
@click.option("--max-batch", is_flag=True, help="Find the largest micro-batch that fits --gpu (none: says \"does not fit, "
              "not even batch 1\"; exit code 0).")
@click.option("--max-seq", is_flag=True, help="Find the longest sequence that fits --gpu, up to the model's position "
              "limit unless RoPE scaling extends it (none: says so; exit code 0).")
@click.option("--explain", is_flag=True, help="List every saved tensor of a layer.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG: each phase's bytes by category, with "
              "the bytes needed and GPU capacities as lines (with --explain-reserved, also NAME-reserved.png: "
              "allocated vs reserved through the replay).")
@click.option("--alloc-conf", default=None, metavar="TEXT",
              help="PYTORCH_CUDA_ALLOC_CONF options the allocator replay assumes, e.g. expandable_segments:True "
                   "(default: the environment's PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF, else torch's).")
@click.option("--explain-reserved", is_flag=True, help="The allocator replay behind the reserved line: the segments "
              "at the peak and allocated vs reserved through two steps.")
def estimate(batch: int, seq: int, max_batch: bool, max_seq: bool, explain: bool, plot: str | None,
             explain_reserved: bool, **options: Any) -> None:
    """Estimate the memory of training MODEL: a catalog name (trainmem models), a Hub repo id, or a path to a
    config.json or its folder.

    \b
    Example: trainmem estimate meta-llama/Llama-2-7b-hf --recipe mixed-bf16 --optimizer adamw
             trainmem estimate llama-3-8b --batch 4 --seq 4096 --checkpointing full --gpu H100-80GB
             trainmem estimate llama-2-7b --gpu A100-80GB --max-batch
             trainmem estimate llama-3.1-8b --lora 8 --checkpointing full --gpu RTX-4090 --headroom 1
             trainmem estimate llama-3.2-1b --gpu-memory 48GiB
             trainmem estimate --params 7e9 --recipe pure-bf16 --units GB
             trainmem estimate llama-3-8b --checkpointing full --plot memory.png
    """
    from ..planner import estimate_searched
    from ..report import gpu_verdict, render_estimate, to_dict

    if plot is not None:
        from ..outputs import check_output_file

        plot_path = check_output_file(plot, "--plot", ".png")
    w = _workload(options, batch, seq)
    unit, target, as_json = w.unit, w.gpu, options["as_json"]
    if explain_reserved and w.device.fragmentation is not None:
        raise ConfigError("--explain-reserved shows the allocator replay, which --fragmentation replaces: give one")
    est, extra = estimate_searched(w.spec, w.settings, w.device, target, w.parallel, w.finetune, max_batch, max_seq)
    if explain_reserved and est.allocator is None:
        raise ConfigError("--explain-reserved shows the replay of a one-GPU step (a model config, no --activation-k); "
                          "a data-parallel rank or a model-parallel stage applies its step's replayed ratio, which "
                          "the reserved line states")
    if plot is not None:
        from ..outputs import replacing

        from ..plots import plot_estimate

        with replacing(plot_path) as temporary:
            plot_estimate(est, temporary, unit, target)
        if explain_reserved:
            from ..plots import plot_reserved

            reserved_path = plot_path.with_name(f"{plot_path.stem}-reserved.png")
            with replacing(reserved_path) as temporary:
                plot_reserved(est.allocator, temporary, unit, f"{est.model.name}: caching allocator replay")
    if as_json:
        _emit_json(to_dict(est, target, extra))
    else:
        console = _console()
        for key in ("max_batch", "max_seq"):
            if key not in extra:
                continue
            assert target is not None  # (estimate_searched refused --max-batch and --max-seq without --gpu)
            what, value = ("micro-batch" if key == "max_batch" else "sequence length"), extra[key]
            if not value:  # an answer, not an error: exit code 0
                least = "batch 1" if key == "max_batch" else f"a sequence of 1 token at batch {est.settings.batch}"
                console.print(f"[bold red]{target.name}: does not fit, not even {least}[/bold red] (the estimate "
                              f"below is at batch {est.settings.batch}, seq {est.settings.seq:,})", highlight=False,
                              soft_wrap=True)
            elif key == "max_seq" and extra["max_seq_is_position_limit"]:
                console.print(f"[bold]sequence length {value:,} fits {target.name}: the model's "
                              f"max_position_embeddings, the longest it takes[/bold] (shown below)")
            else:
                console.print(f"[bold]largest {what} that fits {target.name}: {value:,}[/bold] (shown below)")
        verdict = gpu_verdict(est, target) if target is not None else None
        render_estimate(est, unit, console, target, explain, verdict)
        if explain_reserved:
            from ..replay import explain_reserved_lines

            for line in explain_reserved_lines(est, unit):
                console.print(line, highlight=False, soft_wrap=True)
        if plot:
            console.print(f"plot written to {plot}")
            if explain_reserved:
                console.print(f"allocator timeline written to {plot_path.with_name(plot_path.stem + '-reserved.png')}")
