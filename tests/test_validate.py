"""The reduced accuracy matrix CI runs: every row must stay within its tolerance (3% on the peak, 5% per
category), estimate against the traced step of the real transformers model."""

import pytest

pytest.importorskip("transformers")

from trainmem.validate import (  # noqa: E402
    CATEGORY_TOLERANCE, MATRIX_MODELS, TOTAL_TOLERANCE, Row, markdown, validate)


@pytest.mark.slow
def test_quick_matrix_is_within_tolerance():
    rows = validate(quick=True)
    # every model type (both Falcon layouts): amp-bf16 sdpa with the config's dropout, and pure-bf16 eager with
    # full checkpointing and no dropout; every phase of each step is scored
    assert len(rows) == 2 * len(MATRIX_MODELS) == 36
    assert {r.family for r in rows} == set(MATRIX_MODELS)
    assert all(r.phase in ("forward", "backward") for r in rows)  # the activation model is what is tested
    assert all(len(r.other_phases) == 4 for r in rows)
    bad = [r for r in rows if not r.within_tolerance]
    assert not bad, "\n".join(
        f"{r.family} {r.recipe} {r.attention} ckpt={r.checkpointing} dropout={r.dropout} {r.batch}x{r.seq}: "
        f"worst phase {r.worst_phase}" for r in bad)
    assert all(abs(r.total_error) <= TOTAL_TOLERANCE for r in rows)
    within = sum(r.within_tolerance for r in rows)
    report = markdown(rows)
    assert f"{within} of 36 rows within tolerance" in report and f"{CATEGORY_TOLERANCE:.0%}" in report


def _row(family: str, trace_acts: int, estimate_acts: int) -> Row:
    base = dict(parameters=1000, gradients=1000, optimizer_states=0, temporaries=100)
    return Row(family, "fp32", "none", 1, 128, "sgd", "backward", dict(base, activations=estimate_acts),
               dict(base, activations=trace_acts))


def test_tolerance_is_scored_per_category_and_in_total():
    assert _row("llama", 1000, 1040).within_tolerance  # activations +4%, total +1.3%
    assert not _row("llama", 1000, 1060).within_tolerance  # activations +6% (total +1.9%)
    tiny = Row("llama", "fp32", "none", 1, 128, "sgd", "backward",
               dict(parameters=10_000, gradients=0, optimizer_states=0, activations=0, temporaries=50),
               dict(parameters=10_000, gradients=0, optimizer_states=0, activations=0, temporaries=90))
    assert tiny.category_error("temporaries") is None and tiny.within_tolerance  # under 1% of the peak: noise


def test_report_rewrites_its_own_matrix_and_keeps_the_other_sections():
    existing = markdown([_row("gpt2", 1000, 1000)], full_size=True) + (
        "## CUDA measurements\n\n2026-11-29, NVIDIA H200: measured rows\n\n"
        "## Tracing full-size models: time and memory\n\ntrace timings\n\n## A note someone wrote\n\nkept\n")
    report = markdown([_row("llama", 1000, 1060)], existing=existing)
    assert report.count("## Matrix: scaled-down configs") == 1 and "| llama |" in report
    assert "**0 of 1 rows within tolerance.**" in report and "Largest category error: +6.00% (activations" in report
    # The full-size matrix, the benchmark sections and an unknown section survive, in the documented order.
    assert "| gpt2 |" in report and "NVIDIA H200: measured rows" in report and "trace timings" in report
    assert "## A note someone wrote\n\nkept" in report
    headings = [line for line in report.splitlines() if line.startswith("## ")]
    assert headings[:4] == ["## Tracing full-size models: time and memory", "## CUDA measurements", "## Matrix: full-size configs",
                            "## Matrix: scaled-down configs"]
    # Rewriting again with the same rows changes nothing (no section is duplicated).
    assert markdown([_row("llama", 1000, 1060)], existing=report) == report


@pytest.mark.parametrize("args, message", [
    (["--jobs", "0"], "--jobs must be at least 1, got 0"),
    (["--quick", "--full-size"], "--quick, --full-size, --random, --lora and --compile are different runs"),
    (["--random", "0"], "--random must be at least 1, got 0"),
    (["--quick", "--seed", "3"], "--seed chooses the cases of --random"),
])
def test_validate_bad_options_are_one_line(run_cli, tmp_path, args, message):
    out = tmp_path / "accuracy.md"
    code, _, err = run_cli("validate", *args, "-o", str(out))
    assert code == 2 and message in err and err.count("\n") == 1
    assert not out.exists()  # nothing written


def test_cuda_benchmark_section_replaces_only_its_own():
    """benchmarks/cuda_accuracy.py runs only on a GPU; its table and its rewrite of the report are checked here
    with a measurement of known values."""
    import importlib.util
    from pathlib import Path

    from trainmem.request import estimate
    from trainmem.measure import Measurement, PhasePeak

    path = Path(__file__).parent.parent / "benchmarks" / "cuda_accuracy.py"
    spec = importlib.util.spec_from_file_location("cuda_accuracy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    est = estimate("gpt2", recipe="amp-bf16", batch=8, seq=1024)
    by_phase = {p.name: p.allocated_bytes for p in est.phases}
    measured = Measurement("cuda", [PhasePeak(name, int(b * 1.02), int(b * 1.1)) for name, b in by_phase.items()])
    section = bench.cuda_section([("gpt2", dict(recipe="amp-bf16", batch=8, seq=1024), measured, est),
                                  ("llama-3-8b", dict(recipe="mixed-bf16"), None, est)],
                                 "NVIDIA H200", "2.13.0", "2026-11-29")
    assert section.startswith(bench.HEADING + "\n\n2026-11-29, NVIDIA H200, torch 2.13.0.")
    rows = [line for line in section.splitlines() if line.startswith("| gpt2 |")]
    assert len(rows) == len(est.phases) and all(line.endswith("| -1.96% |") for line in rows)  # 1/1.02 - 1
    assert "| llama-3-8b | recipe=mixed-bf16 | out of memory |" in section

    existing = markdown([_row("llama", 1000, 1000)]) + "## CUDA measurements\n\nNone yet.\n"
    report = bench.replace_sections(existing, {bench.HEADING: section})
    assert report.count(bench.HEADING) == 1 and "None yet." not in report and "NVIDIA H200" in report
    assert "| llama |" in report  # the matrix is kept


@pytest.mark.slow
@pytest.mark.parametrize("family, recipe, checkpointing", [
    ("gpt2", "amp-bf16", "none"), ("llama", "amp-bf16", "full"), ("gemma2", "pure-bf16", "none"),
    ("phi3", "fp32", "none"), ("mixtral", "pure-bf16", "full")])
def test_dropout_rows_are_traced_as_on_a_gpu(family, recipe, checkpointing):
    """With dropout the CPU would fall back to SDPA's math kernel and keep float masks; the trace runs CUDA's
    flash kernel and bool-mask dropout instead, which is what the estimate models (dropout 0.1, batch 4 x 64)."""
    from trainmem.validate import matrix_config, run_row, scale_down

    config = scale_down(matrix_config(family))
    row = run_row(config, family, recipe, checkpointing, 4, 64, "sgd", dropout=0.1)
    assert row.within_tolerance, (row.total_error, {c: row.category_error(c) for c in row.trace})


@pytest.mark.slow
@pytest.mark.parametrize("label, layers, recipe, batch, seq, attention", [
    ("falcon", 2, "amp-bf16", 4, 2048, "sdpa"),   # Falcon-7B's old layout: multi-query, parallel attention
    ("gpt2", None, "fp32", 8, 1024, "eager"),     # with GPT-2's own dropout 0.1: probabilities, mask, dropped copy
    ("gpt2", None, "amp-bf16", 8, 1024, "eager"),  # CUDA autocast: fp32 probabilities and gelu_new chain
])
def test_full_size_cases_from_issue_9_match_their_traces(label, layers, recipe, batch, seq, attention):
    """Cases a user found 42% and 19% off: at real size, with the config's own dropout, every phase within
    tolerance (measured: within 0.01% of the trace)."""
    from trainmem.validate import matrix_config, run_row

    config = matrix_config(label)
    if layers:
        config["num_hidden_layers"] = layers
    row = run_row(config, label, recipe, "none", batch, seq, "adamw", dropout=None, attention=attention)
    assert row.within_tolerance and abs(row.total_error) < 0.005, (row.phase, row.total_error, row.worst_phase)


@pytest.mark.slow
def test_the_quick_lora_matrix_is_within_tolerance(tmp_path, run_cli):
    """One LoRA row per family whose LoRA step is modelled (q,v, rank 16, checkpointed), traced against the
    estimate: what CI checks of `trainmem validate --lora`."""
    pytest.importorskip("peft")
    from trainmem.validate import LORA_FAMILIES

    out = tmp_path / "accuracy.md"
    code, stdout, err = run_cli("validate", "--lora", "--quick", "-o", str(out))
    assert code == 0, stdout[-2000:] + err
    text = out.read_text()
    assert "## Matrix: LoRA" in text and f"{len(LORA_FAMILIES)} of {len(LORA_FAMILIES)} rows within tolerance" in text


@pytest.mark.slow
def test_the_quick_compile_matrix_is_within_tolerance(tmp_path, run_cli):
    """A full fine-tune and a LoRA all-linear row per family whose compiled layers are modelled, each layer
    compiled with aot_eager_decomp_partition and traced against the estimate: what CI checks of `trainmem validate
    --compile` (every phase within 3%, every category within 5%)."""
    pytest.importorskip("peft")
    from trainmem.validate import COMPILE_FAMILIES

    out = tmp_path / "accuracy.md"
    code, stdout, err = run_cli("validate", "--compile", "--quick", "-o", str(out))
    assert code == 0, stdout[-2000:] + err
    rows = 2 * len(COMPILE_FAMILIES)
    assert "## Matrix: --compile" in out.read_text() and f"{rows} of {rows} rows within tolerance" in out.read_text()


def test_lora_and_compile_matrices_are_separate_runs(run_cli, tmp_path):
    code, _, err = run_cli("validate", "--lora", "--compile", "-o", str(tmp_path / "a.md"))
    assert code == 2 and "different runs" in err and len(err.strip().splitlines()) == 1


def test_lora_matrix_is_its_own_run(run_cli, tmp_path):
    code, _, err = run_cli("validate", "--lora", "--random", "3", "-o", str(tmp_path / "a.md"))
    assert code == 2 and "different runs" in err
