"""Effects the published GPU runs show (benchmarks/published_runs.py): what bitsandbytes' 4-bit Linear keeps for
backward, by release."""

from __future__ import annotations

import pytest

import trainmem


def test_installed_bitsandbytes_4bit_linear_keeps_no_input_and_the_default_estimate_agrees():
    """The installed bitsandbytes' Linear4bit (a real one, on the CPU): its MatMul4Bit node (the autograd ctx) holds
    ``tensors = (None, B)`` for an input that needs a gradient, so a QLoRA step without --bnb-version keeps no
    frozen Linear's input: its saved activations equal plain LoRA's."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    lin = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False, quant_type="nf4")
    lin = lin.to("cpu")  # quantizes the weight (Params4bit._quantize)
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    ctx = lin(x).grad_fn
    assert type(ctx).__name__ == "MatMul4BitBackward" and ctx.tensors[0] is None and ctx.tensors[1] is not None
    kwargs = dict(recipe="pure-bf16-bf16states", lora=8, lora_targets="q,v", batch=1, seq=256)
    assert trainmem.estimate("llama-3.2-1b", qlora=True, **kwargs).activations.saved_bytes == \
        trainmem.estimate("llama-3.2-1b", **kwargs).activations.saved_bytes


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_bitsandbytes_before_0_43_2_keeps_each_4bit_linears_input(checkpointing):
    """bitsandbytes before 0.43.2 (``ctx.tensors = (A, B)``, removed by #1270): every 4-bit Linear whose input
    needs a gradient keeps that input. On Llama-3.2-1B with bf16 q,v adapters (which keep the q/k/v input anyway;
    SDPA keeps its output, o_proj's input) that is the MLP's input and down_proj's input in every layer, counted
    here from the config's widths; under (non-reentrant) checkpointing those nodes hold the inputs through the
    forward too."""
    from trainmem.catalog import catalog_config

    config = catalog_config("llama-3.2-1b")
    tokens, hidden, inter = 256, config["hidden_size"], config["intermediate_size"]
    kwargs = dict(recipe="pure-bf16-bf16states", lora=8, lora_targets="q,v", batch=1, seq=tokens, qlora=True,
                  adapter_dtype="bf16", checkpointing=checkpointing)
    new = trainmem.estimate("llama-3.2-1b", **kwargs)
    old = trainmem.estimate("llama-3.2-1b", bnb_version="0.42.0", **kwargs)
    def layer_terms(est) -> float:  # what the layers keep for backward (under checkpointing: in the recompute)
        return sum(la.count * la.bytes_per_token for la in est.activations.layers) * tokens

    per_layer = 2 * tokens * (hidden + inter)  # bf16: gate/up input, down input
    assert layer_terms(old) - layer_terms(new) == per_layer * config["num_hidden_layers"]
    # non-reentrant checkpointing: the autograd nodes hold every 4-bit Linear's input through the forward
    # (q/k/v, o, gate/up, down), beside the checkpointed layer input
    held = 2 * tokens * (3 * hidden + inter) * config["num_hidden_layers"] if checkpointing == "full" else 0
    assert old.activations.layers_bytes - new.activations.layers_bytes == \
        (held if checkpointing == "full" else per_layer * config["num_hidden_layers"])
    assert layer_terms(trainmem.estimate("llama-3.2-1b", bnb_version="0.43.2", **kwargs)) == layer_terms(new)


@pytest.mark.parametrize("args, says", [
    (["--lora", "8", "--bnb-version", "0.42.0"], "applies to a 4-bit base"),
    (["--lora", "8", "--qlora", "--bnb-version", "new"], "release like 0.42.0"),
    (["--bnb-version", "0.42.0"], "need --lora RANK"),
])
def test_bnb_version_refuses_bad_input_in_one_line(run_cli, args, says):
    code, _, err = run_cli("estimate", "llama-3.2-1b", *args)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1


def test_lora_with_an_adapter_on_the_lm_head_matches_peft_traced():
    """peft's adapter on the LM head (litgpt's ``lora_head``, torchtune's ``apply_lora_to_output``) on a 2-layer
    Llama, litgpt's config-hub settings (bf16 adapters, dropout, chunked loss), traced (trace_step: peft on fake
    tensors): every phase within 1% of the estimate (measured 0.00%, as with the standard loss, fp32 adapters and
    full checkpointing). The head keeps its
    input for lora_A and the A output for lora_B; the frozen head makes the logits all the same, and its
    ``result + lora_B(...) * scaling`` (three logits-sized tensors) stays under the loss's fp32 moment."""
    pytest.importorskip("peft")
    from trainmem.lora import FineTune, LoraOptions
    from trainmem.models import spec_from_config
    from trainmem.settings import make_settings
    from trainmem.stepmodel import estimate_model
    from trainmem.trace import trace_step

    config = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=8192, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    spec = spec_from_config(config)
    finetune = FineTune(LoraOptions(8, targets=("q", "v", "lm_head"), dropout=0.1, adapter_dtype="bf16"))
    step = make_settings(recipe="pure-bf16-bf16states", dropout=0.0, optimizer_impl="foreach",
                         loss="chunked-output", batch=2, seq=128)
    est = estimate_model(spec, step, finetune=finetune)
    traced = trace_step(config, step, spec, finetune=finetune)
    assert est.peak is not None
    for e, t in zip(est.phases, traced.phases):
        assert abs(e.allocated_bytes - t.allocated_bytes) <= 0.01 * t.allocated_bytes, (e, t)


def test_fsdp2_with_the_embedding_and_head_as_groups_of_their_own_matches_its_trace():
    """--fsdp-embedding-groups (torchtune's custom_sharded_layers ['tok_embeddings', 'output']): the trace wraps the
    head, the layers and the embedding as torchtune's shard_model does, then the root; FSDPMemTracker on a fake
    process group of 4 ranks gives every phase within 1% of the estimate (measured 0.00% on a 2-layer Llama-3.2-1B
    with an untied 128,256-token head), and the estimate is below the root-gathered one's."""
    pytest.importorskip("transformers")
    from trainmem.models import spec_from_config
    from trainmem.settings import make_settings
    from trainmem.sharding import Parallel
    from trainmem.stepmodel import estimate_model
    from trainmem.trace import trace_fsdp_step

    config = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=32768, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    spec = spec_from_config(config)
    settings = make_settings(recipe="mixed-bf16", batch=2, seq=128, optimizer_impl="foreach")
    parallel = Parallel(gpus=4, fsdp="full", fsdp_embedding_groups=True)
    est = estimate_model(spec, settings, parallel=parallel)
    traced = trace_fsdp_step(config, settings, parallel, spec)
    for e, t in zip(est.phases, traced.phases):
        assert abs(e.allocated_bytes - t.allocated_bytes) <= 0.01 * t.allocated_bytes, (e, t)
    root = estimate_model(spec, settings, parallel=Parallel(gpus=4, fsdp="full"))
    assert est.peak.allocated_bytes < root.peak.allocated_bytes


@pytest.mark.parametrize("args, says", [
    (["--gpus", "4", "--fsdp", "grad-op", "--fsdp-embedding-groups"], "give --fsdp full or hybrid"),
    (["--gpus", "4", "--fsdp-embedding-groups"], "give --fsdp full or hybrid"),
    (["--gpus", "4", "--fsdp", "full", "--fsdp-embedding-groups", "--lora", "8"], "with LoRA is not modelled"),
])
def test_fsdp_embedding_groups_refuses_what_it_does_not_model_in_one_line(run_cli, args, says):
    code, _, err = run_cli("estimate", "llama-3.2-1b", *args)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1
