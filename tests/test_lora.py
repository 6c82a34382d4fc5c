"""LoRA: the adapters trainmem counts are the ones peft creates, for every model type (MoE included)."""

import json

import pytest

from tiny_configs import TINY_CONFIGS

import trainmem
from trainmem.errors import ConfigError
from trainmem.lora import LoraOptions, adapter_parameters
from trainmem.models import spec_from_config

DENSE = [name for name, cfg in TINY_CONFIGS.items()
         if cfg["model_type"] not in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")]


def _peft_counts(config: dict, rank: int, target_modules, dora: bool = False,
                 modules_to_save=None) -> tuple[int, int]:
    """peft's (trainable, all) parameter counts of ``config``'s model with LoRA (or DoRA) adapters, built on the
    meta device."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=target_modules, use_dora=dora,
                                                      modules_to_save=modules_to_save)).get_nb_trainable_parameters()


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("rank, dora", [(8, False), (64, False), (8, True)])
def test_all_linear_adds_what_peft_adds(name, rank, dora):
    config = TINY_CONFIGS[name]
    trainable, everything = _peft_counts(config, rank, "all-linear", dora)
    spec = spec_from_config(config)
    ours = adapter_parameters(spec, LoraOptions(rank, targets=("all-linear",), dora=dora))
    assert ours == trainable
    assert spec.num_parameters + ours == everything


MODULE_TARGETS = {
    "llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "gpt_neox": ["query_key_value", "dense"],
    "falcon": ["query_key_value", "dense_4h_to_h"], "bloom": ["dense_h_to_4h"], "opt": ["q_proj", "out_proj", "fc1"],
    "phi3": ["qkv_proj", "gate_up_proj"], "gemma2": ["o_proj", "down_proj"], "gpt2-inner-untied": ["c_proj"],
}


@pytest.mark.parametrize("name, modules", list(MODULE_TARGETS.items()))
def test_module_names_select_what_peft_selects(name, modules):
    config = TINY_CONFIGS[name]
    trainable, _ = _peft_counts(config, 16, modules)
    assert adapter_parameters(spec_from_config(config), LoraOptions(16, targets=tuple(modules))) == trainable


def test_short_names_on_fused_projections_select_the_fused_layer():
    neox = spec_from_config(TINY_CONFIGS["gpt_neox"])
    assert adapter_parameters(neox, LoraOptions(8, targets=("q",))) == \
        adapter_parameters(neox, LoraOptions(8, targets=("query_key_value",)))
    assert adapter_parameters(neox, LoraOptions(8, targets=("q", "k", "v"))) == \
        adapter_parameters(neox, LoraOptions(8, targets=("q",)))


def _assert_traced_within(model: str, options: LoraOptions, tolerance: float, vocab: int | None = None, **settings):
    """peft's step on a 2-layer ``model`` (``vocab`` tokens if given), traced (trace_step with finetune: peft on the
    meta device, then fake tensors), against its estimate: every phase within ``tolerance``. Returns the estimate."""
    pytest.importorskip("peft")
    from trainmem.catalog import catalog_config
    from trainmem.stepmodel import estimate_model
    from trainmem.lora import FineTune
    from trainmem.settings import make_settings
    from trainmem.trace import trace_step

    config = dict(catalog_config(model), num_hidden_layers=2, **({"vocab_size": vocab} if vocab else {}))
    spec = spec_from_config(config)
    finetune = FineTune(options)
    step = make_settings(dropout=0.0, optimizer_impl="foreach", **settings)
    est = estimate_model(spec, step, finetune=finetune)
    traced = trace_step(config, step, spec, finetune=finetune)
    assert est.peak is not None
    for e, t in zip(est.phases, traced.phases):
        assert abs(e.allocated_bytes - t.allocated_bytes) <= tolerance * t.allocated_bytes, (e, t)
    return est


@pytest.mark.parametrize("kwargs, says", [
    (dict(rank=0), "rank must be"), (dict(rank=8, targets=("qq",)), "unknown lora target"),
    (dict(rank=8, targets=()), "targets are empty"), (dict(rank=8, adapter_dtype="fp8"), "unknown adapter dtype"),
    (dict(rank=8, alpha=-1), "alpha must be"), (dict(rank=8, dropout=1.0), "dropout must be"),
])
def test_bad_options_are_refused(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        adapter_parameters(spec_from_config(TINY_CONFIGS["llama"]), LoraOptions(**kwargs))


MOE = [name for name, cfg in TINY_CONFIGS.items()
       if cfg["model_type"] in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")]


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("rank", [8, 64])
def test_lora_on_moe_adds_what_peft_adds(name, rank):
    """peft 0.21 on transformers v5: all-linear adapts the nn.Linears, and for the types in its conversion table
    (Mixtral; Qwen3-MoE and DeepSeek-V3 as Qwen2-MoE) the router and the 3-D experts (gate_up_proj at rank 2r)
    instead of the Linears named like v4 expert projections; Qwen2-MoE itself keeps its shared experts' Linears."""
    config = TINY_CONFIGS[name]
    spec = spec_from_config(config)
    attention = ["kv_b_proj", "o_proj"] if config["model_type"] == "deepseek_v3" else ["q_proj", "o_proj"]
    for peft_targets, ours in (("all-linear", ("all-linear",)), (attention, tuple(attention))):
        trainable, everything = _peft_counts(config, rank, peft_targets)
        assert adapter_parameters(spec, LoraOptions(rank, targets=ours)) == trainable, peft_targets
        assert spec.num_parameters + trainable == everything


def test_what_lora_on_moe_does_not_take_is_refused_in_one_line():
    mixtral = spec_from_config(TINY_CONFIGS["mixtral"])
    with pytest.raises(ConfigError, match="accepted there are all-linear and the attention projections"):
        adapter_parameters(mixtral, LoraOptions(8, targets=("gate",)))
    with pytest.raises(ConfigError, match="ParamWrapper"):
        adapter_parameters(mixtral, LoraOptions(8, targets=("all-linear",), dora=True))
    with pytest.raises(ConfigError, match="quantized mixture-of-experts base"):
        trainmem.estimate("mixtral-8x7b", lora=8, qlora=True)
    with pytest.raises(ConfigError, match="no module of that name"):
        adapter_parameters(spec_from_config(TINY_CONFIGS["llama"]), LoraOptions(8, targets=("c_attn",)))


def test_lora_static_memory_trains_only_the_adapters():
    import trainmem
    from trainmem.catalog import catalog_spec

    spec = catalog_spec("llama-3.1-8b")
    est = trainmem.estimate("llama-3.1-8b", recipe="pure-bf16-bf16states", lora=8, lora_targets="q,v")
    parts = {c.name: c.bytes for c in est.static}
    # q_proj 4096 -> 4096 and v_proj 4096 -> 1024 in each of 32 layers: 8 x (8192 + 5120) x 32 adapter parameters
    adapters = 8 * (4096 + 4096 + 4096 + 1024) * 32
    assert adapters == 3_407_872
    assert parts["weights"] == 2 * spec.num_parameters + 4 * adapters  # bf16 base, fp32 adapters (peft's default)
    assert parts["gradients"] == 4 * adapters and parts["optimizer_states"] == 8 * adapters
    assert parts["master_weights"] == 0
    assert est.peak is not None  # a Llama with SDPA: the activations are modelled too
    bf16 = trainmem.estimate("llama-3.1-8b", recipe="pure-bf16-bf16states", lora=8, adapter_dtype="bf16")
    assert {c.name: c.bytes for c in bf16.static}["optimizer_states"] == 4 * adapters  # bf16 states


def test_qlora_base_is_stored_as_bitsandbytes_stores_it():
    import trainmem
    from trainmem.catalog import catalog_spec
    from trainmem.quantization import stored_bytes

    spec = catalog_spec("llama-3.1-8b")
    est = trainmem.estimate("llama-3.1-8b", recipe="pure-bf16-bf16states", lora=8, qlora=True)
    quantized = unquantized = 0
    for g in spec.param_groups:
        for t in g.tensors:
            if g.name.startswith("layers") and len(t.shape) == 2:
                quantized += g.repeat * stored_bytes(t.shape, "nf4", True)
            else:
                unquantized += g.repeat * 2 * t.numel  # embedding, norms and the LM head stay bf16
    weights = {c.name: c.bytes for c in est.static}["weights"]
    assert weights == quantized + unquantized + 4 * 3_407_872


@pytest.mark.parametrize("args, says", [
    (["--qlora"], "need --lora RANK"), (["--dora"], "need --lora RANK"),
    (["--train-modules", "lm_head"], "need --lora"),
    (["--lora", "8", "--train-modules", "norm"], "accepted: the token embedding and the LM head"),
    (["--lora", "8", "--train-modules", "lm_head", "--lora-targets", "q,v,lm_head"], "not both"),
    (["--lora", "8", "--gpus", "4", "--tp", "2"], "LoRA with --tp is not modelled yet"),
    (["--lora", "8", "--base-quant", "int4"], "unknown base quantization"),
    (["--lora", "8", "--base-quant", "int8", "--double-quant"], "4-bit base"),
    (["--lora", "0"], "rank must be"),
])
def test_lora_flags_refuse_what_is_not_modelled_in_one_line(run_cli, args, says):
    code, out, err = run_cli("estimate", "llama-3.2-1b", *args)
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_lora_json_records_the_adapters(run_cli):
    import json

    code, out, _ = run_cli("estimate", "llama-3.2-1b", "--lora", "16", "--lora-targets", "all-linear", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["lora"]["rank"] == 16 and doc["lora"]["targets"] == ["all-linear"]
    assert doc["peak"]["allocated_bytes"] > doc["static"]["total_bytes"]
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "--lora", "16", "--base-quant", "int8", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["peak"] is None and doc["fits"] is None  # an 8-bit base: static memory only
    code, out, _ = run_cli("sweep", "llama-3.2-1b", "--lora", "8", "--batch", "1,2", "--seq", "256", "--json")
    rows = json.loads(out)["sweep"]
    assert code == 0 and rows[0]["peak"]["allocated_bytes"] < rows[1]["peak"]["allocated_bytes"]
    code, _, err = run_cli("sweep", "llama-3.2-1b", "--lora", "8", "--base-quant", "int8")
    assert code == 2 and "not modelled yet" in err


@pytest.mark.slow
@pytest.mark.parametrize("rank, targets, recipe, checkpointing, batch, seq, model, dropout", [
    (8, ("q", "v"), "pure-bf16-bf16states", "none", 1, 512, "llama-3.2-1b", 0.0),
    (8, ("q", "v"), "pure-bf16-bf16states", "full", 2, 512, "llama-3.2-1b", 0.0),
    (16, ("all-linear",), "pure-bf16-bf16states", "none", 2, 256, "llama-3.2-1b", 0.0),
    (64, ("all-linear",), "fp32", "full", 1, 512, "llama-3.2-1b", 0.0),
    (8, ("q", "k", "v", "o"), "pure-bf16", "none", 2, 256, "llama-3.2-1b", 0.0),
    (32, ("q", "v", "down"), "mixed-bf16", "none", 1, 512, "llama-3.2-1b", 0.0),
    (8, ("q", "v"), "fp32", "none", 1, 256, "llama-3.2-1b", 0.0),
    (8, ("q", "v"), "pure-bf16-bf16states", "none", 1, 512, "phi-3-mini-4k", 0.0),
    (16, ("all-linear",), "pure-bf16-bf16states", "full", 2, 256, "phi-3-mini-4k", 0.0),
    (8, ("q", "v"), "pure-bf16-bf16states", "none", 1, 512, "llama-3.2-1b", 0.05),
    (8, ("q", "k", "v", "o"), "pure-bf16", "full", 2, 256, "llama-3.2-1b", 0.1),
    (8, ("q", "v"), "amp-bf16", "none", 1, 512, "llama-3.2-1b", 0.0),
    (16, ("all-linear",), "amp-bf16", "none", 2, 256, "llama-3.2-1b", 0.0),
    (8, ("q", "v"), "amp-bf16", "full", 1, 512, "llama-3.2-1b", 0.0),
    (16, ("all-linear",), "amp-bf16", "full", 2, 256, "llama-3.2-1b", 0.0),
    (8, ("q", "k", "v", "o"), "amp-fp16", "none", 1, 256, "qwen2.5-0.5b", 0.0),
    (8, ("q", "v"), "amp-bf16", "none", 1, 256, "phi-3-mini-4k", 0.0),
    (8, ("c_attn",), "pure-bf16-bf16states", "none", 1, 256, "gpt2", 0.0),
    (16, ("all-linear",), "fp32", "full", 1, 256, "gpt2", 0.0),
    (8, ("c_attn",), "amp-bf16", "none", 1, 256, "gpt2", 0.0),
    (8, ("q", "v"), "pure-bf16-bf16states", "none", 1, 256, "opt-1.3b", 0.0),
])
def test_lora_step_matches_its_trace(rank, targets, recipe, checkpointing, batch, seq, model, dropout):
    """peft's LoRA on a 2-layer Llama-3.2-1B (and Phi-3-mini, fused projections), traced (trace_step with finetune:
    peft on the meta device, then fake tensors): every phase within 1% of the estimate (measured: 0.00% in bf16 for
    Llama, up to +0.11% over an fp32 base)."""
    _assert_traced_within(model, LoraOptions(rank, targets=targets, dropout=dropout), 0.01, recipe=recipe,
                          checkpointing=checkpointing, batch=batch, seq=seq)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, targets, model", [
    ("pure-bf16-bf16states", ("all-linear",), "llama-3.2-1b"), ("fp32", ("all-linear",), "llama-3.2-1b"),
    ("pure-bf16-bf16states", ("q", "k", "v", "o"), "llama-3.2-1b"),
    ("pure-bf16-bf16states", ("all-linear",), "mistral-7b"), ("amp-bf16", ("all-linear",), "llama-3.2-1b"),
    ("amp-bf16", ("q", "v"), "llama-3.2-1b"),
])
def test_lora_peaks_inside_checkpointed_layers_match_the_trace(recipe, targets, model):
    """A small vocabulary and short sequences put a checkpointed LoRA step's peaks inside the layers: the adapters'
    sums in the no-save forward and in the recompute (an fp32 scaled B output and sum beside the base output).
    Measured on Llama-3.2-1B: forward 0.00-0.01%, backward -0.90% (bf16 all-linear), -0.20% (fp32)."""
    est = _assert_traced_within(model, LoraOptions(16, targets=targets), 0.015, vocab=512, recipe=recipe,
                                checkpointing="full", batch=2, seq=64)
    assert est.phases[1].moment == "inside the last layer"


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("modules", [("lm_head",), ("embed_tokens",), ("lm_head", "embed_tokens")])
def test_trained_modules_add_what_peft_trains(tied, modules):
    """peft's modules_to_save trains a copy of each module (a tied head's copy is a head of its own)."""
    from trainmem.lora import trained_copies

    config = dict(TINY_CONFIGS["llama"], tie_word_embeddings=tied)
    trainable, everything = _peft_counts(config, 8, ["q_proj", "v_proj"], modules_to_save=list(modules))
    spec = spec_from_config(config)
    options = LoraOptions(8, targets=("q", "v"), train_modules=modules)
    copies = sum(trained_copies(spec, options).values())
    assert copies == len(modules) * config["vocab_size"] * config["hidden_size"]
    assert adapter_parameters(spec, options) + copies == trainable
    assert spec.num_parameters + adapter_parameters(spec, options) + copies == everything


@pytest.mark.slow
@pytest.mark.parametrize("model, recipe, checkpointing, rank, targets, modules, vocab", [
    ("llama-3.2-1b", "pure-bf16-bf16states", "none", 8, ("q", "v"), ("lm_head", "embed_tokens"), None),
    ("llama-3.2-1b", "fp32", "full", 8, ("q", "v"), ("lm_head",), None),
    ("llama-3.2-1b", "mixed-bf16", "none", 8, ("q", "v"), ("embed_tokens",), None),
    ("llama-3.2-1b", "pure-bf16", "full", 16, ("all-linear",), ("lm_head", "embed_tokens"), None),
    ("mistral-7b", "pure-bf16-bf16states", "none", 8, ("q", "v"), ("lm_head", "embed_tokens"), 8000),
])
def test_trained_modules_step_matches_its_trace(model, recipe, checkpointing, rank, targets, modules, vocab):
    """--train-modules (peft's modules_to_save) on a 2-layer model, traced: the copies' gradients and states, the
    head's kept input and weight gradient, the embedding's backward (measured: every phase within 0.01%)."""
    _assert_traced_within(model, LoraOptions(rank, targets=targets, train_modules=modules), 0.001, vocab=vocab,
                          recipe=recipe, checkpointing=checkpointing, batch=1, seq=256)


@pytest.mark.slow
@pytest.mark.parametrize("rank, targets, recipe, checkpointing, seq, model", [
    (8, ("q", "v"), "pure-bf16-bf16states", "none", 512, "llama-3.2-1b"),
    (8, ("all-linear",), "pure-bf16-bf16states", "none", 64, "llama-3.2-1b"),
    (8, ("all-linear",), "pure-bf16-bf16states", "full", 64, "llama-3.2-1b"),
    (64, ("all-linear",), "fp32", "full", 128, "llama-3.2-1b"),
    (16, ("all-linear",), "pure-bf16-bf16states", "full", 128, "phi-3-mini-4k"),
])
def test_dora_step_matches_its_trace(rank, targets, recipe, checkpointing, seq, model):
    """peft's DoRA (use_dora) on a 2-layer model, traced: the outputs its layers keep, and the weight norm each
    forward recomputes (an in x in identity and four out x in weights at the short sequences, where it is the
    peak); every phase within 2% (measured 2026-12-01: up to 0.06%, +0.22% in Phi-3's checkpointed backward)."""
    _assert_traced_within(model, LoraOptions(rank, targets=targets, dora=True), 0.02, recipe=recipe,
                          checkpointing=checkpointing, batch=1, seq=seq)


def test_dora_adds_its_magnitudes_and_a_weight_norm_inside_each_layer():
    """DoRA = LoRA + out_features magnitudes per adapted Linear (fp32 like the adapters), and inside each layer the
    weight norm: Llama-3.1-8B's largest adapted Linear on all-linear is down_proj (14336 -> 4096): a 14336^2
    identity, rank x 14336 and four 4096 x 14336 fp32 weights over a bf16 base, at its moment of the last layer's
    forward."""
    import trainmem

    kwargs = dict(recipe="pure-bf16-bf16states", batch=1, seq=1024, lora=8, lora_targets="all-linear")
    lora, dora = trainmem.estimate("llama-3.1-8b", **kwargs), trainmem.estimate("llama-3.1-8b", dora=True, **kwargs)
    magnitudes = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)
    assert {c.name: c.bytes for c in dora.static}["weights"] - {c.name: c.bytes for c in lora.static}["weights"] \
        == 4 * magnitudes
    (forward,) = [p for p in dora.phases if p.name == "forward"]
    (lora_forward,) = [p for p in lora.phases if p.name == "forward"]
    norm = 4 * (14336 ** 2 + 8 * 14336 + 4 * 4096 * 14336)
    assert forward.moment == "last layer's DoRA adapter"
    assert forward.allocated_bytes - lora_forward.allocated_bytes > norm
    assert dora.peak.allocated_bytes > lora.peak.allocated_bytes


@pytest.mark.parametrize("model, kwargs, says", [
    ("llama-3.2-1b", dict(lora=8, dora=True, lora_dropout=0.1), "DoRA with dropout"),
    ("gpt2", dict(lora=8, lora_targets="c_proj", dropout=0.0), "without q, k or v"),
    ("llama-3.2-1b", dict(lora=8, base_quant="int8"), "8-bit base"),
    ("llama-3.2-1b", dict(lora=8, lora_targets="down"), "without q, k or v"),
])
def test_lora_set_ups_outside_the_traced_ground_give_static_memory_and_say_why(model, kwargs, says):
    import trainmem

    est = trainmem.estimate(model, **kwargs)
    assert est.peak is None and any(says in n for n in est.notes), est.notes


def test_lora_estimate_has_a_peak_where_its_activations_are_modelled():
    import trainmem

    est = trainmem.estimate("llama-3.1-8b", recipe="pure-bf16-bf16states", batch=2, seq=2048, checkpointing="full",
                            lora=8, lora_alpha=16, lora_targets="q,v", gpu="RTX-4090")
    full = trainmem.estimate("llama-3.1-8b", recipe="pure-bf16-bf16states", batch=2, seq=2048, checkpointing="full")
    assert est.peak is not None and est.peak.allocated_bytes < full.peak.allocated_bytes
    assert sum(la.count for la in est.activations.layers) == 32  # the first layer stands apart


def test_qlora_adds_one_dequantized_weight_inside_the_layers_and_says_it_is_not_validated():
    from trainmem.catalog import catalog_spec
    from trainmem.lora import FineTune
    from trainmem.settings import make_settings
    from trainmem.stepmodel import compile_step

    spec = catalog_spec("llama-3.2-1b")
    settings = make_settings(recipe="pure-bf16-bf16states")
    lora = LoraOptions(8, targets=("q", "v"))
    plain = compile_step(spec, settings, finetune=FineTune(lora)).candidates(1, 1024)[1]
    step = compile_step(spec, settings, finetune=FineTune(lora, "nf4", True))
    qlora = step.candidates(1, 1024)[1]
    largest = 8192 * 2048  # Llama-3.2-1B's gate, up and down projections
    backward = {ph.moment: ph for ph in plain[2]}, {ph.moment: ph for ph in qlora[2]}
    assert backward[1]["layer 0 MLP"].temporaries - backward[0]["layer 0 MLP"].temporaries == 2 * largest
    assert backward[1]["loss gradients"].temporaries == backward[0]["loss gradients"].temporaries
    assert any("not validated" in note for note in step.unchecked)


@pytest.mark.slow
def test_trace_command_runs_lora_and_refuses_a_quantized_base(run_cli, tmp_path):
    """`trainmem trace --lora` runs peft's step (a 2-layer Llama-shaped config) beside its estimate; a 4-bit base,
    whose bitsandbytes kernels cannot run on fake tensors, is refused in one line."""
    pytest.importorskip("peft")
    jsonschema = pytest.importorskip("jsonschema")
    from trainmem.report import json_schema

    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=1024, tie_word_embeddings=False)))
    code, out, _ = run_cli("trace", str(config), "--recipe", "pure-bf16-bf16states", "--lora", "8", "--seq", "128",
                           "--batch", "2", "--dropout", "0", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["lora"]["rank"] == 8 and not list(jsonschema.Draft202012Validator(json_schema())
                                                                 .iter_errors(doc))
    assert all(abs(p["relative_error"]) <= 0.01 for p in doc["phases"]), doc["phases"]
    code, _, err = run_cli("trace", str(config), "--lora", "8", "--qlora")
    assert code == 2 and "full-precision base" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("family, recipe, checkpointing, targets, found", [
    ("llama", "pure-bf16-bf16states", "full", ("all-linear",),
     "the recompute starts at lora_B; the first layer is not apart"),
    ("llama", "fp32", "full", ("all-linear",), "the first layer is not apart under checkpointing"),
    ("llama", "amp-bf16", "none", ("all-linear",), "the adapters' half copies; the fp32 final hidden states"),
    ("llama", "amp-bf16", "full", ("q", "v"), "the frozen down_proj's half copy is freed before the MLP moment"),
    ("llama", "amp-bf16", "full", ("all-linear",), "the recompute's weight copies and peft's fp32 input copies"),
    ("qwen3", "fp32", "none", ("q", "v"), "q_norm and k_norm keep no normalised value; k_norm nothing in layer 0"),
    ("phi3", "fp32", "full", ("all-linear",), "a norm's fp32 input, and a Linear input kept as is, are locals"),
    ("opt", "fp32", "full", ("q", "v"), "the token embeddings are a leaf autograd holds under checkpointing"),
    ("llama", "pure-bf16-bf16states", "selective", ("all-linear",), "every second layer checkpointed"),
    ("qwen3", "amp-bf16", "full", ("q", "v"), "a frozen down_proj's recompute stops before its output"),
    ("qwen2", "amp-bf16", "full", ("all-linear",),
     "peft's fp32 copy of the o/down input in the checkpointed forward; earlier layers' cached adapter copies"),
    ("gpt2", "pure-bf16-bf16states", "full", ("all-linear",), "an adapted down's input gradient is in fp32"),
])
def test_scaled_lora_matrix_rows_that_were_out_of_tolerance_are_within_it(family, recipe, checkpointing, targets,
                                                                           found):
    """Rows of `trainmem validate --lora` (hidden 128, rank 16: adapters weigh as much as they ever do) that missed
    by 2-6% before what ``found`` says was traced and modelled (and layer-selective checkpointing, which the matrix
    does not run): every phase within 3%, every category within 5%."""
    pytest.importorskip("peft")
    from trainmem import validate

    row = validate._run_lora((family, recipe, checkpointing, targets, 0.0, False))
    assert row.within_tolerance, (found, row.worst_phase, row.estimate, row.trace)


@pytest.mark.slow
@pytest.mark.parametrize("family, recipe, checkpointing", [
    ("llama", "pure-bf16-bf16states", "full"),  # was -5.5% forward: the weight norm at each Linear, not the largest
    ("llama", "fp32", "full"),  # +3.5%: the recompute's moments where each Linear runs
    ("opt", "fp32", "full"),  # +3.9%: the bias taken off the base output; OPT's MLP frees its norm output
    ("qwen2", "pure-bf16-bf16states", "none"),  # -4.0% backward: DoRA's gradients at the MLP's widest Linear
    ("phi3", "fp32", "full"),  # fused gate_up: its backward runs after the activation's
])
def test_scaled_dora_rows_are_within_tolerance(family, recipe, checkpointing):
    """DoRA rows of `trainmem validate --lora` (all-linear, rank 16, hidden 128) that missed by up to 6% while
    DoRA's transients were modelled as one buffer for the layer's largest Linear at every moment: with each
    adapted Linear's weight norm and products modelled where it runs, every phase within 3%, every category
    within 5%."""
    pytest.importorskip("peft")
    from trainmem import validate

    row = validate._run_lora((family, recipe, checkpointing, ("all-linear",), 0.0, True))
    assert row.within_tolerance, (row.worst_phase, row.estimate, row.trace)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_lora_dropout_under_autocast_keeps_its_masks(checkpointing):
    """Under autocast with lora dropout each adapter keeps the dropout's bool mask beside lora_A's half copy of the
    dropped-out input: the matrix's q,k,v,o row with dropout 0.05 (-1.27% to -1.85% before) within tolerance."""
    pytest.importorskip("peft")
    from trainmem import validate

    row = validate._run_lora(("llama", "amp-bf16", checkpointing, ("q", "k", "v", "o"), 0.05, False))
    assert row.within_tolerance, (row.worst_phase, row.estimate, row.trace)


def test_lora_on_a_traced_path_type_names_the_linears_it_has(run_cli, tmp_path):
    """A model_type without a hand-written description (counted by transformers, its step traced with peft's
    adapters: tests/test_tracedstep.py) under --lora with targets it has no module of: one line naming the Linears
    it has, not the --params message."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))
    code, _, err = run_cli("estimate", str(config), "--lora", "8")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "has no Linear of those names" in err and "query" in err and "--params" not in err
