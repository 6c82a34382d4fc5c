"""A planned layout written as the files the engines read, and those files read back (``trainmem estimate
--ds-config / --accelerate-config / --torchtitan-config``).

Which engine runs which layout as trainmem models it (``writers``; ``trainmem plan`` offers a layout only where one
of them does, docs/method.md "Plans and their files"):

- DeepSpeed ZeRO 1-3 (``ds_config.json``, with accelerate's ``accelerate.yaml`` and ``launch.sh``; Megatron-
  DeepSpeed's ``pretrain_gpt.py`` for tensor and pipeline parallelism with ZeRO-1): ``mixed-bf16`` (``"bf16":
  {"enabled": true}``: bf16 parameters, fp32 master partition and fp32 Adam states, deepspeed/runtime/zero/
  stage_1_and_2.py ``single_partition_of_fp32_groups``) and ``mixed-fp16``. Its ``bf16_master_weights_and_grads``
  and ``bf16_optimizer_states`` (deepspeed/runtime/precision_config.py) keep a *bf16 master partition*, a clone of
  the parameters' (stage_1_and_2.py: ``.clone().to(dtype=self.master_weights_and_grads_dtype)``), and need
  ZeRO-Offload with DeepSpeedCPUAdam unless both are set (base_optimizer.py ``_configure_master_weights``): neither
  is a recipe trainmem models (``pure-bf16-bf16states`` holds no master copy), so no bf16-state layout is offered
  for DeepSpeed. Layer-selective checkpointing is not a DeepSpeed setting.
- accelerate (``accelerate.yaml``, ``launch.sh``; accelerate/commands/config/config_args.py ``ClusterConfig``): one
  GPU and DDP (``MULTI_GPU``) with ``amp-bf16``/``amp-fp16`` (``mixed_precision``: torch.autocast over the fp32
  model), ``fp32`` or ``pure-bf16-bf16states`` (``mixed_precision: no``, the model loaded in bf16, torch's AdamW
  keeping its states in the parameters' dtype); FSDP2 with ``fp32`` or ``pure-bf16-bf16states`` only: with
  ``mixed_precision`` set, accelerate upcasts the parameters to fp32 and reduces in the compute dtype
  (accelerate/utils/fsdp_utils.py ``fsdp2_prepare_model``; utils/dataclasses.py ``set_mixed_precision``:
  ``param_dtype = reduce_dtype``), where trainmem's FSDP2 mixed recipe reduces in fp32 (torchtitan's). FSDP2
  hybrid carries accelerate's ``parallelism_config`` (``parallelism_config_dp_replicate_size`` nodes x
  ``parallelism_config_dp_shard_size`` GPUs per node: accelerate/commands/config/cluster.py, launch.py
  ``prepare_extend_env_parallelism_config``); full checkpointing is ``fsdp_activation_checkpointing`` under FSDP2
  and the training script's ``--gradient_checkpointing`` otherwise; CPU offload is ``fsdp_offload_params``.
- torchtitan 0.3.0 (``torchtitan.json`` with ``torchtitan_plan.py``; 0.3.0 loads a config only as a Python
  ``config_registry`` function named by ``--module``/``--config``, torchtitan/config/manager.py, no TOML): FSDP2
  full / grad-op / hybrid, with tensor, pipeline, context and expert parallelism, and FSDP2's CPU offload
  (``training.enable_cpu_offload``), in ``mixed-bf16`` (``mixed_precision_param = "bfloat16"`` over the fp32 model)
  or ``fp32``. 0.3.0 applies fully_shard to every model, with a shard degree of 1 too (torchtitan/models/llama3/
  parallelize.py: "Always run apply_fsdp_to_decoder"), so its DDP and its runs without data parallelism are not
  trainmem's DDP; and it reduces in float32 whatever the dtype (``mixed_precision_reduce`` takes only "float32"),
  so its ``training.dtype = "bfloat16"`` is not ``pure-bf16-bf16states`` (bf16 reduce). ``activation_checkpoint``
  is FullAC or None (0.3.0's ``SelectiveAC`` is per-op, every second matmul: trainmem's layer-selective
  checkpointing is written by no engine, so not offered).
- ``pure-bf16`` (fp32 states over bf16 weights without a master copy) is no engine's setting: torch's AdamW keeps
  its states in the parameters' dtype, DeepSpeed keeps a master partition.

Every user string written into a file is escaped for that file: JSON by ``json.dumps``, YAML as double-quoted JSON
strings (a YAML double-quoted scalar is a superset of a JSON string), shell words by ``shlex.quote``; the Python
module holds no user string (it reads ``torchtitan.json``). The YAML is written here (PyYAML is not a core
dependency). All files go to a fresh temporary folder and are moved into DIR only when every one is written.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .errors import ConfigError

if TYPE_CHECKING:
    from .plan import Layout

DEEPSPEED_RECIPES = {"mixed-bf16": "bf16", "mixed-fp16": "fp16"}
"""The recipes DeepSpeed's bf16 / fp16 modes run as trainmem models them: half parameters, fp32 master and states."""
ACCELERATE_REPLICATED_RECIPES = {"amp-bf16": "bf16", "amp-fp16": "fp16", "fp32": "no", "pure-bf16-bf16states": "no"}
"""One GPU and DDP under accelerate: its mixed_precision (autocast) or none, over the model's own dtype."""
ACCELERATE_FSDP_RECIPES = {"fp32": "no", "pure-bf16-bf16states": "no"}
TORCHTITAN_BASES = {"llama-3-8b": "llama3:llama3_8b", "llama-3.1-8b": "llama3:llama3_8b",
                    "llama-3-70b": "llama3:llama3_70b", "llama-3.1-70b": "llama3:llama3_70b",
                    "llama-3.1-405b": "llama3:llama3_405b"}
"""trainmem catalog names whose architecture torchtitan 0.3.0 ships a config for (torchtitan/models/llama3/
config_registry.py); other models name theirs in TORCHTITAN_BASE=module:function when launching."""
TORCHTITAN_RECIPES = {"mixed-bf16": "bfloat16", "fp32": "float32"}
"""torchtitan 0.3.0's recipes as trainmem models them: the fp32 model (training.dtype float32) with fully_shard's
param_dtype (mixed_precision_param) and a float32 reduce."""
MODEL_DTYPE = {"fp32": "float32", "amp-bf16": "float32", "amp-fp16": "float32", "pure-bf16-bf16states": "bfloat16",
               "mixed-bf16": "bfloat16", "mixed-fp16": "float16"}
"""The dtype the training script loads the model in (``--torch_dtype``)."""


def written_recipe(recipe: str) -> str:
    """``recipe`` if some engine's files run it (writers), else one line saying which do."""
    from .recipes import get_recipe

    get_recipe(recipe)
    accepted = sorted(set(DEEPSPEED_RECIPES) | set(ACCELERATE_REPLICATED_RECIPES) | {"mixed-bf16"})
    if recipe not in accepted:
        raise ConfigError(f"--recipe {recipe}: no engine's config runs it as trainmem models it (docs/method.md, "
                          f"\"Plans and their files\"), so plan does not offer it; accepted: {', '.join(accepted)}")
    return recipe


def mixed_precision(recipe: str) -> str:
    """accelerate's and DeepSpeed's name for the recipe's compute dtype: bf16, fp16, or no."""
    from .recipes import get_recipe

    return {"bf16": "bf16", "fp16": "fp16"}.get(get_recipe(recipe).compute, "no")


def megatron_deepspeed(layout: Layout) -> bool:
    """Tensor and pipeline parallelism with ZeRO: Megatron-DeepSpeed's pretrain_gpt.py with a DeepSpeed JSON."""
    return layout.zero is not None and layout.tp * layout.pp > 1


def writers(layout: Layout) -> tuple[str, ...]:
    """The engines whose files run ``layout`` as trainmem models it (module docstring), preferred first:
    "megatron-deepspeed", "deepspeed", "accelerate", "torchtitan"; () where none does."""
    split = layout.tp * layout.pp * layout.cp * layout.ep
    if layout.zero is not None:
        if layout.recipe not in DEEPSPEED_RECIPES or layout.checkpointing == "selective" or \
                layout.cp * layout.ep > 1:
            return ()
        if megatron_deepspeed(layout):
            return ("megatron-deepspeed",) if layout.offload == "none" else ()
        return ("deepspeed",)
    if layout.checkpointing == "selective":
        return ()
    out = []
    if split == 1:
        recipes = ACCELERATE_FSDP_RECIPES if layout.fsdp else ACCELERATE_REPLICATED_RECIPES
        if layout.recipe in recipes and (layout.offload == "none" or layout.fsdp):
            out.append("accelerate")
    # torchtitan 0.3.0 applies fully_shard to every model, a shard degree of 1 included ("Always run
    # apply_fsdp_to_decoder", torchtitan/models/llama3/parallelize.py): it runs FSDP2 layouts only, and reduces in
    # float32 (mixed_precision_reduce takes nothing else), which is trainmem's FSDP2 for mixed-bf16 and fp32
    if layout.fsdp is not None and layout.recipe in TORCHTITAN_RECIPES and layout.offload in ("none",
                                                                                               "optimizer+params"):
        out.append("torchtitan")
    return tuple(out)


# ---------------------------------------------------------------------------------------------------- DeepSpeed


def deepspeed_config(layout: Layout) -> dict[str, Any]:
    """DeepSpeed's JSON for a ZeRO layout, or Megatron-DeepSpeed's with tensor and pipeline parallelism (the batch is
    counted over the data-parallel ranks, as DeepSpeed does with Megatron's mpu). The recipe's dtypes are DeepSpeed's
    bf16 (or fp16) mode: half parameters, fp32 master partition and states (DEEPSPEED_RECIPES)."""
    if layout.zero is None or layout.recipe not in DEEPSPEED_RECIPES:
        raise ConfigError(f"{layout.engine} {layout.recipe}: DeepSpeed's config runs ZeRO with "
                          f"{' or '.join(DEEPSPEED_RECIPES)} only")
    # (overlap_comm and the buckets left at DeepSpeed's defaults, which the plan's estimate assumes: overlap_comm,
    # on by default in stage 3 only, doubles the gradient bucket; sharding.DeepSpeedConfig)
    zero: dict[str, Any] = {"stage": layout.zero, "contiguous_gradients": True}
    if layout.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if layout.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    half = DEEPSPEED_RECIPES[layout.recipe]
    bf16 = {"enabled": half == "bf16"}
    if half == "bf16":  # (DeepSpeed's defaults, written out: fp32 master weights and optimizer states)
        bf16 |= {"bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
    return {
        "train_batch_size": layout.micro_batch * layout.grad_accum * layout.data_parallel,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        "bf16": bf16,
        "fp16": {"enabled": half == "fp16"},
        "zero_optimization": zero,
        "gradient_clipping": 1.0,
        "wall_clock_breakdown": False,
    }


# ---------------------------------------------------------------------------------------------------- accelerate


def accelerate_config(layout: Layout) -> dict[str, Any]:
    """accelerate's ClusterConfig for a DeepSpeed, FSDP2, DDP or one-GPU layout (module docstring)."""
    nodes = -(-layout.gpus // layout.gpus_per_node)
    deepspeed = layout.zero is not None
    precision = mixed_precision(layout.recipe) if deepspeed or not layout.fsdp else "no"
    if not deepspeed:
        table = ACCELERATE_FSDP_RECIPES if layout.fsdp else ACCELERATE_REPLICATED_RECIPES
        if layout.recipe not in table:
            raise ConfigError(f"{layout.engine} {layout.recipe}: accelerate's config does not run this recipe")
        precision = table[layout.recipe]
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0, "main_training_function": "main",
        "mixed_precision": precision, "num_machines": nodes, "num_processes": layout.gpus, "rdzv_backend": "static",
        "same_network": True, "use_cpu": False, "downcast_bf16": "no", "tpu_env": [], "tpu_use_cluster": False,
        "tpu_use_sudo": False}
    if deepspeed:
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {"deepspeed_config_file": "ds_config.json", "zero3_init_flag": layout.zero == 3}
    elif layout.fsdp:
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
        if layout.fsdp == "hybrid":
            config["parallelism_config"] = {"parallelism_config_dp_replicate_size": nodes,
                                            "parallelism_config_dp_shard_size": layout.gpus_per_node,
                                            "parallelism_config_tp_size": 1, "parallelism_config_cp_size": 1}
    elif layout.gpus > 1:
        config["distributed_type"] = "MULTI_GPU"
    else:
        config["distributed_type"] = "NO"
    return config


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"cannot write the non-finite number {value!r} into a YAML file")
        return repr(value)
    if isinstance(value, str):
        return _yaml_string(value)
    raise TypeError(f"no YAML scalar for {type(value).__name__}")


_YAML_PRINTABLE = re.compile("[\t\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufeff\uff00-\ufffd"
                             "\U00010000-\U0010ffff]")
"""The characters a YAML stream may hold as they are (YAML 1.1 c-printable, PyYAML's reader), less the line breaks
(NEL, LS, PS) that a double-quoted scalar would fold."""


def _yaml_string(text: str) -> str:
    """A double-quoted YAML scalar that reads back as ``text`` exactly: JSON's escapes (a JSON string is a YAML
    double-quoted scalar), every other character outside the printable set as \\uXXXX (so no surrogate pairs)."""
    body = json.dumps(text, ensure_ascii=False)[1:-1]
    return '"' + "".join(c if c == "\\" or _YAML_PRINTABLE.fullmatch(c) else f"\\u{ord(c):04x}" for c in body) + '"'


def to_yaml(config: dict[str, Any], indent: int = 0) -> str:
    """A mapping of scalars, nested mappings and lists of scalars as block YAML that yaml.safe_load reads back
    identically (tests/test_engine_configs.py checks it over arbitrary strings); keys and strings are quoted."""
    lines = []
    pad = " " * indent
    for key, value in config.items():
        name = _yaml_string(str(key))
        if isinstance(value, dict):
            if value:
                lines.append(f"{pad}{name}:")
                lines.append(to_yaml(value, indent + 2).rstrip("\n"))
            else:
                lines.append(f"{pad}{name}: {{}}")
        elif isinstance(value, (list, tuple)):
            lines.append(f"{pad}{name}: [{', '.join(_yaml_scalar(v) for v in value)}]")
        else:
            lines.append(f"{pad}{name}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- torchtitan


def torchtitan_config(layout: Layout, seq: int, model_name: str) -> dict[str, Any] | None:
    """The torchtitan 0.3.0 settings of the layout, by section and field (torchtitan/config/configs.py
    ``TrainingConfig`` and ``ParallelismConfig``; ``activation_checkpoint``: "full" (FullAC) or "none"), which
    torchtitan_plan.py applies to the base config; None where torchtitan does not run the layout (writers)."""
    if "torchtitan" not in writers(layout):
        return None
    dp = layout.data_parallel
    if layout.fsdp:
        shard = layout.gpus_per_node if layout.fsdp == "hybrid" else dp
    else:
        shard = 1
    pipelined = layout.pp > 1
    local = layout.micro_batch * layout.grad_accum if pipelined else layout.micro_batch
    training = {
        "local_batch_size": local,
        "global_batch_size": layout.micro_batch * layout.grad_accum * dp,
        "seq_len": seq,
        "dtype": "float32",
        "mixed_precision_param": TORCHTITAN_RECIPES[layout.recipe],
        "mixed_precision_reduce": "float32",
        "enable_cpu_offload": layout.offload == "optimizer+params",
    }
    parallelism: dict[str, Any] = {"data_parallel_shard_degree": shard, "data_parallel_replicate_degree": dp // shard}
    if layout.fsdp:
        # ("always" also with PP, where torchtitan's default keeps the parameters gathered: the estimate is of
        # full sharding)
        parallelism["fsdp_reshard_after_forward"] = "always" if layout.fsdp in ("full", "hybrid") else "never"
    parallelism |= {"tensor_parallel_degree": layout.tp, "enable_sequence_parallel": layout.tp > 1,
                    "pipeline_parallel_degree": layout.pp}
    if pipelined:
        parallelism |= {"pipeline_parallel_schedule": "1F1B", "pipeline_parallel_microbatch_size": layout.micro_batch}
    parallelism |= {"context_parallel_degree": layout.cp, "expert_parallel_degree": layout.ep}
    return {"trainmem": {"model": model_name, "recipe": layout.recipe, "engine": layout.engine,
                         "gpus": layout.gpus, "gpus_per_node": layout.gpus_per_node},
            "base_config": TORCHTITAN_BASES.get(model_name),
            "training": training, "parallelism": parallelism,
            "activation_checkpoint": "full" if layout.checkpointing == "full" else "none"}


TORCHTITAN_MODULE = '''"""torchtitan 0.3.0 config_registry written by `trainmem plan`: the planned layout,
read from torchtitan.json beside this file, applied to a torchtitan base config (torchtitan.json's base_config, or
TORCHTITAN_BASE=module:function, e.g. llama3:llama3_70b). Run: PYTHONPATH=<this folder> torchrun ...
-m torchtitan.train --module torchtitan_plan --config trainmem_plan"""

import importlib
import json
import os
from pathlib import Path

PLAN = json.loads((Path(__file__).resolve().parent / "torchtitan.json").read_text(encoding="utf-8"))


def trainmem_plan():
    from torchtitan.distributed.activation_checkpoint import FullAC

    base = os.environ.get("TORCHTITAN_BASE") or PLAN["base_config"]
    if not base or ":" not in base:
        raise ValueError("set TORCHTITAN_BASE=module:function, the torchtitan config of this model (e.g. "
                         "llama3:llama3_70b)")
    module, function = base.split(":", 1)
    if "." not in module:
        module = f"torchtitan.models.{module}.config_registry"
    config = getattr(importlib.import_module(module), function)()
    for section in ("training", "parallelism"):
        target = getattr(config, section)
        for key, value in PLAN[section].items():
            if not hasattr(target, key):
                raise ValueError(f"{section}.{key}: not a field of this torchtitan's config")
            setattr(target, key, value)
    config.activation_checkpoint = FullAC.Config() if PLAN["activation_checkpoint"] == "full" else None
    return config
'''


# ---------------------------------------------------------------------------------------------------- launch


def _script_args(layout: Layout, engine: str) -> list[str]:
    """transformers TrainingArguments (and run_clm.py's --torch_dtype) for TRAIN_SCRIPT: what the configs leave to
    the script (the micro-batch, accumulation, the model's dtype, autocast, checkpointing outside FSDP2)."""
    args = [f"--per_device_train_batch_size {layout.micro_batch}",
            f"--gradient_accumulation_steps {layout.grad_accum}", f"--torch_dtype {MODEL_DTYPE[layout.recipe]}"]
    half = mixed_precision(layout.recipe)
    if engine == "deepspeed":
        args.append(f"--{half}")
        args.append('--deepspeed "$HERE/ds_config.json"')
    elif half != "no" and not layout.fsdp and layout.recipe.startswith("amp-"):
        args.append(f"--{half}")  # (HF Trainer: torch.autocast over the fp32 model)
    if layout.checkpointing == "full" and not layout.fsdp:
        args.append("--gradient_checkpointing")
    return args


def _header(layout: Layout, what: str) -> list[str]:
    nodes = -(-layout.gpus // layout.gpus_per_node)
    return ["#!/usr/bin/env bash",
            f"# trainmem plan: {layout.gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} of {layout.gpus_per_node}), "
            f"TP {layout.tp} x PP {layout.pp} x CP {layout.cp} x DP {layout.data_parallel} (EP {layout.ep}), "
            f"{layout.engine}, {layout.recipe}, checkpointing {layout.checkpointing}, offload {layout.offload}, "
            f"micro-batch {layout.micro_batch} x {layout.grad_accum} accumulation steps: {what}.",
            "set -euo pipefail",
            'HERE="$(cd "$(dirname "$0")" && pwd)"']


def _torchrun(layout: Layout) -> str:
    nodes = -(-layout.gpus // layout.gpus_per_node)
    return (f"torchrun --nnodes {nodes} --nproc-per-node {layout.gpus_per_node} --node-rank \"${{NODE_RANK:-0}}\" "
            '--rdzv-endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}" \\')


def launch_script(layout: Layout, seq: int = 0, engine: str | None = None) -> str:
    """The launch line of ``engine`` (default: the layout's first writer)."""
    engine = engine or (writers(layout) or ("accelerate",))[0]
    nodes = -(-layout.gpus // layout.gpus_per_node)
    if engine == "megatron-deepspeed":
        # Megatron-DeepSpeed's arguments (megatron/arguments.py): its recompute flags, ZeRO stage and DeepSpeed JSON
        precision = {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(mixed_precision(layout.recipe), [])
        recompute = ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"] \
            if layout.checkpointing == "full" else []
        flags = [f"--tensor-model-parallel-size {layout.tp}", f"--pipeline-model-parallel-size {layout.pp}",
                 *(["--sequence-parallel"] if layout.tp > 1 else []), f"--micro-batch-size {layout.micro_batch}",
                 f"--global-batch-size {layout.micro_batch * layout.grad_accum * layout.data_parallel}",
                 f"--seq-length {seq}", *precision, *recompute, f"--zero-stage {layout.zero}", "--deepspeed",
                 '--deepspeed_config "$HERE/ds_config.json"']
        return "\n".join([
            *_header(layout, "Megatron-DeepSpeed with ds_config.json"),
            "# Run from Megatron-DeepSpeed's checkout on every node, with NODE_RANK and MASTER_ADDR set; give the "
            "model's",
            "# architecture (--num-layers, --hidden-size, ...) and data (--data-path, --tokenizer-type, ...) as "
            "arguments.",
            _torchrun(layout),
            "    pretrain_gpt.py " + " \\\n    ".join(flags) + ' \\\n    "$@"',
            "",
        ])
    if engine == "torchtitan":
        return "\n".join([
            *_header(layout, "torchtitan 0.3.0 with torchtitan.json (torchtitan_plan.py)"),
            "# Run on every node with NODE_RANK and MASTER_ADDR set, torchtitan 0.3.0 installed; TORCHTITAN_BASE "
            "(module:function)",
            "# names the base config when torchtitan.json's base_config is null.",
            'export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"',
            _torchrun(layout),
            '    -m torchtitan.train --module torchtitan_plan --config trainmem_plan "$@"',
            "",
        ])
    flags = _script_args(layout, engine)
    return "\n".join([
        *_header(layout, "accelerate with accelerate.yaml" + (" and ds_config.json" if engine == "deepspeed"
                                                                 else "")),
        "# Run on every node with NODE_RANK and MASTER_ADDR set; TRAIN_SCRIPT is your training script, taking",
        "# transformers' TrainingArguments (and run_clm.py's --torch_dtype) as below.",
        'TRAIN_SCRIPT="${TRAIN_SCRIPT:-train.py}"',
        f'accelerate launch --config_file "$HERE/accelerate.yaml" --num_machines {nodes} '
        f"--num_processes {layout.gpus} \\",
        *(['    --deepspeed_config_file "$HERE/ds_config.json" \\'] if engine == "deepspeed" else []),
        '    --machine_rank "${NODE_RANK:-0}" --main_process_ip "${MASTER_ADDR:-127.0.0.1}" '
        '--main_process_port "${MASTER_PORT:-29500}" \\',
        '    "$TRAIN_SCRIPT" ' + " \\\n    ".join(flags) + ' \\\n    "$@"',
        "",
    ])


def plan_files(layout: Layout, seq: int, model_name: str) -> dict[str, str]:
    """The files of every engine that runs the layout (writers): name -> text."""
    engines = writers(layout)
    if not engines:
        raise ConfigError(f"{layout.engine} with {layout.recipe} and checkpointing {layout.checkpointing}: no "
                          "engine's files run this layout as planned (docs/method.md, \"Plans and their files\")")
    files: dict[str, str] = {"launch.sh": launch_script(layout, seq, engines[0])}
    if engines[0] in ("deepspeed", "megatron-deepspeed"):
        files["ds_config.json"] = json.dumps(deepspeed_config(layout), indent=2) + "\n"
    if engines[0] in ("deepspeed", "accelerate"):
        files["accelerate.yaml"] = to_yaml(accelerate_config(layout))
    if "torchtitan" in engines:
        files["torchtitan.json"] = json.dumps(torchtitan_config(layout, seq, model_name), indent=2,
                                              ensure_ascii=True) + "\n"
        files["torchtitan_plan.py"] = TORCHTITAN_MODULE
        if engines[0] != "torchtitan":
            files["launch_torchtitan.sh"] = launch_script(layout, seq, "torchtitan")
    return files


def write_configs(layout: Layout, seq: int, model_name: str, out: str | os.PathLike[str]) -> list[Path]:
    """Write the layout's files into ``out`` (created if missing); returns their paths."""
    if not str(out):
        raise ConfigError("--out is empty; give a folder")
    target = Path(out)
    try:
        if target.exists() and not target.is_dir():
            raise ConfigError(f"--out {str(out)!r} is a file; give a folder")
        if not target.parent.is_dir():
            raise ConfigError(f"--out: the folder {str(target.parent)!r} does not exist")
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r}: not a usable folder ({exc.strerror or exc})") from None
    files = plan_files(layout, seq, model_name)
    try:
        for name in files:  # (refused before anything is written: nothing half-written)
            if (target / name).is_dir() or (target / name).is_symlink():
                raise ConfigError(f"--out {str(out)!r}: {name} there is a folder or a link; give another folder")
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r}: not a usable folder ({exc.strerror or exc})") from None
    try:
        target.mkdir(exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".trainmem-plan-", dir=target))
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r}: cannot write there ({exc.strerror or exc})") from None
    try:
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        for name in files:
            if name.endswith(".sh"):
                (staging / name).chmod(0o755)
        written = []
        for name in files:
            os.replace(staging / name, target / name)
            written.append(target / name)
        return written
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r}: cannot write there ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- reading back


def _strict_json(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """A JSON object from ``path``, refusing duplicate keys (as DeepSpeed does: runtime/config.py loads with
    config_utils.dict_raise_error_on_duplicate_keys) and NaN/Infinity literals, in one line."""
    from .models import CONFIG_SIZE_LIMIT

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {path}: no such file (or not a regular file); give a JSON file")
    try:
        data = p.read_bytes()[:CONFIG_SIZE_LIMIT + 1]
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > CONFIG_SIZE_LIMIT:
        raise ConfigError(f"{what} {path}: more than {CONFIG_SIZE_LIMIT:,} bytes")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = {}
        for key, value in items:
            if key in out:
                raise ConfigError(f"{what} {path}: the key {key!r} appears twice (DeepSpeed refuses duplicate keys)")
            out[key] = value
        return out

    def constant(name: str) -> NoReturn:
        raise ConfigError(f"{what} {path}: {name} is not a number JSON allows")

    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path}: not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") \
            from None
    except RecursionError:
        raise ConfigError(f"{what} {path}: nested too deeply") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{what} {path}: not a JSON object")
    return doc


def _whole(value: object, where: str, least: int = 1, most: int = 1 << 30) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ConfigError(f"{where} must be a whole number from {least} to {most:,}, got {value!r}")
    return value


def _flag(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    return value


def deepspeed_file_settings(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a DeepSpeed JSON sets beyond zero_optimization's memory knobs (sharding.read_deepspeed_config): the
    recipe (bf16 / fp16 mode), micro-batch, accumulation and the global batch, as make_request's keywords. Keys that
    are absent or "auto" (filled by the Hugging Face Trainer) set nothing."""
    doc = _strict_json(path, "--ds-config")
    out: dict[str, Any] = {}
    for key, name in (("train_micro_batch_size_per_gpu", "batch"), ("gradient_accumulation_steps", "grad_accum"),
                      ("train_batch_size", "train_batch_size")):
        if key in doc and doc[key] != "auto":
            out[name] = _whole(doc[key], f"{path}: {key}")
    enabled = {}
    for half in ("bf16", "fp16"):
        section = doc.get(half, doc.get("bfloat16") if half == "bf16" else None)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: {half} must be an object such as {{\"enabled\": true}}, got {section!r}")
        if section.get("enabled", False) == "auto":
            continue
        enabled[half] = _flag(section.get("enabled", False), f"{path}: {half}.enabled")
        if half == "bf16":
            for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
                if _flag(section.get(key, False), f"{path}: bf16.{key}"):
                    raise ConfigError(f"{path}: bf16.{key} keeps a bf16 master partition (DeepSpeed's "
                                      "_configure_master_weights), which no trainmem recipe models; remove it for "
                                      "mixed-bf16 (fp32 master weights and states)")
    if enabled.get("bf16") and enabled.get("fp16"):
        raise ConfigError(f"{path}: bf16 and fp16 are both enabled; DeepSpeed takes one")
    if enabled.get("bf16"):
        out["recipe"] = "mixed-bf16"
    elif enabled.get("fp16"):
        out["recipe"] = "mixed-fp16"
    elif enabled:  # said, and off: DeepSpeed trains in fp32
        out["recipe"] = "fp32"
    return out


def _load_yaml_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        import yaml
    except ModuleNotFoundError:
        raise ConfigError("--accelerate-config needs PyYAML to read YAML; pip install pyyaml (or trainmem[trainer])") \
            from None
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--accelerate-config {path}: no such file (or not a regular file); give accelerate's "
                          "config YAML")
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"--accelerate-config {path}: not readable YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--accelerate-config {path}: not a YAML mapping")
    return doc


def accelerate_file_settings(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str | None]:
    """make_request's keywords from accelerate's config YAML (ClusterConfig's keys), and the DeepSpeed JSON it
    names (deepspeed_config.deepspeed_config_file, relative to the YAML's folder)."""
    doc = _load_yaml_mapping(path)
    out: dict[str, Any] = {}
    processes = _whole(doc.get("num_processes", 1), f"{path}: num_processes")
    machines = _whole(doc.get("num_machines", 1), f"{path}: num_machines")
    if processes % machines:
        raise ConfigError(f"{path}: num_processes {processes} does not split over num_machines {machines}")
    out["gpus"] = processes
    if processes > 1:
        out["gpus_per_node"] = processes // machines
    kind = doc.get("distributed_type", "NO")
    precision = doc.get("mixed_precision", "no")
    if precision not in ("no", "bf16", "fp16"):
        raise ConfigError(f"{path}: mixed_precision must be no, bf16 or fp16, got {precision!r}")
    ds_file = None
    if kind == "DEEPSPEED":
        section = doc.get("deepspeed_config") or {}
        if not isinstance(section, dict) or not isinstance(section.get("deepspeed_config_file"), str):
            raise ConfigError(f"{path}: deepspeed_config.deepspeed_config_file must name the DeepSpeed JSON")
        ds_file = str(Path(path).parent / section["deepspeed_config_file"])
    elif kind == "FSDP":
        fsdp = doc.get("fsdp_config")
        if not isinstance(fsdp, dict):
            raise ConfigError(f"{path}: fsdp_config must be a mapping")
        if fsdp.get("fsdp_version", 1) != 2:
            raise ConfigError(f"{path}: fsdp_config.fsdp_version must be 2 (FSDP2); an FSDP1 layout is not read "
                              "from accelerate's config: estimate it with --fsdp full --fsdp-version 1")
        if precision != "no":
            raise ConfigError(f"{path}: FSDP2 with mixed_precision {precision} upcasts to fp32 and reduces in "
                              f"{precision} (accelerate's fsdp2_prepare_model), which trainmem does not model; "
                              "estimate it with --fsdp and --recipe")
        reshard = _flag(fsdp.get("fsdp_reshard_after_forward", True), f"{path}: fsdp_config.fsdp_reshard_after_forward")
        par = doc.get("parallelism_config") or {}
        if not isinstance(par, dict):
            raise ConfigError(f"{path}: parallelism_config must be a mapping")
        replicate = _whole(par.get("parallelism_config_dp_replicate_size", 1), f"{path}: dp_replicate_size")
        for key in ("parallelism_config_tp_size", "parallelism_config_cp_size"):
            if _whole(par.get(key, 1), f"{path}: {key}") != 1:
                raise ConfigError(f"{path}: {key} above 1 is not read here; estimate it with --tp / --cp")
        if replicate > 1:
            shard = _whole(par.get("parallelism_config_dp_shard_size", processes // replicate),
                           f"{path}: dp_shard_size")
            if replicate * shard != processes or shard != processes // machines or not reshard:
                raise ConfigError(f"{path}: dp_replicate_size x dp_shard_size must be num_processes, sharded over "
                                  "one node's GPUs with resharding (FSDP2 hybrid)")
            out["fsdp"] = "hybrid"
        else:
            out["fsdp"] = "full" if reshard else "grad-op"
        if _flag(fsdp.get("fsdp_offload_params", False), f"{path}: fsdp_config.fsdp_offload_params"):
            out["offload"] = "optimizer+params"
        if _flag(fsdp.get("fsdp_activation_checkpointing", False),
                 f"{path}: fsdp_config.fsdp_activation_checkpointing"):
            out["checkpointing"] = "full"
    elif kind not in ("MULTI_GPU", "NO"):
        raise ConfigError(f"{path}: distributed_type {kind!r} is not read here; accepted: NO, MULTI_GPU, FSDP, "
                          "DEEPSPEED")
    if kind != "DEEPSPEED" and precision != "no":
        out["recipe"] = f"amp-{precision}"  # accelerate's native AMP: torch.autocast over the fp32 model
    elif kind != "DEEPSPEED":
        out["recipe_of_the_model"] = ("fp32", "pure-bf16-bf16states")
    return out, ds_file


def torchtitan_file_settings(path: str | os.PathLike[str]) -> dict[str, Any]:
    """make_request's keywords from the torchtitan.json `trainmem plan` writes (torchtitan 0.3.0's field names)."""
    doc = _strict_json(path, "--torchtitan-config")
    training, par = doc.get("training"), doc.get("parallelism")
    if not isinstance(training, dict) or not isinstance(par, dict):
        raise ConfigError(f"{path}: needs a training and a parallelism object (torchtitan's sections)")
    shard = _whole(par.get("data_parallel_shard_degree", 1), f"{path}: data_parallel_shard_degree")
    replicate = _whole(par.get("data_parallel_replicate_degree", 1), f"{path}: data_parallel_replicate_degree")
    tp = _whole(par.get("tensor_parallel_degree", 1), f"{path}: tensor_parallel_degree")
    pp = _whole(par.get("pipeline_parallel_degree", 1), f"{path}: pipeline_parallel_degree")
    cp = _whole(par.get("context_parallel_degree", 1), f"{path}: context_parallel_degree")
    ep = _whole(par.get("expert_parallel_degree", 1), f"{path}: expert_parallel_degree")
    dp = shard * replicate
    gpus_per_node = doc.get("trainmem", {}).get("gpus_per_node") if isinstance(doc.get("trainmem"), dict) else None
    out: dict[str, Any] = {"gpus": dp * tp * pp * cp, "tp": tp, "pp": pp, "cp": cp, "ep": ep,
                           "sp": tp > 1 and _flag(par.get("enable_sequence_parallel", True),
                                                  f"{path}: enable_sequence_parallel")}
    if gpus_per_node is not None:
        out["gpus_per_node"] = _whole(gpus_per_node, f"{path}: trainmem.gpus_per_node")
    reshard = par.get("fsdp_reshard_after_forward", "default")
    if reshard not in ("default", "always", "never"):
        raise ConfigError(f"{path}: fsdp_reshard_after_forward must be default, always or never, got {reshard!r}")
    out["fsdp"] = "hybrid" if replicate > 1 and shard > 1 else ("grad-op" if reshard == "never" else "full")
    local = _whole(training.get("local_batch_size", 8), f"{path}: local_batch_size")
    global_batch = training.get("global_batch_size", -1)
    global_batch = local * dp if global_batch == -1 else _whole(global_batch, f"{path}: global_batch_size")
    if global_batch % (local * dp):
        raise ConfigError(f"{path}: global_batch_size {global_batch} is not a multiple of local_batch_size x the "
                          f"data-parallel degree ({local * dp})")
    accum = global_batch // (local * dp)
    if pp > 1:
        micro = _whole(par.get("pipeline_parallel_microbatch_size", 1), f"{path}: pipeline_parallel_microbatch_size")
        if local % micro:
            raise ConfigError(f"{path}: local_batch_size is not a multiple of pipeline_parallel_microbatch_size")
        if accum != 1:
            raise ConfigError(f"{path}: gradient accumulation with pipeline parallelism is not read here")
        out |= {"batch": micro, "micro_batches": local // micro, "grad_accum": local // micro}
    else:
        out |= {"batch": local, "grad_accum": accum}
    out["seq"] = _whole(training.get("seq_len", 2048), f"{path}: seq_len")
    dtype = training.get("dtype", "float32")
    param = training.get("mixed_precision_param", "bfloat16")
    if dtype not in ("float32", "bfloat16") or param not in ("float32", "bfloat16"):
        raise ConfigError(f"{path}: training.dtype and mixed_precision_param must be float32 or bfloat16")
    if dtype == "bfloat16":
        raise ConfigError(f"{path}: training.dtype bfloat16 reduces the bf16 gradients in float32 "
                          "(mixed_precision_reduce), which no trainmem recipe models; estimate it with --fsdp and "
                          "--recipe pure-bf16-bf16states for the states alone")
    if shard == 1 and cp == 1:
        raise ConfigError(f"{path}: a data-parallel shard degree of 1 (torchtitan 0.3.0 applies fully_shard anyway, "
                          "over the replicas) is not modelled; estimate it with --gpus and --fsdp")
    out["recipe"] = "fp32" if param == "float32" else "mixed-bf16"  # fully_shard's MixedPrecisionPolicy
    if _flag(training.get("enable_cpu_offload", False), f"{path}: enable_cpu_offload"):
        out["offload"] = "optimizer+params"
    ac = doc.get("activation_checkpoint", "none")
    if ac not in ("none", "full"):
        raise ConfigError(f"{path}: activation_checkpoint must be none or full, got {ac!r}")
    out["checkpointing"] = ac
    return out


REQUEST_DEFAULTS = {"gpus": 1, "gpus_per_node": 0, "zero": None, "fsdp": None, "offload": "none", "tp": 1, "sp": False,
                    "pp": 1, "micro_batches": 0, "cp": 1, "ep": 1, "batch": 1, "grad_accum": 1,
                    "recipe": "mixed-bf16", "checkpointing": "none", "seq": 2048}
"""make_request's (and the CLI's) defaults: a file's value applies where the keyword is at its default."""
FLAG_NAMES = {"gpus_per_node": "--gpus-per-node", "micro_batches": "--micro-batches", "grad_accum": "--grad-accum"}


def merge_engine_files(given: dict[str, Any], ds_config: str | os.PathLike[str] | None = None,
                       accelerate_config: str | os.PathLike[str] | None = None,
                       torchtitan_config: str | os.PathLike[str] | None = None) -> tuple[dict[str, Any], Any]:
    """``given`` (make_request's layout keywords and settings) with what the engine files set: a file's value
    applies where the keyword is at its default (REQUEST_DEFAULTS), and one that differs from a given value is
    refused in one line. Returns (the merged keywords, the DeepSpeed JSON to read the ZeRO knobs from)."""
    found: list[tuple[str, dict[str, Any]]] = []
    train_batch = None
    if accelerate_config is not None:
        values, named = accelerate_file_settings(accelerate_config)
        found.append((str(accelerate_config), values))
        if named is not None:
            if ds_config is not None and Path(ds_config).resolve() != Path(named).resolve():
                raise ConfigError(f"--ds-config {ds_config} and {accelerate_config}'s deepspeed_config_file {named} "
                                  "disagree; give one")
            ds_config = named
    if torchtitan_config is not None:
        found.append((str(torchtitan_config), torchtitan_file_settings(torchtitan_config)))
    if ds_config is not None:
        values = deepspeed_file_settings(ds_config)
        train_batch = values.pop("train_batch_size", None)
        found.append((str(ds_config), values))
    merged = dict(given)
    for source, values in found:
        choices = values.pop("recipe_of_the_model", None)
        if choices is not None and merged.get("recipe", REQUEST_DEFAULTS["recipe"]) not in choices:
            raise ConfigError(f"{source}: mixed_precision no keeps the model's own dtype, which the file does not "
                              f"say: give --recipe {' or '.join(choices)} (launch.sh's --torch_dtype)")
        for key, value in values.items():
            default = REQUEST_DEFAULTS.get(key)
            if merged.get(key, default) in (default, value):
                merged[key] = value
            else:
                flag = FLAG_NAMES.get(key, f"--{key.replace('_', '-')}")
                raise ConfigError(f"{flag} {merged[key]} and {source}'s {key} {value} disagree; give one")
    if train_batch is not None:
        dp = merged.get("gpus", 1) // max(1, merged.get("tp", 1) * merged.get("pp", 1) * merged.get("cp", 1))
        per_step = merged.get("batch", 1) * merged.get("grad_accum", 1) * dp
        if per_step != train_batch:
            raise ConfigError(f"{ds_config}: train_batch_size {train_batch} is not train_micro_batch_size_per_gpu x "
                              f"gradient_accumulation_steps x the data-parallel GPUs ({per_step}; DeepSpeed asserts "
                              "it): give --gpus")
    return merged, ds_config
