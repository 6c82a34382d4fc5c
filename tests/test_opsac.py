"""--checkpointing op: torchtitan's per-op selective activation checkpointing (opsac.py), estimated from the saved
ops' outputs and traced with torchtitan's own policy through torch.utils.checkpoint's selective contexts."""

import pytest

from trainmem.catalog import catalog_config, catalog_spec
from trainmem.errors import ConfigError
from trainmem.models import spec_from_config
from trainmem.settings import make_settings
from trainmem.stepmodel import estimate_model

TINY = dict(num_hidden_layers=3, vocab_size=512, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("model,recipe,layers,batch,seq", [
    ("llama-3.2-1b", "pure-bf16", 3, 2, 512),   # q, v, gate, down saved (the 1st, 3rd, 5th, 7th aten.mm); flash
    ("llama-3.2-1b", "fp32", 2, 1, 1000),       # the memory-efficient kernel (its logsumexp padded to 32 rows);
                                                # the forward's peak at the last layer's attention
    ("qwen2.5-0.5b", "mixed-bf16", 3, 2, 512),  # biased q/k/v run aten.addmm: o and up saved
])
def test_op_checkpointing_matches_its_trace(model, recipe, layers, batch, seq):
    from trainmem.trace import trace_step

    config = dict(catalog_config(model), **dict(TINY, num_hidden_layers=layers))
    spec = spec_from_config(config)
    settings = make_settings(recipe=recipe, batch=batch, seq=seq, dropout=0.0, checkpointing="op")
    est = estimate_model(spec, settings)
    traced = trace_step(config, settings, spec)
    for e, t in zip(est.phases, traced.phases, strict=True):
        assert abs(e.allocated_bytes / t.allocated_bytes - 1) <= 0.01, (e, t)


def test_op_sits_between_full_and_none():
    spec = catalog_spec("llama-3-8b")
    acts = {c: estimate_model(spec, make_settings(recipe="pure-bf16", seq=4096, checkpointing=c)).activations
            for c in ("none", "op", "full")}
    assert acts["full"].layers_bytes < acts["op"].layers_bytes < acts["none"].layers_bytes


@pytest.mark.parametrize("model,options,says", [
    ("llama-3.2-1b", dict(recipe="amp-bf16"), "checkpointing 'op' is modelled for recipes without autocast"),
    ("llama-3.2-1b", dict(recipe="pure-bf16", attention="eager"), "modelled with --attention sdpa"),
    ("gpt2", dict(recipe="pure-bf16"), "modelled for Llama-like layers"),
])
def test_what_op_does_not_model_is_refused(model, options, says):
    with pytest.raises(ConfigError, match=says):
        estimate_model(catalog_spec(model), make_settings(checkpointing="op", **options))


def test_op_with_lora_is_refused():
    from trainmem.lora import FineTune, LoraOptions

    with pytest.raises(ConfigError, match="modelled for full fine-tuning"):
        estimate_model(catalog_spec("llama-3.2-1b"), make_settings(recipe="pure-bf16", checkpointing="op"),
                       finetune=FineTune(lora=LoraOptions(rank=8)))


def test_op_checkpointing_under_fsdp2_matches_one_rank_traced():
    """torchtitan's set-up: FSDP2 (MixedPrecisionPolicy, mixed-bf16) over every layer, op SAC, rank 0 of 8 on a fake
    process group. At llama-3.2-1b's own width, 2 layers, as tests/test_sharding.py traces FSDP2 (at width 256 the
    FSDP2 estimate is off by 6-7% in backward with or without checkpointing, a gap of the FSDP model)."""
    from trainmem.sharding import Parallel
    from trainmem.trace import trace_fsdp_step

    config = dict(catalog_config("llama-3.2-1b"), num_hidden_layers=2)
    spec = spec_from_config(config)
    settings = make_settings(recipe="mixed-bf16", batch=2, seq=512, checkpointing="op", optimizer_impl="foreach")
    parallel = Parallel(gpus=8, fsdp="full")
    est = estimate_model(spec, settings, parallel=parallel)
    traced = trace_fsdp_step(config, settings, parallel, spec)
    for e, t in zip(est.phases, traced.phases, strict=True):
        assert abs(e.allocated_bytes / t.allocated_bytes - 1) <= 0.01, (e, t)


@pytest.mark.slow
@pytest.mark.parametrize("model,recipe,layers,batch,seq", [
    ("llama-3.2-1b", "pure-bf16", 3, 2, 512),   # q, v, gate kept (down's output is read by the residual add only)
    ("llama-3.2-1b", "mixed-bf16", 2, 1, 1024),
    ("qwen2.5-0.5b", "pure-bf16", 2, 2, 512),   # o and up kept; o's freed once the residual is recomputed
])
def test_compiled_op_checkpointing_matches_its_trace(model, recipe, layers, batch, seq):
    """torchtitan's order: op SAC on each layer, then torch.compile of the checkpointed layer (aot_eager_decomp_partition:
    the partitioner saves what the policy tags MUST_SAVE and backward reads, recomputes the rest in one backward graph;
    activations.compiled_checkpoint_terms). Every phase within 3% (measured: forward 0.01%, backward +0.7 to +1.6%)."""
    from trainmem.trace import trace_step

    config = dict(catalog_config(model), **dict(TINY, num_hidden_layers=layers))
    spec = spec_from_config(config)
    settings = make_settings(recipe=recipe, batch=batch, seq=seq, dropout=0.0, checkpointing="op", compile=True)
    est = estimate_model(spec, settings)
    traced = trace_step(config, settings, spec)
    for e, t in zip(est.phases, traced.phases, strict=True):
        assert abs(e.allocated_bytes / t.allocated_bytes - 1) <= 0.03, (e, t)
    assert est.activations.layers[0].checkpoint_terms != estimate_model(
        spec, make_settings(recipe=recipe, batch=batch, seq=seq, dropout=0.0, checkpointing="op")
    ).activations.layers[0].checkpoint_terms  # (what the compiled layer keeps is not eager SAC's)


def test_compiled_op_layer_keeps_its_input_and_the_saved_outputs_backward_reads():
    """Llama: the layer input, q, v and gate outputs, SDPA's output and logsumexp, not down_proj's output."""
    spec = catalog_spec("llama-3-8b")
    compiled, eager = (estimate_model(spec, make_settings(recipe="pure-bf16", seq=4096, checkpointing="op",
                                                          compile=c)).activations for c in (True, False))
    h = spec.hidden_size
    assert eager.layers_bytes - compiled.layers_bytes == 2 * h * 4096 * spec.num_layers  # down_proj's output


def test_selective_with_compile_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="checkpointing 'selective' with --compile is not modelled; with --compile give "
                                          "--checkpointing op, full or none"):
        make_settings(recipe="pure-bf16", checkpointing="selective", compile=True)
