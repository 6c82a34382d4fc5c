"""A planned layout written as the files the engines read: a DeepSpeed JSON, an accelerate config YAML (DeepSpeed or
FSDP2), a torchtitan TOML where the layout is expressible there (FSDP2 without offload; tensor and pipeline
parallelism over FSDP2 or DDP), and a launch script (accelerate, torchtitan, or Megatron-DeepSpeed's pretrain_gpt.py
for tensor and pipeline parallelism with ZeRO-1).

Key names follow each engine's own parser: DeepSpeed's config keys (deepspeed/runtime/config.py and
runtime/zero/config.py: ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
``zero_optimization.stage``, ``offload_optimizer.device``), accelerate's ``ClusterConfig`` (accelerate/commands/
config/config_args.py: ``distributed_type``, ``fsdp_config`` with ``fsdp_version: 2``, ``deepspeed_config`` with
``deepspeed_config_file``), torchtitan's JobConfig sections (torchtitan/config/job_config.py: ``[training]
local_batch_size``, ``seq_len``, ``[parallelism] data_parallel_shard_degree``, ``[activation_checkpoint] mode``).
All files are written to a fresh temporary folder and moved into DIR only when every one is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ConfigError
from .plan import Layout
from .settings import SELECTIVE_EVERY

def mixed_precision(recipe: str) -> str:
    """accelerate's and DeepSpeed's name for the recipe's compute dtype: bf16, fp16, or no."""
    from .recipes import get_recipe

    return {"bf16": "bf16", "fp16": "fp16"}.get(get_recipe(recipe).compute, "no")


def deepspeed_config(layout: Layout) -> dict:
    """DeepSpeed's JSON for a DDP (stage 0) or ZeRO layout, or Megatron-DeepSpeed's with tensor and pipeline
    parallelism (the batch is counted over the data-parallel ranks, as DeepSpeed does with Megatron's mpu)."""
    stage = layout.zero or 0
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if layout.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if layout.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    precision = mixed_precision(layout.recipe)
    return {
        "train_batch_size": layout.micro_batch * layout.grad_accum * layout.data_parallel,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_optimization": zero,
        "gradient_clipping": 1.0,
        "wall_clock_breakdown": False,
    }


def accelerate_config(layout: Layout) -> dict:
    nodes = -(-layout.gpus // layout.gpus_per_node)
    config = {"compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "main_training_function": "main",
              "mixed_precision": mixed_precision(layout.recipe), "num_machines": nodes,
              "num_processes": layout.gpus, "rdzv_backend": "static", "same_network": True, "use_cpu": False,
              "debug": False, "downcast_bf16": "no", "tpu_env": [], "tpu_use_cluster": False,
              "tpu_use_sudo": False}
    if layout.fsdp:
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": layout.fsdp in ("full", "hybrid"),
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": layout.offload == "optimizer+params",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_activation_checkpointing": layout.checkpointing == "full",
        }
    elif layout.gpus > 1:
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {"deepspeed_config_file": "ds_config.json", "zero3_init_flag": layout.zero == 3}
    else:
        config["distributed_type"] = "NO"
    return config


def megatron_deepspeed(layout: Layout) -> bool:
    """Tensor and pipeline parallelism with ZeRO: Megatron-DeepSpeed's pretrain_gpt.py with a DeepSpeed JSON."""
    return layout.zero is not None and layout.tp * layout.pp > 1


def torchtitan_only(layout: Layout) -> bool:
    """Tensor, pipeline, context or expert parallelism over FSDP2 or DDP, or layer-selective checkpointing: only
    torchtitan's file says them here (accelerate's and DeepSpeed's configs have no such keys)."""
    return ((layout.tp * layout.pp * layout.cp * layout.ep > 1 or layout.checkpointing == "selective")
            and not megatron_deepspeed(layout))


def torchtitan_toml(layout: Layout, seq: int, model_name: str) -> str | None:
    """torchtitan's job config for an FSDP2 layout without offload, or a tensor/pipeline-parallel one over FSDP2,
    DDP (``data_parallel_replicate_degree``) or nothing (torchtitan shards with FSDP2 and has no DeepSpeed engine);
    None where the layout is not expressible there. torchtitan's TP plan is sequence parallel; its local batch is
    per data-parallel rank, split into ``pipeline_parallel_microbatch_size`` micro-batches with PP."""
    dp = layout.data_parallel
    if layout.offload != "none" or not (layout.fsdp or torchtitan_only(layout)):
        return None
    if layout.fsdp:
        shard = layout.gpus_per_node if layout.fsdp == "hybrid" else dp
    else:
        shard = 1
    replicate = dp // shard
    pipelined = layout.pp > 1
    local = layout.micro_batch * layout.grad_accum if pipelined else layout.micro_batch
    lines = [
        f"# trainmem plan: {model_name}, TP {layout.tp} x PP {layout.pp} x CP {layout.cp} x DP {dp} (EP {layout.ep}), "
        f"{layout.engine}, {layout.recipe}, "
        f"checkpointing {layout.checkpointing}",
        "[training]",
        f"local_batch_size = {local}",
        f"global_batch_size = {layout.micro_batch * layout.grad_accum * dp}",
        f"seq_len = {seq}",
        f'mixed_precision_param = "{"bfloat16" if mixed_precision(layout.recipe) == "bf16" else "float32"}"',
        "",
        "[parallelism]",
        f"data_parallel_shard_degree = {shard}",
        f"data_parallel_replicate_degree = {replicate}",
    ]
    if layout.fsdp:
        # ("always" also with PP, where torchtitan's default keeps the parameters gathered: the estimate is of
        # full sharding)
        reshard = "always" if layout.fsdp in ("full", "hybrid") else "never"
        lines.append(f'fsdp_reshard_after_forward = "{reshard}"')
    lines += [f"tensor_parallel_degree = {layout.tp}", f"pipeline_parallel_degree = {layout.pp}"]
    if pipelined:
        lines += ['pipeline_parallel_schedule = "1F1B"', f"pipeline_parallel_microbatch_size = {layout.micro_batch}"]
    lines += [f"context_parallel_degree = {layout.cp}"]
    if layout.ep > 1:
        lines.append(f"expert_parallel_degree = {layout.ep}")
    lines += ["", "[activation_checkpoint]", f'mode = "{layout.checkpointing}"']
    if layout.checkpointing == "selective":
        lines.append(f'selective_ac_option = "{SELECTIVE_EVERY}"')
    lines.append("")
    return "\n".join(lines)


def launch_script(layout: Layout, seq: int = 0) -> str:
    nodes = -(-layout.gpus // layout.gpus_per_node)
    rendezvous = (f"torchrun --nnodes {nodes} --nproc-per-node {layout.gpus_per_node} --node-rank \"${{NODE_RANK:-0}}\" "
                  '--rdzv-endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}" \\')
    if megatron_deepspeed(layout):
        # Megatron-DeepSpeed's arguments (megatron/arguments.py): its recompute flags, ZeRO stage and DeepSpeed JSON
        precision = {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(mixed_precision(layout.recipe), [])
        recompute = ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"] \
            if layout.checkpointing == "full" else []
        flags = [f"--tensor-model-parallel-size {layout.tp}", f"--pipeline-model-parallel-size {layout.pp}",
                 *(["--sequence-parallel"] if layout.tp > 1 else []), f"--micro-batch-size {layout.micro_batch}",
                 f"--global-batch-size {layout.micro_batch * layout.grad_accum * layout.data_parallel}",
                 f"--seq-length {seq}", *precision, *recompute, f"--zero-stage {layout.zero}", "--deepspeed",
                 '--deepspeed_config "$(dirname "$0")/ds_config.json"']
        return "\n".join([
            "#!/usr/bin/env bash",
            f"# trainmem plan: {layout.gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} of {layout.gpus_per_node}), "
            f"TP {layout.tp} x PP {layout.pp} x DP {layout.data_parallel}, {layout.engine}: Megatron-DeepSpeed with "
            "ds_config.json.",
            "# Run from Megatron-DeepSpeed's checkout on every node, with NODE_RANK and MASTER_ADDR set; give the "
            "model's",
            "# architecture (--num-layers, --hidden-size, ...) and data (--data-path, --tokenizer-type, ...) as "
            "arguments.",
            "set -euo pipefail",
            rendezvous,
            "    pretrain_gpt.py " + " \\\n    ".join(flags) + ' \\\n    "$@"',
            "",
        ])
    if torchtitan_only(layout):
        return "\n".join([
            "#!/usr/bin/env bash",
            f"# trainmem plan: {layout.gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} of {layout.gpus_per_node}), "
            f"TP {layout.tp} x PP {layout.pp} x DP {layout.data_parallel}, {layout.engine}: torchtitan with "
            "torchtitan.toml.",
            "# Run from torchtitan's checkout on every node, with NODE_RANK and MASTER_ADDR set.",
            "set -euo pipefail",
            rendezvous,
            '    -m torchtitan.train --job.config_file "$(dirname "$0")/torchtitan.toml" "$@"',
            "",
        ])
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# trainmem plan: {layout.gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} of {layout.gpus_per_node}), "
        f"{layout.engine}, micro-batch {layout.micro_batch} x {layout.grad_accum} accumulation steps.",
        "# Run on every node with NODE_RANK and MASTER_ADDR set; TRAIN_SCRIPT is your training script.",
        "set -euo pipefail",
        'TRAIN_SCRIPT="${TRAIN_SCRIPT:-train.py}"',
        f"accelerate launch --config_file accelerate.yaml --num_machines {nodes} --num_processes {layout.gpus} \\",
        '    --machine_rank "${NODE_RANK:-0}" --main_process_ip "${MASTER_ADDR:-127.0.0.1}" '
        '--main_process_port "${MASTER_PORT:-29500}" \\',
        '    "$TRAIN_SCRIPT" "$@"',
        "# or, without accelerate:",
        f"# torchrun --nnodes {nodes} --nproc-per-node {layout.gpus_per_node} --node-rank \"$NODE_RANK\" "
        '--rdzv-endpoint "$MASTER_ADDR:29500" "$TRAIN_SCRIPT"',
        "",
    ])


def write_configs(layout: Layout, seq: int, model_name: str, out: str | os.PathLike) -> list[Path]:
    """Write the layout's files into ``out`` (created if missing); returns their paths."""
    import yaml

    target = Path(out)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; give a folder")
    if not target.parent.is_dir():
        raise ConfigError(f"--out: the folder {str(target.parent)!r} does not exist")
    files: dict[str, str] = {"launch.sh": launch_script(layout, seq)}
    if not torchtitan_only(layout) and not megatron_deepspeed(layout):
        files["accelerate.yaml"] = yaml.safe_dump(accelerate_config(layout), sort_keys=False)
    if not layout.fsdp and layout.gpus > 1 and not torchtitan_only(layout):
        files["ds_config.json"] = json.dumps(deepspeed_config(layout), indent=2) + "\n"
    titan = torchtitan_toml(layout, seq, model_name)
    if titan is not None:
        files["torchtitan.toml"] = titan
    target.mkdir(exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".trainmem-plan-", dir=target))
    try:
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        (staging / "launch.sh").chmod(0o755)
        written = []
        for name in files:
            os.replace(staging / name, target / name)
            written.append(target / name)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
