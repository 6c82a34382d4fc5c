"""FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) where its memory differs from FSDP2's: what one rank holds.

Read in torch 2.13's code (torch/distributed/fsdp/; docs/method.md, "FSDP1"), for a model wrapped one unit per
decoder layer (ModuleWrapPolicy over the layer class: lit-gpt's ``auto_wrap_policy={Block}``) and the root unit
holding the rest (the embedding, the final norm, the LM head):

- One FlatParameter per unit (_flat_param.py, ``FlatParamHandle._init_flat_param_and_metadata``): the unit's
  parameters flattened in one dtype (``_validate_tensors_to_flatten`` refuses mixed dtypes), each padded to a
  16-byte address with ``use_orig_params=True`` (``_get_aligned_numel``), the whole padded to a multiple of the world
  size; each rank's shard is ceil(numel / W) elements (``_get_shard``: ``torch.chunk``'s first chunk).
- ``use_orig_params=False`` refuses a unit that mixes frozen and trained parameters (_wrap_utils.py,
  ``_validate_frozen_params``: ValueError); with ``use_orig_params=True`` it warns that "the gradient memory usage
  will be higher than expected": the views the forward uses are split off the flat parameter, which requires grad
  if any of its parameters does (``_use_unsharded_views(as_params=False)``, ``_get_unflat_views_unaligned``:
  ``torch.split``), so autograd computes the frozen weights' gradients too, and the split's backward concatenates
  them into one gradient of the whole FlatParameter (frozen part included), which the post-backward hook
  reduce-scatters (_runtime_utils.py, ``_post_backward_hook``, ``_reduce_grad``) into a shard of the whole unit.
- That sharded flat gradient stays in ``flat_param.grad`` after ``optimizer.zero_grad()`` (which clears only the
  original parameters' ``.grad`` views) until the next forward's ``_reset_flat_param_grad_info_if_needed``.
- The optimizer steps the original parameters' views into the shard (``_use_sharded_views``): a rank's states
  follow the trained elements that fall in its shard, which differ between ranks (LoRA's matrices sit at fixed
  offsets of each unit); the most loaded rank is reported.
- FULL_SHARD: a unit is all-gathered straight into its unsharded flat parameter (``FlatParamHandle.unshard``: no
  separate buffer to copy out of) before its forward and freed after it (``_post_forward_reshard``), except the
  root, kept unsharded into backward; backward_prefetch=BACKWARD_PRE (the default) all-gathers the next unit in
  backward order while a unit's backward runs, the last layer from the root's pre-backward hook on.
  SHARD_GRAD_OP keeps every unit unsharded from forward to backward. ``limit_all_gathers`` (two all-gathers in
  flight at most: ``_FreeEventQueue``) bounds how far the CPU runs ahead of the GPU; the frees it waits for were
  already counted when ``resize_(0)`` ran, so it changes reserved memory, not ``max_memory_allocated()``.
- ``no_sync()`` (FullyShardedDataParallel.no_sync: "FSDP will accumulate the full model gradients (instead of
  gradient shards) until the eventual sync"): ``_post_backward_hook`` returns before reduce-scattering, so every
  trained unit's unsharded flat gradient is alive through the following micro-batches and the synced one's forward
  and backward; under SHARD_GRAD_OP the unsharded parameters are kept too (``_should_free_in_backward``).

- LoRA without ``use_orig_params``: a unit may not mix frozen and trained parameters, so the adapters are wrapped
  apart, as peft's ``fsdp_auto_wrap_policy`` (peft/utils/other.py) and Answer.AI's fsdp_qlora (train.py,
  ``get_wrapping_policy``) wrap them: ``lambda_auto_wrap_policy`` over every leaf module whose weight requires grad
  (each lora_A, lora_B, DoRA magnitude, trained copy) or'ed with ``transformer_auto_wrap_policy`` over the decoder
  layers. Each adapter matrix is then a FlatParameter of its own, sharded ceil(numel / W) elements a rank, the
  layer's unit holds the frozen base alone, and the optimizer steps the adapters' flat parameters.
- A 4-bit base (bitsandbytes' ``Params4bit``): its packed data is flattened with the norms only when it is stored in
  their dtype (``bnb_4bit_quant_storage``, which fsdp_qlora and the HF FSDP-QLoRA guide set to the model's dtype:
  bitsandbytes/backends/default/ops.py, ``quantize_4bit``, views the packed bytes as that dtype); the
  ``quant_state`` (absmax, the nested constants) is not a parameter, so every rank keeps it whole and
  ``Linear4bit.forward`` restores it from the module (``fix_4bit_weight_quant_state_from_module``).

- NO_SHARD: each unit's FlatParameter is whole on every rank, without padding to the world size
  (``FlatParamHandle.shard`` shards only under a sharded strategy), so there is nothing to all-gather or free
  (``unshard`` and ``reshard`` return early); its gradient is all-reduced in place (``_reduce_grad_no_shard``:
  ``dist.all_reduce(flat_param.grad)``): no reduce-scatter output, and, unlike DDP, no gradient buckets.

Not modelled (ConfigError): MixedPrecision (recipes with fp32 masters), CPU offload, HYBRID_SHARD,
an int8 base (its Int8Params have no storage dtype to flatten with the norms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigError
from .models import ModelSpec
from .sharding import Buffer, Parallel, RankLayout

if TYPE_CHECKING:  # (for the annotations only)
    from .finetune_sharding import Held, HeldGroup
    from .lora import FineTune
    from .optimizers import Optimizer
    from .recipes import Recipe

ALIGNMENT_BYTES = 16
"""_flat_param.py, ``_get_aligned_numel``: each original parameter starts on a 16-byte address (use_orig_params)."""
FSDP1_STRATEGIES = ("full", "grad-op", "no-shard")


@dataclass(frozen=True)
class Flat:
    """One tensor of a unit: its elements, bytes per element, whether it trains."""

    numel: int
    itemsize: int
    trains: bool


@dataclass(frozen=True)
class Unit:
    """One FSDP1 unit's FlatParameter, as ``FlatParamHandle`` lays it out on ``world`` ranks."""

    repeat: int
    is_layer: bool
    tensors: tuple[Flat, ...]
    world: int
    aligned: bool
    """use_orig_params=True: each tensor padded to a 16-byte address, the whole to a multiple of the world."""
    adapter: bool = False
    """A trained leaf module wrapped apart (LoRA without use_orig_params: module docstring)."""

    @property
    def itemsize(self) -> int:
        return self.tensors[0].itemsize

    @property
    def trains(self) -> bool:
        """flat_param.requires_grad: any of its parameters does (_flat_param.py, ``_validate_tensors_to_flatten``)."""
        return any(t.trains for t in self.tensors)

    def offsets(self) -> list[tuple[int, Flat]]:
        """Where each tensor starts in the flat parameter (``_init_flat_param_and_metadata``'s padding)."""
        align = ALIGNMENT_BYTES // self.itemsize if self.aligned else 0
        total, out = 0, []
        for t in self.tensors:
            if align and total % align:
                total += align - total % align
            out.append((total, t))
            total += t.numel
        return out

    @property
    def numel(self) -> int:
        """The flat parameter's elements, padding included (to a multiple of W where aligned)."""
        last, t = self.offsets()[-1]
        total = last + t.numel
        if self.aligned and total % self.world:
            total += self.world - total % self.world
        return total

    @property
    def shard(self) -> int:
        """Elements of every rank's shard: ceil(numel / W) (``_get_shard``, ``_get_sharded_size``)."""
        return -(-self.numel // self.world)

    @property
    def bytes(self) -> int:
        """The unsharded flat parameter (and its gradient): W shards."""
        return self.world * self.shard * self.itemsize

    def trained_in_shard(self, rank: int) -> int:
        """Trained elements of the original parameters whose views fall in ``rank``'s shard."""
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        return sum(max(0, min(hi, start + t.numel) - max(lo, start)) for start, t in self.offsets() if t.trains)


def check_fsdp1(parallel: Parallel, master_weights: bool, base_quant: str | None, lora: bool) -> None:
    """One line for each FSDP1 set-up that is not modelled (module docstring)."""
    if parallel.fsdp not in FSDP1_STRATEGIES:
        raise ConfigError(f"--fsdp-version 1 is modelled for --fsdp full (FULL_SHARD), grad-op (SHARD_GRAD_OP) and "
                          f"no-shard (NO_SHARD), got {parallel.fsdp!r}")
    if master_weights:
        raise ConfigError("--fsdp-version 1 is modelled without MixedPrecision: give a recipe with no fp32 masters "
                          "(pure-bf16, pure-bf16-bf16states, fp32)")
    if parallel.offload != "none":
        raise ConfigError("--fsdp-version 1 with --offload (FSDP1's CPUOffload) is not modelled; leave --offload out")
    if base_quant == "int8":
        raise ConfigError("--fsdp-version 1 with an int8 base is not modelled (bitsandbytes' Int8Params have no "
                          "storage dtype FSDP1 could flatten with the norms): give --base-quant nf4 or fp4, or "
                          "--fsdp-version 2")


def full_units(spec: ModelSpec, weight_bytes: int, parallel: Parallel) -> tuple[Unit, ...]:
    """Full fine-tuning: one unit per decoder layer, the root unit the rest; everything trains."""
    world, aligned = parallel.shard_size, parallel.fsdp_use_orig_params
    layers = [Unit(g.repeat, True, tuple(Flat(t.numel, weight_bytes, True) for t in g.tensors), world, aligned)
              for g in spec.param_groups if g.is_layer]
    root = tuple(Flat(t.numel, weight_bytes, True) for g in spec.param_groups if not g.is_layer for t in g.tensors)
    return (*layers, *((Unit(1, False, root, world, aligned),) if root else ()))


def lora_units(groups: tuple[HeldGroup, ...], parallel: Parallel, storage_bytes: int = 2) -> tuple[Unit, ...]:
    """LoRA (finetune_sharding.held_groups). With use_orig_params each layer's frozen base and adapters are one unit,
    the root the rest (peft's trained copies included); without it every trained tensor is a unit of its own and
    the layer's unit the frozen base (module docstring). A quantized weight's packed data is flattened as
    ``storage_bytes``-wide elements (bnb_4bit_quant_storage in the weights' dtype)."""
    world, aligned = parallel.shard_size, parallel.fsdp_use_orig_params

    def flat(x: Held) -> Flat:
        if x.packed:
            return Flat(-(-x.numel * x.itemsize // storage_bytes), storage_bytes, False)
        return Flat(x.numel, x.itemsize, x.trains)

    layers, adapters, root = [], [], []
    for g in groups:
        tensors = [flat(x) for x in g.tensors]
        if not aligned:
            adapters += [Unit(g.repeat, False, (t,), world, False, adapter=True) for t in tensors if t.trains]
            tensors = [t for t in tensors if not t.trains]
        if g.is_layer:
            layers.append(Unit(g.repeat, True, tuple(tensors), world, aligned))
        else:
            root += tensors
    units = (*layers, *adapters, *((Unit(1, False, tuple(root), world, aligned),) if root else ()))
    for u in units:
        if len({t.itemsize for t in u.tensors}) > 1:
            raise ConfigError("FSDP1 flattens one dtype per unit (_flat_param.py, _validate_tensors_to_flatten): give "
                              "--adapter-dtype equal to the weights' dtype")
    return units


@dataclass(frozen=True)
class Trained:
    """What the optimizer steps on the most loaded rank."""

    numel: int
    """Elements it updates (its states and temporaries follow them)."""
    whole: int
    """All trained elements (the unsharded model's)."""


def most_loaded(units: tuple[Unit, ...], flat_optimizer: bool) -> Trained:
    """The rank whose shards hold the most trained elements. ``flat_optimizer`` (use_orig_params=False): the
    optimizer steps the flat parameters themselves, padding included."""
    whole = sum(u.repeat * t.numel for u in units for t in u.tensors if t.trains)
    if flat_optimizer:
        return Trained(sum(u.repeat * u.shard for u in units if u.trains), whole)
    world = units[0].world if units else 1
    return Trained(max(sum(u.repeat * u.trained_in_shard(r) for u in units) for r in range(world)), whole)


def fsdp1_layout(units: tuple[Unit, ...], states_full: int, trained_state_base: int, parallel: Parallel,
                 layer_trained: int, kept_whole: int = 0, layer_gradient_shard: int | None = None) -> RankLayout:
    """One rank's FSDP1 states and buffers (module docstring). ``states_full``: the optimizer's states over
    ``trained_state_base`` trained elements; ``layer_trained``: the trained elements the step's layer walk counts
    gradients for in one layer (the whole layer in full fine-tuning, its adapters under LoRA); ``kept_whole``: bytes
    every rank keeps whole (a 4-bit base's quantization state); ``layer_gradient_shard``: where the adapters are
    units of their own, the elements of one layer's finished gradient shards (else its unit's shard)."""
    world = parallel.shard_size
    trained = most_loaded(units, not parallel.fsdp_use_orig_params)
    weights = sum(u.repeat * u.shard * u.itemsize for u in units) + kept_whole
    grads = sum(u.repeat * u.shard * u.itemsize for u in units if u.trains)
    states = -(-states_full * trained.numel // max(1, trained_state_base))
    layers = [u for u in units if u.is_layer]
    root = next((u for u in units if not u.is_layer and not u.adapter), None)
    layer = max(layers, key=lambda u: u.bytes) if layers else None
    buffers = _gather_buffers(layers, root, parallel, [u for u in units if u.adapter])
    buffers += _kept_gradients(parallel, grads)
    notes = ("FSDP1: flat parameters per unit, modelled from torch's fsdp/_flat_param.py and _runtime_utils.py; "
             "per-phase bytes checked on CPU processes (gloo), not on a GPU",)
    accumulated = sum(u.repeat * u.bytes for u in units if u.trains) if parallel.fsdp_no_sync else None
    shard_of = None
    if layer_gradient_shard is not None and layer_trained:
        shard_of = (layer_gradient_shard, layer_trained)  # (its adapters' shards, each a unit)
    elif layer is not None and layer_trained:
        shard_of = (layer.shard, layer_trained)  # a finished layer's gradient: its unit's shard, frozen part included
    flat = None
    if layer is not None and layer.trains:  # the views' gradients the layer walk does not count: the frozen ones
        flat = (sum(t.numel for t in layer.tensors if not t.trains) * layer.itemsize, layer.bytes)
    root_flat = root.bytes if root is not None and root.trains else 0
    return RankLayout(weights, grads, 0, states, trained.numel, world, tuple(buffers), False, notes=notes,
                      gradient_shard_bytes=0, head_gradient_sharded=False, gradient_shard_of=shard_of,
                      flat_gradient=flat, root_flat_gradient=root_flat, accumulated_gradients=accumulated)


def _gather_buffers(layers: list[Unit], root: Unit | None, parallel: Parallel,
                    adapters: list[Unit] | None = None) -> list[Buffer]:
    """The unsharded flat parameters (module docstring: FULL_SHARD, SHARD_GRAD_OP, the backward prefetch); an
    adapter wrapped apart is unsharded around its own module's forward and backward, inside its layer's."""
    step = ("forward", "backward")
    layer = max((u.bytes for u in layers), default=0)
    root_bytes = root.bytes if root is not None else 0
    adapters = adapters or []
    if parallel.fsdp == "no-shard":
        return []  # (the flat parameter is never sharded: unshard and reshard do nothing, _flat_param.py)
    if parallel.fsdp == "grad-op":
        every = sum(u.repeat * u.bytes for u in (*layers, *adapters)) + root_bytes
        phases = step if not parallel.fsdp_no_sync else step + ("optimizer",)
        return [Buffer("every unit's unsharded flat parameter (SHARD_GRAD_OP: kept from forward to backward"
                       + ("; under no_sync across the micro-batches" if parallel.fsdp_no_sync else "") + ")",
                       every, "parameters", phases, "_runtime_utils.py _post_forward_reshard, "
                       "_should_free_in_backward")]
    if not adapters:
        prefetched = Buffer("the next unit's unsharded flat parameter (BACKWARD_PRE prefetch)", layer, "parameters",
                            ("backward:layer", "backward:head"), "_runtime_utils.py _prefetch_handle")
        running_adapter = []
    else:
        prefetched = Buffer("the layer below's unsharded flat parameter, prefetched as this layer's backward ends",
                            layer, "parameters", ("backward:handoff",), "the adapters' units come between the "
                            "layers' in the execution order BACKWARD_PRE prefetches by (_exec_order_utils.py), so "
                            "the layer below is all-gathered only while this layer's first adapters and input norm "
                            "run their backward; a frozen unit is resharded when its inputs' gradients are made "
                            "(_runtime_utils.py _register_post_backward_reshard_only_hook); measured on gloo ranks")
        running_adapter = [Buffer("the running adapter's unsharded flat parameter (a unit of its own)",
                                  max(u.bytes for u in adapters), "parameters", ("forward:layer", "backward:layer"))]
    return [*running_adapter,
            Buffer("the root unit's unsharded flat parameter (embedding, final norm, LM head)", root_bytes,
                   "parameters", step, "the root is not resharded after forward (_post_forward_reshard)"),
            Buffer("the running unit's unsharded flat parameter", layer, "parameters",
                   ("forward:layer", "backward:layer")),
            prefetched]


def _kept_gradients(parallel: Parallel, grads: int) -> list[Buffer]:
    """use_orig_params: the sharded flat gradients outlive zero_grad."""
    if not (grads and parallel.fsdp_use_orig_params):
        return []
    return [Buffer("the sharded flat gradients, kept through zero_grad until the next forward", grads, "gradients",
                   ("between_steps",), "optimizer.zero_grad clears the original parameters' .grad views, not "
                   "flat_param.grad (_runtime_utils.py _reset_flat_param_grad_info_if_needed)")]


def fsdp1_rank_layout(spec: ModelSpec, recipe: Recipe, optimizer: Optimizer, states_full: int, parallel: Parallel,
                      finetune: FineTune | None = None) -> RankLayout:
    """One rank's FSDP1 layout for full fine-tuning (``states_full``: the optimizer's states over the whole model)
    or LoRA (``finetune``, as finetune_sharding.engine_finetune gives it; ``states_full`` unused)."""
    check_fsdp1(parallel, bool(recipe.master_weights), finetune.base_quant if finetune else None,
                finetune is not None)
    if finetune is None:
        units = full_units(spec, recipe.weight_bytes, parallel)
        layer = max((g.numel_each for g in spec.param_groups if g.is_layer), default=0)
        return fsdp1_layout(units, states_full, spec.num_parameters, parallel, layer)
    from .finetune_sharding import held_groups
    from .lora import trainables

    if spec.tied_embeddings and finetune.lora.train_modules:
        raise ConfigError("--fsdp-version 1 with trained copies of tied embeddings is not modelled")
    t = trainables(spec, recipe, optimizer, finetune)
    groups = held_groups(spec, recipe, finetune, t.adapter_bytes)
    units = lora_units(groups, parallel, recipe.weight_bytes)
    world = parallel.shard_size
    trained_layers = [[x.numel for x in g.tensors if x.trains] for g in groups if g.is_layer]
    layer = max((sum(numels) for numels in trained_layers), default=0)
    apart = None if parallel.fsdp_use_orig_params else max(
        (sum(-(-n // world) for n in numels) for numels in trained_layers), default=0)
    kept_whole = sum(g.repeat * x.whole_extra for g in groups for x in g.tensors)
    return fsdp1_layout(units, t.states, t.adapters + t.copies, parallel, layer, kept_whole, apart)
