"""Measure real CUDA peaks against the estimate and record them in docs/accuracy.md.

For sessions with a GPU: builds each model for real (random weights), runs two training steps with
``trainmem.measure.measure_steps`` (torch.cuda.max_memory_allocated / max_memory_reserved, peak reset at each
phase boundary), estimates the same set-up, prints the comparison and replaces the "CUDA measurements" section
of docs/accuracy.md with it, dated and naming the GPU (the other sections are kept). Exits 2 without a CUDA
device. ``cuda_section`` and the report rewrite are tested on the CPU (tests/test_validate.py).

Run: python benchmarks/cuda_accuracy.py [--quick]
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


def cuda_section(results, gpu: str, torch_version: str, date: str) -> str:
    lines = [HEADING, "", f"{date}, {gpu}, torch {torch_version}. Two steps, the second measured; dropout 0. "
             "The estimate is compared with `max_memory_allocated()`; `reserved` is `max_memory_reserved()`.", "",
             "| model | settings | phase | measured allocated | reserved | estimate | error |",
             "|---|---|---|---|---|---|---|", *cuda_rows(results)]
    return "\n".join(lines) + "\n\n"


def main() -> int:
    import torch

    from trainmem.catalog import catalog_config, catalog_spec
    from trainmem.estimate import estimate_model
    from trainmem.measure import measure_steps
    from trainmem.settings import make_settings

    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured", file=sys.stderr)
        return 2
    cases = CASES[:3] if "--quick" in sys.argv else CASES
    results = []
    for name, kw in cases:
        settings = make_settings(dropout=0.0, **kw)
        estimate = estimate_model(catalog_spec(name), settings)
        try:
            measured = measure_steps(catalog_config(name), settings, "cuda")
        except torch.OutOfMemoryError:
            measured = None
        torch.cuda.empty_cache()
        results.append((name, kw, measured, estimate))
        print("\n".join(cuda_rows(results[-1:])), flush=True)
    section = cuda_section(results, torch.cuda.get_device_name(), torch.__version__,
                           datetime.date.today().isoformat())
    print(section)
    text = replace_sections(DOC.read_text() if DOC.exists() else None, {HEADING: section})
    tmp = DOC.with_suffix(".md.tmp")  # written whole, then renamed: an interrupted run leaves the old report
    tmp.write_text(text)
    tmp.replace(DOC)
    print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
