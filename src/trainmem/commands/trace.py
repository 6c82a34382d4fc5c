"""`trainmem trace`: a step traced in PyTorch beside its estimate (or a model factory's program)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..cli import _console, _header, _emit_json, _short, _workload, _workload_options, _Whole, _MAX_STEP
from ..errors import ConfigError
from ..units import parse_unit

if TYPE_CHECKING:
    from ..factory import ModuleProgram
    from ..settings import TrainingSettings
    from ..trace import TraceResult


@click.command()
@_workload_options
@click.option("--batch", type=_Whole(_MAX_STEP), default=1, show_default=True, help="Micro-batch size per GPU.")
@click.option("--seq", type=_Whole(_MAX_STEP), default=2048, show_default=True, help="Sequence length in tokens.")
@click.option("--no-round", is_flag=True, help="Keep raw tensor sizes (CUDA rounds each allocation to 512 B).")
@click.option("--allocator", "replay_allocator", is_flag=True,
              help="Replay two steps' allocations through a model of CUDA's caching allocator: max_memory_reserved, "
                   "fragmentation at the peak, largest inactive split, and the first allocation that fails on --gpu. "
                   "One GPU, or one FSDP2 rank (--gpus N --fsdp full: its second step, twice).")
@click.option("--alloc-conf", default=None, metavar="TEXT",
              help="PYTORCH_CUDA_ALLOC_CONF options for --allocator, e.g. expandable_segments:True (default: the "
                   "environment's PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF).")
@click.option("--factory", default=None, metavar="PKG.MODULE:FUNCTION",
              help="Trace your own model (not a transformers one): the function that builds the torch.nn.Module, "
                   "called under FakeTensorMode; instead of MODEL (recipe fp32 unless --recipe says otherwise).")
@click.option("--batch-fn", default=None, metavar="PKG.MODULE:FUNCTION",
              help="--factory: make_batch(batch, seq) returns the forward's input (a tensor, a tuple or a dict); "
                   "default: input_ids below the model's vocab_size.")
@click.option("--at", "at_sizes", default=None, metavar="BxS,...",
              help="--factory: also record the step at four sizes around --seq and estimate it at these micro-batch "
                   "x sequence sizes, e.g. 8x4096,16x2048.")
def trace(batch: int, seq: int, no_round: bool, replay_allocator: bool, alloc_conf: str | None, factory: str | None,
          batch_fn: str | None, at_sizes: str | None, **options: Any) -> None:
    """Run one real training step of MODEL's transformers implementation under FakeTensorMode on the CPU
    (no GPU, no memory), count every allocation, and compare with the estimate. With --gpus N --fsdp full, one rank
    of FSDP2 on a fake process group; with --gpus N --tp N [--sp], one rank of DTensor tensor parallelism.

    \b
    Example: trainmem trace llama-2-7b --batch 1 --seq 2048 --recipe mixed-bf16
             trainmem trace llama-3-8b --gpus 8 --fsdp full --recipe mixed-bf16
             trainmem trace llama-3.2-1b --gpus 8 --fsdp full --lora 16
             trainmem trace llama-3-8b --gpus 2 --tp 2 --sp --recipe pure-bf16-bf16states
             trainmem trace llama-3.2-1b --allocator --alloc-conf expandable_segments:True --gpu L4
             trainmem trace llama-3.2-1b --allocator --gpus 8 --fsdp full --recipe mixed-bf16
    """
    from ..step import check_runnable

    if factory is not None or batch_fn is not None or at_sizes is not None:
        return _trace_factory(factory, batch_fn, at_sizes, batch, seq, no_round, options)
    if alloc_conf is not None and not replay_allocator:
        raise ConfigError("--alloc-conf sets the allocator that --allocator replays: give --allocator too")
    w = _workload(options, batch, seq, need_config="trace")
    if w.finetune is not None and w.finetune.base_quant:
        raise ConfigError("trace runs LoRA on a full-precision base: bitsandbytes' quantized kernels cannot run on "
                          "fake tensors (the stored bytes are checked against bitsandbytes in the tests)")
    tensor_parallel = w.parallel is not None and w.parallel.is_model_parallel
    sharded = w.parallel is not None and w.parallel.engine != "single" and not tensor_parallel
    if sharded and w.parallel.engine != "fsdp2":
        raise ConfigError("trace runs one GPU, one rank of FSDP2 (--gpus N --fsdp full|grad-op) or of tensor "
                          "parallelism (--gpus N --tp N [--sp]); DDP and DeepSpeed are estimated only, as is FSDP1")
    if replay_allocator and tensor_parallel:
        raise ConfigError("trace --allocator replays one GPU or one FSDP2 rank; not with --tp yet")
    if replay_allocator:
        from ..allocator import config_from_environment, parse_alloc_conf

        alloc_config = parse_alloc_conf(alloc_conf) if alloc_conf is not None else config_from_environment()
        # the card's memory less what is not PyTorch's (--cuda-overhead: the CUDA context and libraries)
        capacity = w.gpu.memory_bytes - w.device.cuda_overhead_bytes if w.gpu is not None else None
        if w.gpu is not None and capacity is not None and capacity <= 0:
            raise ConfigError(f"--cuda-overhead leaves nothing of {w.gpu.name}'s memory to the caching allocator")
    if tensor_parallel:
        from ..trace import check_tp_traceable

        check_tp_traceable(w.settings, w.parallel, w.spec)
    elif sharded:
        from ..trace import check_fsdp_traceable

        check_fsdp_traceable(w.settings, w.parallel)
    else:
        check_runnable(w.settings)
    from ..meta_count import check_transformers_config

    check_transformers_config(w.model_config, w.spec.source or w.spec.name)  # (what transformers would refuse mid-trace)

    from ..stepmodel import estimate_model
    from ..report import render_trace, trace_to_dict
    from ..trace import trace_fsdp_step, trace_step

    spec, settings, unit, as_json = w.spec, w.settings, w.unit, options["as_json"]
    config = w.model_config
    est = estimate_model(spec, settings, w.device, w.parallel, w.finetune)
    from ..progress import Progress

    with Progress(f"tracing one step of {spec.name} on fake tensors", as_json=as_json):
        if tensor_parallel:
            from ..trace import trace_tp_step

            result = trace_tp_step(config, settings, w.parallel, spec, round_to_cuda=not no_round)
        elif sharded:
            result = trace_fsdp_step(config, settings, w.parallel, spec, round_to_cuda=not no_round,
                                     finetune=w.finetune, record_allocations=replay_allocator)
        else:
            result = trace_step(config, settings, spec, round_to_cuda=not no_round, finetune=w.finetune,
                                record_allocations=replay_allocator)
    replayed = None
    if replay_allocator:
        from ..allocator import render_lines, replay

        replayed = replay(result.allocations, alloc_config, capacity=capacity,
                          device_total=w.gpu.memory_bytes if w.gpu is not None else None)
    if as_json:
        document = trace_to_dict(est, result.phases, result.seconds, result.rounded, result.host_bytes)
        if replayed is not None:
            document["trace"]["allocator"] = {**replayed.to_dict(),
                                              "traced_max_allocated_bytes": result.peak.allocated_bytes}
        _emit_json(document)
    else:
        console = _console()
        render_trace(est, result.phases, result.seconds, unit, console, result.host_bytes)
        if replayed is not None:
            for line in render_lines(replayed, result.peak.allocated_bytes, unit):
                console.print(line, markup=False, highlight=False)


_FACTORY_FLAGS = ("recipe", "optimizer", "optimizer_impl", "grad_accum", "checkpointing", "loss", "compile",
                  "offload_activations", "optimizer_in_backward", "task")
"""The settings a --factory trace takes (factory.check_module_settings refuses the ones it does not run); every
other workload flag, changed from its default, is refused in one line."""


def _at_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        b, sep, s = part.lower().partition("x")
        if not sep or not b.isdigit() or not s.isdigit() or int(b) < 1 or int(s) < 1:
            raise ConfigError(f"--at {_short(text)!r}: give micro-batch x sequence sizes such as 8x4096,16x2048")
        sizes.append((int(b), int(s)))
    if not sizes:
        raise ConfigError("--at needs at least one size such as 8x4096")
    return sizes


def _trace_factory(factory: str | None, batch_fn: str | None, at_sizes: str | None, batch: int, seq: int,
                   no_round: bool, options: dict[str, Any]) -> None:
    """trace --factory: a user's own module traced under FakeTensorMode (factory.py)."""
    from ..factory import check_module_settings, load_factory, record_module, trace_module
    from ..settings import make_settings

    if factory is None:
        raise ConfigError("--batch-fn and --at go with --factory pkg.module:build_model")
    if options["model"] is not None or options["params"] is not None:
        raise ConfigError("give a MODEL (a transformers config) or --factory (your own module), not both")
    context = click.get_current_context()
    extra = sorted(k for k in options if k not in (*_FACTORY_FLAGS, "model", "params", "units", "as_json")
                   and context.get_parameter_source(k) not in (click.core.ParameterSource.DEFAULT, None))
    if extra:
        raise ConfigError(f"trace --factory traces one GPU's step of your module; {', '.join('--' + k.replace('_', '-') for k in extra)} "
                          "are for transformers models")
    values = {k: options[k] for k in _FACTORY_FLAGS}
    if context.get_parameter_source("recipe") == click.core.ParameterSource.DEFAULT:
        values["recipe"] = "fp32"  # (estimate's default, mixed-bf16, keeps masters a user's module does not have)
    settings = make_settings(batch=batch, seq=seq, **values)
    check_module_settings(settings)
    sizes = _at_sizes(at_sizes) if at_sizes is not None else []
    build = load_factory(factory)
    make_batch = load_factory(batch_fn, "--batch-fn") if batch_fn is not None else None
    from ..progress import Progress

    with Progress(f"tracing {factory} on fake tensors", as_json=options["as_json"]):
        result = trace_module(build, settings, make_batch, round_to_cuda=not no_round)
        program = record_module(build, settings, make_batch, seq=seq) if sizes else None
    _print_factory(factory, settings, result, program, sizes, parse_unit(options["units"]), options["as_json"])


def _print_factory(factory: str, settings: TrainingSettings, result: TraceResult, program: ModuleProgram | None,
                   sizes: list[tuple[int, int]], unit: str, as_json: bool) -> None:
    from ..units import format_bytes

    estimated = [(b, s, program.phases(b, s)) for b, s in sizes] if program is not None else []
    if as_json:
        _emit_json({**_header("trace"), "factory": factory, "settings": settings.as_dict(),
                    "phases": [{"name": p.name, **p.by_category(), "allocated_bytes": p.allocated_bytes}
                               for p in result.phases],
                    "estimated": [{"batch": b, "seq": s, "peak_phase": max(ph, key=lambda p: p.allocated_bytes).name,
                                   "peak_bytes": max(p.allocated_bytes for p in ph)} for b, s, ph in estimated]})
        return
    console = _console()
    console.print(f"{factory}: one step traced under FakeTensorMode at micro-batch {settings.batch}, sequence "
                  f"{settings.seq} ({settings.recipe}, {settings.optimizer}) in {result.seconds:.1f} s",
                  markup=False, highlight=False)
    for p in result.phases:
        parts = ", ".join(f"{k} {format_bytes(v, unit)}" for k, v in p.by_category().items() if v)
        console.print(f"  {p.name:<14} {format_bytes(p.allocated_bytes, unit):>12}  ({parts})", markup=False,
                      highlight=False)
    console.print(f"  peak: {result.peak.name}, {format_bytes(result.peak.allocated_bytes, unit)}", markup=False,
                  highlight=False)
    for b, s, ph in estimated:
        top = max(ph, key=lambda p: p.allocated_bytes)
        console.print(f"  estimated at {b} x {s}: peak {format_bytes(top.allocated_bytes, unit)} ({top.name}; "
                      f"recorded at 1 x {settings.seq}, 1 x {2 * settings.seq}, 1 x {3 * settings.seq}, "
                      f"2 x {settings.seq}, fitted c0 + b*q(s))", markup=False, highlight=False)
