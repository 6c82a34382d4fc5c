"""`trainmem validate`: the estimate against traced steps over a matrix or random models."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..cli import _console, _Whole
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..validate import RandomResult, Row


@click.command()
@click.option("--quick", is_flag=True, help="The reduced matrix CI runs (two rows per model type).")
@click.option("--full-size", is_flag=True, help="The real configs up to 9B instead of scaled-down ones (112 rows, "
              "8-80 s each).")
@click.option("--random", "random_cases", type=_Whole(10_000), default=None,
              help="Instead of a matrix, N random models and set-ups (the differential test; every phase scored).")
@click.option("--seed", type=_Whole(2**64 - 1), default=None,
              help="Seed of --random (default 0): the same seed draws the "
              "same cases.")
@click.option("--lora", is_flag=True, help="The LoRA matrix: peft's adapters on the families whose LoRA step is "
              "modelled (with --quick: one row per family).")
@click.option("--compile", "compiled", is_flag=True, help="The --compile matrix: layers compiled with "
              "aot_eager_decomp_partition on the families whose compiled layers are modelled (with --quick: two rows "
              "per family).")
@click.option("--jobs", "-j", type=_Whole(1024), default=1, show_default=True,
              help="Rows traced in parallel processes.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default="docs/accuracy.md", show_default=True,
              help="Markdown report to write; its other sections (the other matrix, benchmark results) are kept.")
def validate(quick: bool, full_size: bool, random_cases: int | None, seed: int | None, lora: bool, compiled: bool,
             jobs: int, output: str) -> None:
    """Trace and estimate a matrix of model types x recipes x attention x checkpointing x dropout (or random
    models with --random) and write the comparison as Markdown. Exit code 1 when a row is outside its tolerance.

    \b
    Example: trainmem validate --quick -o /tmp/accuracy.md
             trainmem validate --random 200 --seed 7 --jobs 2
             trainmem validate --lora --jobs 2
             trainmem validate --compile --jobs 2
    """
    from ..outputs import check_output_file, read_existing_text, write_text
    from ..validate import COMPILE_HEADING, LORA_HEADING, RANDOM_HEADING, compile_section, lora_section, markdown, \
        random_section, replace_sections, validate as run_validate, validate_compile, validate_lora, validate_random

    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    if (quick + full_size + (random_cases is not None) > 1 or lora + compiled > 1
            or (lora or compiled) and (full_size or random_cases is not None)):
        raise ConfigError("--quick, --full-size, --random, --lora and --compile are different runs: give one "
                          "(--lora and --compile take --quick)")
    if random_cases is not None and random_cases < 1:
        raise ConfigError(f"--random must be at least 1, got {random_cases}")
    if seed is not None and random_cases is None:
        raise ConfigError("--seed chooses the cases of --random; the matrices have no randomness: give --random N")
    seed = seed or 0
    output_path = check_output_file(output, "--output")
    existing = read_existing_text(output_path, "--output")
    console = _console()

    def show_row(r: Row) -> None:
        bar.advance()
        verdict = "ok" if r.within_tolerance else "OUT OF TOLERANCE (worst phase %s %+.2f%%)" % (
            r.worst_phase[0], 100 * r.worst_phase[1])
        bar.print(console, f"{r.family:12s} {r.recipe:20s} {r.attention:5s} ckpt={r.checkpointing:4s} "
                  f"dropout={r.dropout} {r.batch}x{r.seq:<4d} {r.phase:9s} total {r.total_error:+.2%} {verdict}")

    from ..progress import Progress
    from ..validate import compile_matrix, lora_matrix, matrix

    rows_to_run = (random_cases if random_cases is not None else len(list(
        lora_matrix(quick) if lora else compile_matrix(quick) if compiled else matrix(quick, full_size))))
    with Progress("validate: rows traced", total=rows_to_run) as bar:
        if lora or compiled:
            run, section, heading = ((validate_lora, lora_section, LORA_HEADING) if lora
                                     else (validate_compile, compile_section, COMPILE_HEADING))
            rows = run(quick=quick, progress=show_row, jobs=jobs)
            text = replace_sections(existing, {heading: section(rows, quick)})
            bad = sum(not r.within_tolerance for r in rows)
            total = len(rows)
        elif random_cases is not None:
            def show(r: RandomResult) -> None:
                bar.advance()
                if r.ok:
                    assert r.row is not None  # (ok: a row within tolerance)
                    phase, error = r.row.worst_phase
                    bar.print(console, f"case {r.index:<4d} {r.config['model_type']:12s} worst phase {phase} "
                                  f"{error:+.2%} ok")
                else:
                    bar.print(console, r.describe(), markup=False, highlight=False)

            results = validate_random(random_cases, seed, jobs, progress=show)
            text = replace_sections(existing, {RANDOM_HEADING: random_section(results, seed)})
            bad = sum(not r.ok for r in results)
            total = len(results)
        else:
            rows = run_validate(quick=quick, full_size=full_size, jobs=jobs, progress=show_row)
            text = markdown(rows, full_size=full_size, quick=quick, existing=existing)
            bad = sum(not r.within_tolerance for r in rows)
            total = len(rows)
    write_text(output_path, text)  # (a temporary file renamed: an interrupted run never leaves half a report)
    console.print(f"wrote {output}: {total - bad} of {total} within tolerance")
    if bad:
        raise click.exceptions.Exit(1)
