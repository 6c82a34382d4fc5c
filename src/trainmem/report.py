"""Rendering an :class:`~trainmem.estimate.Estimate`: the versioned JSON document and the rich tables.

The JSON schema is documented in docs/json-schema.md. Memory figures in JSON are always integers in bytes,
whatever unit the table uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from . import __version__
from .estimate import NO_PEAK, Estimate
from .device_overhead import estimate_overhead_lines
from .hardware import DEFAULT_FRAGMENTATION, GPUS, GPU
from .plaintext import table_class
from .replay import plan_reserved_note, reserved_basis, reserved_dict
from .units import format_bytes, format_count

if TYPE_CHECKING:  # (names for the annotations only)
    from .activations import ActivationEstimate, LayerActivations
    from .models import ModelSpec
    from .plan import Layout, PlanSearch
    from .sharding import Parallel
    from .timeline import Phase

SCHEMA_VERSION = 2
"""The one version of every JSON document trainmem prints (docs/json-schema.md lists what each version changed)."""

_PHASE_KEYS = {"parameters": "parameters_bytes", "gradients": "gradients_bytes",
               "optimizer_states": "states_and_master_bytes", "activations": "activations_bytes",
               "temporaries": "temporaries_bytes"}
"""A phase's categories in JSON. The static section's ``optimizer_states`` is the optimizer's states alone; in a
phase the category holds the fp32 master weights too, so it has its own name."""


SCHEMA_FILE = f"schema/trainmem-{SCHEMA_VERSION}.schema.json"
"""The JSON Schema every document validates against, in the package (tests/test_json_schema.py)."""


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of every ``--json`` document of this schema version."""
    import json
    from importlib.resources import files

    return cast(dict[str, Any], json.loads(files("trainmem").joinpath(SCHEMA_FILE).read_text()))


def header(engine: str) -> dict[str, Any]:
    """What every JSON document starts with: the schema version, the tool and the command that made it."""
    return {"schema_version": SCHEMA_VERSION, "tool": {"name": "trainmem", "version": __version__}, "engine": engine}


def phase_categories(phase: Phase) -> dict[str, int]:
    return {_PHASE_KEYS[k]: v for k, v in phase.by_category().items()}


def model_dict(m: ModelSpec) -> dict[str, Any]:
    """The ``model`` object of every document that names a model."""
    return {
        "name": m.name,
        "model_type": m.model_type,
        "source": m.source,
        "parameters": m.num_parameters,
        "active_parameters": m.num_active_parameters,
        "largest_layer_parameters": m.largest_layer_parameters,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "vocab_size": m.vocab_size,
        "analytic": m.has_architecture or m.is_nominal,
    }


def kept_bytes_per_token(acts: ActivationEstimate, la: LayerActivations) -> float:
    """What the step keeps on the device per token for each layer of the run ``la``, as the timeline counts it
    (ActivationEstimate.layer_saved_bytes, less the batch-independent constant): a checkpointed layer (every layer
    under --checkpointing full, every second one under selective) keeps its input, and nothing on the device when
    --offload-activations moves that input to host memory; any other layer keeps its terms."""
    if la.checkpointed:
        return 0.0 if acts.offloaded else float(sum(t.bytes_per_token for t in la.checkpoint_terms))
    return la.bytes_per_token


_STEPPED_IN_BACKWARD = ("none held: each parameter's gradient is stepped and freed as backward makes it "
                        "(--optimizer-in-backward)")


def held_static(est: Estimate) -> list[tuple[Any, int, float, str]]:
    """The static components as the step holds them, (component, bytes, bytes per parameter, note): under
    --optimizer-in-backward the gradients are never held together (the timeline has none in any phase; one
    parameter's exists at a time, inside backward), so they are listed with 0 bytes."""
    rows = []
    for c in est.static:
        if c.name == "gradients" and est.settings.optimizer_in_backward:
            rows.append((c, 0, 0.0, _STEPPED_IN_BACKWARD))
        else:
            rows.append((c, c.bytes, c.bytes_per_param, c.note))
    return rows


def _activations_dict(est: Estimate) -> dict[str, Any] | None:
    if est.activation_bytes is None:
        return None
    out: dict[str, Any] = {"bytes": est.activation_bytes}
    acts = est.activations
    if est.activation_k_bytes is not None:
        out["model"] = f"seed rule of thumb b*s*h*L*k*2, k={est.settings.activation_k:g}"
        return out
    assert acts is not None
    out.update({
        "model": "architecture",
        "saved_bytes": acts.saved_bytes,
        "logits_bytes": acts.logits_bytes,
        "layers_bytes": acts.layers_bytes,
        "embedding_bytes": acts.embedding_bytes,
        "head_bytes": acts.head_bytes,
        "constant_bytes": acts.constant_bytes,
        "kv_cache_bytes": acts.kv_cache_bytes,
        **({"host_bytes": acts.host_bytes} if acts.offloaded else {}),
        "per_layer": [
            {"count": la.count, "bytes_per_token": la.bytes_per_token, "bytes": acts.layer_saved_bytes(la),
             "checkpointed": la.checkpointed, "kept_bytes_per_token": kept_bytes_per_token(acts, la),
             "constant_bytes": la.constant_bytes,
             "terms": [{"name": t.name, "bytes_per_token": t.bytes_per_token} for t in la.terms]}
            for la in acts.layers
        ],
    })
    return out


def models_document() -> dict[str, Any]:
    """The built-in catalog with exact parameter counts (``trainmem models --json``, GET /api/models)."""
    from .catalog import catalog_names, catalog_spec

    models = []
    for name in catalog_names():
        spec = catalog_spec(name)
        models.append({"name": name, "hub_id": spec.source, "model_type": spec.model_type,
                       "parameters": spec.num_parameters, "active_parameters": spec.num_active_parameters})
    return {**header("models"), "models": models}


def gpus_document() -> dict[str, Any]:
    """The GPU table (GET /api/gpus): each GPU's name and the memory its driver reports."""
    return {**header("gpus"), "gpus": [{"name": g.name, "memory_bytes": g.memory_bytes, "bf16": g.bf16,
                                        "spec_sheet": g.spec_sheet}
                                       for g in GPUS.values()]}


def json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: such floats are written as the strings "NaN", "Infinity", "-Infinity"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def gpu_verdict(est: Estimate, gpu: GPU, search_batch: bool = True) -> dict[str, Any]:
    """Whether ``est`` fits ``gpu``, by how much (``margin_bytes``: the GPU's memory less the required bytes, negative
    when short) and the largest micro-batch that fits at this sequence length and layout (``max_micro_batch``, 0 when
    not even one; None when unknown: no peak, or ``search_batch`` False). The required bytes are the device total
    (allocated + the caching allocator's fragmentation + the CUDA context) x ``headroom``: the headroom comes on
    top of those allowances (estimate.peak_of_phases), and headroom 1 is the plain answer."""
    fits = est.fits(gpu)
    margin = None if est.peak is None else gpu.memory_bytes - est.peak.required_bytes
    if fits and margin is not None and margin < 0:  # (it runs because the allocator frees its cache: the margin
        from .allocator import DEFAULT_CONFIG, least_capacity  # is over the least memory it runs in)

        least = least_capacity(est.allocation_log, est.device.alloc_config or DEFAULT_CONFIG)
        margin = gpu.memory_bytes - int((least + est.device.cuda_overhead_bytes) * est.device.headroom)
    largest = None
    if search_batch and est.peak is not None and est.model.has_architecture:
        from .planner import max_batch

        largest = max_batch(est.model, est.settings, gpu, est.device, est.parallel, est.finetune)
    return {"fits": fits, "margin_bytes": margin, "max_micro_batch": largest, "headroom": est.device.headroom}


def verdict_line(est: Estimate, gpu: GPU, unit: str, verdict: dict[str, Any] | None = None) -> str:
    """One line: fits or not on ``gpu``, the margin in ``unit``, the largest micro-batch, and what the required
    bytes include."""
    v = verdict or gpu_verdict(est, gpu)
    if v["fits"] is None:
        return f"{gpu.name}: whether it fits is unknown: the step's peak needs its activations (the notes say why)"
    dev, s = est.device, est.settings
    margin, largest = v["margin_bytes"], v["max_micro_batch"]
    if v["fits"]:
        answer = f"fits at batch {s.batch}, {format_bytes(margin, unit)} to spare"
    elif largest == 0:
        answer = f"does not fit, not even batch 1 ({format_bytes(-margin, unit)} short at batch {s.batch})"
    else:
        answer = f"does not fit at batch {s.batch}, {format_bytes(-margin, unit)} short"
    if largest:
        answer += f"; largest micro-batch that fits: {largest:,} at seq {s.seq:,}"
    fragmentation = ("replayed allocator" if est.peak is not None and est.peak.reserved_from != "flat" else
                     f"{dev.fragmentation if dev.fragmentation is not None else DEFAULT_FRAGMENTATION:.0%}")
    allowances = (f"{fragmentation} fragmentation and {format_bytes(dev.cuda_overhead_bytes, 'MiB', 0)} CUDA "
                  "allowances")
    basis = (f"required = device total x {dev.headroom:g} headroom, on top of the {allowances}; --headroom 1 "
             "for the plain answer" if dev.headroom != 1 else
             f"required = device total (no headroom), the {allowances} included")
    return f"{gpu.name} ({format_bytes(gpu.memory_bytes, unit)}): {answer} ({basis})"


def activation_source(est: Estimate) -> str | None:
    """Which model answered the phases and the peak (the JSON's activation_source), None without a peak."""
    if est.peak is None:
        return None
    if est.traced is not None:
        return "traced"
    return "seed-rule" if est.activation_k_bytes is not None else "hand-written"


def to_dict(est: Estimate, gpu: GPU | None = None, extra: dict[str, Any] | None = None,
            search_batch: bool = True) -> dict[str, Any]:
    """The estimate document; with ``gpu``, its verdict (gpu_verdict; ``search_batch`` False leaves
    ``max_micro_batch`` null, as a sweep's many estimates do)."""
    m = est.model
    held = held_static(est)
    static: dict[str, Any] = {
        c.name: {"dtype": c.dtype, "bytes": nbytes, "bytes_per_param": round(per_param, 6), "note": note}
        for c, nbytes, per_param, note in held
    }
    static["total_bytes"] = sum(nbytes for _, nbytes, _, _ in held)
    doc: dict[str, Any] = {
        **header("estimate"),
        "model": model_dict(m),
        "settings": est.settings.as_dict(),
        "static": static,
        "activations": _activations_dict(est),
        "phases": [
            {"name": p.name, "moment": p.moment, "allocated_bytes": p.allocated_bytes, **phase_categories(p)}
            for p in est.phases
        ],
        "peak": None,
        "fits": None,
        "fits_unknown_reason": NO_PEAK,
        "notes": list(est.notes),
        "warnings": list(est.warnings),
        "activation_source": activation_source(est),
    }
    if est.traced is not None:
        doc["traced"] = est.traced.as_dict()
    if est.peak is not None:
        pk = est.peak
        doc["peak"] = {
            "phase": pk.phase, "moment": pk.moment, "allocated_bytes": pk.allocated_bytes,
            "reserved_bytes": pk.reserved_bytes, "device_bytes": pk.device_bytes, "required_bytes": pk.required_bytes,
            "headroom": est.device.headroom, "fragmentation": est.device.fragmentation,
            "cuda_overhead_bytes": est.device.cuda_overhead_bytes, **reserved_dict(est),
            "device_lines": [line.to_dict() for line in estimate_overhead_lines(est, gpu)],
        }
        doc["fits"] = est.fit_table()
        doc["fits_unknown_reason"] = None
    if gpu is not None:
        verdict = gpu_verdict(est, gpu, search_batch)
        doc["gpu"] = {"name": gpu.name, "memory_bytes": gpu.memory_bytes, "memory_source": gpu.memory_source,
                      "fits": verdict["fits"], "margin_bytes": verdict["margin_bytes"],
                      "max_micro_batch": verdict["max_micro_batch"], "headroom": verdict["headroom"]}
    if est.per_gpu:
        _parallel_keys(est, doc)
    if est.finetune is not None:
        doc["lora"] = est.finetune.as_dict(m)
    if est.paged_bytes:  # (paged optimizers' states in unified memory: not in static, phases or peak)
        doc["paged_bytes"] = est.paged_bytes
    if extra:
        doc.update(extra)
    return doc


def _parallel_keys(est: Estimate, doc: dict[str, Any]) -> None:
    """With several GPUs: the layout, the engine's buffers (counted in the phases, not in static.total_bytes) and
    the host memory of one node."""
    rank, parallel = est.rank, est.parallel
    doc["parallel"] = parallel.as_dict()
    buffers = rank.buffers if rank else ()
    doc["static"]["buffers"] = [{"name": b.name, "bytes": b.bytes, "category": b.category, "phases": list(b.phases),
                                 "note": b.note} for b in buffers]
    per_node = min(parallel.node_size, parallel.gpus)
    doc["host"] = {"bytes_per_node": (rank.host_bytes_per_rank if rank else 0) * per_node,
                   "pinned_bytes_per_node": (rank.host_pinned_bytes_per_rank if rank else 0) * per_node,
                   "gpus_per_node": per_node}
    if est.per_rank:
        doc["per_rank"] = [role.as_dict() for role in est.per_rank]


def estimate_title(est: Estimate) -> str:
    m = est.model
    title = f"{m.name} ({m.model_type}): {m.num_parameters:,} parameters"
    if m.num_active_parameters != m.num_parameters:
        title += f", {m.num_active_parameters:,} active per token"
    if est.per_gpu:
        title += f"; per GPU of {_layout_words(est.parallel)}"
    if est.finetune is not None:
        f = est.finetune
        title += f"; {'DoRA' if f.lora.dora else 'LoRA'} rank {f.lora.rank} on {','.join(f.lora.targets)}" + (
            f", {f.base_quant}{' + double quant' if f.double_quant else ''} base" if f.base_quant else "") + (
            f", training {','.join(f.lora.train_modules)}" if f.lora.train_modules else "")
    return title


def _engine_words(parallel: Parallel) -> str:
    engine = {"single": "no data-parallel engine", "ddp": "DDP", "deepspeed": f"DeepSpeed ZeRO-{parallel.zero}",
              "fsdp2": f"FSDP2 ({parallel.fsdp})",
              "fsdp1": f"FSDP1 ({parallel.fsdp}" + (", use_orig_params" if parallel.fsdp_use_orig_params else "")
              + (", no_sync" if parallel.fsdp_no_sync else "") + ")"}[parallel.engine]
    return engine + (f", offload {parallel.offload}" if parallel.offload != "none" else "")


def _layout_words(parallel: Parallel) -> str:
    if not parallel.is_model_parallel:
        return f"{parallel.gpus} ({_engine_words(parallel)})"
    axes = [f"TP {parallel.tp}" + (" with SP" if parallel.sp else "")] if parallel.tp > 1 else []
    if parallel.pp > 1:
        axes.append(f"PP {parallel.pp}" + (f" interleaved x{parallel.virtual_stages}" if parallel.virtual_stages > 1
                                           else "") + f", {parallel.in_flight_micro_batches} micro-batches")
    axes += [f"{name} {getattr(parallel, name.lower())}" for name in ("CP", "EP") if getattr(parallel, name.lower()) > 1]
    axes.append(f"DP {parallel.data_parallel}")
    engine = f", {_engine_words(parallel)}" if parallel.engine != "single" else ""
    return f"{parallel.gpus} ({' x '.join(axes)}{engine})"


def render_estimate(est: Estimate, unit: str, console: Any, gpu: GPU | None = None, explain: bool = False,
                    verdict: dict[str, Any] | None = None) -> None:
    """Print the breakdown tables to a rich console, and with ``gpu`` the verdict line (``verdict``: gpu_verdict's,
    when the caller has it)."""
    Table = table_class(console)

    m, s = est.model, est.settings
    caption = f"recipe {s.recipe}, optimizer {s.optimizer}; unit {unit}"
    table = Table(title=estimate_title(est), caption=caption)
    table.add_column("component")
    table.add_column("dtype")
    table.add_column("bytes/param", justify="right")
    table.add_column(f"total ({unit})", justify="right")
    table.add_column("what", style="dim")
    static_rows = held_static(est)
    for c, nbytes, per_param, note in static_rows:
        table.add_row(c.name, c.dtype, f"{per_param:.2f}", format_bytes(nbytes, unit), note)
    held = est.rank_model or m  # (a model-parallel rank holds a part of the model)
    static_bytes = sum(nbytes for _, nbytes, _, _ in static_rows)
    per_param = static_bytes / held.num_parameters
    table.add_row("static total", "", f"{per_param:.2f}", format_bytes(static_bytes, unit),
                  f"{held.num_parameters:,} parameters on this GPU" if est.rank_model else "", style="bold")
    if est.rank is not None:
        for b in est.rank.buffers:
            table.add_row(f"[dim]+ {b.name}[/dim]", "", "", format_bytes(b.bytes, unit),
                          f"in {', '.join(b.phases)}" + (f"; {b.note}" if b.note else ""))
        if est.rank.host_bytes_per_rank:
            table.add_row("[dim]host memory (this GPU's share)[/dim]", "", "",
                          format_bytes(est.rank.host_bytes_per_rank, unit), "offloaded states, CPU RAM")
    if est.activation_bytes is not None:
        what = (f"batch {s.batch} x seq {s.seq}, {s.attention} attention, checkpointing {s.checkpointing}"
                if est.activation_k_bytes is None else f"seed rule b*s*h*L*k*2, k={s.activation_k:g}")
        table.add_row("activations", "", "", format_bytes(est.activation_bytes, unit),
                      what + (", logits included" if est.activations else ""))
    console.print(table)

    if est.activations is not None:
        _render_activations(est, unit, console, explain)
    if est.phases:
        phases = Table(title="Peak of each phase of a training step (allocated, like max_memory_allocated)"
                       + (", per GPU" if est.per_gpu else ""))
        phases.add_column("phase")
        phases.add_column("peak at")
        for col in ("parameters", "gradients", "states+master", "activations", "temporaries", "allocated"):
            phases.add_column(col, justify="right")
        for p in est.phases:
            style = "bold" if est.peak and p.name == est.peak.phase else None
            phases.add_row(p.name, p.moment, *(format_bytes(v, unit) for v in p.by_category().values()),
                           format_bytes(p.allocated_bytes, unit), style=style)
        console.print(phases)
    if est.per_rank:
        _render_per_rank(est, unit, console)
    if est.peak is not None:
        _render_peak(est, unit, console, gpu)
    for note in est.notes:
        console.print(f"[dim]note: {note}[/dim]")
    render_warnings(est, console)
    if gpu is not None:  # last, where the eye lands
        console.print(f"[bold]{verdict_line(est, gpu, unit, verdict)}[/bold]", highlight=False, soft_wrap=True)


def _render_per_rank(est: Estimate, unit: str, console: Any) -> None:
    Table = table_class(console)

    table = Table(title="Each kind of GPU in the layout (the figures above are the most loaded one's)")
    for col in ("role", "stages", "layers", "parameters", "static", "activations", "peak (allocated)", "required"):
        table.add_column(col, justify="left" if col in ("role", "stages") else "right")
    top = max(est.per_rank, key=lambda r: r.estimate.peak.allocated_bytes if r.estimate.peak else 0)
    for role in est.per_rank:
        e = role.estimate
        stages = ",".join(str(x) for x in role.stages) if len(role.stages) < 4 else \
            f"{role.stages[0]}..{role.stages[-1]}"
        table.add_row(role.name, stages, str(e.rank_model.num_layers if e.rank_model else e.model.num_layers),
                      f"{(e.rank_model or e.model).num_parameters:,}", format_bytes(e.static_bytes, unit),
                      format_bytes(e.activation_bytes or 0, unit),
                      format_bytes(e.peak.allocated_bytes, unit) if e.peak else "-",
                      format_bytes(e.peak.required_bytes, unit) if e.peak else "-",
                      style="bold" if role is top else None)
    console.print(table)


def render_warnings(est: Estimate, console: Any) -> None:
    for warning in est.warnings:
        console.print(f"[bold yellow]warning:[/bold yellow] {warning}")


def _render_activations(est: Estimate, unit: str, console: Any, explain: bool) -> None:
    Table = table_class(console)

    acts = est.activations
    assert acts is not None
    table = Table(title=f"Activations saved for backward ({acts.tokens:,} tokens per micro-batch)")
    table.add_column("where")
    table.add_column("bytes/token", justify="right")
    table.add_column("count", justify="right")
    table.add_column(f"total ({unit})", justify="right")
    for la in acts.layers:
        kind = "MoE" if la.layer.moe else "dense"
        how = (", checkpointed, input in host memory" if acts.offloaded else ", checkpointed") if la.checkpointed \
            else ""
        table.add_row(f"decoder layer ({kind}{how})", f"{kept_bytes_per_token(acts, la):,.0f}", str(la.count),
                      format_bytes(acts.layer_saved_bytes(la) * la.count, unit))
        if explain and la.checkpointed:
            for t in la.checkpoint_terms:
                host = " (in host memory: 0 on the GPU)" if acts.offloaded else ""
                table.add_row(f"  [dim]{t.name}{host}[/dim]", f"[dim]{t.bytes_per_token:,.0f}[/dim]", "", "")
        elif explain:
            for t in la.terms:
                table.add_row(f"  [dim]{t.name}[/dim]", f"[dim]{t.bytes_per_token:,.0f}[/dim]", "", "")
            if la.constant_bytes:
                table.add_row("  [dim]per-layer constant (autocast weight copies, ...)[/dim]", "", "",
                              f"[dim]{format_bytes(la.constant_bytes, unit)}[/dim]")
    for label, terms, total in (("embedding", acts.embedding_terms, acts.embedding_bytes),
                                ("final norm, LM head, loss", acts.head_terms, acts.head_bytes)):
        table.add_row(label, f"{sum(t.bytes_per_token for t in terms):,.0f}", "1", format_bytes(total, unit))
        if explain:
            for t in terms:
                table.add_row(f"  [dim]{t.name}[/dim]", f"[dim]{t.bytes_per_token:,.0f}[/dim]", "", "")
    table.add_row("batch-independent (rotary tables, autocast head copy)", "", "",
                  format_bytes(acts.constant_bytes, unit))
    table.add_row("logits returned by the model", "", "", format_bytes(acts.logits_bytes, unit))
    table.add_row("total", "", "", format_bytes(acts.saved_bytes + acts.logits_bytes, unit), style="bold")
    if acts.offloaded:
        table.add_row("[dim]host memory: what the decoder saved, offloaded[/dim]", "", "",
                      format_bytes(acts.host_bytes, unit))
    console.print(table)
    if not explain:
        console.print("[dim]--explain lists every saved tensor of a layer[/dim]")


def _render_peak(est: Estimate, unit: str, console: Any, gpu: GPU | None) -> None:
    Table = table_class(console)

    pk = est.peak
    assert pk is not None
    dev = est.device
    lines = Table(title=f"What {'each' if est.per_gpu else 'the'} GPU needs (peak in the {pk.phase} phase: "
                        f"{pk.moment})", show_header=False)
    lines.add_column("")
    lines.add_column("", justify="right")
    lines.add_column("", style="dim")
    lines.add_row("allocated", format_bytes(pk.allocated_bytes, unit), "compare with torch.cuda.max_memory_allocated()")
    lines.add_row("reserved", format_bytes(pk.reserved_bytes, unit), reserved_basis(est))
    lines.add_row("device total", format_bytes(pk.device_bytes, unit),
                  f"+ {format_bytes(dev.cuda_overhead_bytes, 'MiB', 0)} CUDA context and workspaces; nvidia-smi")
    for line in estimate_overhead_lines(est, gpu):
        lines.add_row(f"  {line.label}", format_bytes(line.bytes, "MiB", 1), line.source, style="dim")
    lines.add_row("required", format_bytes(pk.required_bytes, unit), f"x {dev.headroom:g} headroom", style="bold")
    if est.paged_bytes:
        lines.add_row("paged optimizer states (not above)", format_bytes(est.paged_bytes, unit),
                      "CUDA unified memory: max_memory_allocated() does not count it and the driver can evict it to "
                      "host memory under pressure, so it is left out of the lines above; while resident, nvidia-smi's "
                      "total may include it")
    console.print(lines)
    fits = Table(title="GPUs")
    fits.add_column("GPU")
    fits.add_column(f"memory ({unit})", justify="right")
    fits.add_column("fits", justify="center")
    fits.add_column("bf16", justify="center")
    listed = list(GPUS.values())
    if gpu is not None and gpu not in listed:  # a --gpu-memory card
        listed.append(gpu)
    for g in listed:
        ok = est.fits(g)
        style = "bold" if gpu is not None and g.name == gpu.name else None
        fits.add_row(g.name, format_bytes(g.memory_bytes, unit), "[green]yes[/green]" if ok else "[red]no[/red]",
                     "?" if g.bf16 is None else "yes" if g.bf16 else "no", style=style)
    console.print(fits)


def render_models(rows: list[tuple[str, str, str, int, int]], console: Any) -> None:
    from rich.table import Table

    table = Table(title="trainmem catalog")
    for col, justify in (("name", "left"), ("Hub id", "left"), ("model_type", "left"),
                         ("parameters", "right"), ("active", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, repo, model_type, params, active in rows:
        table.add_row(name, repo, model_type, f"{params:,} ({format_count(params)})",
                      format_count(active) if active != params else "")
    console.print(table)


def render_sweep(estimates: list[Estimate], unit: str, console: Any, gpu: GPU | None) -> None:
    from rich.table import Table

    layouts = len({(e.parallel.gpus, e.parallel.zero) for e in estimates if e.parallel}) > 1
    title = estimate_title(estimates[0]).split("; per GPU")[0] if layouts else estimate_title(estimates[0])
    table = Table(title=f"{title}: peak allocated / required ({unit})" + (", per GPU" if layouts else ""))
    if layouts:
        table.add_column("GPUs", justify="right")
        table.add_column("engine")
    table.add_column("batch", justify="right")
    table.add_column("seq", justify="right")
    table.add_column("activations", justify="right")
    table.add_column("peak phase")
    table.add_column("allocated", justify="right")
    table.add_column("required", justify="right")
    if gpu is not None:
        table.add_column(f"fits {gpu.name}", justify="center")
        table.add_column("margin", justify="right")
    for e in estimates:
        assert e.peak is not None
        row = [str(e.parallel.gpus), _engine_words(e.parallel) if e.per_gpu else "one GPU"] if layouts else []
        row += [str(e.settings.batch), str(e.settings.seq), format_bytes(e.activation_bytes or 0, unit), e.peak.phase,
               format_bytes(e.peak.allocated_bytes, unit), format_bytes(e.peak.required_bytes, unit)]
        if gpu is not None:
            row += ["yes" if e.fits(gpu) else "no", format_bytes(gpu.memory_bytes - e.peak.required_bytes, unit)]
        table.add_row(*row)
    console.print(table)


def trace_to_dict(est: Estimate, phases: Sequence[Phase], seconds: float, rounded: bool,
                  host_bytes: int = 0) -> dict[str, Any]:
    """The estimate's document with the traced phases in its place, and the estimate beside them; ``host_bytes``:
    what the traced step offloaded to host memory (--offload-activations)."""
    doc = to_dict(est)
    doc["engine"] = "trace"
    estimated = {p["name"]: p for p in doc["phases"]}
    doc["phases"] = []
    for p in phases:
        row = {"name": p.name, "moment": p.moment, "allocated_bytes": p.allocated_bytes,
               **phase_categories(p)}
        if p.name in estimated:
            e = estimated[p.name]["allocated_bytes"]
            row["estimate_allocated_bytes"] = e
            row["relative_error"] = (e - p.allocated_bytes) / p.allocated_bytes if p.allocated_bytes else 0.0
        doc["phases"].append(row)
    top = max(phases, key=lambda ph: ph.allocated_bytes)
    doc["estimate_peak"] = doc["peak"]  # the estimate's own, with its reserved, device and required bytes
    doc["peak"] = {"phase": top.name, "moment": top.moment, "allocated_bytes": top.allocated_bytes,
                   "estimate_allocated_bytes": est.peak.allocated_bytes if est.peak else None}
    doc["trace"] = {"seconds": round(seconds, 2), "rounded_to_512_bytes": rounded}
    if est.activations is not None and est.activations.offloaded:
        doc["trace"]["host_bytes"] = host_bytes
    return doc


def render_trace(est: Estimate, phases: Sequence[Phase], seconds: float, unit: str, console: Any,
                 host_bytes: int = 0) -> None:
    from rich.table import Table

    table = Table(title=f"{estimate_title(est)}: traced step vs estimate ({unit})",
                  caption=f"traced in {seconds:.1f} s under FakeTensorMode with CUDA's autocast lists and kernel "
                          "choices; sizes rounded to 512 bytes like CUDA")
    table.add_column("phase")
    for col in ("parameters", "gradients", "states+master", "activations", "temporaries"):
        table.add_column(col, justify="right")
    table.add_column("traced", justify="right")
    table.add_column("estimate", justify="right")
    table.add_column("error", justify="right")
    estimated = {p.name: p for p in est.phases}
    for p in phases:
        e = estimated.get(p.name)
        error = f"{(e.allocated_bytes - p.allocated_bytes) / p.allocated_bytes:+.2%}" if e and p.allocated_bytes else ""
        table.add_row(p.name, *(format_bytes(v, unit) for v in p.by_category().values()),
                      format_bytes(p.allocated_bytes, unit), format_bytes(e.allocated_bytes, unit) if e else "",
                      error)
    console.print(table)
    if est.activations is not None and est.activations.offloaded:
        acts = est.activations
        error = f" ({(acts.host_bytes - host_bytes) / host_bytes:+.2%})" if host_bytes else ""
        console.print(f"activations offloaded to host memory: traced {format_bytes(host_bytes, unit)}, estimate "
                      f"{format_bytes(acts.host_bytes, unit)}{error}")
    render_warnings(est, console)


def plan_document(found: PlanSearch, top: int, min_gpus: int | None = None) -> dict[str, Any]:
    """``trainmem plan --json`` (and POST /api/plan): the search, and its ``top`` fastest fitting layouts, each
    with its time and the estimate document of that layout (the same figures ``trainmem estimate --json`` gives)."""
    from .plan import TIME_MODEL, throughput_of

    sheet = throughput_of(found.gpu)
    doc: dict[str, Any] = {
        **header("plan"),
        "model": model_dict(found.model),
        "gpu": {"name": found.gpu.name, "memory_bytes": found.gpu.memory_bytes, "dense_tflops": sheet.dense_tflops,
                "link_gbps": sheet.link_gbps, "host_gbps": sheet.host_gbps, "source": sheet.source},
        "search": {"gpus": found.gpus, "seq": found.seq, "global_batch": found.global_batch,
                   "candidates": found.candidates, "evaluated": found.evaluated, "fitting": found.fitting,
                   "seconds": round(found.seconds, 4), "mfu": found.mfu, "inter_node_gbps": found.inter_node_gbps,
                   "host_memory_bytes_per_node": found.host_memory_bytes, "time_model": TIME_MODEL,
                   "not_searched": list(found.skipped), "cut_short": found.cut_short,
                   **({"cut_short_note": "the time budget (or a cap) cut this search short: the plans are the ones "
                                         "found by then"} if found.cut_short else {})},
        "plans": [{"layout": p.layout.as_dict(), "time": p.time.as_dict(), "host_bytes_per_node": p.host_bytes_per_node,
                   "estimate": json_safe(to_dict(p.estimate, found.gpu))} for p in found.plans[:top]],
    }
    if any(p.layout.recipe == "pure-bf16-bf16states" for p in found.plans[:top]):
        from .plan import BF16_STATES_NOTE

        doc["search"]["bf16_states_note"] = BF16_STATES_NOTE
    if min_gpus is not None:
        doc["min_gpus"] = min_gpus
    return doc


def render_plan(found: PlanSearch, top: int, unit: str, console: Any, min_gpus: int | None = None) -> None:
    from rich import box
    from rich.table import Table

    from .plan import BF16_STATES_NOTE
    from .units import to_unit

    short = ("[bold yellow]the time budget (or a cap) cut this search short: the layouts below are the ones found "
             "by then[/bold yellow]")
    if not found.plans:
        console.print(f"[bold red]no layout of {found.gpus} x {found.gpu.name} fits[/bold red] "
                      f"(searched {found.candidates:,} layouts; try more GPUs, --min-gpus, or a shorter --seq)")
        if found.cut_short:
            console.print(short)
        return
    model = found.model
    lora = getattr(found, "finetune", None)
    tuned = "" if lora is None else f" (LoRA rank {lora.lora.rank}{', nf4 base' if lora.base_quant else ''})"
    table = Table(title=f"{model.name}{tuned}: {found.gpus} x {found.gpu.name}, {found.global_batch} sequences of "
                        f"{found.seq:,} tokens a step: the fastest layouts that fit ({unit} per GPU)",
                  caption=f"{found.candidates:,} layouts searched ({found.evaluated:,} evaluated) in "
                          f"{found.seconds:.2f} s; {found.fitting:,} fit. Time: {found.mfu:.0%} of peak FLOPS, "
                          "communication overlapped, offload not (docs/method.md): it ranks, it does not promise "
                          "seconds.", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    # (every cell whole: the headers are on two lines and the offload shortened, so that the table fits 100
    # columns and more; _console() is at least 120 wide)
    for col, left in (("#", False), ("tp/pp\n/cp/dp", False), ("engine", True), ("recipe", True), ("ckpt", True),
                      ("offload", True), ("micro\nx accum", False), (f"needed\n{unit}", False),
                      (f"host\n{unit}/node", False), ("step\ns", False), ("tokens\n/s/GPU", False),
                      ("comm/\ncomp", False)):
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    marked = False
    for i, p in enumerate(found.plans[:top], 1):
        L, t = p.layout, p.time
        states = L.recipe == "pure-bf16-bf16states"
        marked = marked or states
        degrees = f"{L.tp}{'+sp' if L.tp > 1 else ''}/{L.pp}/{L.cp}/{L.data_parallel}" + \
            (f" ep{L.ep}" if L.ep > 1 else "")
        engine = "no DP" if L.engine == "no data parallelism" else L.engine
        table.add_row(str(i), degrees, engine, L.recipe + ("*" if states else ""), L.checkpointing,
                      {"optimizer+params": "opt+params"}.get(L.offload, L.offload),
                      f"{L.micro_batch} x {L.grad_accum}",
                      f"{to_unit(p.peak.required_bytes, unit):,.{0 if unit == 'B' else 2}f}",
                      f"{to_unit(p.host_bytes_per_node, unit):,.0f}",
                      f"{t.seconds:.2f}", f"{t.as_dict()['tokens_per_second_per_gpu']:,.0f}",
                      f"{t.communication_seconds / t.compute_seconds:.2f}")
    console.print(table)
    console.print(f"[dim]{plan_reserved_note(found.plans[0].step.device)}[/dim]", highlight=False)
    if found.cut_short:
        console.print(short)
    if marked:
        console.print("* " + BF16_STATES_NOTE)
    if any(p.layout.offload == "optimizer+params" for p in found.plans[:top]):
        console.print("opt+params: the optimizer states and the parameters offloaded to host memory")
    for line in plan_reasons(found):
        console.print(line)


def _degrees(layout: Layout) -> str:
    return (f"{layout.tp}{'+sp' if layout.tp > 1 else ''} x {layout.pp} x {layout.cp} x {layout.data_parallel}"
            + (f", ep {layout.ep}" if layout.ep > 1 else ""))


def plan_reasons(found: PlanSearch) -> list[str]:
    """Why the best layouts win, in words: what bounds the best step, and what the runners-up pay."""
    best = found.plans[0]
    L, t = best.layout, best.time
    bound = "compute" if t.compute_seconds >= t.communication_seconds else "communication"
    split = (f"TP {L.tp}{' with SP' if L.tp > 1 else ''} x PP {L.pp} x CP {L.cp} x DP {L.data_parallel}"
             + (f" with EP {L.ep}" if L.ep > 1 else "") + ", ") if L.model_parallel * L.ep > 1 else ""
    lines = [f"best: {split}{L.engine}, {L.recipe}, checkpointing {L.checkpointing}, offload {L.offload}, "
             f"micro-batch {L.micro_batch} x {L.grad_accum}: {bound}-bound ({t.compute_seconds:.2f} s compute"
             + (" with the pipeline bubble" if L.pp > 1 else "") + f", {t.communication_seconds:.2f} s "
             f"data-parallel communication overlapped, {t.exposed_seconds:.2f} s tensor/pipeline communication "
             f"exposed, {t.offload_seconds:.2f} s offload a step)"]
    if L.model_parallel * L.ep > 1 and not any(p.layout.model_parallel * p.layout.ep == 1 for p in found.plans):
        lines.append("  tensor/pipeline parallelism: no data-parallel layout alone fits")
    same = [p.layout for p in found.plans if (p.layout.engine, p.layout.recipe) == (L.engine, L.recipe)]
    if L.checkpointing == "full" and not any(x.checkpointing == "none" and x.offload == L.offload for x in same):
        lines.append(f"  full checkpointing: without it no {L.engine} layout with this recipe and offload fits "
                     "(it costs a third more compute)")
    if L.offload != "none" and not any(x.offload == "none" for x in same):
        lines.append(f"  offload {L.offload}: no {L.engine} layout with this recipe fits without it")
    for p in found.plans[1:3]:
        slower = p.time.seconds / t.seconds - 1
        what = []
        if p.time.offload_seconds > t.offload_seconds:
            what.append("more offload traffic")
        if p.time.communication_seconds > t.communication_seconds and p.time.communication_seconds > \
                p.time.compute_seconds:
            what.append("communication-bound")
        if p.layout.checkpointing == "full" and L.checkpointing == "none":
            what.append("recomputes the forward")
        if not what and p.layout.micro_batch < L.micro_batch:
            what.append("smaller micro-batch")
        if p.time.exposed_seconds > t.exposed_seconds:
            what.append("more tensor/pipeline communication")
        if p.layout.pp > 1 and p.time.compute_seconds > t.compute_seconds * 1.001:
            what.append("a larger pipeline bubble")
        lines.append(f"  then {_degrees(p.layout)} {p.layout.engine} {p.layout.recipe} ({p.layout.checkpointing}, "
                     f"{p.layout.offload}): "
                     f"{slower:+.1%}" + (f", {', '.join(what)}" if what else ", equal time; more memory needed"))
    return lines
