"""How fast `trainmem plan` searches: layouts counted per second (every micro-batch of every recipe x engine x
checkpointing x offload) and estimator evaluations per second, for a few models and GPU counts.

    taskset -c 0 python benchmarks/plan_speed.py     # one core, as README.md quotes it
"""

import time

from trainmem.catalog import catalog_spec
from trainmem.hardware import get_gpu
from trainmem.plan import search

CASES = [("llama-3-8b", "H100-80GB", 8, 4096, 512), ("llama-3-8b", "H100-80GB", 64, 4096, 1024),
         ("llama-3-70b", "H100-80GB", 64, 4096, 1024), ("mixtral-8x7b", "A100-80GB", 32, 4096, 2048),
         ("llama-3.1-405b", "H100-80GB", 256, 8192, 2048)]


def main() -> None:
    total_candidates = total_evaluated = 0
    total_seconds = 0.0
    for model, gpu, gpus, seq, batch in CASES:
        spec = catalog_spec(model)
        started = time.perf_counter()
        found = search(spec, get_gpu(gpu), gpus, seq, batch)
        seconds = time.perf_counter() - started
        total_candidates += found.candidates
        total_evaluated += found.evaluated
        total_seconds += seconds
        print(f"{model:16s} {gpus:4d} x {gpu:10s} seq {seq:5d} batch {batch:5d}: {found.candidates:6,d} layouts, "
              f"{found.evaluated:5,d} evaluated, {found.fitting:3d} fit, {seconds:6.3f} s "
              f"({found.candidates / seconds:8,.0f} layouts/s)")
    print(f"all: {total_candidates:,} layouts in {total_seconds:.2f} s: {total_candidates / total_seconds:,.0f} "
          f"layouts/s, {total_evaluated / total_seconds:,.0f} evaluations/s")


if __name__ == "__main__":
    main()
