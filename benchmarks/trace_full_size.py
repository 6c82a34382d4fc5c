"""Time and peak RSS of tracing full-size models under FakeTensorMode (issue: Llama-2-7B at batch 1, seq 2048
in under 60 s with under 2 GiB RSS; Llama-3-70B without running out of memory).

Each model runs in its own process so that RSS is its own. Run: python benchmarks/trace_full_size.py [names...]
"""

import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
from trainmem.catalog import catalog_config, catalog_spec
from trainmem.stepmodel import estimate_model
from trainmem.settings import make_settings
from trainmem.trace import trace_step
name = sys.argv[1]
s = make_settings(recipe="mixed-bf16", batch=1, seq=2048)
start = time.perf_counter()
traced = trace_step(catalog_config(name), s, catalog_spec(name))
seconds = time.perf_counter() - start
est = estimate_model(catalog_spec(name), s)
rows = {p.name: [p.allocated_bytes, e.allocated_bytes] for p, e in zip(traced.phases, est.phases)}
print(json.dumps({"seconds": seconds, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "phases": rows}))
"""


def main() -> None:
    names = sys.argv[1:] or ["llama-2-7b", "llama-3-70b"]
    for name in names:
        out = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name}: traced in {result['seconds']:.1f} s, peak RSS {result['rss_mib']:.0f} MiB "
              "(mixed-bf16, batch 1, seq 2048)")
        for phase, (traced, estimated) in result["phases"].items():
            print(f"  {phase:14s} trace {traced / 2**30:9.3f} GiB  estimate {estimated / 2**30:9.3f} GiB  "
                  f"error {(estimated - traced) / traced:+.2%}")


if __name__ == "__main__":
    main()
