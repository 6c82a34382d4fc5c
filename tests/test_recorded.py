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
    (32, 0, 1, (2, 3)),  # (at least two: the bottom layer is not the top one)
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
    # (Llama 4's moe_layers where every layer is one: a list of indices, not one distinct value per layer)
    every = {"num_hidden_layers": 6, "moe_layers": list(range(6)), "layer_types": list("aaabaa")}
    assert per_layer_lists(every, 6) == ({"layer_types": list("aaabaa")}, {"moe_layers": list(range(6))})
    out = reduced_config({"model_type": "x", "num_hidden_layers": 6}, full, "num_hidden_layers", 6, 4)
    assert out == {"model_type": "x", "num_hidden_layers": 4, "layer_types": list("abab"),
                   "mlp_only_layers": [0, 3]}


def test_a_reduced_config_keeps_the_per_layer_sizes_of_its_first_layers():
    """Gemma 4's per_layer_config ({layer index: that layer's own sizes}) is cut to the traced layers: transformers
    refuses an index past the layer count, so without the cut every reduced trace of such a config fails."""
    transformers = pytest.importorskip("transformers")
    overrides = {"05": {"head_dim": 32}, "11": {"head_dim": 32}}
    full = {"model_type": "gemma4_text", "num_hidden_layers": 12, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
            "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16, "per_layer_config": overrides}
    out = reduced_config(full, full, "num_hidden_layers", 12, 6)
    assert out["per_layer_config"] == {"05": {"head_dim": 32}}
    fields = {k: v for k, v in out.items() if k != "model_type"}
    assert transformers.AutoConfig.for_model("gemma4_text", **fields).num_hidden_layers == 6


def test_a_config_counting_its_encoder_and_decoder_layers_gets_no_num_hidden_layers():
    """ProphetNet's config refuses a num_hidden_layers (its num_encoder_layers and num_decoder_layers say it): the
    reduced config sets the counts the config has (traced: prophetnet, the traced path failed where a full trace
    ran; it is byte-exact now, docs/accuracy.md)."""
    full = {"model_type": "p", "num_hidden_layers": 6, "num_encoder_layers": 6, "num_decoder_layers": 6}
    config = {"model_type": "p", "num_encoder_layers": 6, "num_decoder_layers": 6}
    out = reduced_config(config, full, "num_hidden_layers", 6, 3)
    assert out == {"model_type": "p", "num_encoder_layers": 3, "num_decoder_layers": 3}


def test_a_multimodal_config_is_reduced_in_its_text_config():
    """Where the causal LM is the text model of a multimodal config (Emu3, Qwen3.5, Mllama), its layer count and
    lists are the text config's: a top-level count is read by no one (both traces had every layer, and the
    extrapolation added periods to a full model: Qwen3.5 was +23.6% at the forward peak)."""
    full = {"model_type": "t_text", "num_hidden_layers": 6, "layer_types": list("ababab")}
    config = {"model_type": "t", "vision_config": {"depth": 2}, "text_config": {"model_type": "t_text",
                                                                                "num_hidden_layers": 6}}
    out = reduced_config(config, full, "num_hidden_layers", 6, 4)
    assert out == {"model_type": "t", "vision_config": {"depth": 2},
                   "text_config": {"model_type": "t_text", "num_hidden_layers": 4, "layer_types": list("abab")}}


def test_module_moments_of_a_layer_at_both_ends_are_not_extrapolated():
    """A layer's moment keyed from the bottom is kept only where it is not the top layer too, and from the top only
    where it is not the bottom one (a one-layer Pegasus decoder's layer 0 was +4.0% at the backward peak as "the
    bottom layer" of four)."""
    peaks = {"model.layers.0.mlp": (1, 2), "model.layers.1.mlp": (3, 4), "lm_head": (5, 6)}
    assert recorded._anchored(peaks, 2) == {("bottom", "model.layers", 0, "mlp"): (1, 2),
                                            ("top", "model.layers", 0, "mlp"): (3, 4), ("module", "lm_head"): (5, 6)}
    assert recorded._anchored({"model.layers.0.mlp": (1, 2)}, 1) == {}


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
@pytest.mark.parametrize("config, counts", [(DENSE, (2, 3)), (OLMO3, (2, 4))], ids=["ministral", "olmo3-hybrid"])
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


PEGASUS = {"model_type": "pegasus", "d_model": 64, "encoder_layers": 4, "decoder_layers": 4,
           "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 1024, "decoder_ffn_dim": 1024,
           "vocab_size": 211, "max_position_embeddings": 64, "pad_token_id": 0, "eos_token_id": 0,
           "decoder_start_token_id": 0}
"""An encoder-decoder's decoder trained as a causal LM (PegasusForCausalLM): its cross-attention takes no
gradient, and a layer at both ends of a one-layer trace has the top's moments."""


@pytest.mark.slow
def test_a_decoder_with_unused_cross_attention_extrapolates_to_its_full_trace():
    """Under mixed-bf16's masters the cross-attention's parameters (no gradient: no encoder output) are skipped,
    as torch's optimizers skip them (the trace was an AttributeError on ``p.grad.float()``); the reduced traces are
    2 and 3 layers, the bottom layer's moments apart from the top's (from 1 and 2 layers: backward +97,792 B)."""
    pytest.importorskip("transformers")
    from trainmem.settings import TrainingSettings
    from trainmem.trace import trace_step

    spec, settings = _spec(PEGASUS), TrainingSettings(batch=2, seq=64, recipe="mixed-bf16")
    phases, plan = recorded.record(PEGASUS, settings, spec, progress=False)
    assert plan.counts == (2, 3)
    assert phases == trace_step(PEGASUS, settings, spec).phases


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
    assert doc["traced"]["recorded_layers"] == [2, 3] and doc["traced"]["layers"] == 4
    assert any("traced path" in note and "recorded 2 and 3 of 4 layers" in note for note in doc["notes"])
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
