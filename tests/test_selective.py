"""--checkpointing selective: torchtitan's layer-selective activation checkpointing (every second decoder layer,
``selective_ac_option = "2"``), estimated layer by layer and traced with transformers checkpointing those layers."""

import pytest

from trainmem.catalog import catalog_config, catalog_spec
from trainmem.errors import ConfigError
from trainmem.stepmodel import estimate_model
from trainmem.models import spec_from_config
from trainmem.settings import make_settings


@pytest.mark.parametrize("model,layers,recipe,batch,seq,dropout,attention", [
    ("llama-3.2-1b", 4, "pure-bf16", 2, 1024, 0.0, "sdpa"),   # the last layer kept: the final norm's moment
    ("llama-3.2-1b", 3, "pure-bf16", 2, 1024, 0.0, "sdpa"),   # the last layer checkpointed
    ("llama-3.2-1b", 4, "mixed-bf16", 1, 1024, 0.0, "eager"),
    ("gpt2", 4, "fp32", 2, 512, 0.1, "sdpa"),
    ("qwen2.5-0.5b", 5, "pure-bf16", 2, 512, 0.0, "sdpa"),
])
def test_selective_checkpointing_matches_its_trace(model, layers, recipe, batch, seq, dropout, attention):
    from trainmem.trace import trace_step

    config = dict(catalog_config(model), num_hidden_layers=layers, vocab_size=512)
    spec = spec_from_config(config)
    settings = make_settings(recipe=recipe, batch=batch, seq=seq, dropout=dropout, attention=attention,
                             checkpointing="selective")
    est = estimate_model(spec, settings)
    traced = trace_step(config, settings, spec)
    for e, t in zip(est.phases, traced.phases, strict=True):
        assert abs(e.allocated_bytes / t.allocated_bytes - 1) <= 0.01, (e, t)


def test_selective_sits_between_none_and_full():
    spec = catalog_spec("llama-3-8b")
    acts = {c: estimate_model(spec, make_settings(recipe="pure-bf16", seq=4096, checkpointing=c)).activations
            for c in ("none", "selective", "full")}
    assert acts["full"].layers_bytes < acts["selective"].layers_bytes < acts["none"].layers_bytes
    checkpointed = [la.checkpointed for la in acts["selective"].layers for _ in range(la.count)]
    assert checkpointed == [i % 2 == 0 for i in range(32)]  # layers 0, 2, 4, ... (torchtitan's count)
    layer = acts["none"].layer_saved_bytes(acts["none"].layers[0])
    kept = acts["full"].layer_saved_bytes(acts["full"].layers[0])
    assert acts["selective"].layers_bytes == 16 * layer + 16 * kept


@pytest.mark.parametrize("options,says", [
    (dict(recipe="amp-bf16"), "without autocast"),
    (dict(recipe="pure-bf16", compile=True), "checkpointing 'selective' with --compile"),
    (dict(recipe="pure-bf16", offload_activations=True), "--offload-activations is modelled with --checkpointing full"),
])
def test_what_selective_does_not_model_is_refused(options, says):
    with pytest.raises(ConfigError, match=says):
        make_settings(checkpointing="selective", **options)
