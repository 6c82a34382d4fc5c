"""Measure real CUDA peaks against the estimate and record them in docs/accuracy.md.

For sessions with a GPU: builds each model for real (random weights), runs two training steps with
``trainmem.measure.measure_steps`` (torch.cuda.max_memory_allocated / max_memory_reserved, peak reset at each
phase boundary), estimates the same set-up, prints the comparison and replaces the "CUDA measurements" section
of docs/accuracy.md with it, dated and naming the GPU. Exits 2 without a CUDA device.

Run: python benchmarks/cuda_accuracy.py [--quick]
"""

import datetime
import pathlib
import re
import sys

import torch

from trainmem.catalog import catalog_config, catalog_spec
from trainmem.estimate import estimate_model
from trainmem.measure import measure_steps
from trainmem.settings import make_settings

CASES = [
    ("qwen2.5-0.5b", dict(recipe="mixed-bf16", batch=4, seq=2048)),
    ("qwen2.5-0.5b", dict(recipe="amp-bf16", batch=4, seq=2048)),
    ("llama-3.2-1b", dict(recipe="mixed-bf16", batch=2, seq=4096)),
    ("llama-3.2-1b", dict(recipe="mixed-bf16", batch=8, seq=4096, checkpointing="full")),
    ("gpt2", dict(recipe="amp-bf16", batch=8, seq=1024)),
    ("llama-2-7b", dict(recipe="pure-bf16-bf16states", batch=1, seq=2048)),
    ("llama-3-8b", dict(recipe="mixed-bf16", batch=1, seq=4096, checkpointing="full")),
]
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "accuracy.md"
HEADING = "## CUDA measurements"


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured", file=sys.stderr)
        return 2
    cases = CASES[:3] if "--quick" in sys.argv else CASES
    gpu = torch.cuda.get_device_name()
    lines = [HEADING, "", f"{datetime.date.today().isoformat()}, {gpu}, torch {torch.__version__}. Two steps, "
             "the second measured; dropout 0.", "",
             "| model | settings | phase | measured allocated | reserved | estimate | error |", "|---|---|---|---|---|---|---|"]
    for name, kw in cases:
        settings = make_settings(dropout=0.0, **kw)
        try:
            measured = measure_steps(catalog_config(name), settings, "cuda")
        except torch.OutOfMemoryError:
            lines.append(f"| {name} | {kw} | out of memory | | | | |")
            torch.cuda.empty_cache()
            continue
        estimated = {p.name: p.allocated_bytes for p in estimate_model(catalog_spec(name), settings).phases}
        for p in measured.phases:
            e = estimated[p.name]
            row = (f"| {name} | {kw} | {p.name} | {p.allocated_bytes / 2**30:.3f} GiB | "
                   f"{p.reserved_bytes / 2**30:.3f} GiB | {e / 2**30:.3f} GiB | "
                   f"{(e - p.allocated_bytes) / p.allocated_bytes:+.2%} |")
            lines.append(row)
            print(row, flush=True)
        torch.cuda.empty_cache()
    section = "\n".join(lines) + "\n"
    text = DOC.read_text() if DOC.exists() else "# Accuracy\n"
    if HEADING in text:
        text = re.sub(rf"{HEADING}.*?(?=\n## |\Z)", section, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + section
    tmp = DOC.with_suffix(".md.tmp")  # written whole, then renamed: an interrupted run leaves the old report
    tmp.write_text(text)
    tmp.replace(DOC)
    print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
