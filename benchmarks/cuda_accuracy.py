"""Measure real CUDA peaks against the estimate and record them in docs/accuracy.md.

For sessions with a GPU: builds each model for real (random weights), runs two training steps with
``trainmem.measure.measure_steps`` (torch.cuda.max_memory_allocated / max_memory_reserved, peak reset at each
phase boundary), estimates the same set-up, prints the comparison and replaces the "CUDA measurements" section
of docs/accuracy.md with it, dated and naming the GPU (the other sections are kept). Exits 2 without a CUDA
device. ``cuda_section`` and the report rewrite are tested on the CPU (tests/test_validate.py).

Reserved memory: each phase's ``max_memory_reserved()`` (measure's CUDA recorder) and, at the end of each phase,
``torch.cuda.memory._snapshot()`` (the segments, by wrapping the recorder's phase switch). The same set-up is traced
on the CPU with its allocations recorded and replayed through trainmem's model of the caching allocator
(trainmem.allocator, under the run's own PYTORCH_CUDA_ALLOC_CONF); a second table compares the replayed
max_memory_reserved and segments with the measured ones, beside the estimate's flat-factor reserved. The real
figure also holds what the trace does not allocate through the caching allocator's callers it sees (cuBLAS
workspaces are taken from the caching allocator, one per handle and stream).

Run: python benchmarks/cuda_accuracy.py [--quick] [--no-replay]
On a node with several GPUs, benchmarks/cuda_sharded.py (under torchrun) measures FSDP2 and ZeRO-2/3 per GPU.
"""

import datetime
import pathlib
import sys

from trainmem.validate import replace_sections

CASES = [
    ("qwen2.5-0.5b", dict(recipe="mixed-bf16", batch=4, seq=2048)),
    ("qwen2.5-0.5b", dict(recipe="amp-bf16", batch=4, seq=2048)),
    ("llama-3.2-1b", dict(recipe="mixed-bf16", batch=2, seq=4096)),
    ("llama-3.2-1b", dict(recipe="mixed-bf16", batch=8, seq=4096, checkpointing="full")),
    ("gpt2", dict(recipe="amp-bf16", batch=8, seq=1024)),
    ("llama-2-7b", dict(recipe="pure-bf16-bf16states", batch=1, seq=2048)),
    ("llama-3-8b", dict(recipe="pure-bf16-bf16states", batch=1, seq=4096, checkpointing="full")),
]
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "accuracy.md"
HEADING = "## CUDA measurements"


def cuda_rows(results) -> list[str]:
    """Table rows for ``results``: (model, settings kwargs, Measurement or None when it ran out of memory,
    Estimate)."""
    lines = []
    for name, kw, measured, estimate in results:
        settings = ", ".join(f"{k}={v}" for k, v in kw.items())
        if measured is None:
            lines.append(f"| {name} | {settings} | out of memory | | | | |")
            continue
        estimated = {p.name: p.allocated_bytes for p in estimate.phases}
        for p in measured.phases:
            e = estimated[p.name]
            reserved = f"{p.reserved_bytes / 2**30:.3f} GiB" if p.reserved_bytes is not None else "-"
            lines.append(f"| {name} | {settings} | {p.name} | {p.allocated_bytes / 2**30:.3f} GiB | {reserved} | "
                         f"{e / 2**30:.3f} GiB | {(e - p.allocated_bytes) / p.allocated_bytes:+.2%} |")
    return lines


def snapshot_summary(snapshot: dict) -> dict:
    """Segments of a ``torch.cuda.memory._snapshot()``: their count, reserved and allocated bytes, their sizes, and
    the largest inactive block of a segment that also holds other blocks (an inactive split)."""
    segments = snapshot.get("segments", [])
    split = [b["size"] for s in segments if len(s["blocks"]) > 1 for b in s["blocks"] if b["state"] == "inactive"]
    return {"segments": len(segments), "reserved": sum(s["total_size"] for s in segments),
            "allocated": sum(s["allocated_size"] for s in segments),
            "sizes": sorted(s["total_size"] for s in segments), "largest_inactive_split": max(split, default=0)}


def replay_summary(report) -> dict:
    """The same figures for a trainmem.allocator.ReplayReport's segments at its peak."""
    segments = report.segments_at_peak
    return {"segments": len(segments), "reserved": sum(s.total_size for s in segments),
            "allocated": sum(s.allocated_size for s in segments), "sizes": sorted(s.total_size for s in segments),
            "largest_inactive_split": report.largest_inactive_split}


def reserved_rows(results) -> list[str]:
    """Rows comparing reserved memory: (model, settings kwargs, Measurement or None, Estimate, peak-phase snapshot
    summary or None, ReplayReport or None, allocator settings)."""
    lines = []
    for name, kw, measured, estimate, snap, report, conf in results:
        settings = ", ".join(f"{k}={v}" for k, v in kw.items())
        if measured is None or report is None:
            lines.append(f"| {name} | {settings} | {conf} | {'out of memory' if measured is None else ''} | "
                         f"{'' if report is None else f'{report.max_reserved / 2**30:.3f} GiB'} | | | | |")
            continue
        real = max(p.reserved_bytes or 0 for p in measured.phases)
        flat = estimate.peak.reserved_bytes
        segs = f"{snap['segments']} / {len(report.segments_at_peak)}" if snap else f"- / {len(report.segments_at_peak)}"
        replayed = report.max_reserved
        lines.append(f"| {name} | {settings} | {conf} | {real / 2**30:.3f} GiB | {replayed / 2**30:.3f} GiB "
                     f"| {(replayed - real) / real:+.2%} | {flat / 2**30:.3f} GiB | {(flat - real) / real:+.2%} "
                     f"| {segs} |")
    return lines


def cuda_section(results, gpu: str, torch_version: str, date: str, reserved=()) -> str:
    lines = [HEADING, "", f"{date}, {gpu}, torch {torch_version}. Two steps, the second measured; dropout 0. "
             "The estimate is compared with `max_memory_allocated()`; `reserved` is `max_memory_reserved()`.", "",
             "| model | settings | phase | measured allocated | reserved | estimate | error |",
             "|---|---|---|---|---|---|---|", *cuda_rows(results)]
    if reserved:
        lines += ["", "Reserved memory: the measured step's `max_memory_reserved()` against the trace's allocations "
                  "replayed through trainmem's caching allocator model (two steps) and against the estimate's flat "
                  "fragmentation factor; segments counted in `torch.cuda.memory._snapshot()` at the end of the peak "
                  "phase and in the replay at its peak.", "",
                  "| model | settings | PYTORCH_CUDA_ALLOC_CONF | measured reserved | replayed | error | flat factor "
                  "| error | segments measured / replayed |", "|---|---|---|---|---|---|---|---|---|",
                  *reserved_rows(reserved)]
    return "\n".join(lines) + "\n\n"


def _snapshots_per_phase(torch, taken: dict):
    """While active, measure's CUDA recorder also takes ``torch.cuda.memory._snapshot()`` as each phase ends."""
    import contextlib

    from trainmem import measure

    @contextlib.contextmanager
    def wrapped():
        original = measure._CudaRecorder.switch

        def switch(self, phase):
            ending = self.current
            original(self, phase)
            taken[ending] = torch.cuda.memory._snapshot()

        measure._CudaRecorder.switch = switch
        try:
            yield
        finally:
            measure._CudaRecorder.switch = original

    return wrapped()


def _replayed(name, settings):
    """The CPU trace of the same set-up, its allocations replayed under this process's PYTORCH_CUDA_ALLOC_CONF."""
    from trainmem.allocator import config_from_environment, replay
    from trainmem.catalog import catalog_config, catalog_spec
    from trainmem.trace import trace_step

    traced = trace_step(catalog_config(name), settings, catalog_spec(name), record_allocations=True)
    config = config_from_environment()
    return replay(traced.allocations, config), config.describe()


def main() -> int:
    import torch

    from trainmem.catalog import catalog_config, catalog_spec
    from trainmem.stepmodel import estimate_model
    from trainmem.measure import measure_steps
    from trainmem.settings import make_settings

    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured", file=sys.stderr)
        return 2
    cases = CASES[:3] if "--quick" in sys.argv else CASES
    results, reserved = [], []
    for name, kw in cases:
        settings = make_settings(dropout=0.0, **kw)
        estimate = estimate_model(catalog_spec(name), settings)
        snapshots: dict = {}
        try:
            with _snapshots_per_phase(torch, snapshots):
                measured = measure_steps(catalog_config(name), settings, "cuda")
        except torch.OutOfMemoryError:
            measured = None
        torch.cuda.empty_cache()
        results.append((name, kw, measured, estimate))
        print("\n".join(cuda_rows(results[-1:])), flush=True)
        if "--no-replay" not in sys.argv:
            report, conf = _replayed(name, settings)
            peak_phase = max(measured.phases, key=lambda p: p.reserved_bytes or 0).name if measured else None
            snap = snapshot_summary(snapshots[peak_phase]) if peak_phase in snapshots else None
            reserved.append((name, kw, measured, estimate, snap, report, conf))
            print("\n".join(reserved_rows(reserved[-1:])), flush=True)
            if snap:
                print(f"  segments measured {snap['sizes']}\n  segments replayed {replay_summary(report)['sizes']}")
    section = cuda_section(results, torch.cuda.get_device_name(), torch.__version__,
                           datetime.date.today().isoformat(), reserved)
    print(section)
    text = replace_sections(DOC.read_text() if DOC.exists() else None, {HEADING: section})
    tmp = DOC.with_suffix(".md.tmp")  # written whole, then renamed: an interrupted run leaves the old report
    tmp.write_text(text)
    tmp.replace(DOC)
    print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
