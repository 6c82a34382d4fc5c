"""``trainmem plan``: the layouts that fit a GPU, ranked by a stated time model.

The search: recipe x engine (DDP, ZeRO 1-3, FSDP2 full / grad-op / hybrid) x activation checkpointing (none, full;
layer-selective, every second layer, is modelled but written by no engine) x offload x micro-batch, for a global
batch of sequences split evenly over the data-parallel ranks (micro-batch x accumulation = global batch / data
parallel); and tensor parallelism (with sequence parallelism, inside a node) x pipeline stages (1F1B, the
accumulated micro-batches through the pipeline) x context parallelism (from 16k tokens) x expert parallelism (MoE),
as torchtitan runs them: with FSDP2 full sharding or DDP over the data-parallel ranks (modelparallel.py), and tensor
x pipeline parallelism with ZeRO-1 as Megatron-DeepSpeed runs them. Each layout's memory is the estimator's
(stepmodel.py: compiled once per recipe, engine, checkpointing and offload, each pipeline stage shared by the
layouts that hold it); memory grows with the micro-batch, so the largest that fits is looked for by galloping from
the last answer of the same degrees, then bisection (largest_fitting), each probe ruled out by a lower bound where
it can be, and the larger ones are counted as searched without being evaluated. What is not searched is listed in
NOT_SEARCHED; a layout no engine's files run as planned (engine_configs.writers) is not offered. The work is
bounded: at most MAX_PLAN_GPUS GPUs and MAX_GLOBAL_BATCH sequences, and ``time_budget_s`` seconds when given
(PlanSearch.cut_short).

The time model ranks; it does not promise seconds (docs/method.md, "The plan's time model"):

- compute: model FLOPs per token 6 N (forward and backward; N the active parameters) plus causal attention's
  q.k and p.v over the keys each query sees (6 L a (d_qk + d_v) s / 2), plus the forward again under full
  checkpointing (Narayanan et al. 2021, "Efficient large-scale language model training"; Korthikanti et al. 2022),
  at ``mfu`` (default 0.4) of the GPU's peak dense bf16 FLOPS (hardware.THROUGHPUT);
- communication, per GPU, ring collectives moving (n - 1) / n of the bytes: DDP and ZeRO-1 all-reduce the gradients
  once a step (2 x); ZeRO-2 and FSDP2 grad-op reduce-scatter them every micro-batch and all-gather the updated
  parameters once; ZeRO-3 and FSDP2 full all-gather the parameters in forward and in backward and reduce-scatter the
  gradients, every micro-batch (3 x); FSDP2 hybrid does that inside a node and all-reduces the gradients across
  nodes. Inside a node at the GPU's link bandwidth, across nodes at ``inter_node_gbps`` per GPU;
- communication overlaps compute entirely (a lower bound: time = max(compute, communication)); offloaded states
  cross the GPU's host link (gradients down and parameters up every step; offloaded parameters every micro-batch
  in forward and backward), which is added, not overlapped;
- tensor parallelism divides the compute by T and adds, on the critical path (not overlapped), two all-gathers and
  two reduce-scatters of a micro-batch's hidden states per layer in forward and as many in backward (sequence
  parallelism; the volume of Megatron's four all-reduces), and two more with full checkpointing, over the node's
  link; pipeline parallelism divides the compute by P, adds the 1F1B bubble ((P - 1) / M of the compute: Narayanan
  et al. 2021) and each micro-batch's hidden states sent forward and their gradient back between stages; context
  parallelism divides the compute by C and exposes each layer's key/value all-gather (and the gradients'
  reduce-scatter); expert parallelism exposes two all-to-alls per MoE layer each way of every routed token copy.
"""

from __future__ import annotations

import functools
import gc
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, ParamSpec, TypeVar

from .errors import ConfigError
from .estimate import DeviceOptions, Estimate, Peak
from .hardware import (DEFAULT_HOST_MEMORY_GIB, DEFAULT_INTER_NODE_GBPS, GPU, THROUGHPUT, Throughput)
from .modelparallel import check_layout, divisors, tensor_parallel_spec
from .models import ModelSpec
from .recipes import DTYPE_BYTES, get_recipe
from .settings import SELECTIVE_EVERY, make_settings
from .sharding import Parallel
from .stepmodel import StepModel, compile_step

if TYPE_CHECKING:
    import os

    from .lora import FineTune

_P = ParamSpec("_P")
_R = TypeVar("_R")

TIME_MODEL = ("step = max(compute, communication) + offload + exposed; compute = model FLOPs (6N + causal attention, "
              "+ the forward again under full checkpointing) / (tp x pp) at mfu x peak dense bf16 FLOPS, x (1 + "
              "(pp - 1) / micro-batches) for the 1F1B bubble; communication = ring collectives of the data-parallel "
              "engine over the node's link or the inter-node bandwidth; offload = PCIe traffic of offloaded states; "
              "exposed = tensor-parallel collectives (4 per layer each way), pipeline sends, context-parallel "
              "key/value gathers and expert-parallel all-to-alls, not overlapped")
"""The time model in one line, for the JSON document (the module docstring and docs/method.md in full)."""

PLAN_RECIPES = ("mixed-bf16", "amp-bf16", "pure-bf16-bf16states")
"""Searched unless --recipe names one: the bf16 recipes some engine's files run (fp32 and fp16 ones change the
numerics, not just memory; pure-bf16, fp32 states without a master copy, is no engine's setting: engine_configs)."""
BF16_STATES_NOTE = ("bf16 optimizer states (pure-bf16-bf16states, marked *): the usual recipe is mixed-bf16, fp32 "
                    "master weights and Adam states; in pure bf16 an update smaller than half a weight's last bit "
                    "rounds away (trainmem precision-check counts how many), so give --recipe mixed-bf16 to plan "
                    "with the usual one")
"""What a plan that relies on bf16 optimizer states says about it (the table's mark and the JSON's note)."""
DEFAULT_MFU = 0.4
"""Fraction of peak FLOPS the model's matmuls reach: 0.4 is typical of well-tuned dense training at scale (Chowdhery
et al. 2022 report 46% for PaLM 540B; Megatron-LM reports 41-48% on A100/H100)."""
MAX_MIN_GPUS = 1 << 16
MAX_PLAN_GPUS = 1 << 16
"""The most GPUs one search takes (and --min-gpus looks at): 65,536, past the largest published training runs."""
MAX_GLOBAL_BATCH = 1 << 20
"""The most sequences a step's global batch may hold (1,048,576: at 2,048 tokens, two billion tokens a step, two
orders of magnitude past the largest published batches; also the most micro-batches a pipeline takes); its divisors
are the micro-batches searched."""
MFU_RANGE = (0.01, 1.0)
INTER_NODE_GBPS_RANGE = (0.01, 100_000.0)
"""GB/s per GPU between nodes: from a slow Ethernet link to far past any fabric built (NVLink switch systems: 900)."""
HOST_MEMORY_GIB_RANGE = (0.0, float(1 << 20))
"""Host memory per node, GiB: up to 1 PiB."""
NOT_SEARCHED = ("context parallelism below 16,384 tokens (estimate it with --cp)",
                "the interleaved pipeline schedule (estimate it with --pp-schedule interleaved)",
                "ZeRO-2 and ZeRO-3 with tensor or pipeline parallelism, and ZeRO with context or expert parallelism "
                "(DeepSpeed's pipeline engine takes ZeRO-1 only; Megatron-DeepSpeed's sequence and expert "
                "parallelism are schemes of their own); offload with tensor or pipeline parallelism",
                "selective checkpointing (layer-selective, every second layer, is estimated with trainmem estimate "
                "--checkpointing selective, but no engine's file sets it: torchtitan 0.3.0's SelectiveAC is per-op)",
                "pure-bf16 (fp32 Adam states over bf16 weights without a master copy): no engine's file sets it")
MAX_PIPELINE_STAGES = 16
CONTEXT_PARALLEL_FROM = 16_384
"""Context parallelism is searched for sequences this long or longer (below, its gathers cost more than the memory
it saves buys: estimate it with --cp)."""


@dataclass(frozen=True)
class Layout:
    recipe: str
    engine: str
    """DDP, ZeRO-1..3, FSDP2 full, FSDP2 grad-op, FSDP2 hybrid, or one GPU."""
    zero: int | None
    fsdp: str | None
    offload: str
    checkpointing: str
    micro_batch: int
    grad_accum: int
    gpus: int
    gpus_per_node: int
    tp: int = 1
    """Tensor parallel degree, with sequence parallelism when above 1."""
    pp: int = 1
    """Pipeline stages (1F1B); the grad_accum micro-batches go through the pipeline."""
    cp: int = 1
    """Context parallel degree: the sequence split across cp GPUs."""
    ep: int = 1
    """Expert parallel degree (MoE), taken from the data-parallel x context-parallel ranks."""

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def model_parallel(self) -> int:
        """GPUs one copy of the model's compute is split over (EP splits experts, not the work per token)."""
        return self.tp * self.pp * self.cp

    @property
    def parallel(self) -> Parallel:
        return Parallel(gpus=self.gpus, gpus_per_node=self.gpus_per_node, zero=self.zero, fsdp=self.fsdp,
                        offload=self.offload, tp=self.tp, sp=self.tp > 1, pp=self.pp,
                        micro_batches=self.grad_accum if self.pp > 1 else 0, cp=self.cp, ep=self.ep)

    def as_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "engine": self.engine, "zero": self.zero, "fsdp": self.fsdp,
                "offload": self.offload, "checkpointing": self.checkpointing, "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum, "gpus": self.gpus, "gpus_per_node": self.gpus_per_node,
                "nodes": math.ceil(self.gpus / self.gpus_per_node), "data_parallel": self.data_parallel,
                "tensor_parallel": self.tp, "sequence_parallel": self.tp > 1, "pipeline_parallel": self.pp,
                "context_parallel": self.cp, "expert_parallel": self.ep}


@dataclass(frozen=True)
class StepTime:
    compute_seconds: float
    """Model FLOPs on this GPU at mfu, the pipeline bubble included."""
    communication_seconds: float
    """The data-parallel engine's collectives, overlapped with compute."""
    offload_seconds: float
    tokens_per_gpu: int
    exposed_seconds: float = 0.0
    """Tensor-parallel collectives and pipeline sends, on the critical path."""

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.communication_seconds) + self.offload_seconds + self.exposed_seconds

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "compute_seconds": self.compute_seconds,
                "communication_seconds": self.communication_seconds, "offload_seconds": self.offload_seconds,
                "exposed_communication_seconds": self.exposed_seconds,
                "tokens_per_second_per_gpu": self.tokens_per_gpu / self.seconds if self.seconds else None}


@dataclass(frozen=True)
class Plan:
    layout: Layout
    peak: Peak
    time: StepTime
    host_bytes_per_node: int
    step: StepModel = field(repr=False, compare=False)
    seq: int = 0
    finetune: FineTune | None = field(default=None, repr=False)
    """The LoRA adapters the search trained (lora.FineTune), or None: full fine-tuning."""

    @property
    def estimate(self) -> Estimate:
        """The full estimate of this layout (as `trainmem estimate` gives it for the same flags), built when asked:
        a search keeps only the peak of every fitting layout."""
        L = self.layout
        settings = make_settings(recipe=L.recipe, checkpointing=L.checkpointing, seq=self.seq, batch=L.micro_batch,
                                 grad_accum=L.grad_accum)
        step = compile_step(self.step.spec, settings, self.step.device, L.parallel if L.gpus > 1 else None,
                            self.finetune)
        return step.estimate(L.micro_batch, self.seq)


@dataclass(frozen=True)
class PlanSearch:
    model: ModelSpec
    plans: tuple[Plan, ...]
    """Every fitting layout, fastest first."""
    candidates: int
    evaluated: int
    fitting: int
    seconds: float
    gpu: GPU
    gpus: int
    seq: int
    global_batch: int
    mfu: float
    inter_node_gbps: float
    host_memory_bytes: int
    skipped: tuple[str, ...] = field(default=())
    """Engines left out of this search, and why."""
    cut_short: bool = False
    """True when the time budget (or a cap) ended the search before every layout was looked at: the plans are the
    ones found by then, and a faster or fitting layout may be missing."""
    finetune: FineTune | None = field(default=None, repr=False)
    """The LoRA adapters searched (lora.FineTune), or None: full fine-tuning."""


def _engines(gpus: int, gpus_per_node: int) -> list[tuple[str, int | None, str | None, tuple[str, ...]]]:
    """(label, zero, fsdp, offloads) of every data-parallel engine for ``gpus`` GPUs."""
    if gpus == 1:
        return [("one GPU", None, None, ("none",))]
    engines = [("DDP", None, None, ("none",)), ("ZeRO-1", 1, None, ("none", "optimizer")),
               ("ZeRO-2", 2, None, ("none", "optimizer")), ("ZeRO-3", 3, None, ("none", "optimizer",
                                                                                  "optimizer+params")),
               ("FSDP2 full", None, "full", ("none", "optimizer+params")),
               ("FSDP2 grad-op", None, "grad-op", ("none",))]
    if gpus > gpus_per_node and gpus % gpus_per_node == 0:
        engines.append(("FSDP2 hybrid", None, "hybrid", ("none",)))
    return engines


def _rank_parameters(spec: ModelSpec, layout: Layout) -> float:
    """Parameters one GPU's data-parallel engine reduces: the rank's share under TP and EP, over P stages."""
    if layout.tp == layout.ep == 1:
        return spec.num_parameters / layout.pp
    return tensor_parallel_spec(spec, Parallel(gpus=layout.gpus, tp=layout.tp, ep=layout.ep, cp=layout.cp,
                                               pp=layout.pp)).num_parameters / layout.pp


def _model_parallel_engines(data_parallel: int, cp: int = 1,
                            ep: int = 1) -> list[tuple[str, int | None, str | None, tuple[str, ...]]]:
    """The data-parallel engines combined with model parallelism: torchtitan's FSDP2 full sharding or DDP
    replication, and, with tensor and pipeline parallelism alone, Megatron-DeepSpeed's ZeRO-1 (the pipeline engine
    refuses ZeRO-2 and 3)."""
    if data_parallel == 1:
        return [("no data parallelism", None, None, ("none",))]
    engines: list[tuple[str, int | None, str | None, tuple[str, ...]]] = [("FSDP2 full", None, "full", ("none",)),
                                                                           ("DDP", None, None, ("none",))]
    if cp == ep == 1:
        engines.append(("ZeRO-1", 1, None, ("none",)))
    return engines


def model_parallel_degrees(spec: ModelSpec, gpus: int, gpus_per_node: int,
                           seq: int) -> list[tuple[int, int, int, int]]:
    """(tp, pp, cp, ep) worth searching: TP (with SP) inside a node, dividing the heads, kv heads, MLP width and the
    sequence; PP dividing the layers, up to MAX_PIPELINE_STAGES; CP (up to 8) from CONTEXT_PARALLEL_FROM tokens on;
    EP (MoE only) dividing the experts and the data-parallel x context-parallel ranks; tp x pp x cp dividing the
    GPUs."""
    contexts = [c for c in (1, 2, 4, 8) if c == 1 or seq >= CONTEXT_PARALLEL_FROM]
    experts = min((layer.moe.num_experts for layer, _ in spec.layer_runs if layer.moe), default=1)
    out = []
    for tp in divisors(gpus_per_node):
        for pp in [d for d in divisors(spec.num_layers) if d <= MAX_PIPELINE_STAGES]:
            for cp in contexts:
                if gpus % (tp * pp * cp):
                    continue
                group = gpus // (tp * pp * cp) * cp
                for ep in [e for e in divisors(experts) if group % e == 0]:
                    if (tp, pp, cp, ep) != (1, 1, 1, 1):
                        try:
                            check_layout(spec, Parallel(gpus=gpus, tp=tp, sp=tp > 1, pp=pp, cp=cp, ep=ep), seq)
                        except ConfigError:
                            continue
                    out.append((tp, pp, cp, ep))
    return out


def throughput_of(gpu: GPU) -> Throughput:
    try:
        return THROUGHPUT[gpu.name]
    except KeyError:
        raise ConfigError(f"--gpu {gpu.name}: trainmem plan needs its peak FLOPS and link bandwidths, which its data "
                          f"sheet does not give; accepted: {', '.join(THROUGHPUT)}") from None


def step_time(spec: ModelSpec, layout: Layout, seq: int, gpu: GPU, mfu: float = DEFAULT_MFU,
              inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS, trained: int | None = None) -> StepTime:
    """The time model of one optimizer step on one GPU (module docstring). ``trained``: the parameters that train
    where it is not all of them (LoRA): backward then computes the inputs' gradients only (2 FLOPs per
    multiply-add instead of 4: forward x 2 + recompute, not x 3), and only their gradients are reduced and
    offloaded; the frozen base is still gathered (ZeRO-3, FSDP2)."""
    sheet = throughput_of(gpu)
    recipe = get_recipe(layout.recipe)
    sequences = layout.micro_batch * layout.grad_accum  # per data-parallel rank, i.e. per model replica
    tokens = sequences * seq
    split = layout.model_parallel
    n = spec.num_active_parameters
    # the share of the layers whose forward runs again in backward
    full = {"none": 0.0, "full": 1.0}[layout.checkpointing] if layout.checkpointing != "selective" else \
        -(-spec.num_layers // SELECTIVE_EVERY) / spec.num_layers
    # multiply-adds per token of q.k^T and p.v in forward, over the keys a query sees (half the sequence on
    # average under the causal mask, or the window)
    attention_macs = 0.0
    for layer, count in spec.layer_runs:
        att = layer.attention
        keys = min(seq / 2, layer.sliding_window or seq)
        attention_macs += count * att.num_heads * (att.head_dim + att.v_head_dim) * keys
    # forward 2 FLOPs per multiply-add; backward twice the forward; full checkpointing recomputes the forward
    forward = 2 * n + 2 * attention_macs
    flops = tokens * forward * ((3 if trained is None else 2) + full) / split
    bubble = (layout.pp - 1) / layout.grad_accum  # 1F1B: (P - 1) micro-batch slots idle per M (Narayanan 2021)
    compute = flops * (1 + bubble) / (sheet.dense_tflops * 1e12 * mfu)

    p, g, w = _rank_parameters(spec, layout), recipe.gradient_bytes, recipe.weight_bytes
    pg = p if trained is None else trained / layout.pp  # what the engine reduces gradients of
    dp, node = layout.data_parallel * layout.cp, layout.gpus_per_node  # (gradients are reduced over dp x cp)
    ring = (dp - 1) / dp if dp > 1 else 0.0
    bandwidth = (sheet.link_gbps if layout.gpus <= node else min(sheet.link_gbps, inter_node_gbps)) * 1e9
    micro = layout.grad_accum
    exposed = 0.0
    compute_bytes = DTYPE_BYTES[recipe.compute]
    hidden_states = layout.micro_batch * seq // layout.cp * spec.hidden_size * compute_bytes
    layers = spec.num_layers / layout.pp
    if layout.tp > 1:  # 4 collectives per layer forward and backward (+2 recomputing), each (T - 1) / T moved
        collectives = micro * layers * (8 + 2 * full)
        exposed += collectives * hidden_states * (layout.tp - 1) / layout.tp / (sheet.link_gbps * 1e9)
    if layout.cp > 1:  # keys and values all-gathered per layer in forward (and recomputing), dK dV reduce-scattered
        att = spec.layer_runs[0][0].attention
        kv_width = att.num_kv_heads * (att.head_dim + att.v_head_dim) // layout.tp
        kv = layout.micro_batch * seq * kv_width * compute_bytes
        cp_link = sheet.link_gbps if layout.tp * layout.cp <= node else min(sheet.link_gbps, inter_node_gbps)
        exposed += micro * layers * (2 + full) * kv * (layout.cp - 1) / layout.cp / (cp_link * 1e9)
    if layout.ep > 1:  # all-to-all dispatch and combine per MoE layer, forward and backward (+2 recomputing)
        moe_layers = sum(count for layer, count in spec.layer_runs if layer.moe) / layout.pp
        top_k = max(layer.moe.top_k for layer, _ in spec.layer_runs if layer.moe)
        ep_link = sheet.link_gbps if layout.gpus <= node else min(sheet.link_gbps, inter_node_gbps)
        exposed += (micro * moe_layers * (4 + 2 * full) * top_k * hidden_states * (layout.ep - 1) / layout.ep
                    / (ep_link * 1e9))
    if layout.pp > 1:  # each micro-batch's activations forward and their gradient back, between stages
        stage_link = sheet.link_gbps if split <= node else min(sheet.link_gbps, inter_node_gbps)
        exposed += micro * 2 * hidden_states / (stage_link * 1e9)
    # (the engine by its typed fields, zero and fsdp: Layout.engine is display text)
    if dp == 1:
        volume = 0.0
    elif layout.zero in (None, 1) and layout.fsdp is None:  # DDP, ZeRO-1
        volume = 2 * pg * g
    elif layout.zero == 2 or layout.fsdp == "grad-op":
        volume = micro * pg * g + pg * w
    elif layout.fsdp == "hybrid":
        inside = micro * (2 * p * w + pg * g) * ((node - 1) / node)
        nodes = dp // node
        across = 2 * (pg / node) * g * ((nodes - 1) / nodes)
        communication = inside / (sheet.link_gbps * 1e9) + across / (inter_node_gbps * 1e9)
        volume = None
    else:  # ZeRO-3, FSDP2 full
        volume = micro * (2 * p * w + pg * g)
    if volume is not None:
        communication = volume * ring / bandwidth
    offload = 0.0
    shard = p / dp
    if layout.offload != "none":
        offload += pg / dp * (g + w) / (sheet.host_gbps * 1e9)  # gradients down, updated parameters up, every step
    if layout.offload == "optimizer+params":
        offload += micro * 2 * shard * w / (sheet.host_gbps * 1e9)  # the parameter shards, forward and backward
    return StepTime(compute, communication, offload, tokens // split, exposed)


def largest_fitting(count: int, peak_at: Callable[[int], Peak | None],
                    guess: int | None = None) -> tuple[int, Peak | None, int]:
    """The largest index in range(count) whose ``peak_at(index)`` is a Peak (it fits), given that the ones that fit
    are those up to some index (memory grows with the micro-batch); (index, peak, probes made), or (-1, None,
    probes) where none fits. With a ``guess`` it gallops from it (1, 2, 4, ... indices away) until the answer is
    bracketed, so that a layout like the last one is settled in two probes; then bisection."""
    best: tuple[int, Peak | None]
    low, high, best, probes = 0, count - 1, (-1, None), 0

    def probe(index: int) -> bool:
        nonlocal low, high, best, probes
        probes += 1
        peak = peak_at(index)
        if peak is not None:
            best, low = (index, peak), index + 1
            return True
        high = index - 1
        return False

    if guess is not None and count:
        # gallop from the guess (1, 2, 4, ... away) until the answer is bracketed
        guess, step = min(guess, count - 1), 1
        if probe(guess):
            while low <= high and probe(min(guess + step, high)):
                step *= 2
        else:
            while low <= high and not probe(max(guess - step, low)):
                step *= 2
    while low <= high:
        probe((low + high) // 2)
    return best[0], best[1], probes


def _cycle_collection_paused(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """Runs ``function`` with the cyclic garbage collector paused. A search makes and drops a few hundred thousand
    small objects that reference counting frees (none is in a cycle); the collector would otherwise walk the ones
    the search keeps again and again (about a tenth of a search's time, benchmarks/plan_speed.py)."""

    @functools.wraps(function)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not gc.isenabled():
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()

    return paused


class _OutOfTime(Exception):
    """The search's time budget is spent: what was found so far is the answer (PlanSearch.cut_short)."""


def _check_number(name: str, value: object, low: float, high: float, unit: str = "") -> float:
    """A finite number in [low, high], or one line naming the input and the range (the CLI and the API share it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ConfigError(f"{name} must be a finite number from {low:g} to {high:g}{unit}, got {value!r}")
    return float(value)


def check_search_numbers(gpus: int, seq: int, gpus_per_node: int, mfu: float, inter_node_gbps: float,
                         host_memory_gib: float, global_batch: int | None,
                         time_budget_s: float | None = None) -> None:
    """What a search refuses before it starts, in one line each: the CLI and POST /api/plan call search, so both
    refuse the same input the same way."""
    for name, value, least, most in (("gpus", gpus, 1, MAX_PLAN_GPUS), ("seq", seq, 1, 1 << 30),
                                      ("gpus_per_node", gpus_per_node, 1, MAX_PLAN_GPUS)):
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise ConfigError(f"{name} must be a whole number from {least} to {most:,}, got {value!r}")
    _check_number("mfu", mfu, *MFU_RANGE)
    _check_number("inter-node bandwidth (--inter-node-gbps)", inter_node_gbps, *INTER_NODE_GBPS_RANGE, " GB/s")
    _check_number("host memory (--host-memory-gib)", host_memory_gib, *HOST_MEMORY_GIB_RANGE, " GiB")
    if time_budget_s is not None:
        _check_number("time budget", time_budget_s, 0.0, 86_400.0, " s")
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or not 1 <= global_batch <= MAX_GLOBAL_BATCH):
        raise ConfigError(f"global batch must be a whole number of sequences from 1 to {MAX_GLOBAL_BATCH:,}, "
                          f"got {global_batch!r}")


@_cycle_collection_paused
def search(spec: ModelSpec, gpu: GPU, gpus: int, seq: int, global_batch: int | None = None,
           gpus_per_node: int = 8, recipes: tuple[str, ...] = PLAN_RECIPES, device: DeviceOptions | None = None,
           mfu: float = DEFAULT_MFU, inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS,
           host_memory_gib: float = DEFAULT_HOST_MEMORY_GIB,
           checkpointing: tuple[str, ...] = ("none", "selective", "full"),
           engines: tuple[str, ...] | None = None, model_parallel: bool = True,
           time_budget_s: float | None = None, writable: bool = True,
           finetune: FineTune | None = None) -> PlanSearch:
    """Every layout of ``gpus`` GPUs for ``global_batch`` sequences of ``seq`` tokens (default: one sequence per GPU),
    the fitting ones ranked by step_time; ``model_parallel=False`` searches data parallelism alone. With
    ``time_budget_s`` the search stops when that many seconds have passed and answers what it found
    (``cut_short``). ``writable`` (the default) keeps only the layouts some engine's files can run as planned
    (engine_configs.writers): a recipe an engine cannot configure is not offered for that engine. ``finetune``
    (lora.FineTune) searches LoRA on a frozen base: data parallelism only (LoRA under TP, PP, CP or EP is not
    modelled), every engine of it (finetune_sharding.py)."""
    traced = not spec.has_architecture and bool(spec.built_config)  # the traced path (recorded.py, tracedstep.py)
    if not spec.has_architecture and not traced:
        raise ConfigError("trainmem plan needs the model's architecture: give a model config, not --params")
    if traced:
        model_parallel, checkpointing = False, _traced_checkpointing(checkpointing, finetune)
    throughput_of(gpu)
    check_search_numbers(gpus, seq, gpus_per_node, mfu, inter_node_gbps, host_memory_gib, global_batch,
                         time_budget_s)
    global_batch = gpus if global_batch is None else global_batch
    if global_batch % gpus:
        raise ConfigError(f"the global batch ({global_batch} sequences) must split evenly over {gpus} GPUs: give a "
                          f"multiple of {gpus}")
    from .engine_configs import writers

    node = min(gpus_per_node, gpus)
    device = device or DeviceOptions()
    if gpus == 1:  # (on several GPUs each layout's step applies its own replayed ratio, as its estimate does:
        # StepModel.replayed_ratio, one replay per compiled step)
        device = search_ratio(spec, seq, recipes[0], checkpointing[0], device, gpu)
    host_memory = int(host_memory_gib * 2**30)
    started = time.perf_counter()
    deadline = None if time_budget_s is None else started + time_budget_s
    plans: list[Plan] = []
    counts = [0, 0]  # candidates, evaluated
    unwritable: set[str] = set()
    # compiled steps, shared by every layout that holds the same one (stepmodel.compile_step)
    cache: dict[Any, Any] = {}
    # the last answer of these degrees (and checkpointing): where the next is looked for
    guesses: dict[tuple[int | str, ...], int] = {}
    if finetune is not None:
        model_parallel = False

    def layouts() -> Iterator[tuple[int, int, int, int, str, str, int | None, str | None, str, str]]:
        for tp, pp, cp, ep in (model_parallel_degrees(spec, gpus, node, seq) if model_parallel else [(1, 1, 1, 1)]):
            data_parallel = gpus // (tp * pp * cp)
            engine_list = _engines(gpus, node) if (tp, pp, cp, ep) == (1, 1, 1, 1) else \
                _model_parallel_engines(data_parallel * cp, cp, ep)
            for recipe in recipes:
                get_recipe(recipe)
                for label, zero, fsdp, offloads in engine_list:
                    if engines is not None and label not in engines:
                        continue
                    for offload in offloads:
                        for ckpt in checkpointing:
                            if ckpt == "selective" and (get_recipe(recipe).autocast or zero is not None
                                                        or offload != "none"):
                                continue  # (modelled without autocast; written as torchtitan's, which has no ZeRO)
                            yield tp, pp, cp, ep, recipe, label, zero, fsdp, offload, ckpt

    try:
        for tp, pp, cp, ep, recipe, label, zero, fsdp, offload, ckpt in layouts():
            if deadline is not None and time.perf_counter() > deadline:
                raise _OutOfTime
            per_rank = global_batch // (gpus // (tp * pp * cp))  # sequences per model replica and step
            if writable and not writers(Layout(recipe, label, zero, fsdp, offload, ckpt, 1, per_rank, gpus, node,
                                               tp, pp, cp, ep)):
                unwritable.add(recipe)
                continue
            _search_layout(spec, gpu, seq, device, mfu, inter_node_gbps, host_memory, node, gpus, per_rank, recipe,
                           label, zero, fsdp, offload, ckpt, tp, pp, cp, ep, cache, guesses, plans, counts,
                           finetune)
        cut_short = False
    except _OutOfTime:
        cut_short = True
    # fastest first; on a tie (the time model has no per-kernel efficiency), no offload, the larger micro-batch
    # (larger matmuls run closer to peak), then the least memory needed
    plans.sort(key=lambda pl: (round(pl.time.seconds, 9), pl.layout.offload != "none", -pl.layout.micro_batch,
                               pl.peak.required_bytes))
    skipped = NOT_SEARCHED + (TRACED_NOT_SEARCHED if traced else ())
    if finetune is not None:
        skipped += ("tensor, pipeline, context and expert parallelism with LoRA (not modelled: data parallelism "
                    "only)",)
    if unwritable:
        skipped += (f"layouts whose recipe no engine's files set as planned ({', '.join(sorted(unwritable))} with "
                    "some engines: engine_configs.writers and docs/method.md say which engine runs which recipe)",)
    return PlanSearch(spec, tuple(plans), counts[0], counts[1], len(plans), time.perf_counter() - started, gpu,
                      gpus, seq, global_batch, mfu, inter_node_gbps, host_memory, skipped, cut_short, finetune)


TRACED_NOT_SEARCHED = (
    "tensor, pipeline, context and expert parallelism on the traced path (a model_type without a hand-written "
    "description: the trace has no tensor-parallel plan or layer split for an arbitrary type; data parallelism only)",
    "attention FLOPs in the step time on the traced path (no description of the layers: parameters' FLOPs only)")


def _traced_checkpointing(checkpointing: tuple[str, ...], finetune: FineTune | None) -> tuple[str, ...]:
    """The checkpointing a plan searches on the traced path: none and full (each recorded when first probed, cached:
    recorded.py); LoRA is not on the traced path yet."""
    if finetune is not None:
        raise ConfigError("trainmem plan with --lora is not available on the traced path (a model_type without a "
                          "hand-written description) yet: plan its full fine-tuning, or estimate the LoRA step")
    kept = tuple(c for c in checkpointing if c != "selective")
    if not kept:
        raise ConfigError("trainmem plan on the traced path searches --checkpointing none and full (the step time "
                          "of layer-selective checkpointing needs the layer count of a hand-written description)")
    return kept


_SEARCH_RATIOS: dict[tuple[Any, ...], float | None] = {}


def search_ratio(spec: ModelSpec, seq: int, recipe: str, checkpointing: str, device: DeviceOptions,
                 gpu: GPU | None = None) -> DeviceOptions:
    """``device`` with the fragmentation ratio a search's fit checks apply: the replay (replay.py) of the model's
    one-GPU step at micro-batch 1 in the first recipe and checkpointing searched, one replay per search (a replay
    per layout would cost 50-500 ms each). The plans' own estimates replay their steps."""
    from dataclasses import replace

    if device.fragmentation is not None or device.reserved_ratio is not None or not spec.has_architecture:
        return device
    key = (spec, seq, recipe, checkpointing, device.alloc_config)
    if key not in _SEARCH_RATIOS:
        settings = make_settings(recipe=recipe, checkpointing=checkpointing, seq=seq, batch=1)
        step = compile_step(spec, settings, device)
        floor = (sum(c.bytes for c in step.static) + device.cuda_overhead_bytes) * device.headroom
        if gpu is not None and floor > gpu.memory_bytes:  # (its model states alone do not fit: nothing to replay)
            return device
        _SEARCH_RATIOS[key] = step.replayed_ratio(1, seq)
    return replace(device, reserved_ratio=_SEARCH_RATIOS[key])


def _search_layout(spec: ModelSpec, gpu: GPU, seq: int, device: DeviceOptions, mfu: float, inter_node_gbps: float,
                   host_memory: int, node: int, gpus: int, per_rank: int, recipe: str, label: str, zero: int | None,
                   fsdp: str | None, offload: str, ckpt: str, tp: int, pp: int, cp: int, ep: int,
                   cache: dict[Any, Any], guesses: dict[tuple[int | str, ...], int], plans: list[Plan],
                   counts: list[int], finetune: FineTune | None = None) -> None:
    """One engine, recipe, offload, checkpointing and degrees: the largest micro-batch that fits, appended to
    ``plans``; ``counts`` (candidates, evaluated) grow by what was counted and probed."""
    micro_batches = divisors(per_rank)
    steps: dict[int, StepModel] = {}

    def step_for(b: int) -> StepModel:
        """The compiled step at micro-batch b, from the search's cache. Its accumulation steps (per_rank / b)
        matter only as more than one (the gradients then live through forward: timeline._static) and, with a
        pipeline, as what each stage holds in flight (min(M, P)) and, in torch's pipelining, as its receive buffers
        (M): one step per distinct M, whose compiled stages are shared with every layout that holds them."""
        m = per_rank // b
        m = (m if zero is None else min(m, pp)) if pp > 1 else min(m, 2)
        if m not in steps:
            parallel = Layout(recipe, label, zero, fsdp, offload, ckpt, b, m, gpus, node, tp, pp, cp,
                              ep).parallel if gpus > 1 else None
            settings = make_settings(recipe=recipe, checkpointing=ckpt, seq=seq, batch=1, grad_accum=min(m, 2))
            steps[m] = compile_step(spec, settings, device, parallel, finetune, cache=cache)
        return steps[m]

    step = step_for(micro_batches[0])
    counts[0] += len(micro_batches)
    host = step.rank.host_bytes_per_rank * node if step.rank is not None else 0
    if host > host_memory:  # (the offloaded states, whatever the micro-batch)
        return
    # the step's peak holds at least its static memory: a layout whose model states alone, with the CUDA overhead
    # and headroom, exceed the GPU fits at no micro-batch
    floor = (sum(c.bytes for c in step.static) + device.cuda_overhead_bytes) * device.headroom
    if floor > gpu.memory_bytes:
        return

    # memory grows with the micro-batch (with a pipeline too: b x min(P, M) activations): the largest divisor that
    # fits, looked for first where the last layout of these degrees and checkpointing found it
    def peak_at(index: int) -> Peak | None:
        b = micro_batches[index]
        return step_for(b).fitting_peak(b, seq, gpu)

    guess = guesses.get((tp, pp, cp, ep, ckpt), guesses.get((tp, pp, cp, ep)))
    index, peak, probes = largest_fitting(len(micro_batches), peak_at, guess)
    counts[1] += probes
    guesses[(tp, pp, cp, ep, ckpt)] = guesses[(tp, pp, cp, ep)] = max(index, 0)
    if peak is None:
        return
    b = micro_batches[index]
    layout = Layout(recipe, label, zero, fsdp, offload, ckpt, b, per_rank // b, gpus, node, tp, pp, cp, ep)
    trained = None
    if finetune is not None:
        from .lora import trainables

        t = trainables(spec, get_recipe(recipe), step.optimizer, finetune)
        trained = t.adapters + t.copies
    plans.append(Plan(layout, peak, step_time(spec, layout, seq, gpu, mfu, inter_node_gbps, trained), host,
                      step_for(b), seq, finetune))


MIN_GPUS_EVERY_COUNT_UP_TO = 512
"""--min-gpus tries every count up to this one (1, 2, 4, then each multiple of the node size), then the node size
times powers of two: which counts fit is not monotone (a count whose factors give no tensor x pipeline x context
split the model needs can fail where a smaller one fits: Llama-3.1-405B at 65,536 tokens fits 128 and 160 H100s,
not 144), so no bisection finds the fewest; the failing searches are cheap (a floor rules most layouts out)."""


def min_gpus_counts(gpus_per_node: int) -> list[int]:
    """The GPU counts --min-gpus tries, in order (MIN_GPUS_EVERY_COUNT_UP_TO)."""
    counts = {1, 2, 4} | set(range(gpus_per_node, MIN_GPUS_EVERY_COUNT_UP_TO + 1, gpus_per_node))
    power = gpus_per_node
    while power <= MAX_MIN_GPUS:
        counts.add(power)
        power *= 2
    return sorted(c for c in counts if c <= MAX_MIN_GPUS)


def min_gpus(spec: ModelSpec, gpu: GPU, seq: int, gpus_per_node: int = 8, time_budget_s: float | None = None,
             **options: Any) -> tuple[int, PlanSearch] | None:
    """The fewest GPUs of this type that can train the model at all (one sequence per GPU, any engine, checkpointing
    and offload), among min_gpus_counts, tried in ascending order; None past MAX_MIN_GPUS. With ``time_budget_s``
    the searches share that many seconds; when it runs out before a count fits the answer is None, and a search
    the budget cut short is marked ``cut_short``."""
    if time_budget_s is not None:
        _check_number("time budget", time_budget_s, 0.0, 86_400.0, " s")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or not 1 <= gpus_per_node <= \
            MAX_PLAN_GPUS:
        raise ConfigError(f"gpus_per_node must be a whole number from 1 to {MAX_PLAN_GPUS:,}, got {gpus_per_node!r}")
    deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s
    for n in min_gpus_counts(gpus_per_node):
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            return None
        found = search(spec, gpu, n, seq, None, min(gpus_per_node, n), time_budget_s=left, **options)
        if found.plans:
            return n, found
        if found.cut_short:
            return None
    return None


def run_plan(model: str | os.PathLike[str] | ModelSpec | None, gpu: str, gpus: int | None = None, seq: int = 2048,
             global_batch: int | None = None, gpus_per_node: int = 8, nodes: int | None = None,
             recipe: str | None = None, checkpointing: str | None = None, min_gpus_wanted: bool = False,
             hub: bool = False, time_budget_s: float | None = None, lora: dict[str, Any] | None = None,
             **options: Any) -> tuple[PlanSearch, int | None]:
    """What ``trainmem plan`` and POST /api/plan answer: the search (or, with ``min_gpus_wanted``, the fewest GPUs
    and the search at that count). ``model`` as trainmem.estimate takes it; ``options``: mfu, inter_node_gbps,
    host_memory_gib, device. ``time_budget_s`` bounds the seconds the answer may take (PlanSearch.cut_short says
    when it ended the search early). ``lora``: make_request's LoRA keywords (lora, lora_targets, dora, qlora, ...),
    which search LoRA on a frozen base."""
    from .request import make_request

    if nodes is not None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_PLAN_GPUS:
            raise ConfigError(f"nodes must be a whole number from 1 to {MAX_PLAN_GPUS:,}, got {nodes!r}")
        if gpus is not None and gpus != nodes * gpus_per_node:
            raise ConfigError(f"--gpus {gpus} is not --nodes {nodes} x --gpus-per-node {gpus_per_node}; give one")
        gpus = nodes * gpus_per_node
    gpus = 8 if gpus is None else gpus
    # the numbers first: a search's inputs are refused before the model is read
    check_search_numbers(gpus, seq, gpus_per_node, options.get("mfu", DEFAULT_MFU),
                         options.get("inter_node_gbps", DEFAULT_INTER_NODE_GBPS),
                         options.get("host_memory_gib", DEFAULT_HOST_MEMORY_GIB), global_batch, time_budget_s)
    req = make_request(model, gpu=gpu, hub=hub, seq=seq, recipe=recipe or "mixed-bf16",
                       checkpointing=checkpointing or "none", **(lora or {}))
    target = req.gpu
    assert target is not None  # (gpu is a name: make_request looked the card up)
    if req.finetune is not None:
        options["finetune"] = req.finetune
    options.setdefault("device", req.device)
    from .engine_configs import written_recipe

    if recipe:
        written_recipe(recipe)
    if checkpointing == "op":
        raise ConfigError("--checkpointing op: plan searches the checkpointing the engines' files write; accepted: "
                          "none, full (estimate it with trainmem estimate --checkpointing op)")
    if checkpointing == "selective":
        raise ConfigError("--checkpointing selective: no engine's file sets layer-selective checkpointing (torchtitan "
                          "0.3.0's SelectiveAC is per-op), so plan does not offer it; accepted: none, full (estimate "
                          "it with trainmem estimate --checkpointing selective)")
    options["recipes"] = (recipe,) if recipe else PLAN_RECIPES
    options["checkpointing"] = (checkpointing,) if checkpointing else ("none", "full")
    if min_gpus_wanted:
        if global_batch is not None:
            raise ConfigError("--min-gpus answers a GPU count (one sequence per GPU): it takes no --global-batch")
        result = min_gpus(req.model, target, seq, gpus_per_node, time_budget_s=time_budget_s, **options)
        if result is None:
            raise ConfigError(f"no count of {target.name} up to {MAX_MIN_GPUS:,} trains {req.model.name} at {seq} "
                              "tokens with the layouts searched" + (" in the time budget" if time_budget_s is not None
                                                                    else ""))
        answer, found = result
        return found, answer
    return search(req.model, target, gpus, seq, global_batch, gpus_per_node, time_budget_s=time_budget_s,
                  **options), None
