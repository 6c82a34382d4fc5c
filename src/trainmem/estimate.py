"""The estimator: model spec + training settings -> where every byte of a training step goes.

Pure functions over frozen dataclasses; no torch. The entry points build on these types from above them, so the
import graph has no cycle: ``trainmem.estimate("llama-2-7b")`` (request.estimate) validates a request and calls
stepmodel.estimate_model, which compiles the step model and evaluates it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from .activations import ActivationEstimate
from .errors import ConfigError, ModelError
from .hardware import DEFAULT_CUDA_OVERHEAD_MIB, DEFAULT_FRAGMENTATION, GPUS, MIB, GPU
from .models import ModelSpec
from .optimizers import TRACEABLE_OPTIMIZERS, get_optimizer
from .recipes import get_recipe
from .settings import TrainingSettings
from .timeline import Phase

DEFAULT_HEADROOM = 1.25
"""The seed article's advice: pick a GPU with 1.2-1.3x the estimate."""
NO_PEAK = "no peak: without activations the step's peak is unknown, so whether it fits a GPU is unknown"


@dataclass(frozen=True)
class StaticComponent:
    """One part of the memory that lives for the whole run (weights, gradients, master weights, states)."""

    name: str
    dtype: str
    bytes: int
    bytes_per_param: float
    note: str = ""


MAX_HEADROOM = 10.0
MAX_CUDA_OVERHEAD_BYTES = 2**40
"""Bounds far above any real set-up (the seed's advice is 1.2-1.3x headroom; a CUDA context is a few hundred MiB)."""


@dataclass(frozen=True)
class DeviceOptions:
    """How allocated bytes become what the GPU must hold. Checked here, so the API refuses what the CLI refuses."""

    headroom: float = DEFAULT_HEADROOM
    fragmentation: float | None = None
    """An explicit caching-allocator overhead, a fraction of the dynamic memory (--fragmentation); None: replay the
    step through the allocator model (replay.py) and take its max_memory_reserved()."""
    cuda_overhead_bytes: int = DEFAULT_CUDA_OVERHEAD_MIB * MIB
    alloc_config: Any = None
    """allocator.AllocatorConfig the replay assumes (--alloc-conf or PYTORCH_CUDA_ALLOC_CONF); None: torch's
    defaults."""
    reserved_ratio: float | None = None
    """Set by a plan search: the replayed fragmentation ratio its fit checks apply (plan.search_ratio)."""

    def __post_init__(self) -> None:
        if not isinstance(self.headroom, (int, float)) or not 1.0 <= self.headroom <= MAX_HEADROOM:
            raise ConfigError(f"headroom must be a number from 1.0 to {MAX_HEADROOM:g}, got {self.headroom!r}")
        if self.fragmentation is not None and (not isinstance(self.fragmentation, (int, float))
                                               or not 0.0 <= self.fragmentation < 1.0):
            raise ConfigError(f"fragmentation must be in [0, 1), got {self.fragmentation!r}")
        if (isinstance(self.cuda_overhead_bytes, bool) or not isinstance(self.cuda_overhead_bytes, int)
                or not 0 <= self.cuda_overhead_bytes <= MAX_CUDA_OVERHEAD_BYTES):
            raise ConfigError(f"cuda_overhead_bytes must be an integer from 0 to {MAX_CUDA_OVERHEAD_BYTES:,}, got "
                              f"{self.cuda_overhead_bytes!r}")


@dataclass(frozen=True)
class Peak:
    phase: str
    moment: str
    allocated_bytes: int
    """Comparable to torch.cuda.max_memory_allocated()."""
    reserved_bytes: int
    """Comparable to torch.cuda.max_memory_reserved(): the allocator replay's (replay.py), or allocated + the flat
    fragmentation factor where it is given (--fragmentation) or there is no replay (``reserved_from``)."""
    device_bytes: int
    """Comparable to nvidia-smi: reserved + CUDA context and library workspaces."""
    required_bytes: int
    """device_bytes x headroom: what to look for in a GPU."""
    reserved_from: str = "flat"
    """How reserved_bytes was found: "replay" (the estimate's allocations through the allocator model), "ratio"
    (the replayed fragmentation of a reference step, applied in a search), "flat" (a fraction of the dynamic
    memory)."""

    def fits(self, gpu: GPU) -> bool:
        return self.required_bytes <= gpu.memory_bytes


@dataclass(frozen=True)
class Estimate:
    model: ModelSpec
    settings: TrainingSettings
    static: tuple[StaticComponent, ...]
    activations: ActivationEstimate | None = None
    activation_k_bytes: int | None = None
    """Set when --activation-k replaced the architecture model with the seed's b*s*h*L*k*2 rule."""
    phases: tuple[Phase, ...] = ()
    peak: Peak | None = None
    device: DeviceOptions = field(default_factory=DeviceOptions)
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    """What makes the set-up itself doubtful (a sequence past the model's position limit), not the estimate."""
    gpu: GPU | None = None
    """The GPU asked about, if any: ``fits()`` answers for it."""
    parallel: Any = None
    """sharding.Parallel: how many GPUs and which engine; every figure is then per GPU."""
    rank: Any = None
    """sharding.RankLayout of one GPU under a data-parallel engine (its buffers, host memory), None on one GPU."""
    finetune: Any = None
    """lora.FineTune when adapters train on a frozen (possibly quantized) base."""
    per_rank: tuple[Any, ...] = ()
    """modelparallel.RankRole of each kind of rank of a model-parallel layout; the figures above are the most
    loaded one's."""
    rank_model: ModelSpec | None = None
    """The part of the model that most loaded rank holds (its heads, layers, experts), when model parallel."""
    in_flight_bytes: int = 0
    """Activations of the other micro-batches a pipeline stage keeps while it computes one."""
    traced: Any = None
    """recorded.Recorded when the traced path answered (a model_type without a hand-written description)."""
    allocation_log: Any = None
    """allocator.AllocationLog the replay ran (replay.step_sequence), where reserved memory was replayed: the
    report (``allocator``) and the fit checks on a card (``fits``) replay it."""
    paged_bytes: int = 0
    """Optimizer states in CUDA unified memory (bitsandbytes' paged optimizers: cudaMallocManaged), per GPU. Not in
    ``static``, the phases or the peak: torch.cuda.max_memory_allocated() does not count them and the driver can
    evict them to host memory, so what "fits" compares leaves them out; resident, they are on the device too."""
    replayed: Any = field(default=None, repr=False, compare=False)
    """allocator.ReplayReport of ``allocation_log``, where the estimate already replayed it (stepmodel: the same
    pass gave the peak's reserved bytes); ``allocator`` replays the log where it is None."""

    @property
    def per_gpu(self) -> bool:
        return self.rank is not None or bool(self.per_rank)

    @property
    def static_bytes(self) -> int:
        return sum(c.bytes for c in self.static)

    def component(self, name: str) -> StaticComponent:
        for c in self.static:
            if c.name == name:
                return c
        raise ModelError(f"no static component {name!r}; accepted: {', '.join(c.name for c in self.static)}")

    @property
    def activation_bytes(self) -> int | None:
        """Saved for backward at the end of forward, logits included (the JSON's activations.bytes)."""
        if self.activation_k_bytes is not None:
            return self.activation_k_bytes
        if self.activations is None:
            return None
        return self.activations.saved_bytes + self.activations.logits_bytes + self.in_flight_bytes

    @functools.cached_property
    def allocator(self) -> Any:
        """allocator.ReplayReport of the step's replay (replay.py) where reserved memory was replayed, else None:
        the estimate's own (``replayed``), else made on first use. Its segments at the peak take one more pass,
        when they are asked for (the JSON, --explain-reserved)."""
        if self.allocation_log is None or self.peak is None or self.peak.reserved_from != "replay":
            return None
        if self.replayed is not None:
            return self.replayed
        from .allocator import DEFAULT_CONFIG, replay

        return replay(self.allocation_log, self.device.alloc_config or DEFAULT_CONFIG, steps=2)

    def fits(self, gpu: GPU | None = None) -> bool | None:
        """Whether the step's required memory fits ``gpu`` (default: the one asked about); None when no peak could
        be computed."""
        gpu = gpu or self.gpu
        if gpu is None:
            raise ConfigError("fits() needs a GPU: pass one, or ask estimate(..., gpu=NAME)")
        if self.peak is None:
            return None
        return self.peak.fits(gpu) or self.capacity_on(gpu) is not None

    def capacity_on(self, gpu: GPU) -> int | None:
        """Where the replayed step needs more than ``gpu`` by its unlimited max_memory_reserved() but its allocated
        bytes fit: the card's memory / headroom less the CUDA context if the replay runs there (the allocator frees
        its cache before it fails: allocator.runs_within), else None."""
        peak, log = self.peak, self.allocation_log
        if peak is None or log is None or peak.reserved_from != "replay":
            return None
        from .allocator import DEFAULT_CONFIG, runs_within

        capacity = int(gpu.memory_bytes / self.device.headroom) - self.device.cuda_overhead_bytes
        if capacity < peak.allocated_bytes:
            return None
        return capacity if runs_within(log, capacity, self.device.alloc_config or DEFAULT_CONFIG) else None

    def fit_table(self) -> dict[str, bool | None]:
        return {name: self.fits(gpu) for name, gpu in GPUS.items()}


def static_components(model: ModelSpec, settings: TrainingSettings) -> tuple[StaticComponent, ...]:
    """Weights, gradients, master weights and optimizer states, each in bytes.

    Gradients have the size of the trainable parameters in the recipe's gradient dtype (``param.grad`` is
    allocated like its parameter; Megatron's fp32 main-grad buffer replaces it). The optimizer keeps its
    states for the tensors it updates: the fp32 master copy where the recipe has one, else the parameters.
    """
    recipe = get_recipe(settings.recipe)
    optimizer = get_optimizer(settings.optimizer)
    n = model.num_parameters
    state_bytes = recipe.state_bytes_for(optimizer.name)
    # a paged optimizer's large states are in unified memory, not allocated by torch: reported apart (paged_bytes)
    states = optimizer.state_bytes(model.param_groups, state_bytes) - optimizer.paged_bytes(model.param_groups,
                                                                                            state_bytes)
    state_dtype = "uint8+fp32" if optimizer.name.endswith("8bit") else \
        recipe.optimizer_states if state_bytes == recipe.state_bytes else recipe.weights
    note = optimizer.states + (" (paged: the states of tensors of 1e5+ elements are in unified memory, reported "
                               "apart)" if optimizer.paged else "")
    gradients, gradient_note = n * recipe.gradient_bytes, "param.grad, same shape as the parameters"
    if model.vocab_shards > 1 and model.has_embedding and model.has_architecture:
        # DTensor (torch 2.13) returns the vocabulary-parallel embedding's gradient replicated: every rank gets the
        # whole V x h (traced); Megatron's VocabParallelEmbedding keeps it sharded.
        rows = model.vocab_size * (model.vocab_shards - 1)
        gradients += rows * (model.embedding_dim or model.hidden_size) * recipe.gradient_bytes
        gradient_note += "; the embedding's whole (replicated by DTensor's vocabulary-parallel backward)"
    weights, weights_note = n * recipe.weight_bytes, "model parameters"
    if model.buffer_bytes:  # (GPT-J's position table, GPT-BigCode's causal mask: ModelSpec.buffer_bytes)
        weights += model.buffer_bytes
        weights_note += f" and {model.buffer_bytes:,} bytes of buffers"
    return (
        StaticComponent("weights", recipe.weights, weights,
                        recipe.weight_bytes if weights == n * recipe.weight_bytes else weights / n, weights_note),
        StaticComponent("gradients", recipe.gradients, gradients,
                        recipe.gradient_bytes if gradients == n * recipe.gradient_bytes else gradients / n,
                        gradient_note),
        StaticComponent("master_weights", recipe.master_weights or "-", n * recipe.master_bytes, recipe.master_bytes,
                        "fp32 copy the optimizer updates" if recipe.master_weights else "none in this recipe"),
        StaticComponent("optimizer_states", state_dtype, states, states / n, note),
    )


def paged_state_bytes(model: ModelSpec, settings: TrainingSettings) -> int:
    """The optimizer's states in unified memory on one GPU (0 unless the optimizer is paged): optimizers.py."""
    optimizer = get_optimizer(settings.optimizer)
    if not optimizer.paged:
        return 0
    return optimizer.paged_bytes(model.param_groups, get_recipe(settings.recipe).state_bytes_for(optimizer.name))


def dynamic_bytes(top: Phase) -> int:
    """What the step allocates and frees at its peak phase (the flat factor's base)."""
    return top.activations + top.temporaries + (top.gradients if top.name == "backward" else 0)


def peak_of_phases(phases: tuple[Phase, ...], device: DeviceOptions, reserved: int | None = None,
                   ratio: float | None = None) -> Peak:
    """The step's peak: its largest phase (the earliest on a tie), and what the GPU must hold for it. Reserved
    memory: --fragmentation where given, else the replay's ``reserved`` (replay.py), else allocated + ``ratio`` of
    the dynamic memory (a replayed ratio), else the flat DEFAULT_FRAGMENTATION (no replay: no architecture)."""
    top = max(phases, key=lambda ph: ph.allocated_bytes)
    dynamic = dynamic_bytes(top)
    if device.fragmentation is not None or (reserved is None and ratio is None):
        source, fraction = "flat", DEFAULT_FRAGMENTATION if device.fragmentation is None else device.fragmentation
        total = top.allocated_bytes + int(fraction * dynamic)
    elif reserved is not None:
        source, total = "replay", max(reserved, top.allocated_bytes)
    else:
        assert ratio is not None
        source, total = "ratio", top.allocated_bytes + int(ratio * dynamic)
    device_bytes = total + device.cuda_overhead_bytes
    return Peak(top.name, top.moment, top.allocated_bytes, total, device_bytes, int(device_bytes * device.headroom),
                source)


def position_warning(model: ModelSpec, seq: int) -> str | None:
    """A warning when ``seq`` is past the length the model was built for and nothing extends it."""
    limit = model.position_limit
    if limit is None or seq <= limit:
        return None
    if model.position_table_rows:
        return (f"seq {seq:,} is past {model.name}'s {limit:,} positions: its learned position table has no row for "
                "the later tokens, so a real run fails (the estimate is for a model that had them)")
    return (f"seq {seq:,} is past {model.name}'s max_position_embeddings ({limit:,}) and its config has no RoPE "
            "scaling (rope_scaling / rope_parameters): the model runs, but it was not trained for this length")


def validation_notes(model: ModelSpec, settings: TrainingSettings) -> tuple[str, ...]:
    """What in this set-up no trace has checked (docs/accuracy.md lists the validated ground)."""
    notes = []
    if settings.optimizer not in TRACEABLE_OPTIMIZERS:
        notes.append(f"not validated: optimizer {settings.optimizer!r} is not traced (torch has no implementation to "
                     "run); its states follow its library's documented layout")
    if settings.loss == "chunked":
        notes.append("not validated: --loss chunked has no transformers implementation to trace")
    if settings.compile:
        notes.append("not validated on a GPU: --compile is checked against the aot_eager_decomp_partition trace "
                     "(within 0.3%: docs/accuracy.md, Matrix: --compile), whose unfused graphs make the SiLU's fp32 "
                     "intermediates that inductor fuses away, so a real compiled step may hold less"
                     + ("; the chunked-output loss is counted as inductor's generated code allocates (compiled_loss.py)"
                        if settings.loss == "chunked-output" else ""))
    if settings.compile and settings.checkpointing == "full":
        notes.append("not validated: --compile with --checkpointing full (the trace does not run a compiled "
                     "layer inside its checkpoint yet); the recomputed layer keeps what a compiled layer keeps")
    if settings.attention == "flash":
        notes.append("not validated: --attention flash (flash_attention_2) needs the flash-attn package and a GPU, so "
                     "it is not traced; its terms are those of SDPA's flash kernel")
    return tuple(notes)


def fits_at_least(allocated: int, device: DeviceOptions, gpu: GPU) -> bool:
    """Whether a step whose peak allocates at least ``allocated`` bytes can fit ``gpu``: what the GPU must hold
    for it (peak_of_phases, less the fragmentation of the part that changes) is within its memory."""
    return int((allocated + device.cuda_overhead_bytes) * device.headroom) <= gpu.memory_bytes
