"""The traced path (recorded.py): any model_type transformers builds gets a peak, from reduced traces extrapolated
over its layer pattern, checked against full traces of the same step; its cache; its answer without torch."""

import json

import pytest

from trainmem import recorded
from trainmem.recorded import LayerPlan, extrapolate, find_period, per_layer_lists, plan_layers, reduced_config
from trainmem.timeline import Phase

DENSE = {"model_type": "ministral", "hidden_size": 64, "intermediate_size": 104, "num_hidden_layers": 4,
         "head_dim": 16, "num_key_value_heads": 2, "num_attention_heads": 4, "vocab_size": 211,
         "max_position_embeddings": 64}
"""A dense model_type without a hand-written description (period 1; phi, then starcoder2 had none until each got
one; widths of its own: tests/test_tracedstep.py records a Ministral too)."""
OLMO3 = {"model_type": "olmo3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 211, "max_position_embeddings": 64,
         "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 3, "pad_token_id": 0}
"""A hybrid: sliding-window and full-attention layers alternating (period 2), a 8-token window the 32-token
sequence reaches."""


# -- the layer pattern (no torch) ----------------------------------------------------------------------------------

@pytest.mark.parametrize("signatures, expected", [
    (list("aaaaaa"), (0, 1)),
    (list("abababab"), (0, 2)),
    (list("dddabcabcabcabc"), (3, 3)),  # DeepSeek's dense first layers, then a period of three
    (list("daaaaa"), (1, 1)),
    (list("abcde"), (0, 5)),  # nothing repeats: the whole model is traced
    (list("aaab"), (0, 4)),  # a different last layer: no period covers it
])
def test_the_period_is_the_smallest_that_repeats_after_a_prefix(signatures, expected):
    assert find_period(signatures) == expected


@pytest.mark.parametrize("layers, prefix, period, counts", [
    (32, 0, 1, (1, 2)),
    (32, 0, 4, (4, 8)),
    (30, 0, 4, (6, 10)),  # 30 = 6 + 6 x 4: the remainder of 2 layers is in the first traced count
    (61, 3, 1, (4, 5)),
    (8, 0, 4, (8,)),  # too few layers to reduce: traced as it is
])
def test_the_traced_counts_leave_whole_periods_to_the_real_count(layers, prefix, period, counts):
    plan = plan_layers(layers, prefix, period)
    assert plan.counts == counts
    if len(counts) == 2:
        assert counts[0] >= prefix + period and (layers - counts[0]) % period == 0
        assert counts[0] + plan.periods_added * period == layers


def test_a_reduced_config_keeps_the_first_layers_of_each_per_layer_list():
    full = {"num_hidden_layers": 6, "layer_types": list("ababab"), "mlp_only_layers": [0, 3, 5],
            "mrope_section": [1, 2, 3, 4, 5, 6], "intermediate_size": 96}
    assert per_layer_lists(full, 6) == ({"layer_types": list("ababab")}, {"mlp_only_layers": [0, 3, 5]})
    out = reduced_config({"model_type": "x", "num_hidden_layers": 6}, full, "num_hidden_layers", 6, 4)
    assert out == {"model_type": "x", "num_hidden_layers": 4, "layer_types": list("abab"),
                   "mlp_only_layers": [0, 3]}


def test_extrapolation_adds_one_period_of_bytes_per_period_in_every_category():
    a = (Phase("forward", "peak", 10, 0, 20, 100, 7),)
    b = (Phase("forward", "peak", 15, 0, 30, 160, 7),)
    assert extrapolate(a, b, 3) == (Phase("forward", "peak", 25, 0, 50, 280, 7),)
    with pytest.raises(ValueError):
        extrapolate(b, a, 3)


# -- against full traces -------------------------------------------------------------------------------------------

def _settings(**kw):
    from trainmem.settings import TrainingSettings

    return TrainingSettings(batch=1, seq=32, **kw)


def _spec(config):
    from trainmem.meta_count import spec_by_building

    return spec_by_building(config, config["model_type"], "test")


@pytest.mark.slow
@pytest.mark.parametrize("config, counts", [(DENSE, (1, 2)), (OLMO3, (2, 4))], ids=["ministral", "olmo3-hybrid"])
def test_the_extrapolated_step_equals_a_full_trace(config, counts):
    """Two reduced traces and the full one: the full is a third point, on the line the two make, in every phase
    and every category, byte for byte (and the parameter count is the full model's)."""
    pytest.importorskip("transformers")
    from trainmem.meta_count import build_meta_model
    from trainmem.trace import trace_step

    spec, settings = _spec(config), _settings()
    phases, plan = recorded.record(config, settings, spec, progress=False)
    assert plan.counts == counts
    assert phases == trace_step(config, settings, spec).phases
    assert spec.num_parameters == sum(p.numel() for p in build_meta_model(config).parameters())


@pytest.mark.slow
def test_a_cache_hit_gives_the_same_bytes_without_tracing_or_building(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from trainmem import meta_count

    monkeypatch.setenv("TRAINMEM_CACHE_DIR", str(tmp_path))
    spec, settings = _spec(DENSE), _settings(checkpointing="full")
    first = recorded.recorded_phases(DENSE, settings, spec, progress=False)
    assert not first.from_cache and first.cache.startswith(str(tmp_path))

    def fail(*args, **kwargs):
        raise AssertionError("traced or built again")

    monkeypatch.setattr(recorded, "record_places", fail)
    monkeypatch.setattr(meta_count, "_count_by_building", fail)
    again = recorded.recorded_phases(DENSE, settings, _spec(DENSE), progress=False)
    assert again.from_cache and again.phases == first.phases and again.cache == first.cache
    assert _spec(DENSE) == spec
    with pytest.raises(AssertionError, match="traced or built again"):  # another setting is another entry
        recorded.recorded_phases(DENSE, _settings(), spec, progress=False)


@pytest.mark.slow
def test_estimate_answers_a_peak_on_the_traced_path_and_says_so(run_cli, tmp_path):
    pytest.importorskip("transformers")
    jsonschema = pytest.importorskip("jsonschema")
    from trainmem.report import json_schema

    path = tmp_path / "config.json"
    path.write_text(json.dumps(DENSE))
    code, out, err = run_cli("estimate", str(path), "--batch", "1", "--seq", "32", "--json")
    assert code == 0, err
    doc = json.loads(out)
    jsonschema.validate(doc, json_schema())
    assert doc["activation_source"] == "traced" and doc["peak"]["allocated_bytes"] > 0
    assert doc["traced"]["recorded_layers"] == [1, 2] and doc["traced"]["layers"] == 4
    assert any("traced path" in note and "recorded 1 and 2 of 4 layers" in note for note in doc["notes"])
    code, out, _ = run_cli("estimate", "gpt2", "--json")
    assert json.loads(out)["activation_source"] == "hand-written"


@pytest.mark.slow
def test_without_torch_the_estimate_is_static_memory_and_one_line_naming_the_extra(monkeypatch):
    """The spec is counted (and cached) first; then torch cannot be found, as on an install without the extra."""
    pytest.importorskip("transformers")
    import importlib.util

    from trainmem.estimate import NO_PEAK
    from trainmem.stepmodel import estimate_model

    spec = _spec(DENSE)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    est = estimate_model(spec, _settings())
    assert est.peak is None and est.phases == () and est.static_bytes > 0
    named = [n for n in est.notes if recorded.TRACE_EXTRA in n]
    assert len(named) == 1 and "torch" in named[0] and NO_PEAK in est.notes
