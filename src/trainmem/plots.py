"""PNG pictures of estimates: where the bytes go in each phase of the step, and how the need grows with the batch or
the sequence against GPU capacities.

matplotlib with the Agg backend (no display). Each picture is drawn from the same Estimate objects the tables and
the JSON print, and the numbers it draws are returned, so a test can hold them against the estimate. The PNG is
written to a temporary file beside the target and moved into place: an error leaves no half-written image.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .estimate import Estimate
from .hardware import GPU, GPUS
from .units import format_bytes, to_unit

if TYPE_CHECKING:
    from .allocator import ReplayReport

CATEGORY_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer_states": "#55A868",
                   "activations": "#C44E52", "temporaries": "#8172B3"}
"""timeline.CATEGORIES (optimizer_states includes fp32 master weights), in stacking order."""
STATIC_COLORS = {"weights": "#4C72B0", "gradients": "#DD8452", "master_weights": "#937860",
                 "optimizer_states": "#55A868"}
CAPACITY_LINES = 4
"""GPUs drawn when none is asked about: the distinct memory sizes nearest above and below what is required."""


def check_plot_path(path: str | os.PathLike[str]) -> Path:
    """The PNG's path, refused in one line before any work if it cannot be written."""
    target = Path(path)
    if target.suffix.lower() != ".png":
        raise ConfigError(f"--plot writes a PNG: give a path ending in .png, got {str(path)!r}")
    if not target.parent.is_dir():
        raise ConfigError(f"--plot: the folder {str(target.parent)!r} does not exist")
    if target.is_dir():
        raise ConfigError(f"--plot: {str(path)!r} is a folder")
    return target


def capacity_gpus(required: int, gpu: GPU | None) -> list[GPU]:
    """The GPU asked about, or the nearest distinct memory sizes around ``required`` (two below, two above)."""
    if gpu is not None:
        return [gpu]
    ordered = _one_per_size(GPUS.values())
    below = [g for g in ordered if g.memory_bytes < required][-(CAPACITY_LINES // 2):]
    above = [g for g in ordered if g.memory_bytes >= required][:CAPACITY_LINES - len(below)]
    return below + above


def plot_estimate(est: Estimate, path: str | os.PathLike[str], unit: str = "GiB",
                  gpu: GPU | None = None) -> dict[str, Any]:
    """One stacked bar per phase of the step (parameters, gradients, optimizer states and masters, activations,
    temporaries at that phase's peak moment), the peak phase marked, the bytes the GPU needs (with headroom)
    and GPU capacities as horizontal lines. Without a modelled step (static memory only), one bar of the static
    components. Returns what was drawn, in bytes."""
    from .report import estimate_title

    target = check_plot_path(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5.6))
    if est.phases:
        bars = {ph.name: ph.by_category() for ph in est.phases}
        colors = CATEGORY_COLORS
        xlabel = "phase of the training step (each at its peak moment)"
    else:
        bars = {"static": {c.name: c.bytes for c in est.static}}
        colors = STATIC_COLORS
        xlabel = "static memory (the step's activations are not modelled here)"
    names = list(bars)
    positions = range(len(names))
    bottoms = [0.0] * len(names)
    for category, color in colors.items():
        heights = [to_unit(bars[n].get(category, 0), unit) for n in names]
        ax.bar(positions, heights, bottom=bottoms, color=color, width=0.6,
               label="optimizer states + masters" if category == "optimizer_states" and est.phases else category)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if len(names) == 1:
        ax.set_xlim(-1.5, 1.5)
    peak = est.peak
    peak_phase = peak.phase if peak else None
    ax.set_xticks(positions, [f"{n}\n(peak: {peak.moment})" if peak is not None and n == peak_phase else n
                              for n in names], fontsize=8)
    totals = {n: sum(bars[n].values()) for n in names}
    for i, n in enumerate(names):
        ax.text(i, to_unit(totals[n], unit), format_bytes(totals[n], unit), ha="center", va="bottom", fontsize=8)
    lines = {}
    required = est.peak.required_bytes if est.peak else est.static_bytes
    if est.peak:
        ax.axhline(to_unit(required, unit), color="black", linestyle="--", linewidth=1.2)
        ax.text(0.99, to_unit(required, unit), f"needed with headroom: {format_bytes(required, unit)}",
                ha="right", va="bottom", fontsize=8, transform=ax.get_yaxis_transform())
        lines["required"] = required
    for g in capacity_gpus(required, gpu):
        fits = g.memory_bytes >= required
        ax.axhline(to_unit(g.memory_bytes, unit), color="#2a9d8f" if fits else "#e76f51", linewidth=1.2)
        ax.text(0.01, to_unit(g.memory_bytes, unit), f"{g.name} {format_bytes(g.memory_bytes, unit, 0)}",
                ha="left", va="bottom", fontsize=8, color="#2a9d8f" if fits else "#e76f51",
                transform=ax.get_yaxis_transform())
        lines[g.name] = g.memory_bytes
    ax.set_ylabel(f"memory ({unit})")
    ax.set_xlabel(xlabel)
    ax.set_title(_wrapped(estimate_title(est)), fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_ylim(0, max([to_unit(v, unit) for v in list(totals.values()) + list(lines.values())]) * 1.12)
    _save(fig, target, plt)
    return {"bars": bars, "lines": lines, "peak_phase": peak_phase}


def plot_sweep(estimates: list[Estimate], path: str | os.PathLike[str], unit: str = "GiB",
               gpu: GPU | None = None) -> dict[str, Any]:
    """The bytes the GPU needs (with headroom) against the micro-batch or the sequence length, whichever the sweep
    varies, one curve per value of the other (and per GPU layout), with GPU capacities as lines and, on each curve,
    where each GPU runs out (the first point that does not fit). Returns what was drawn, in bytes."""
    from .report import estimate_title

    target = check_plot_path(path)
    batches = sorted({e.settings.batch for e in estimates})
    seqs = sorted({e.settings.seq for e in estimates})
    if len(batches) < 2 and len(seqs) < 2:
        raise ConfigError("--plot draws memory against the batch or the sequence: give more than one --batch or "
                          "--seq value")
    along_batch = len(batches) > 1
    curves: dict[str, list[tuple[int, int]]] = {}
    for e in estimates:
        x = e.settings.batch if along_batch else e.settings.seq
        other = f"seq {e.settings.seq}" if along_batch else f"batch {e.settings.batch}"
        if e.per_gpu:
            other += f", {e.parallel.gpus} GPUs ZeRO-{e.parallel.zero}" if e.parallel.zero is not None else \
                f", {e.parallel.gpus} GPUs {e.parallel.engine}"
        assert e.peak is not None  # (sweep refused estimates without activations)
        curves.setdefault(other, []).append((x, e.peak.required_bytes))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5.6))
    highest = max(b for points in curves.values() for _, b in points)
    gpus = capacity_gpus(highest, gpu) if gpu else _sweep_gpus(curves)
    runs_out: dict[str, dict[str, int | None]] = {}
    for label, points in curves.items():
        points.sort()
        xs, ys = [x for x, _ in points], [to_unit(b, unit) for _, b in points]
        (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=label)
        runs_out[label] = {}
        for g in gpus:
            first = next((x for x, b in points if b > g.memory_bytes), None)
            runs_out[label][g.name] = first
            if first is not None:
                ax.plot([first], [to_unit(dict(points)[first], unit)], marker="x", markersize=9,
                        color=line.get_color())
    for g in gpus:
        ax.axhline(to_unit(g.memory_bytes, unit), color="grey", linestyle="--", linewidth=1)
        ax.text(0.01, to_unit(g.memory_bytes, unit), f"{g.name} {format_bytes(g.memory_bytes, unit, 0)}",
                va="bottom", fontsize=8, color="dimgrey", transform=ax.get_yaxis_transform())
    ax.set_xscale("log", base=2)
    ticks = sorted({x for points in curves.values() for x, _ in points})
    ax.set_xticks(ticks, [f"{x:,}" for x in ticks], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("micro-batch size" if along_batch else "sequence length (tokens)")
    ax.set_ylabel(f"needed with headroom ({unit})")
    ax.set_title(_wrapped(estimate_title(estimates[0]).split("; per GPU")[0] + " — x: first point past a GPU"),
                 fontsize=9)
    ax.legend(fontsize=8)
    _save(fig, target, plt)
    return {"axis": "batch" if along_batch else "seq", "curves": curves,
            "lines": {g.name: g.memory_bytes for g in gpus}, "runs_out": runs_out}


def _sweep_gpus(curves: dict[str, list[tuple[int, int]]]) -> list[GPU]:
    """The distinct GPU sizes the curves cross, or the nearest ones around them."""
    low = min(b for points in curves.values() for _, b in points)
    high = max(b for points in curves.values() for _, b in points)
    gpus = _one_per_size(g for g in GPUS.values() if low <= g.memory_bytes <= high)
    return gpus[:CAPACITY_LINES] if gpus else capacity_gpus(high, None)


def _one_per_size(gpus: Iterable[GPU]) -> list[GPU]:
    """One GPU per memory size (to the nearest GiB), smallest first."""
    sizes: dict[int, GPU] = {}
    for g in sorted(gpus, key=lambda g: g.memory_mib):
        sizes.setdefault(round(g.memory_mib / 1024), g)
    return list(sizes.values())


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'trainmem[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wrapped(title: str, width: int = 110) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(title, width))


def _save(fig: Any, target: Path, plt: Any) -> None:
    fig.tight_layout()
    # (a name of our own rather than tempfile's, whose 0600 mode the image would keep)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(temporary, dpi=110, format="png")
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)


def plot_reserved(report: ReplayReport, path: str | os.PathLike[str], unit: str = "GiB",
                  title: str = "") -> dict[str, Any]:
    """allocated and reserved memory through a caching allocator replay (allocator.ReplayReport.timeline), the
    peak marked. Returns what was drawn, in bytes."""
    target = check_plot_path(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.8))
    events = [e for e, _, _ in report.timeline]
    allocated = [to_unit(a, unit) for _, a, _ in report.timeline]
    reserved = [to_unit(r, unit) for _, _, r in report.timeline]
    ax.fill_between(events, reserved, step="post", color="#e9c46a", alpha=0.5, label="reserved (segments)")
    ax.step(events, allocated, where="post", color="#264653", linewidth=1.0, label="allocated (tensors)")
    ax.axvline(report.peak_event, color="black", linestyle="--", linewidth=1.0)
    ax.text(report.peak_event, to_unit(report.max_reserved, unit),
            f" peak: {format_bytes(report.max_allocated, unit)} allocated, "
            f"{format_bytes(report.max_reserved, unit)} reserved", fontsize=8, va="bottom")
    ax.set_xlabel(f"allocation or free ({report.steps} steps, {report.settings})")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(0, max(reserved, default=1) * 1.15)
    ax.set_title(_wrapped(title or "caching allocator replay"), fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    _save(fig, target, plt)
    return {"events": len(events), "max_allocated": report.max_allocated, "max_reserved": report.max_reserved}
