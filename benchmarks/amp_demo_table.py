"""The tables of docs/mixed-precision.md, section 8, from a fresh run of `trainmem amp-demo` on this machine.

The losses depend on the CPU's fp16/bf16 kernels (and the time on whether the CPU computes bf16 natively), so the
numbers differ between processors; the claims the section makes from them are asserted, on any machine, by
tests/test_precision.py::test_amp_demo_claims. Run: python benchmarks/amp_demo_table.py
"""

import platform

import torch

from trainmem.amp_demo import run_all


def main() -> None:
    plain, plain_seconds = run_all(steps=200, batch=8)
    small, small_seconds = run_all(steps=200, batch=8, grad_scale_down=2.0**-20)
    print(f"torch {torch.__version__}, {platform.machine()} {platform.processor() or ''}, "
          f"{torch.get_num_threads()} threads: {plain_seconds:.0f} s and {small_seconds:.0f} s for the two sets")
    start = plain[0].losses[0]
    print(f"starting loss {start:.3f}\n")
    reference = {r.name: r for r in plain}["fp32"].final_loss
    print("| run | final loss | gap to fp32 | zero gradients | skipped steps |")
    print("|---|---|---|---|---|")
    for r in plain:
        gap = "" if r.name == "fp32" else f"{r.final_loss - reference:+.3f}".replace("-", "−")
        skipped = str(r.skipped_steps) if "scaler" in r.name else ""
        print(f"| {r.name} | {r.final_loss:.3f} | {gap} | {r.zero_grad_fraction:.2%} | {skipped} |")
    print("\nWith --grad-scale-down 2^-20:\n")
    print("| run | final loss | zero gradients |")
    print("|---|---|---|")
    for r in small:
        print(f"| {r.name} | {r.final_loss:.3f} | {r.zero_grad_fraction:.2%} |")


if __name__ == "__main__":
    main()
