"""Data parallelism: what one GPU holds under DDP, DeepSpeed ZeRO 1/2/3 and PyTorch FSDP2, with CPU offload.

Every figure is per rank (the most loaded one); activations stay per micro-batch per GPU. Sources, read in the
engines' code (../shared/reference/scale.md cites the commits):
- DDP (torch/csrc/distributed/c10d/reducer.cpp, ``initialize_buckets``): the buckets are flat tensors that
  together hold every parameter's gradient (25 MiB each, 1 MiB for the first), allocated when the model is wrapped
  and kept: a second full copy of the gradients unless ``gradient_as_bucket_view=True`` makes ``param.grad`` a view
  into them. Their size caps change how many there are, not how much they hold.
- DeepSpeed ZeRO (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py, config.py): the fp32 master partition and the
  optimizer states are split across the N ranks (stage 1), then the gradients (stage 2, ``grads_in_partition``),
  then the half parameters (stage 3); each flat partition is padded to a multiple of
  ``nccl_start_alignment_factor (2) x N`` elements; ``reduce_bucket_size`` (5e8 elements) sizes the gradient
  bucket backward fills (``ipg_buffer``; two with ``overlap_comm``); at ``step()`` the gradient partition is cast
  to one fp32 flat tensor (``single_grad_partition``); ZeRO-3 gathers each module's parameters as it runs
  (prefetching ``stage3_prefetch_bucket_size`` elements ahead, at most ``stage3_max_live_parameters`` alive) and
  never partitions parameters smaller than ``stage3_param_persistence_threshold``.
- FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _fsdp_collectives.py, _fsdp_param_group.py): each
  parameter is sharded on dim 0 into ceil(dim0 / W) rows per rank (every rank allocates the padded size), in the
  dtype it had when ``fully_shard`` was called (fp32 for the mixed recipes: the shard is the master copy); the
  gradients are reduce-scattered to shards of the same size and dtype; one ``fully_shard`` group per decoder
  layer plus the root (embedding, final norm, LM head); the group being computed is all-gathered in
  ``param_dtype`` while the next one's all-gather is in flight (forward: the computed group and its flat all-gather
  buffer, whose free is deferred to the next group's wait; the forward moments the timeline models are the last
  layer's, which has no next group, and the first layer's gather beside the root's buffer; backward: one group
  prefetched), and backward reduce-scatters each group's unsharded gradients through a ``reduce_dtype`` buffer of
  which the current and the previous one are alive. With ``CPUOffloadPolicy`` (``--offload optimizer+params``) the
  sharded parameters, gradients and states are pinned host memory: ``foreach_reduce`` copies each reduced gradient
  shard to the host as its group is reduced, so the GPU keeps no finished shard (RankLayout.gradients_offloaded).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .errors import ConfigError
from .models import ModelSpec, ParamTensor
from .optimizers import Optimizer
from .recipes import Recipe

FSDP_MODES = ("full", "grad-op", "hybrid", "no-shard")
"""FSDP2 layouts: ``full`` (FULL_SHARD: ``reshard_after_forward=True``), ``grad-op`` (SHARD_GRAD_OP: parameters stay
gathered from forward to backward), ``hybrid`` (sharded within a node, replicated across nodes), ``no-shard``."""
OFFLOADS = ("none", "optimizer", "optimizer+params")
ZERO_STAGES = (0, 1, 2, 3)
MAX_GPUS = 1 << 20
ALIGNMENT = 2
"""DeepSpeed's ``nccl_start_alignment_factor``: a flat partition is padded to a multiple of 2 x world elements."""


@dataclass(frozen=True)
class DeepSpeedConfig:
    """The ``zero_optimization`` keys that change memory, with DeepSpeed's defaults (deepspeed/runtime/zero/config.py).
    Sizes are in elements."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    """Read and reported; it sizes no buffer that outlives a collective in DeepSpeed's code (scale.md section 2.4),
    so no figure depends on it."""
    overlap_comm: bool | None = None
    """None: DeepSpeed's default, True for stage 3 only (``overlap_comm_valid``)."""
    contiguous_gradients: bool = True
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000_000

    def overlap(self, stage: int) -> bool:
        return stage == 3 if self.overlap_comm is None else self.overlap_comm


_DS_INT_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_max_live_parameters",
                "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "sub_group_size")


def read_deepspeed_config(path: str | os.PathLike[str], hidden_size: int,
                          given_stage: int | None = None) -> tuple[DeepSpeedConfig, int | None, str | None]:
    """(the memory knobs, the ZeRO stage, the offload) a DeepSpeed config file sets; None where it says nothing.
    ``"auto"`` values are resolved as the Hugging Face Trainer does (transformers integrations/deepspeed.py:
    reduce_bucket_size h^2, stage3_prefetch_bucket_size 0.9 h^2, stage3_param_persistence_threshold 10 h).
    Refused as DeepSpeed refuses them (deepspeed/runtime/config.py, zero/config.py, zero/offload_config.py):
    duplicate keys, an ``offload_optimizer`` / ``offload_param`` that is not an object (or null), a device other
    than "none", "cpu" or "nvme" (OffloadDeviceEnum is case-sensitive: "CPU" fails its validation). DeepSpeed reads
    ``offload_param`` in stage 3 only (stage3.py; stages 1 and 2 never look at it), so below stage 3 it changes
    nothing here either; in stage 3 without ``offload_optimizer`` it offloads the parameters alone, which trainmem
    does not model: refused in one line. ``given_stage`` is the stage the caller gives where the file names none."""
    from .engine_configs import _strict_json

    raw = _strict_json(path, "--ds-config")
    zero = raw.get("zero_optimization", {})
    if zero is None:
        zero = {}
    if not isinstance(zero, dict):
        raise ConfigError(f"{path}: zero_optimization must be an object")
    auto = {"reduce_bucket_size": hidden_size**2, "stage3_prefetch_bucket_size": int(0.9 * hidden_size**2),
            "stage3_param_persistence_threshold": 10 * hidden_size}
    values: dict[str, Any] = {}
    for key in _DS_INT_KEYS:
        if key not in zero:
            continue
        value = zero[key]
        if value == "auto" and key in auto:
            value = auto[key]
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # DeepSpeed configs write 5e8
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10**13:
            raise ConfigError(f"{path}: zero_optimization.{key} must be a whole number of elements, got {value!r}")
        values[key] = value
    for key in ("overlap_comm", "contiguous_gradients"):
        if key in zero:
            if not isinstance(zero[key], bool):
                raise ConfigError(f"{path}: zero_optimization.{key} must be true or false, got {zero[key]!r}")
            values[key] = zero[key]
    stage = zero.get("stage")
    if stage is not None and (isinstance(stage, bool) or stage not in ZERO_STAGES):
        raise ConfigError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")

    def device(key: str) -> str:
        section = zero.get(key)
        if section is None:
            return "none"
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: zero_optimization.{key} must be an object such as {{\"device\": \"cpu\"}}, "
                              f"got {section!r}")
        name = section.get("device", "none")
        if name not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{path}: zero_optimization.{key}.device must be \"none\", \"cpu\" or \"nvme\" "
                              f"(lower case, as DeepSpeed's OffloadDeviceEnum takes it), got {name!r}")
        return str(name)

    optimizer_device, param_device = device("offload_optimizer"), device("offload_param")
    offload = None
    stage3 = (stage if stage is not None else given_stage) == 3
    if optimizer_device != "none":
        offload = "optimizer+params" if param_device != "none" and stage3 else "optimizer"
    elif param_device != "none" and stage3:
        raise ConfigError(f"{path}: offload_param without offload_optimizer (ZeRO-3 parameters in host memory, the "
                          "optimizer on the GPU) is not modelled; offload both or the optimizer alone")
    return DeepSpeedConfig(**values), stage, offload


@dataclass(frozen=True)
class Parallel:
    """How many GPUs train the model and how the engine lays its state across them."""

    gpus: int = 1
    gpus_per_node: int = 0
    """0: min(8, gpus)."""
    zero: int | None = None
    """DeepSpeed ZeRO stage."""
    fsdp: str | None = None
    """FSDP2 layout (FSDP_MODES)."""
    offload: str = "none"
    ddp_bucket_view: bool = False
    """DDP's ``gradient_as_bucket_view=True``: the gradients live in the buckets, not beside them."""
    fsdp_version: int = 2
    """2: FSDP2 (``fully_shard``); 1: FSDP1 (``FullyShardedDataParallel``, flat parameters per unit: fsdp1.py)."""
    fsdp_use_orig_params: bool = False
    """FSDP1's ``use_orig_params=True`` (fsdp1.py)."""
    fsdp_no_sync: bool = False
    """FSDP1: the accumulation micro-batches run in ``no_sync()`` (Fabric's ``no_backward_sync``), which keeps every
    unit's unsharded gradient until the synced micro-batch (fsdp1.py)."""
    fsdp_embedding_groups: bool = False
    """FSDP2: the token embedding and the LM head are ``fully_shard`` groups of their own, resharded after forward
    (torchtune's ``custom_sharded_layers: ['tok_embeddings', 'output']``), not part of the root group that stays
    gathered through the step. (torchtitan's apply_fsdp wraps them apart too, but by default does not reshard its
    [norm, output] group after forward: not this layout.)"""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    # Model parallelism (modelparallel.py): gpus = data parallel x tp x pp x cp; ep is carved out of dp x cp.
    tp: int = 1
    """Tensor parallel degree: attention heads, MLP width and the vocabulary split across tp ranks."""
    sp: bool = False
    """Sequence parallelism on the tensor-parallel ranks."""
    pp: int = 1
    """Pipeline stages."""
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    """Model chunks per rank with the interleaved schedule."""
    micro_batches: int = 0
    """Micro-batches per step through the pipeline (0: pp, the fewest that fill it)."""
    pp_layers: tuple[int, ...] = ()
    """Decoder layers per pipeline stage, first to last, where they are not split evenly (1F1B; --pp-layers,
    modelparallel.pipeline_split); (): pp equal stages."""
    cp: int = 1
    """Context parallel degree: the sequence split across cp ranks."""
    ep: int = 1
    """Expert parallel degree: the routed experts split across ep ranks."""
    experts_split: int = 1
    """Set on a data-parallel view (data_parallel_view) of an expert-parallel layout: the rank's routed experts are
    already split ep ways, and the engine shards them over the gpus / ep ranks that hold the same experts (Megatron's
    expert data-parallel group; torchtitan's dp_shard_mod_ep mesh, on dim 1 when the experts are fewer)."""

    def __post_init__(self) -> None:
        for name, least in (("gpus", 1), ("gpus_per_node", 0), ("tp", 1), ("pp", 1), ("virtual_stages", 1),
                            ("micro_batches", 0), ("cp", 1), ("ep", 1), ("experts_split", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_GPUS:
                raise ConfigError(f"{name.replace('_', '-')} must be a whole number from {least} to {MAX_GPUS:,}"
                                  + (" (0: 8, or gpus if fewer)" if name == "gpus_per_node" else
                                     " (0: the pipeline's stages)" if name == "micro_batches" else "")
                                  + f", got {value!r}")
        _check_model_parallel(self)
        if self.zero is not None and self.fsdp is not None:
            raise ConfigError("--zero (DeepSpeed) and --fsdp (PyTorch FSDP2) are two engines; give one")
        if self.zero is not None and (isinstance(self.zero, bool) or self.zero not in ZERO_STAGES):
            raise ConfigError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.fsdp is not None and self.fsdp not in FSDP_MODES:
            raise ConfigError(f"unknown fsdp {self.fsdp!r}; accepted: {', '.join(FSDP_MODES)}")
        if self.fsdp_version not in (1, 2) or isinstance(self.fsdp_version, bool):
            raise ConfigError(f"fsdp-version must be 1 (FullyShardedDataParallel) or 2 (fully_shard), got "
                              f"{self.fsdp_version!r}")
        if (self.fsdp_version == 1 or self.fsdp_use_orig_params or self.fsdp_no_sync) and self.fsdp is None:
            raise ConfigError("--fsdp-version, --fsdp-use-orig-params and --fsdp-no-sync describe FSDP: give --fsdp "
                              "full or grad-op")
        if (self.fsdp_use_orig_params or self.fsdp_no_sync) and self.fsdp_version != 1:
            raise ConfigError("--fsdp-use-orig-params and --fsdp-no-sync are FSDP1's (FullyShardedDataParallel): "
                              "give --fsdp-version 1")
        if self.fsdp_version == 1 and self.fsdp_embedding_groups:
            raise ConfigError("--fsdp-embedding-groups is FSDP2's: leave it out with --fsdp-version 1")
        if self.fsdp_embedding_groups and self.fsdp not in ("full", "hybrid"):
            raise ConfigError("--fsdp-embedding-groups shards the embedding and the LM head as FSDP2 groups resharded "
                              "after forward: give --fsdp full or hybrid")
        if self.offload not in OFFLOADS:
            raise ConfigError(f"unknown offload {self.offload!r}; accepted: {', '.join(OFFLOADS)}")
        if self.data_parallel * self.cp == 1 and (self.zero or self.fsdp not in (None, "no-shard")):
            raise ConfigError("sharding needs more than one GPU to shard across: give --gpus N larger than "
                              f"tp x pp (here {self.tp * self.pp}) with --zero or --fsdp")
        if self.gpus_per_node and self.gpus_per_node > self.gpus:
            raise ConfigError(f"gpus_per_node ({self.gpus_per_node}) is more than gpus ({self.gpus})")
        if self.fsdp == "hybrid" and self.gpus % self.node_size:
            raise ConfigError(f"--fsdp hybrid replicates whole nodes: gpus ({self.gpus}) must be a multiple of "
                              f"gpus_per_node ({self.node_size})")
        if self.offload != "none":
            if self.engine in ("single", "ddp") or self.zero == 0:
                raise ConfigError("--offload needs --zero 1, 2 or 3 or --fsdp (DDP keeps everything on the GPU)")
            if self.offload == "optimizer+params" and self.zero in (1, 2):
                raise ConfigError("--offload optimizer+params needs --zero 3: stages 1 and 2 keep the parameters "
                                  "whole on every GPU")
            if self.fsdp is not None and self.offload == "optimizer":
                raise ConfigError("FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer states "
                                  "together: give --offload optimizer+params")

    @property
    def model_parallel(self) -> int:
        """GPUs that hold one copy of the model between them: tp x pp x cp."""
        return self.tp * self.pp * self.cp

    @property
    def data_parallel(self) -> int:
        return self.gpus // self.model_parallel

    @property
    def is_model_parallel(self) -> bool:
        return self.model_parallel > 1 or self.ep > 1

    @property
    def in_flight_micro_batches(self) -> int:
        return self.micro_batches or self.pp

    def data_parallel_view(self) -> "Parallel":
        """The data-parallel engine as one model-parallel rank sees it: its gradients are reduced, and its states
        sharded, across the dp x cp ranks that hold the same part of the model (Megatron's data-parallel group with
        context parallel; torchtitan's dp_shard_cp mesh)."""
        group = self.data_parallel * self.cp
        per_node = max(1, self.node_size // self.model_parallel) if self.gpus_per_node else 0
        return replace(self, gpus=group, gpus_per_node=min(per_node, group), tp=1, sp=False, pp=1,
                       pp_schedule="1f1b", virtual_stages=1, micro_batches=0, cp=1, ep=1, experts_split=self.ep,
                       pp_layers=())

    @property
    def node_size(self) -> int:
        return self.gpus_per_node or min(8, self.gpus)

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.node_size)

    @property
    def engine(self) -> str:
        if self.zero is not None:
            return "deepspeed"
        if self.fsdp is not None:
            return "fsdp1" if self.fsdp_version == 1 else "fsdp2"
        return "ddp" if self.gpus // self.model_parallel * self.cp > 1 else "single"

    @property
    def shard_size(self) -> int:
        """Ranks a sharded tensor is split across."""
        if self.zero:
            return self.gpus
        if self.fsdp in ("full", "grad-op"):
            return self.gpus
        if self.fsdp == "hybrid":
            return self.node_size
        return 1

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _MODEL_PARALLEL_FIELDS
               and f.name not in ("deepspeed", "experts_split") and f.name not in _FSDP1_FIELDS}
        if self.fsdp_version == 1:  # (keys added to schema 2 by issue 27: present only for an FSDP1 layout)
            out.update({name: getattr(self, name) for name in _FSDP1_FIELDS})
        out.update(gpus_per_node=self.node_size, nodes=self.nodes, engine=self.engine, shard_size=self.shard_size)
        if self.is_model_parallel:  # (keys added to schema 2 by issue 13: present only for such a layout)
            out.update({name: getattr(self, name) for name in _MODEL_PARALLEL_FIELDS},
                       micro_batches=self.in_flight_micro_batches if self.pp > 1 else 0,
                       data_parallel=self.data_parallel, shard_size=self.data_parallel_view().shard_size)
            if self.pp_layers:
                out["pp_layers"] = list(self.pp_layers)
        if self.zero is not None:
            out["deepspeed"] = {f.name: getattr(self.deepspeed, f.name) for f in fields(self.deepspeed)}
        return out


PP_SCHEDULES = ("1f1b", "interleaved")
_FSDP1_FIELDS = ("fsdp_version", "fsdp_use_orig_params", "fsdp_no_sync")
_MODEL_PARALLEL_FIELDS = ("tp", "sp", "pp", "pp_schedule", "virtual_stages", "micro_batches", "cp", "ep")
# (pp_layers is written by as_dict only where it is given: an uneven split)
_EXPERT_ROLES = ("expert", "expert_down")


def _check_model_parallel(p: Parallel) -> None:
    """What a layout must satisfy whatever the model (modelparallel.check_layout checks it against the model)."""
    if p.gpus % p.model_parallel:
        raise ConfigError(f"--gpus {p.gpus} is not a multiple of tp x pp x cp = {p.tp} x {p.pp} x {p.cp} = "
                          f"{p.model_parallel}: the world size is data parallel x tp x pp x cp")
    if not isinstance(p.sp, bool):
        raise ConfigError(f"sp must be true or false, got {p.sp!r}")
    if p.sp and p.tp == 1:
        raise ConfigError("--sp splits the sequence across the tensor-parallel ranks: it needs --tp 2 or more")
    if p.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(f"unknown pp-schedule {p.pp_schedule!r}; accepted: {', '.join(PP_SCHEDULES)}")
    if p.pp_layers and (not isinstance(p.pp_layers, tuple) or len(p.pp_layers) != p.pp or p.virtual_stages > 1
                        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in p.pp_layers)):
        raise ConfigError(f"--pp-layers gives the layers of each of the {p.pp} stages of a 1F1B pipeline, each 1 or "
                          f"more, got {p.pp_layers!r}")
    if p.pp == 1 and (p.pp_schedule != "1f1b" or p.virtual_stages > 1 or p.micro_batches):
        raise ConfigError("--pp-schedule, --virtual-stages and --micro-batches describe a pipeline: give --pp 2 "
                          "or more")
    if (p.pp_schedule == "interleaved") != (p.virtual_stages > 1):
        raise ConfigError("the interleaved schedule runs --virtual-stages V >= 2 model chunks per rank; 1f1b runs one:"
                          " give both or neither")
    if p.pp_schedule == "interleaved" and p.in_flight_micro_batches % p.pp:
        raise ConfigError(f"the interleaved schedule needs --micro-batches a multiple of --pp {p.pp} (Megatron's "
                          f"rule), got {p.in_flight_micro_batches}")
    group = (p.gpus // p.model_parallel) * p.cp
    if group % p.ep:
        raise ConfigError(f"--ep {p.ep} must divide data parallel x cp = {group}: the expert-parallel ranks are "
                          "taken from the data-parallel ones (Megatron, torchtitan)")


@dataclass(frozen=True)
class Buffer:
    """Memory an engine allocates beyond the model states: when it exists and which phase category holds it."""

    name: str
    bytes: int
    category: str
    """The phase category: parameters (gathered weights), gradients, or temporaries (communication buffers)."""
    phases: tuple[str, ...]
    """The phases it is alive in (load, forward, backward, optimizer, between_steps), or a place in one:
    ``forward:start`` (the first layer's gather), ``forward:layer``, ``backward:layer`` (the moments inside a
    decoder layer), ``backward:head`` (before the layers: the loss and the LM head) and ``backward:end`` (after
    them: the embedding)."""
    note: str = ""


@dataclass(frozen=True)
class RankLayout:
    """What one rank holds: its model states (bytes), the engine's buffers, what lives in host memory."""

    weights: int
    gradients: int
    master_weights: int
    optimizer_states: int
    optimizer_numel: int
    """Elements the optimizer updates on this rank (its temporaries scale with them)."""
    gradient_shards: int
    """Ranks a finished gradient is split across: it stays whole (1) or is reduce-scattered as backward goes."""
    buffers: tuple[Buffer, ...] = ()
    gradient_cast_in_step: bool = True
    """Whether the optimizer step makes its own fp32 copy of half gradients (torch's optimizers over fp32 masters);
    ZeRO counts its fp32 partition among its buffers, FSDP2's gradients are already in the masters' dtype."""
    host_bytes_per_rank: int = 0
    host_pinned_bytes_per_rank: int = 0
    notes: tuple[str, ...] = ()
    persistent_gradients: bool = False
    """The gradients live in a buffer allocated once (DDP's buckets with gradient_as_bucket_view): every phase."""
    gradient_shard_bytes: int = 0
    """Bytes per element of a finished gradient shard (FSDP2 casts it to the parameters' original dtype); 0: the
    recipe's gradient dtype."""
    head_gradient_sharded: bool = True
    """Whether the LM head's gradient is reduced to the rank's shard as soon as backward has made it (ZeRO's
    buckets), or stays whole until the end of backward (FSDP2's root group reduces last)."""
    head_reduce_scatter_bytes: int = 0
    """FSDP2 with the LM head a group of its own (Parallel.fsdp_embedding_groups): its post-backward
    reduce-scatter's input (W padded shards in reduce_dtype) and output (one shard), beside the head's unsharded
    gradient, once the head is resharded (_fsdp_param_group.py ``post_backward``, _fsdp_collectives.py
    ``foreach_reduce``)."""
    gradients_offloaded: bool = False
    """Whether each finished gradient shard leaves the GPU as soon as its group is reduced (FSDP2's
    CPUOffloadPolicy: ``foreach_reduce`` copies the reduce-scatter output to pinned host memory), so backward keeps
    none of the finished layers' shards on the device."""
    gradient_shard_of: tuple[int, int] | None = None
    """(this rank's elements, all elements) of what trains, padding included, where a finished gradient shard is
    that fraction of the gradient rather than 1 / gradient_shards (LoRA under FSDP2: a lora_A of r rows is one row
    per rank when W >= r; finetune_sharding.py)."""
    flat_gradient: tuple[int, int] | None = None
    """FSDP1 (fsdp1.py): at a decoder layer's end, (bytes of its views' gradients beside those the layer walk
    counts, i.e. the frozen weights' under use_orig_params; bytes of the unit's concatenated flat gradient)."""
    root_flat_gradient: int = 0
    """FSDP1: bytes of the root unit's concatenated flat gradient at the end of backward (a trained root)."""
    accumulated_gradients: int | None = None
    """Gradient bytes alive through the forward and backward of a micro-batch after the first where accumulation
    keeps something other than the finished gradients (FSDP1's ``no_sync``: every trained unit's unsharded flat
    gradient, fsdp1.py); None: the finished gradients (``gradients``)."""


ALL_PHASES = ("load", "forward", "backward", "optimizer", "between_steps")
_STEP = ("forward", "backward")


def _zero_partition(numel: int, world: int) -> int:
    """Elements of one rank's flat ZeRO partition: the total padded to a multiple of 2 x world, split evenly."""
    unit = ALIGNMENT * world
    return -(-numel // unit) * unit // world


def fsdp_shard_numel(t: ParamTensor, world: int, experts_split: int = 1) -> int:
    """Elements FSDP2 allocates on every rank for ``t``: ceil(dim0 / W) rows (torch.chunk's first chunk). Under
    expert parallelism a routed expert tensor is sharded over W / ep ranks, on dim 1 where it has fewer experts
    than that (torchtitan's shard_placement_fn)."""
    if not t.shape:
        return 1
    if experts_split > 1 and t.role in _EXPERT_ROLES:
        world = max(1, world // experts_split)
        if t.shape[0] < world and len(t.shape) > 1:
            cols = t.shape[1]
            return -(-cols // world) * (t.numel // cols)
    rows = t.shape[0]
    return -(-rows // world) * (t.numel // rows)


def _expert_numel(spec: ModelSpec) -> int:
    return sum(g.repeat * t.numel for g in spec.param_groups for t in g.tensors if t.role in _EXPERT_ROLES)


def _zero_elements(spec: ModelSpec, numel: int, world: int, experts_split: int) -> int:
    """One rank's ZeRO partition of ``numel`` elements: the routed experts of an expert-parallel rank are
    partitioned over their own data-parallel group (world / ep), the rest over the world."""
    if experts_split == 1:
        return _zero_partition(numel, world)
    experts = _expert_numel(spec)
    return _zero_partition(numel - experts, world) + _zero_partition(experts, max(1, world // experts_split))


def _groups(spec: ModelSpec) -> list[tuple[int, list[ParamTensor]]]:
    """FSDP2's communication groups as (repeat, tensors): one per decoder layer, and the root (everything else)."""
    layers = [(g.repeat, list(g.tensors)) for g in spec.param_groups if g.is_layer]
    root = [t for g in spec.param_groups if not g.is_layer for t in g.tensors]
    return layers + ([(1, root)] if root else [])


def _largest_layer(spec: ModelSpec) -> int:
    """Parameters of the largest decoder layer."""
    return max((g.numel_each for g in spec.param_groups if g.is_layer), default=0)


def rank_layout(spec: ModelSpec, recipe: Recipe, optimizer: Optimizer, states_full: int,
                parallel: Parallel) -> RankLayout:
    """The per-rank model states and buffers of ``parallel``'s engine (module docstring)."""
    n = spec.num_parameters
    w, g, m = recipe.weight_bytes, recipe.gradient_bytes, recipe.master_bytes
    engine = parallel.engine
    if engine == "single":
        return RankLayout(w * n, g * n, m * n, states_full, n, 1)
    if engine == "ddp":
        if parallel.ddp_bucket_view:  # the gradients are views of the buckets, which exist from the wrapping on
            return RankLayout(w * n, g * n, m * n, states_full, n, 1, persistent_gradients=True)
        buffers = (Buffer("DDP gradient buckets", g * n, "gradients", ALL_PHASES,
                          "flat buckets holding every gradient for the all-reduce (gradient_as_bucket_view=False)"),)
        return RankLayout(w * n, g * n, m * n, states_full, n, 1, buffers,
                          notes=("DDP: with gradient_as_bucket_view=True (--ddp-bucket-view) the gradients are views "
                                 "of the buckets",))
    if engine == "deepspeed":
        return _zero_layout(spec, recipe, states_full, parallel)
    return _fsdp_layout(spec, recipe, optimizer, states_full, parallel)


def grad_partition_buffer(ds: DeepSpeedConfig, part: int) -> Buffer:
    """The fp32 copy of a rank's gradient partition that ZeRO's step makes where gradients are not fp32."""
    return Buffer("fp32 gradient partition at step()", 4 * min(part, ds.sub_group_size), "temporaries",
                  ("optimizer",), "single_grad_partition / _prepare_fp32_grad_for_sub_group")


def reduce_bucket_buffers(ds: DeepSpeedConfig, stage: int, grad_bytes: int, source_note: str = "") -> list[Buffer]:
    """ZeRO's gradient reduce bucket(s), two under overlap_comm at stages 1-2, where DeepSpeed allocates them."""
    if not (ds.contiguous_gradients or stage == 3):
        return []
    count = 2 if ds.overlap(stage) and stage < 3 else 1
    return [Buffer("gradient reduce bucket" + (" x2 (overlap_comm)" if count == 2 else ""),
                   count * ds.reduce_bucket_size * grad_bytes, "temporaries", ("backward",),
                   f"reduce_bucket_size = {ds.reduce_bucket_size:,} elements{source_note}")]


def _zero_layout(spec: ModelSpec, recipe: Recipe, states_full: int, parallel: Parallel) -> RankLayout:
    n, world, stage, ds = spec.num_parameters, parallel.gpus, parallel.zero, parallel.deepspeed
    w, g, m = recipe.weight_bytes, recipe.gradient_bytes, recipe.master_bytes
    assert stage is not None  # (the deepspeed engine's layout: Parallel.zero is set)
    buffers: list[Buffer] = []
    if stage == 0:
        if m and g != 4:  # DeepSpeed's BF16_Optimizer (bf16 without ZeRO): an fp32 flat gradient accumulator
            buffers.append(Buffer("fp32 gradient accumulation buffer", 4 * n, "gradients", ALL_PHASES,
                                  "BF16_Optimizer.fp32_groups_gradients_flat"))
        return RankLayout(w * n, g * n, m * n, states_full, n, 1, tuple(buffers))
    part = _zero_elements(spec, n, world, parallel.experts_split)
    states = -(-states_full * part // n)  # elementwise states follow the padded partition
    persistent = 0
    if stage == 3:
        persistent = sum(g_.repeat * t.numel for g_ in spec.param_groups for t in g_.tensors
                         if t.numel < ds.stage3_param_persistence_threshold)
    offload = parallel.offload
    weights = w * n if stage < 3 else w * (_zero_elements(spec, n - persistent, world, parallel.experts_split)
                                           + persistent)
    grads = g * n if stage == 1 else g * part
    master = m * part
    host = host_pinned = 0
    if offload != "none":
        # the fp32 master partition, the states and the fp32 gradient partition live in (pinned) host memory; the
        # GPU keeps its half parameters and (stage 3) the gathered ones
        host = master + states + 4 * part
        host_pinned = 4 * part
        master, states, grads = 0, 0, (g * n if stage == 1 else 0)
        if offload == "optimizer+params":
            host += weights - w * persistent
            weights = w * persistent
    elif m and g != 4:
        buffers.append(grad_partition_buffer(ds, part))
    buffers += reduce_bucket_buffers(ds, stage, g)
    if stage == 3:
        layer = _largest_layer(spec)
        gathered = min(ds.stage3_max_live_parameters, layer + ds.stage3_prefetch_bucket_size)
        buffers.append(Buffer("gathered parameters", w * gathered, "parameters", _STEP,
                              "the running layer and the prefetch (stage3_prefetch_bucket_size), at most "
                              "stage3_max_live_parameters"))
        buffers.append(Buffer("the running layer's unpartitioned gradients", g * layer, "gradients", ("backward",),
                              "before they are reduce-scattered into the partition"))
    notes = ("not validated: no DeepSpeed run measured (docs/accuracy.md compares with DeepSpeed's own estimators)",)
    return RankLayout(weights, grads, master, states, part, world if stage >= 2 else 1, tuple(buffers), False, host,
                      host_pinned, notes)


def _fsdp_layout(spec: ModelSpec, recipe: Recipe, optimizer: Optimizer, states_full: int,
                 parallel: Parallel) -> RankLayout:
    world = parallel.shard_size
    n = spec.num_parameters
    orig = recipe.master_bytes or recipe.weight_bytes  # the dtype the model had when fully_shard was called
    param_dtype = recipe.weight_bytes  # MixedPrecisionPolicy.param_dtype: the compute weights
    reduce_dtype = max(recipe.gradient_bytes, orig) if recipe.master_weights else recipe.gradient_bytes
    groups = _groups(spec)
    shard = sum(r * fsdp_shard_numel(t, world, parallel.experts_split) for r, ts in groups for t in ts)
    states = -(-states_full * shard // n)
    unsharded = [sum(t.numel for t in ts) for _, ts in groups]
    largest = max(unsharded)
    buffers: list[Buffer] = []
    if world > 1:
        layer = _largest_layer(spec)
        root = unsharded[-1]
        if parallel.fsdp_embedding_groups:
            buffers += _end_group_buffers(spec, param_dtype, reduce_dtype, layer, root)
        elif parallel.fsdp == "grad-op":
            buffers.append(Buffer("gathered parameters (kept from forward to backward)", param_dtype * n, "parameters",
                                  _STEP, "reshard_after_forward=False on every group"))
        else:
            buffers.append(Buffer("gathered root parameters (embedding, final norm, LM head)", param_dtype * root,
                                  "parameters", _STEP, "the root group is not resharded after forward"))
            buffers.append(Buffer("the running layer's gathered parameters", param_dtype * layer, "parameters",
                                  ("forward:layer", "backward:layer")))
            buffers.append(Buffer("the next layer's gathered parameters (backward prefetch)", param_dtype * layer,
                                  "parameters", ("backward:layer",)))
        if not parallel.fsdp_embedding_groups:
            buffers.append(Buffer("a layer's all-gather buffer", param_dtype * layer, "temporaries",
                                  ("forward", "backward:head"),
                                  "the last gathered group's flat buffer, whose free waits for the next group's"))
        if parallel.fsdp != "grad-op" and not parallel.fsdp_embedding_groups:
            buffers.append(Buffer("the root's all-gather buffer", param_dtype * root, "temporaries",
                                  ("forward:start",), "alive until the first layer's gather has been copied out"))
            buffers.append(Buffer("the first layer's gathered parameters", param_dtype * layer, "parameters",
                                  ("forward:start",)))
        buffers.append(Buffer("a layer's reduce-scatter input", reduce_dtype * layer, "temporaries",
                              ("backward:layer", "backward:end"),
                              "in reduce_dtype; held until the next group's reduce-scatter"))
        if parallel.fsdp == "hybrid" and parallel.gpus > world:
            buffers.append(Buffer("all-reduce across nodes", reduce_dtype * -(-layer // world), "temporaries",
                                  ("backward",), "the replicated dimension's all-reduce of one group's shard"))
    head_reduce = 0
    if world > 1 and parallel.fsdp_embedding_groups:
        head = [t for g in spec.param_groups if not g.is_layer for t in g.tensors
                if t.role == "head" and len(t.shape) == 2]
        padded = sum(world * fsdp_shard_numel(t, world, 1) for t in head)
        head_reduce = reduce_dtype * (padded + padded // world)
    host = pinned = 0
    weights, grads = orig * shard, orig * shard
    offloaded = parallel.offload == "optimizer+params"
    notes: tuple[str, ...] = ("not validated on a GPU: FSDP2's sharded states are checked on CPU processes (gloo)",)
    if offloaded:
        # CPUOffloadPolicy (torch 2.13 _fully_shard/_fsdp_collectives.py foreach_reduce): each group's
        # reduce-scatter output is copied to pinned host memory (``new_sharded_grad.to("cpu", non_blocking=...)``)
        # and the GPU copy dropped at once, so sharded_param.grad is a CPU tensor: the gradient shards are host
        # bytes, and on the GPU only the in-flight group's reduce buffers remain (its reduce-scatter input,
        # counted above; its output lives inside foreach_reduce only)
        host = weights + grads + states
        pinned = host
        buffers.append(Buffer("host-to-device copy of the running group's shard", orig * -(-largest // world),
                              "temporaries", _STEP))
        weights = grads = states = 0
        notes += ("not validated: FSDP2's CPUOffloadPolicy is modelled from its source (gradient shards copied to "
                  "the host as each group is reduced); the trace does not run offload",)
    return RankLayout(weights, grads, 0, states, shard, world, tuple(buffers), False, host, pinned, notes,
                      gradient_shard_bytes=orig, head_gradient_sharded=parallel.fsdp_embedding_groups,
                      gradients_offloaded=offloaded, head_reduce_scatter_bytes=head_reduce)


def _end_group_buffers(spec: ModelSpec, param_dtype: int, reduce_dtype: int, layer: int, root: int) -> list[Buffer]:
    """FSDP2 with the token embedding and the LM head as groups of their own (Parallel.fsdp_embedding_groups;
    torchtune's shard_model over custom_sharded_layers), each resharded after its forward
    (_fsdp_param_group.py ``post_forward``): the root keeps the rest (the final norm) gathered; the embedding's
    all-gather buffer is alive while the first layer is gathered; the head, gathered last in forward, leaves its
    flat buffer alive through the loss until backward gathers it again for its own backward (pre_backward, once the
    logits' gradient exists, which prefetches the last layer), where its gradient is reduce-scattered at once (no longer last, with the root); the
    embedding is gathered again for its backward at the end. Traced (FSDPMemTracker, fake process group)."""
    embedding = sum(g.repeat * t.numel for g in spec.param_groups if not g.is_layer for t in g.tensors
                    if t.role == "embedding")
    head = sum(g.repeat * t.numel for g in spec.param_groups if not g.is_layer for t in g.tensors
               if t.role == "head" and len(t.shape) == 2)
    rest = root - embedding - head
    return [
        Buffer("gathered root parameters (final norm)", param_dtype * rest, "parameters", _STEP,
               "the root group is not resharded after forward"),
        Buffer("the running layer's gathered parameters", param_dtype * layer, "parameters",
               ("forward:layer", "backward:layer")),
        Buffer("the next layer's gathered parameters (backward prefetch)", param_dtype * layer, "parameters",
               ("backward:layer",)),
        Buffer("a layer's all-gather buffer", param_dtype * layer, "temporaries", ("forward:start", "forward:layer"),
               "the last gathered group's flat buffer, whose free waits for the next group's"),
        Buffer("the embedding's all-gather buffer", param_dtype * embedding, "temporaries", ("forward:start",),
               "alive until the first layer's gather has been copied out"),
        Buffer("the first layer's gathered parameters", param_dtype * layer, "parameters", ("forward:start",)),
        Buffer("the LM head's all-gather buffer", param_dtype * head, "temporaries", ("forward:head", "backward:loss"),
               "the last group gathered in forward; freed when backward gathers the head again"),
        Buffer("the LM head's gathered parameters (its backward)", param_dtype * head, "parameters",
               ("backward:lmhead",)),
        Buffer("the last layer's gathered parameters (prefetched by the head's backward)", param_dtype * layer,
               "parameters", ("backward:prefetch",)),
        Buffer("the embedding's gathered parameters (its backward)", param_dtype * embedding, "parameters",
               ("backward:end",)),
    ]


