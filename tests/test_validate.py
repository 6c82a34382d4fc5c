"""The reduced accuracy matrix CI runs: every row must stay within its tolerance (3% on the peak, 5% per
category), estimate against the traced step of the real transformers model."""

import pytest

pytest.importorskip("transformers")

from trainmem.validate import CATEGORY_TOLERANCE, TOTAL_TOLERANCE, markdown, validate  # noqa: E402


def test_quick_matrix_is_within_tolerance():
    rows = validate(quick=True)
    # llama, gpt2, gemma2 (fp32, pure-bf16) and mixtral (pure-bf16) x checkpointing none/full, SGD
    assert len(rows) == 14
    assert all(r.phase in ("forward", "backward") for r in rows)  # the activation model is what is tested
    bad = [r for r in rows if not r.within_tolerance]
    assert not bad, "\n".join(
        f"{r.family} {r.recipe} ckpt={r.checkpointing} {r.batch}x{r.seq} {r.optimizer}: total {r.total_error:+.2%}"
        for r in bad)
    assert all(abs(r.total_error) <= TOTAL_TOLERANCE for r in rows)
    report = markdown(rows)
    assert "14 of 14 rows within tolerance" in report and f"{CATEGORY_TOLERANCE:.0%}" in report
