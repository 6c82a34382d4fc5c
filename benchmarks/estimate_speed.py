"""How long an estimate takes: in process for every catalog model at several settings, the compiled step model's
evaluations (what max-batch, sweep and the planner use), and the CLI end to end.

Prints times; the figures in README.md (mean and worst time in process, "well under 0.5 s for `trainmem estimate`") and
docs/method.md (evaluations per second on one core) come from this script. Pin it to one core for that figure:
    taskset -c 0 python benchmarks/estimate_speed.py
    python benchmarks/estimate_speed.py --command     # `trainmem estimate llama-2-7b` alone: process and work times
"""

import itertools
import os
import resource
import subprocess
import sys
import time

from trainmem.catalog import catalog_names, catalog_spec
from trainmem.stepmodel import estimate_model
from trainmem.settings import make_settings
from trainmem.stepmodel import compile_step, evaluate

SETTINGS = [
    make_settings(recipe=r, batch=b, seq=s, checkpointing=c, attention=a)
    for r, b, s, c, a in itertools.product(["fp32", "amp-bf16", "mixed-bf16", "pure-bf16"], [1, 8], [2048, 32768],
                                           ["none", "full"], ["sdpa", "eager"])
]


def main() -> None:
    if "--command" in sys.argv[1:]:  # the CLI's times alone
        command_times()
        return
    worst = (0.0, "")
    total, count = 0.0, 0
    for name in catalog_names():
        spec = catalog_spec(name)
        spec.param_groups  # parsed once, as the CLI does
        for s in SETTINGS:
            start = time.perf_counter()
            estimate_model(spec, s)
            elapsed = time.perf_counter() - start
            total += elapsed
            count += 1
            if elapsed > worst[0]:
                worst = (elapsed, f"{name} {s.recipe} b={s.batch} s={s.seq} {s.checkpointing} {s.attention}")
    print(f"in process: {count} estimates, mean {total / count * 1e3:.3f} ms, worst {worst[0] * 1e3:.3f} ms ({worst[1]})")
    for name, recipe in (("llama-2-7b", "mixed-bf16"), ("mixtral-8x7b", "mixed-bf16"), ("deepseek-v3", "mixed-bf16"),
                         ("deepseek-v3", "amp-bf16")):
        spec = catalog_spec(name)
        seq = 4096
        start = time.perf_counter()
        step = compile_step(spec, make_settings(recipe=recipe))
        evaluate(step, 2, seq)
        evaluate(step, 3, seq)  # the second batch at this seq compiles its lines
        compile_s = time.perf_counter() - start
        n = 50_000
        start = time.perf_counter()
        for i in range(n):
            evaluate(step, 2 + i % 256, seq)
        rate = n / (time.perf_counter() - start)
        print(f"compiled {name} {recipe} seq {seq}: compile {compile_s * 1e3:.1f} ms, then {rate:,.0f} evaluations/s "
              f"(batch 2-257, phases and peak)")
    command_times()


def _children_cpu() -> float:
    """The user + system seconds of this process's finished children (on a shared machine the CPU time of a
    process moves less with the load than its wall time does)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


COMMAND = ["estimate", "llama-2-7b"]
WARM = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
"""A warm install writes and then reads its bytecode (.pyc, and the dataclasses' methods: dataclass_cache.py)."""
RUNS = 15


def command_times(runs: int = RUNS) -> None:
    """`trainmem estimate llama-2-7b` end to end: a new process each time (a warm install: the bytecode is compiled,
    so run the script twice after a change), beside the interpreter's own start-up and the import of trainmem.cli;
    then the command's work in this process (imports done, output to a pipe): the first run (what a process does
    after its imports) and the median of the others (the catalog's parsed config and the activations are cached
    then). On a machine other work also loads, take the best times (and the CPU time, which moves less with the
    load than the wall time does); the bytecode includes the dataclasses' methods (trainmem/dataclass_cache.py),
    kept beside the .pyc files unless PYTHONDONTWRITEBYTECODE is set, so that too is read after the first run."""
    for label, args in (("python -c pass", ["-c", "pass"]),
                        ("python -c 'import trainmem.cli'", ["-c", "import trainmem.cli"]),
                        ("python -m trainmem --help (imports every command)", ["-m", "trainmem", "--help"]),
                        ("python -m trainmem estimate llama-2-7b --json", ["-m", "trainmem", *COMMAND, "--json"]),
                        ("python -m trainmem estimate llama-2-7b (tables, to a pipe)", ["-m", "trainmem", *COMMAND])):
        times, cpu = [], []
        for _ in range(runs):
            used = _children_cpu()
            start = time.perf_counter()
            subprocess.run([sys.executable, *args], check=True, capture_output=True, env=WARM)
            times.append(time.perf_counter() - start)
            cpu.append(_children_cpu() - used)
        times.sort()
        cpu.sort()
        print(f"process `{label}`: wall median {times[len(times) // 2]:.3f} s, best {times[0]:.3f} s; CPU (user + "
              f"system) median {cpu[len(cpu) // 2]:.3f} s, best {cpu[0]:.3f} s, over {runs} runs")
    import contextlib
    import io

    from trainmem.cli import main as cli_main

    times = []
    for _ in range(runs):
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            cli_main(list(COMMAND))
        times.append(time.perf_counter() - start)
    first, rest = times[0], sorted(times[1:])
    print(f"in process `trainmem estimate llama-2-7b` (imports done): first run {first * 1e3:.1f} ms, then median "
          f"{rest[len(rest) // 2] * 1e3:.1f} ms over {len(rest)} runs")

if __name__ == "__main__":
    main()
