"""LoRA, DoRA and QLoRA on several GPUs: what one rank holds under DDP, DeepSpeed ZeRO 0-3 and FSDP2.

The frozen base and the adapters are laid out as each engine lays out any parameter; what differs from full
fine-tuning is that only the adapters (and peft's trained copies, ``modules_to_save``) have gradients and optimizer
states. Read in the engines' code (torch 2.13, DeepSpeed as installed; docs/method.md, "LoRA on several GPUs"):

- DDP (torch/nn/parallel/distributed.py, ``DistributedDataParallel._build_params_for_reducer``): the reducer's
  buckets are built from the parameters that require grad only, so they hold the adapters' gradients; the frozen
  base and the adapters are whole on every rank.
- DeepSpeed (deepspeed/runtime/engine.py, ``_configure_distributed_model``): with bf16 or fp16 enabled every
  parameter is cast to that dtype (``_cast_module_mixed_precision``), the adapters too, and ZeRO keeps their fp32
  masters in its partition; ZeRO 1/2 (zero/stage_1_and_2.py) build their flat groups from the optimizer's
  parameters, which the HF Trainer takes from those that require grad, so stage 1 partitions the adapters'
  masters and states, stage 2 also their gradients; stage 3 (zero/partition_parameters.py, ``_partition_param``,
  ``_aligned_size``) partitions every parameter of the module, the frozen base included, each padded to a multiple
  of the world size, and keeps whole those of at most ``stage3_param_persistence_threshold`` elements
  (``ds_persist``), which many adapter matrices are.
- FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _fsdp_collectives.py): ``fully_shard`` shards every
  parameter on dim 0, frozen or not, ceil(dim0 / W) rows per rank in the dtype it has (a LoRA A matrix of r rows
  is one row per rank when W >= r: padding); a group whose parameters have several dtypes is all-gathered through a
  uint8 buffer (``_get_param_all_gather_inputs``: the bytes of each); ``foreach_reduce`` reduce-scatters the
  gradients of the parameters that have one, so only the adapters' (``FSDPParamGroup.post_backward``).
- QLoRA's base: bitsandbytes' ``Params4bit`` keeps the packed 4-bit data as a (numel / 2, 1) tensor (uint8, or
  ``bnb_4bit_quant_storage`` as Answer.AI's fsdp_qlora sets it to bf16: the same bytes), which is what FSDP shards;
  its ``quant_state`` (absmax, the nested constants, the code) is an attribute of the parameter, outside FSDP's
  flat parameters, so every rank keeps it whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import ConfigError
from .lora import QUANTIZED_ROLES, FineTune, Trainables, _linear_weight, adapted_names, copy_groups, trainables
from .models import ModelSpec
from .optimizers import Optimizer
from .quantization import stored_bytes
from .recipes import Recipe
from .sharding import (ALL_PHASES, Buffer, Parallel, RankLayout, _zero_partition, grad_partition_buffer,
                       reduce_bucket_buffers)


@dataclass(frozen=True)
class Held:
    """One parameter tensor as the engine holds it."""

    shape: tuple[int, ...]
    """The shape the engine splits (a 4-bit weight's packed (bytes, 1) data)."""
    itemsize: int
    trains: bool
    whole_extra: int = 0
    """Bytes beside the split data that every rank keeps whole (a 4-bit weight's quantization state)."""
    packed: bool = False
    """A quantized weight's packed data (``shape`` is its bytes), which an engine may store in another dtype."""

    @property
    def numel(self) -> int:
        out = 1
        for d in self.shape:
            out *= d
        return out

    def fsdp_shard(self, world: int) -> int:
        """Elements FSDP2 allocates for this tensor on every rank: ceil(dim0 / W) rows (sharding.fsdp_shard_numel)."""
        if not self.shape:
            return 1
        return -(-self.shape[0] // world) * (self.numel // self.shape[0])


@dataclass(frozen=True)
class HeldGroup:
    repeat: int
    is_layer: bool
    tensors: tuple[Held, ...]

    def bytes(self, trains: bool | None = None) -> int:
        """Unsharded bytes of one of these groups (of what trains, or of what does not, or all: None)."""
        return sum(t.numel * t.itemsize for t in self.tensors if trains is None or t.trains == trains)

    def padded_bytes(self, world: int, trains: bool | None = None) -> int:
        """Bytes of FSDP2's all-gather output or reduce-scatter input for one group: W padded shards."""
        return sum(world * t.fsdp_shard(world) * t.itemsize for t in self.tensors
                   if trains is None or t.trains == trains)


def held_groups(spec: ModelSpec, recipe: Recipe, finetune: FineTune, adapter_bytes: int) -> tuple[HeldGroup, ...]:
    """The model's parameter groups as a LoRA step holds them: the frozen base (quantized Linear weights as packed
    data), each adapted Linear's lora_A (r, in), lora_B (out, r) and DoRA magnitude (out,) in the group of the
    Linear, and peft's trained copies as groups outside the layers."""
    if spec.is_moe:
        raise ConfigError("LoRA on a mixture-of-experts model over several GPUs is not modelled yet: give --gpus 1")
    options, w = finetune.lora, recipe.weight_bytes
    chosen = adapted_names(spec, options)
    out = []
    for g in spec.param_groups:
        tensors: list[Held] = []
        for t in g.tensors:
            if finetune.base_quant and _linear_weight(t, QUANTIZED_ROLES):
                packed = t.numel if finetune.base_quant == "int8" else -(-t.numel // 2)
                tensors.append(Held((packed, 1), 1, False,
                                    stored_bytes(t.shape, finetune.base_quant, finetune.double_quant) - packed, True))
            else:
                tensors.append(Held(t.shape, w, False))
            if _linear_weight(t) and t.name.removesuffix(".weight") in chosen:
                out_f, in_f = t.shape
                tensors += [Held((options.rank, in_f), adapter_bytes, True),
                            Held((out_f, options.rank), adapter_bytes, True)]
                if options.dora:
                    tensors.append(Held((out_f,), adapter_bytes, True))
        out.append(HeldGroup(g.repeat, g.is_layer, tuple(tensors)))
    for g in copy_groups(spec, options):
        out.append(HeldGroup(1, False, tuple(Held(t.shape, w, True) for t in g.tensors)))
    return tuple(out)


def engine_finetune(finetune: FineTune, recipe: Recipe, parallel: Parallel) -> FineTune:
    """The adapters as the engine runs them: DeepSpeed with bf16 or fp16 casts them to that dtype (module
    docstring), so peft's fp32 adapters become the recipe's half weights with fp32 masters in ZeRO's partition."""
    if parallel.engine == "deepspeed" and finetune.lora.adapter_dtype == "auto" and recipe.weight_bytes == 2:
        return replace(finetune, lora=replace(finetune.lora, adapter_dtype=recipe.weights))
    return finetune


def finetune_rank_layout(spec: ModelSpec, recipe: Recipe, optimizer: Optimizer, finetune: FineTune,
                         parallel: Parallel) -> RankLayout:
    """One rank's model states and buffers for a LoRA step (module docstring); ``finetune`` as engine_finetune
    gives it."""
    t = trainables(spec, recipe, optimizer, finetune)
    groups = held_groups(spec, recipe, finetune, t.adapter_bytes)
    base = sum(g.repeat * (g.bytes(False) + sum(x.whole_extra for x in g.tensors)) for g in groups)
    engine = parallel.engine
    if engine == "ddp":
        trained = t.trainable_bytes
        notes = ("not validated: DDP with LoRA is modelled from torch's source (buckets of the trained parameters "
                 "only); each rank runs the one-GPU LoRA step, which is traced",)
        if parallel.ddp_bucket_view:
            return RankLayout(base + trained, trained, t.masters, t.states, t.adapters + t.copies, 1,
                              persistent_gradients=True, notes=notes)
        bucket = Buffer("DDP gradient buckets", trained, "gradients", ALL_PHASES,
                        "flat buckets of the gradients of the parameters that require grad: the adapters' "
                        "(gradient_as_bucket_view=False)")
        return RankLayout(base + trained, trained, t.masters, t.states, t.adapters + t.copies, 1, (bucket,),
                          notes=notes)
    if engine == "deepspeed":
        return _zero_layout(spec, recipe, t, groups, base, parallel)
    return _fsdp_layout(t, groups, parallel)


def _zero_layout(spec: ModelSpec, recipe: Recipe, t: Trainables, groups: tuple[HeldGroup, ...], base: int,
                 parallel: Parallel) -> RankLayout:
    """DeepSpeed ZeRO over what trains (sharding._zero_layout's rules, the flat groups holding the adapters only);
    stage 3 partitions every parameter, each padded to the world size."""
    world, stage, ds = parallel.gpus, parallel.zero or 0, parallel.deepspeed
    trained_numel, g = t.adapters + t.copies, recipe.gradient_bytes
    buffers: list[Buffer] = []
    if stage == 0:
        if t.masters and g != 4:  # BF16_Optimizer's fp32 gradient accumulator, over what it optimizes
            buffers.append(Buffer("fp32 gradient accumulation buffer", 4 * trained_numel, "gradients", ALL_PHASES,
                                  "BF16_Optimizer.fp32_groups_gradients_flat"))
        return RankLayout(base + t.trainable_bytes, t.trainable_bytes, t.masters, t.states, trained_numel, 1,
                          tuple(buffers))
    part = _zero_partition(trained_numel, world)
    states, master = -(-t.states * part // trained_numel), -(-t.masters * part // trained_numel)
    grads = t.trainable_bytes if stage == 1 else g * part
    weights = base + t.trainable_bytes
    persistent = 0
    if stage == 3:
        threshold = ds.stage3_param_persistence_threshold  # ds_persist: ds_numel <= threshold (_partition_param)
        persistent = sum(gr.repeat * x.numel * x.itemsize for gr in groups for x in gr.tensors
                         if x.numel <= threshold)
        weights = persistent + sum(gr.repeat * (-(-x.numel // world) * x.itemsize + x.whole_extra)
                                   for gr in groups for x in gr.tensors if x.numel > threshold)
    host = pinned = 0
    if parallel.offload != "none":  # the fp32 partition, the states and the fp32 gradient partition on the host
        host, pinned = master + states + 4 * part, 4 * part
        master, states, grads = 0, 0, (t.trainable_bytes if stage == 1 else 0)
        if parallel.offload == "optimizer+params":
            host += weights - persistent
            weights = persistent
    elif t.masters and g != 4:
        buffers.append(grad_partition_buffer(ds, part))
    buffers += reduce_bucket_buffers(ds, stage, g, ", allocated whole (stage_1_and_2.py: "
                                     "torch.empty(int(self.reduce_bucket_size)))")
    if stage == 3:
        layers = [gr for gr in groups if gr.is_layer] or list(groups)
        layer = max(gr.bytes() for gr in layers)
        gathered = min(ds.stage3_max_live_parameters * recipe.weight_bytes,
                       layer + ds.stage3_prefetch_bucket_size * recipe.weight_bytes)
        buffers.append(Buffer("gathered parameters", gathered, "parameters", ("forward", "backward"),
                              "the running layer (frozen base and adapters) and the prefetch"))
        buffers.append(Buffer("the running layer's unpartitioned adapter gradients",
                              max(gr.bytes(True) for gr in layers), "gradients", ("backward",)))
    notes = ("not validated: no DeepSpeed run measured; ZeRO with LoRA is modelled from DeepSpeed's source",)
    return RankLayout(weights, grads, master, states, 0 if parallel.offload != "none" else part,
                      world if stage >= 2 else 1, tuple(buffers), False, host, pinned, notes,
                      gradient_shard_of=(part, trained_numel) if stage >= 2 else None)


def _fsdp_layout(t: Trainables, groups: tuple[HeldGroup, ...], parallel: Parallel) -> RankLayout:
    """FSDP2 with every parameter sharded in its own dtype (no MixedPrecisionPolicy cast: torchtune's LoRA recipes
    and peft's fp32 adapters over a bf16 base), the frozen base gathered layer by layer as in full fine-tuning
    (sharding._fsdp_layout's buffers) and only the adapters reduce-scattered."""
    if parallel.fsdp_embedding_groups:
        raise ConfigError("--fsdp-embedding-groups with LoRA is not modelled yet: it is modelled for full "
                          "fine-tuning (give it without --lora, or leave it out)")
    world = parallel.shard_size
    shard = {k: sum(g.repeat * x.fsdp_shard(world) * x.itemsize for g in groups for x in g.tensors if x.trains == k)
             for k in (False, True)}
    extra = sum(g.repeat * x.whole_extra for g in groups for x in g.tensors)
    trained_numel = t.adapters + t.copies
    shard_numel = sum(g.repeat * x.fsdp_shard(world) for g in groups for x in g.tensors if x.trains)
    states = -(-t.states * shard_numel // trained_numel)
    masters = -(-t.masters * shard_numel // trained_numel)
    layers = [g for g in groups if g.is_layer]
    root = [g for g in groups if not g.is_layer]
    buffers = _fsdp_buffers(layers, root, world, parallel) if world > 1 else ()
    weights, grads = shard[False] + shard[True] + extra, shard[True]
    notes: tuple[str, ...] = ("LoRA under FSDP2: every parameter sharded in its own dtype (frozen base and "
                              "adapters), only the adapters reduce-scattered (traced on the fake process group)",)
    host = pinned = 0
    offloaded = parallel.offload == "optimizer+params"
    if offloaded:  # CPUOffloadPolicy: shards, gradient shards and states in pinned host memory (sharding.py)
        host = pinned = weights + grads + states + masters
        largest = max((g.bytes() for g in layers), default=0)
        buffers += (Buffer("host-to-device copy of the running group's shard", -(-largest // world),
                           "temporaries", ("forward", "backward")),)
        weights = grads = states = masters = 0
        notes += ("not validated: FSDP2's CPUOffloadPolicy is modelled from its source; the trace does not run "
                  "offload",)
    return RankLayout(weights, grads, masters, states, 0 if offloaded else shard_numel, world, buffers, False,
                      host, pinned, notes, head_gradient_sharded=False, gradients_offloaded=offloaded,
                      gradient_shard_of=(shard_numel, trained_numel))


def _fsdp_buffers(layers: list[HeldGroup], root: list[HeldGroup], world: int,
                  parallel: Parallel) -> tuple[Buffer, ...]:
    """FSDP2's gathered parameters and collective buffers (sharding._fsdp_layout), in each tensor's own bytes; the
    all-gather output and the reduce-scatter input are W padded shards (_fsdp_collectives.py)."""
    layer = max((g.bytes() for g in layers), default=0)
    gather = max((g.padded_bytes(world) for g in layers), default=0)
    reduce = max((g.padded_bytes(world, True) for g in layers), default=0)
    root_bytes = sum(g.bytes() for g in root)
    step = ("forward", "backward")
    out = []
    if parallel.fsdp == "grad-op":
        out.append(Buffer("gathered parameters (kept from forward to backward)",
                          sum(g.repeat * g.bytes() for g in layers) + root_bytes, "parameters", step,
                          "reshard_after_forward=False on every group"))
    else:
        out += [Buffer("gathered root parameters (embedding, final norm, LM head)", root_bytes, "parameters", step,
                       "the root group is not resharded after forward"),
                Buffer("the running layer's gathered parameters (frozen base and adapters)", layer, "parameters",
                       ("forward:layer", "backward:layer")),
                Buffer("the next layer's gathered parameters (backward prefetch)", layer, "parameters",
                       ("backward:layer",)),
                Buffer("the root's all-gather buffer", sum(g.padded_bytes(world) for g in root), "temporaries",
                       ("forward:start",), "alive until the first layer's gather has been copied out"),
                Buffer("the first layer's gathered parameters", layer, "parameters", ("forward:start",))]
    out.append(Buffer("a layer's all-gather buffer", gather, "temporaries", ("forward", "backward:head"),
                      "the last gathered group's flat buffer, whose free waits for the next group's"))
    out.append(Buffer("a layer's reduce-scatter input (the adapters' gradients)", reduce, "temporaries",
                      ("backward:layer", "backward:end"), "held until the next group's reduce-scatter"))
    if parallel.fsdp == "hybrid" and parallel.gpus > world:
        out.append(Buffer("all-reduce across nodes", reduce // world, "temporaries", ("backward",)))
    return tuple(out)
