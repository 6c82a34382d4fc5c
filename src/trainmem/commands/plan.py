"""`trainmem plan`: the layouts that fit, ranked by a time model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..cli import _console, _emit_json, _Whole
from ..errors import ConfigError
from ..units import DEFAULT_UNIT, parse_unit

if TYPE_CHECKING:
    from pathlib import Path


@click.command()
@click.argument("model")
@click.option("--gpu", required=True, help="GPU type (trainmem estimate --help lists them).")
@click.option("--gpus", type=int, default=None, help="How many GPUs (default: --nodes x --gpus-per-node, or 8).")
@click.option("--nodes", type=int, default=None, help="Nodes; with --gpus-per-node gives --gpus.")
@click.option("--gpus-per-node", type=int, default=8, show_default=True, help="GPUs per node.")
@click.option("--seq", type=int, default=2048, show_default=True, help="Sequence length in tokens.")
@click.option("--global-batch", type=int, default=None, help="Sequences per optimizer step (default: one per GPU).")
@click.option("--recipe", default=None, help="Search only this recipe (default: mixed-bf16, amp-bf16 and "
              "pure-bf16-bf16states, as the engines write them).")
@click.option("--checkpointing", default=None, help="Search only none or full (default: both; selective is no "
              "engine's setting).")
@click.option("--mfu", type=float, default=None, help="Fraction of peak FLOPS the time model assumes (default 0.4).")
@click.option("--inter-node-gbps", type=float, default=None, help="Node-to-node GB/s per GPU (default 50).")
@click.option("--host-memory-gib", type=float, default=None, help="Host memory per node for offload (default 2048).")
@click.option("--min-gpus", is_flag=True, help="Answer the fewest GPUs of this type that can train the model at all.")
@click.option("--time-budget", type=float, default=None,
              help="Stop the search after this many seconds and show what it found (the answer says so).")
@click.option("--top", type=click.IntRange(1, 1000), default=10, show_default=True, help="Layouts to show.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Write the best layout's files into this "
              "folder: ds_config.json (ZeRO), accelerate.yaml (DeepSpeed, FSDP2, DDP), torchtitan.json with "
              "torchtitan_plan.py (torchtitan 0.3.0), and launch.sh.")
@click.option("--units", default=DEFAULT_UNIT, show_default=True, help="GiB, GB, MiB, ...")
@click.option("--hub", is_flag=True, help="Allow fetching a config from the Hugging Face Hub.")
@click.option("--lora", type=_Whole(65536), default=None, help="Search LoRA adapters of this rank on a frozen base "
              "(data parallelism: DDP, ZeRO 1-3, FSDP2).")
@click.option("--lora-targets", default="q,v", show_default=True, help="Linears with adapters (as estimate takes).")
@click.option("--dora", is_flag=True, help="DoRA adapters (peft's use_dora).")
@click.option("--qlora", is_flag=True, help="QLoRA's base: nf4 with double quantization.")
@click.option("--json", "as_json", is_flag=True, help="Print the versioned JSON document (bytes as integers).")
def plan(model: str, gpu: str, gpus: int | None, nodes: int | None, gpus_per_node: int, seq: int,
         global_batch: int | None, recipe: str | None, checkpointing: str | None, mfu: float | None,
         inter_node_gbps: float | None, host_memory_gib: float | None, min_gpus: bool, time_budget: float | None,
         top: int, out_dir: str | Path | None, units: str, hub: bool, lora: int | None, lora_targets: str, dora: bool,
         qlora: bool, as_json: bool) -> None:
    """Search the layouts of MODEL on GPU that fit and rank them by a stated time model: data parallelism (DDP,
    ZeRO 1-3, FSDP2 full / grad-op / hybrid) x recipe x checkpointing x offload x micro-batch, with tensor (and
    sequence), pipeline, context (from 16k tokens) and expert parallelism; only layouts some engine's files run as
    planned are offered (--out writes them). What is not searched is listed in the answer.

    \b
    Example: trainmem plan llama-3-70b --gpu H100-80GB --gpus 8 --seq 4096 --global-batch 64
             trainmem plan llama-3-8b --gpu A100-80GB --nodes 2 --global-batch 256 --out plan/
             trainmem plan llama-3.1-405b --gpu H100-80GB --seq 4096 --min-gpus
    """
    from ..plan import run_plan
    from ..report import plan_document, render_plan

    unit = parse_unit(units)
    if min_gpus and out_dir is not None:
        raise ConfigError("--min-gpus answers a GPU count (one sequence per GPU): it takes no --global-batch or --out")
    if lora is not None and out_dir is not None:
        raise ConfigError("--out writes full fine-tuning's engine files; with --lora plan answers the layouts only")
    if lora is None and (dora or qlora):
        raise ConfigError("--dora and --qlora need --lora RANK")
    if out_dir is not None:  # (checked before the search; '' is refused, not taken as "no --out")
        from ..outputs import check_output_dir

        out_dir = check_output_dir(out_dir, "--out")
    options: dict[str, Any] = {key: value for key, value in (("mfu", mfu), ("inter_node_gbps", inter_node_gbps),
                                                             ("host_memory_gib", host_memory_gib))
                               if value is not None}
    if lora is not None:
        options["lora"] = dict(lora=lora, lora_targets=lora_targets, dora=dora, qlora=qlora)
    from ..progress import Progress

    with Progress(f"searching the fewest {gpu} for {model}", as_json=as_json or not min_gpus):
        found, answer = run_plan(model, gpu, gpus, seq, global_batch, gpus_per_node, nodes, recipe, checkpointing,
                                 min_gpus, hub, time_budget_s=time_budget, **options)
    if out_dir:
        if not found.plans:
            raise ConfigError("nothing fits, so --out has no layout to write")
        from ..engine_configs import write_configs

        written = write_configs(found.plans[0].layout, seq, found.model.name, out_dir)
    if as_json:
        _emit_json(plan_document(found, top, answer))
    else:
        console = _console()
        if answer is not None:
            console.print(f"[bold]the fewest {found.gpu.name} that train {found.model.name} at {seq:,} tokens: "
                          f"{answer:,}[/bold] (the layouts below)")
        render_plan(found, top, unit, console, answer)
        if out_dir:
            console.print("wrote " + ", ".join(str(p) for p in written))
    if not found.plans:
        raise click.exceptions.Exit(1)
