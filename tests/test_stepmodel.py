"""The compiled step model (stepmodel.py) against the direct computation it replaces in searches."""

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from trainmem.catalog import catalog_spec
from trainmem.estimate import DeviceOptions
from trainmem.stepmodel import estimate_model
from trainmem.hardware import GPUS
from trainmem.planner import max_batch
from trainmem.settings import make_settings
from trainmem.stepmodel import _envelope, _Moment, compile_step, evaluate
from trainmem.timeline import Phase, peak_of

MODELS = ["llama-2-7b", "gpt2", "gemma-2-9b", "mixtral-8x7b", "deepseek-v3", "falcon-7b", "bloom-560m", "phi-3-mini-4k",
          "opt-1.3b", "pythia-1b", "qwen1.5-moe-a2.7b"]
SETUPS = [dict(recipe=r, checkpointing=c, attention=a)
          for r, c, a in itertools.product(["fp32", "amp-bf16", "pure-bf16"], ["none", "full"], ["sdpa", "eager"])]


FLAT = DeviceOptions(fragmentation=0.1)
"""The compiled forms against the direct computation: the allocator replay (tests/test_replay.py) is the same on
both sides and would cost each of these hundreds of evaluations a replay."""


def _direct(spec, settings, batch, seq):
    est = estimate_model(spec, replace(settings, batch=batch, seq=seq), FLAT)  # a fresh step model: computed directly
    return est.phases, est.peak


@pytest.mark.parametrize("name", MODELS)
def test_evaluate_equals_the_direct_estimate_at_every_batch(name):
    spec = catalog_spec(name)
    compiled = 0
    for values in SETUPS:
        settings = make_settings(**values)
        step = compile_step(spec, settings, FLAT)
        for seq in (256, 1024):
            for batch in (1, 2, 3, 5, 12, 40, 333):
                got = evaluate(step, batch, seq)
                assert (got.phases, got.peak) == _direct(spec, settings, batch, seq), (values, seq, batch)
            compiled += step.form(2, seq) is not None
    assert compiled >= len(SETUPS)  # most of these are compiled lines, not the direct fallback


@hsettings(max_examples=60, deadline=None)
@given(name=st.sampled_from(MODELS), setup=st.sampled_from(SETUPS), seq=st.sampled_from([128, 640, 2048]),
       batches=st.lists(st.integers(1, 5000), min_size=3, max_size=6))
def test_evaluate_equals_direct_for_random_batches(name, setup, seq, batches):
    spec = catalog_spec(name)
    settings = make_settings(**setup)
    step = compile_step(spec, settings, FLAT)
    for batch in batches:
        got = evaluate(step, batch, seq)
        assert (got.phases, got.peak) == _direct(spec, settings, batch, seq)


def test_sequences_that_are_not_lines_are_computed_directly():
    """Flash's backward pads rows to 128: at seq 1000 its bytes per token are fractional, so no lines are made."""
    spec = catalog_spec("llama-2-7b")
    settings = make_settings(recipe="amp-bf16", attention="flash")
    step = compile_step(spec, settings)
    for batch in (2, 3, 7):
        assert evaluate(step, batch, 1000).phases == _direct(spec, settings, batch, 1000)[0]
    assert step.form(2, 1000) is None
    from trainmem.stepmodel import COMPILE_AFTER

    # compiled when asked the COMPILE_AFTER-th time (directly before)
    assert all(step.form(2, 1024) is None for _ in range(COMPILE_AFTER - 1)) and step.form(2, 1024) is not None


def test_envelope_resolves_ties_to_the_earlier_moment_like_peak_of():
    # totals at batch b: 100 + 10(b-2), 90 + 15(b-2) (level at b = 4, later in time), 60 + 20(b-2) (level with the
    # first at b = 6, earlier in time), and a flat one
    lines = [(100, 10), (90, 15), (60, 20), (150, 0)]
    order = [2, 0, 1, 3]  # candidate order in time: the third line comes first
    moments = [_Moment(f"m{i}", (t, 0, 0, 0, 0), (s, 0, 0, 0, 0), t, s) for i, (t, s) in
               ((i, lines[i]) for i in order)]
    form = _envelope("backward", moments)
    for batch in range(2, 60):
        explicit = [Phase("backward", m.moment, m.total(batch), 0, 0, 0, 0) for m in moments]
        assert form.phase(batch) == peak_of(tuple(explicit)), batch


def test_max_batch_equals_a_search_over_direct_estimates():
    spec = catalog_spec("llama-3.2-1b")
    settings = make_settings(recipe="mixed-bf16", seq=2048)
    gpu = GPUS["A100-80GB"]
    found = max_batch(spec, settings, gpu, compile_step(spec, settings).device)
    assert found > 1
    assert estimate_model(spec, replace(settings, batch=found)).fits(gpu)
    assert not estimate_model(spec, replace(settings, batch=found + 1)).fits(gpu)
