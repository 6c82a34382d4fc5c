"""One request, validated once in the library: the model, the training settings, the device allowances and the GPU.

The CLI's flags, the Python API's keywords (``trainmem.estimate(...)``, ``max_batch``, ``sweep``) and the web page
to come all build a :class:`Request` with :func:`make_request`, so each refuses the same input with the same
one-line :class:`~trainmem.errors.ConfigError` or :class:`~trainmem.errors.ModelError`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .estimate import DEFAULT_HEADROOM, MAX_CUDA_OVERHEAD_BYTES, DeviceOptions, Estimate
from .hardware import DEFAULT_CUDA_OVERHEAD_MIB, DEFAULT_FRAGMENTATION, GPU, MIB, custom_gpu, get_gpu
from .models import ModelSpec, nominal_spec
from .optimizers import get_optimizer
from .settings import TrainingSettings, make_settings
from .stepmodel import estimate_model
from .sharding import Parallel, read_deepspeed_config
from .units import parse_sized

if TYPE_CHECKING:
    from .allocator import AllocatorConfig
    from .lora import FineTune  # (imported by _finetune, for --lora only)

MAX_PARAMS = 1e16


@dataclass(frozen=True)
class Request:
    """What is asked, validated: every field is in range and consistent with the others."""

    model: ModelSpec
    config: dict[str, Any] | None
    """The model's config.json (None for a nominal ``params`` count or a ModelSpec given directly)."""
    settings: TrainingSettings
    device: DeviceOptions
    gpu: GPU | None = None
    parallel: Parallel = field(default_factory=Parallel)
    """How many GPUs and which engine: every figure is then per GPU."""
    finetune: FineTune | None = None
    """LoRA adapters on a frozen, possibly quantized, base."""


def parse_params(value: Any) -> int:
    """A nominal parameter count: a number, or text such as '7e9', '7B', '6738415616', '13b'."""
    if isinstance(value, bool):
        raise ConfigError(f"params must be a number such as 7e9 or '7B', got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        t = value.strip().replace(",", "").replace("_", "")
        scale = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}.get(t[-1:].lower(), 1)
        try:
            number = float(t[:-1] if scale != 1 else t) * scale
        except ValueError:
            raise ConfigError(f"params: {value!r} is not a number; give e.g. 7e9, 7B or 6738415616") from None
    else:
        raise ConfigError(f"params must be a number such as 7e9 or '7B', got {type(value).__name__}")
    if not 0 < number < MAX_PARAMS:  # (NaN and infinity fail too)
        raise ConfigError(f"params must be a positive number below {MAX_PARAMS:.0e}, got {value!r}")
    return int(number)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return value


def _alloc_config(alloc_conf: str | None) -> AllocatorConfig:
    """The allocator settings the replay assumes: ``alloc_conf`` (--alloc-conf), else PYTORCH_CUDA_ALLOC_CONF (or
    torch's other names for it) from the environment, as torch reads them."""
    from .allocator import config_from_environment, parse_alloc_conf

    return parse_alloc_conf(alloc_conf) if alloc_conf is not None else config_from_environment()


def make_request(model: str | os.PathLike[str] | ModelSpec | None = None, *, params: Any = None,
                 gpu: str | GPU | None = None, gpu_memory: str | int | None = None,
                 headroom: float = DEFAULT_HEADROOM, fragmentation: float | None = None, alloc_conf: str | None = None,
                 cuda_overhead: float = DEFAULT_CUDA_OVERHEAD_MIB, hub: bool = False, need_config: str = "",
                 gpus: int = 1, gpus_per_node: int = 0, zero: int | None = None, fsdp: str | None = None,
                 offload: str = "none", ddp_bucket_view: bool = False, fsdp_embedding_groups: bool = False,
                 fsdp_version: int = 2, fsdp_use_orig_params: bool = False, fsdp_no_sync: bool = False,
                 ds_config: str | os.PathLike[str] | None = None,
                 lora: int | None = None, lora_alpha: float | None = None, lora_targets: Any = ("q", "v"),
                 lora_dropout: float = 0.0, dora: bool = False, train_modules: Any = (),
                 adapter_dtype: str = "auto", base_quant: str | None = None, double_quant: bool = False,
                 qlora: bool = False, bnb_version: str | None = None, tp: int = 1, sp: bool = False, pp: int = 1,
                 pp_schedule: str = "1f1b",
                 virtual_stages: int = 1, micro_batches: int = 0, cp: int = 1, ep: int = 1, pp_layers: Any = None,
                 accelerate_config: str | os.PathLike[str] | None = None,
                 torchtitan_config: str | os.PathLike[str] | None = None, **settings: Any) -> Request:
    """Validate a request. ``model`` is a catalog name, a Hub repo id, a path to a config.json or its folder, or a
    ModelSpec; ``params`` a nominal size instead (``7e9``, ``"7B"``). ``cuda_overhead`` is in MiB. ``hub`` allows
    fetching a config from the Hugging Face Hub (never otherwise: a Hub id must be in the local cache).
    ``need_config`` names a command that cannot run on ``params`` alone. ``gpus``, ``gpus_per_node``, ``zero``,
    ``fsdp``, ``offload``, ``ddp_bucket_view``, ``fsdp_embedding_groups`` lay the run out on several GPUs (sharding.Parallel); ``fsdp_version`` (1:
    FullyShardedDataParallel), ``fsdp_use_orig_params`` and ``fsdp_no_sync`` describe an FSDP1 run (fsdp1.py); ``ds_config`` is a
    DeepSpeed config whose zero_optimization keys (stage, buckets, offload) apply where the keywords say nothing.
    ``lora`` (the rank), ``lora_alpha``, ``lora_targets`` (a list or "q,v"), ``dora``, ``train_modules`` (peft's
    modules_to_save: lm_head, embed_tokens), ``adapter_dtype``, ``base_quant``, ``double_quant`` and ``qlora`` (nf4
    with double quantization) train adapters on a frozen base (lora.py); ``bnb_version`` ("0.42.0") is the
    bitsandbytes release of a 4-bit base (before 0.43.2 its Linears keep their inputs). ``tp``, ``sp``, ``pp``, ``pp_schedule``,
    ``virtual_stages``, ``micro_batches``, ``cp`` and ``ep`` split the model across the GPUs (modelparallel.py);
    ``pp_layers`` ("15,16,...", a list, or "torchtitan") splits the layers unevenly over the stages.
    ``gpu_memory`` (``"48GiB"``, ``"80GB"``, ``"49140MiB"`` or an int of bytes) is the GPU's memory: ``gpu``'s card
    with that memory, or without ``gpu`` a custom card ("custom 48 GiB").
    ``settings`` are TrainingSettings fields. ``ds_config``, ``accelerate_config`` and ``torchtitan_config`` (the
    files `trainmem plan --out` writes, or yours) set the recipe, batch, accumulation, checkpointing, offload and
    degrees they hold where the keywords are at their defaults (engine_configs.merge_engine_files). Checks that cost
    nothing come before the model is read."""
    if need_config and params is not None:
        raise ConfigError(f"{need_config} needs a model config, not --params")
    if model is None and params is None:
        raise ConfigError("give a model (catalog name, Hub id or config path) or --params")
    if model is not None and params is not None:
        raise ConfigError("give a model (catalog name, Hub id or config path) or --params, not both")
    if ds_config is not None or accelerate_config is not None or torchtitan_config is not None:
        from .engine_configs import merge_engine_files

        layout = dict(gpus=gpus, gpus_per_node=gpus_per_node, zero=zero, fsdp=fsdp, offload=offload, tp=tp, sp=sp,
                      pp=pp, micro_batches=micro_batches, cp=cp, ep=ep)
        merged, ds_config = merge_engine_files({**layout, **settings}, ds_config, accelerate_config, torchtitan_config)
        gpus, gpus_per_node, zero, fsdp, offload, tp, sp, pp, micro_batches, cp, ep = (merged.pop(k) for k in layout)
        settings = merged
    training = make_settings(**settings)
    overhead = _number("cuda-overhead", cuda_overhead)
    if not 0 <= overhead <= MAX_CUDA_OVERHEAD_BYTES / MIB:
        raise ConfigError(f"cuda-overhead must be from 0 to {MAX_CUDA_OVERHEAD_BYTES // MIB:,} MiB, got {overhead:g}")
    device = DeviceOptions(headroom=_number("headroom", headroom),
                           fragmentation=None if fragmentation is None else _number("fragmentation", fragmentation),
                           cuda_overhead_bytes=int(overhead * MIB), alloc_config=_alloc_config(alloc_conf))
    if isinstance(gpu, str) and not gpu.strip():
        raise ConfigError("gpu is empty; give a GPU name (trainmem estimate --help lists them)")
    if gpu is not None and not isinstance(gpu, (str, GPU)):
        raise ConfigError(f"gpu must be a GPU name, got {type(gpu).__name__}")
    target = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if gpu_memory is not None:  # a custom card, or the named card with this memory
        nbytes, label = parse_sized(gpu_memory, "gpu-memory")
        target = custom_gpu(nbytes, target, label)
    parallel = Parallel(gpus=gpus, gpus_per_node=gpus_per_node, zero=zero, fsdp=fsdp, offload=offload,
                        ddp_bucket_view=ddp_bucket_view, fsdp_embedding_groups=fsdp_embedding_groups,
                        fsdp_version=fsdp_version, fsdp_use_orig_params=fsdp_use_orig_params, fsdp_no_sync=fsdp_no_sync,
                        tp=tp, sp=sp, pp=pp, pp_schedule=pp_schedule,
                        virtual_stages=virtual_stages, micro_batches=micro_batches, cp=cp, ep=ep)
    if parallel.pp > 1 and training.grad_accum > 1 and training.grad_accum != parallel.in_flight_micro_batches:
        raise ConfigError(f"with --pp the pipeline's --micro-batches ({parallel.in_flight_micro_batches}) are the "
                          f"gradient accumulation: --grad-accum {training.grad_accum} disagrees; give one")
    finetune = _finetune(lora, lora_alpha, lora_targets, adapter_dtype, base_quant, double_quant, qlora,
                         lora_dropout, dora, train_modules, bnb_version)
    config = None
    if training.task != "causal-lm" and (params is not None or isinstance(model, ModelSpec) or finetune):
        raise ConfigError(f"--task {training.task} is traced from the model's config with transformers' head: give a "
                          "model config (not --params or a ModelSpec), without --lora")
    if params is not None:
        spec = nominal_spec(parse_params(params))
    elif isinstance(model, ModelSpec):
        spec = model
    elif training.task != "causal-lm":
        spec, config = _task_spec(model, hub, training)
    else:
        from .catalog import resolve_model_and_config

        spec, config = resolve_model_and_config(model, hub=hub)
    if spec.is_nominal and get_optimizer(training.optimizer).needs_shapes:
        raise ConfigError(f"optimizer {training.optimizer!r} needs tensor shapes; give a model instead of --params")
    if ds_config is not None:
        parallel = _with_deepspeed_config(parallel, ds_config, spec)
    if parallel.engine != "single" and spec.is_nominal and (parallel.zero == 3 or parallel.fsdp):
        raise ConfigError("ZeRO-3 and FSDP2 shard each tensor: give a model instead of --params")
    if pp_layers is not None:
        from .modelparallel import pipeline_split

        if parallel.pp == 1 or not spec.has_architecture:
            raise ConfigError("--pp-layers splits a pipeline's layers: give --pp 2 or more and a model config")
        parallel = replace(parallel, pp_layers=pipeline_split(spec.num_layers, parallel.pp, pp_layers))
    if parallel.is_model_parallel:
        from .modelparallel import check_layout

        check_layout(spec, parallel, training.seq)
    if finetune is not None:
        if spec.is_nominal:
            raise ConfigError("LoRA needs the model's layers: give a model config, not --params")
        finetune.as_dict(spec)  # the targets are checked against the model's modules here
        if parallel.is_model_parallel:
            used = next(f"--{n}" for n in ("tp", "pp", "cp", "ep") if getattr(parallel, n) > 1)
            raise ConfigError(f"LoRA with {used} is not modelled yet: give data parallelism (--gpus N with DDP, "
                              "--zero or --fsdp)")
    return Request(spec, config, training, device, target, parallel, finetune)


def _task_spec(model: str | os.PathLike[str] | None, hub: bool, training: TrainingSettings) -> tuple[ModelSpec, dict[str, Any]]:
    """The spec of another head than a causal LM's (tasks.py): its parameters counted on the meta device, its step
    on the traced path, whether or not the model_type has a hand-written description (that describes a causal LM)."""
    from .catalog import load_config
    from .meta_count import spec_by_building

    config, name, source = load_config(model, hub)
    return spec_by_building(config, name=name, source=source, task=training.task,
                            num_labels=training.num_labels), config


def _finetune(rank: int | None, alpha: float | None, targets: Any, adapter_dtype: str, base_quant: str | None,
              double_quant: bool, qlora: bool, dropout: float = 0.0, dora: bool = False, train_modules: Any = (),
              bnb_version: str | None = None) -> FineTune | None:
    if qlora:
        if base_quant not in (None, "nf4") or double_quant is False and base_quant is not None:
            raise ConfigError("--qlora is nf4 with double quantization; give it alone or --base-quant instead")
        base_quant, double_quant = "nf4", True
    if rank is None:
        if base_quant or double_quant or adapter_dtype != "auto" or alpha is not None or dropout or dora or \
                train_modules or bnb_version is not None:
            raise ConfigError("--base-quant, --qlora, --double-quant, --bnb-version, --lora-alpha, --lora-dropout, "
                              "--dora, --train-modules and --adapter-dtype need --lora RANK")
        return None
    targets = _names(targets, "lora targets", "q,v or all-linear")
    train_modules = _names(train_modules or (), "train modules", "lm_head,embed_tokens")
    if not isinstance(dora, bool):
        raise ConfigError(f"dora must be true or false, got {dora!r}")
    from .lora import FineTune, LoraOptions

    return FineTune(LoraOptions(rank, alpha, targets, adapter_dtype, dropout, dora, train_modules), base_quant,
                    double_quant, _release(bnb_version))


def _release(text: object) -> tuple[int, ...] | None:
    """A release number ("0.42.0", "0.43") as a tuple of ints."""
    if text is None:
        return None
    parts = str(text).strip().split(".")
    if not 2 <= len(parts) <= 3 or not all(part.isdigit() for part in parts):
        raise ConfigError(f"bnb-version must be a bitsandbytes release like 0.42.0, got {text!r}")
    return tuple(int(part) for part in parts)


def _names(value: object, what: str, example: str) -> tuple[str, ...]:
    """A comma-separated string or a list of names, as a tuple."""
    if isinstance(value, str):
        return tuple(t.strip() for t in value.split(",") if t.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        return tuple(value)
    raise ConfigError(f"{what} must be names such as {example}, got {value!r}")


def _with_deepspeed_config(parallel: Parallel, path: str | os.PathLike[str], spec: ModelSpec) -> Parallel:
    if parallel.fsdp is not None:
        raise ConfigError("--ds-config is DeepSpeed's: it does not go with --fsdp")
    knobs, stage, offload = read_deepspeed_config(path, spec.hidden_size or 1, parallel.zero)
    if stage is not None and parallel.zero is not None and stage != parallel.zero:
        raise ConfigError(f"--zero {parallel.zero} and {path}'s zero_optimization.stage {stage} disagree; give one")
    if offload is not None and parallel.offload != "none" and offload != parallel.offload:
        raise ConfigError(f"--offload {parallel.offload} and {path}'s offload ({offload}) disagree; give one")
    zero = parallel.zero if parallel.zero is not None else (stage if stage is not None else 0)
    return replace(parallel, zero=zero, deepspeed=knobs,
                   offload=parallel.offload if parallel.offload != "none" else (offload or "none"))


def estimate(model: str | os.PathLike[str] | ModelSpec | None = None, device: DeviceOptions | None = None,
             **options: Any) -> Estimate:
    """Estimate the memory of training ``model`` (a catalog name, Hub id, config path or ModelSpec).

    ``options`` are the request's (request.make_request: ``params``, ``gpu``, ``headroom``, ``fragmentation``,
    ``cuda_overhead``, ``hub``) and the training settings (TrainingSettings' fields), validated as the CLI validates
    its flags. With ``gpu``, ``fits()`` answers for that GPU.

    >>> e = estimate("llama-2-7b", recipe="pure-bf16", optimizer="adamw")
    >>> e.static_bytes == 12 * e.model.num_parameters
    True
    """
    if device is not None and {"headroom", "fragmentation", "cuda_overhead"} & set(options):
        raise ConfigError("give device=DeviceOptions(...) or headroom/fragmentation/cuda_overhead, not both")
    req = make_request(model, **options)
    return replace(estimate_model(req.model, req.settings, device or req.device, req.parallel, req.finetune),
                   gpu=req.gpu)
