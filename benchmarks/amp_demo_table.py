"""The tables of docs/mixed-precision.md, section 8, from a fresh run of the amp demo on this machine.

The losses depend on the CPU's fp16/bf16 kernels (and the time on whether the CPU computes bf16 natively), so the
numbers differ between processors: they are a dated observation, not a test. What arithmetic guarantees of the
same runs (fp16 without a scaler flushes every gradient at 2^-20, the scaler restores them, bf16 runs are
bit-identical with and without the scale-down) is asserted on any machine by
tests/test_precision.py::test_amp_demo_claims; that is why the scale-down set here runs only the two fp16 runs (the
others would repeat the first set's numbers exactly). Each run's row is printed as it finishes.

Run: python benchmarks/amp_demo_table.py [--steps 200]
"""

import argparse
import datetime
import platform
import time

import torch

from trainmem.amp_demo import RUNS, _model, rounded_away, run


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "flags unknown"
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16") if f in flags]
    return ", ".join(have) or "no AVX2"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    print(f"{datetime.date.today()}, torch {torch.__version__}, {platform.machine()} ({cpu_flags()}), "
          f"{torch.get_num_threads()} threads, {args.steps} steps, batch {args.batch}\n")
    print("| run | final loss | gap to fp32 | zero gradients | skipped steps | seconds |")
    print("|---|---|---|---|---|---|", flush=True)
    reference = None
    total = 0.0
    for name in RUNS:
        started = time.perf_counter()
        r = run(name, steps=args.steps, batch=args.batch)
        seconds = time.perf_counter() - started
        total += seconds
        reference = r.final_loss if name == "fp32" else reference
        gap = "" if name == "fp32" else f"{r.final_loss - reference:+.3f}".replace("-", "−")
        skipped = str(r.skipped_steps) if "scaler" in name else ""
        print(f"| {name} | {r.final_loss:.3f} | {gap} | {r.zero_grad_fraction:.2%} | {skipped} | {seconds:.0f} |",
              flush=True)
    print(f"\n{total:.0f} s for the six runs\n\nWith --grad-scale-down 2^-20 (the fp16 runs):\n")
    print("| run | final loss | zero gradients | seconds |")
    print("|---|---|---|---|", flush=True)
    for name in ("fp16-autocast", "fp16-autocast+scaler"):
        started = time.perf_counter()
        r = run(name, steps=args.steps, batch=args.batch, grad_scale_down=2.0**-20)
        print(f"| {name} | {r.final_loss:.3f} | {r.zero_grad_fraction:.2%} | {time.perf_counter() - started:.0f} |",
              flush=True)
    model = _model(torch, 0)
    lost = [rounded_away(torch, p, torch.full_like(p, lr)) for lr in (3e-3, 1e-4) for p in model.parameters()]
    half = len(lost) // 2
    for lr, part in ((3e-3, lost[:half]), (1e-4, lost[half:])):
        bf16, fp32, n = (sum(x[i] for x in part) for i in range(3))
        print(f"\nan update of {lr:g} on every initial weight: pure bf16 rounds away {bf16:,} of {n:,} "
              f"({bf16 / n:.2%}), fp32 master weights {fp32:,}")


if __name__ == "__main__":
    main()
