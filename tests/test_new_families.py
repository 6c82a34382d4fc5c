"""OLMo-2 (``olmo2``), Cohere (``cohere``), Phi-1.5 / Phi-2 (``phi``), Granite, StarCoder2, StableLM, GPT-J,
GPT-BigCode, OLMo-1 (``olmo``) and GPT-OSS (``gpt_oss``): a
traced step of small models (the real transformers model on fake tensors, trace.py) against the estimate, every
phase within 1% in total, in fp32 / amp-bf16 / mixed-bf16 / pure-bf16, with and without full checkpointing, eager
and SDPA, with and without dropout. Exact parameter counts of the real checkpoints: each against the count
transformers' own model has on the meta device and the figure written here (tests/test_models.py also checks
tiny_configs.py and the whole catalog)."""

import pytest

pytest.importorskip("transformers")
slow = pytest.mark.slow  # (every test here but the parameter counts traces a model)

from trainmem.settings import make_settings  # noqa: E402
from trainmem.validate import _total_error, compare  # noqa: E402

_SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=4103, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
CASES = [
    ("olmo2", {}, "fp32", "none", "sdpa"),
    ("olmo2", {}, "amp-bf16", "none", "sdpa"),
    ("olmo2", {}, "pure-bf16", "none", "eager"),
    ("olmo2", {}, "amp-bf16", "full", "eager"),
    ("olmo2", {"tie_word_embeddings": True, "attention_bias": True}, "fp32", "full", "sdpa"),
    ("cohere", {}, "fp32", "none", "sdpa"),
    ("cohere", {}, "amp-bf16", "none", "sdpa"),
    ("cohere", {}, "pure-bf16", "none", "eager"),
    ("cohere", {}, "amp-bf16", "full", "eager"),
    ("cohere", {}, "pure-bf16", "full", "sdpa"),
    ("cohere", {"use_qk_norm": True, "tie_word_embeddings": False, "attention_bias": True}, "amp-bf16", "none",
     "sdpa"),
]


# Activations dominate (4 x 1,024 tokens, a vocabulary of 1,031): where the checkpointed layer input, the eager
# softmax's cast back to a half q and the parallel block's pending input gradient were once 1.5-3.4% off.
LONG = [
    ("olmo2", {}, "amp-bf16", "full", "sdpa"),
    ("olmo2", {}, "amp-bf16", "full", "eager"),
    ("olmo2", {}, "pure-bf16", "full", "sdpa"),
    ("cohere", {}, "fp32", "full", "sdpa"),
    ("cohere", {"use_qk_norm": True}, "amp-bf16", "full", "eager"),
    ("cohere", {}, "fp32", "none", "eager"),
]


def _every_phase_within_one_percent(config, settings):
    row = compare(config, settings)
    for phase, estimate, trace in ((row.phase, row.estimate, row.trace), *row.other_phases):
        assert abs(_total_error(estimate, trace)) <= 0.01, (phase, estimate, trace)


def _check(model_type, extra, recipe, checkpointing, attention, batch, seq, dropout=0.0):
    config = dict(_SMALL, model_type=model_type, **extra)
    settings = make_settings(recipe=recipe, checkpointing=checkpointing, batch=batch, seq=seq, optimizer="adamw",
                             dropout=dropout, attention=attention)
    _every_phase_within_one_percent(config, settings)


@slow
@pytest.mark.parametrize("model_type, extra, recipe, checkpointing, attention", CASES)
def test_every_phase_within_one_percent_of_the_trace(model_type, extra, recipe, checkpointing, attention):
    _check(model_type, extra, recipe, checkpointing, attention, 2, 256)


@slow
@pytest.mark.parametrize("model_type, extra, recipe, checkpointing, attention", LONG)
def test_long_sequences_within_one_percent(model_type, extra, recipe, checkpointing, attention):
    _check(model_type, dict(extra, vocab_size=1031), recipe, checkpointing, attention, 4, 1024)


@slow
def test_the_random_cohere_case_that_once_missed_the_attention_gradient():
    """validate --random seed 5, case 69: Cohere under autocast, eager, checkpointed, dropout; the attention
    output's half gradient waits through the MLP's backward."""
    from trainmem.validate import DRAW_BEFORE_2026_12_02, TYPES_BEFORE_2026_12_02, random_case_for, run_random_case

    config, training = random_case_for(5, 69, TYPES_BEFORE_2026_12_02, DRAW_BEFORE_2026_12_02)  # (as recorded)
    assert config["model_type"] == "cohere"
    result = run_random_case(config, training, 69)
    assert result.ok, result.describe()


# Phi (modeling_phi.py): parallel attention and MLP on one LayerNorm, partial rotary, biases everywhere, gelu_new,
# embedding and residual dropout, optional per-head q/k LayerNorms. Long sequences (activations dominate): where the
# rotary split's locals, the held attention output and gelu_new's fp32 output at fc2 were once 1.4-5.5% off.
PHI = [
    ({}, "amp-bf16", "full", "eager", 0.0),
    ({}, "mixed-bf16", "none", "eager", 0.0),
    ({}, "amp-bf16", "none", "eager", 0.1),
    ({}, "fp32", "full", "eager", 0.1),
    ({}, "amp-bf16", "none", "sdpa", 0.1),
    ({"qk_layernorm": True, "num_key_value_heads": 2}, "fp32", "none", "sdpa", 0.0),
    ({"qk_layernorm": True, "num_key_value_heads": 2}, "amp-bf16", "none", "eager", 0.0),
]


@slow
@pytest.mark.parametrize("extra, recipe, checkpointing, attention, dropout", PHI)
def test_phi_within_one_percent_of_the_trace(extra, recipe, checkpointing, attention, dropout):
    _check("phi", dict({"num_key_value_heads": 4, "vocab_size": 1031}, **extra), recipe, checkpointing, attention,
           4, 1024, dropout)


# Granite (modeling_granite.py): Llama's modules; its four multipliers are products with Python scalars (nothing
# saved), the logits division a transient under the loss's. Long sequences and a large vocabulary, with dropout.
GRANITE = dict(num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=0.22,
               attention_multiplier=0.0078125, logits_scaling=16.0)
GRANITE_CASES = [
    (dict(vocab_size=1031), "fp32", "none", "sdpa", 4, 1024, 0.0),
    (dict(vocab_size=1031), "amp-bf16", "full", "eager", 4, 1024, 0.0),
    (dict(vocab_size=32003, attention_dropout=0.1), "amp-bf16", "none", "eager", 2, 256, 0.1),
    (dict(vocab_size=32003, attention_bias=True, mlp_bias=True), "pure-bf16", "full", "sdpa", 2, 256, 0.0),
]


@slow
@pytest.mark.parametrize("extra, recipe, checkpointing, attention, batch, seq, dropout", GRANITE_CASES)
def test_granite_within_one_percent_of_the_trace(extra, recipe, checkpointing, attention, batch, seq, dropout):
    _check("granite", dict(GRANITE, **extra), recipe, checkpointing, attention, batch, seq, dropout)


# SmolLM3, InternLM3, ERNIE 4.5, GLM-4, OLMo-3 and Cohere 2: one traced step each where a modelled difference
# shows (each case missed by 1.2-17% before the operation it checks was modelled):
# - SmolLM3's NoPE layers: eager attention under autocast with an unrotated half q keeps the softmax's cast-back copy
#   beside its fp32 input (a checkpointed forward was -14.7%); sliding windows on the NoPE layers;
# - ERNIE 4.5 and GLM-4 rotate with each layer's own repeat_interleave'd cos and sin (kept for backward; ERNIE's
#   fp32 in every recipe) and the model's tables die with the layer loop; ERNIE drops nothing out in attention;
# - GLM-4's four sandwich norms (-7% when only Gemma's were counted), fused gate_up, partial rotary;
# - OLMo-3 and Cohere 2: sliding and full layers (windows the sequence reaches), Cohere 2's unrotated full layers.
NEWER_FAMILIES = [
    ("smollm3", dict(no_rope_layer_interval=2, vocab_size=1031), "amp-bf16", "full", "eager", 4, 1024, 0.0),
    ("smollm3", dict(use_sliding_window=True, sliding_window=128, no_rope_layer_interval=2, attention_bias=True),
     "pure-bf16", "none", "sdpa", 2, 256, 0.0),
    ("internlm3", dict(head_dim=64, qkv_bias=True, bias=True), "fp32", "none", "sdpa", 2, 256, 0.0),
    ("ernie4_5", dict(head_dim=64, vocab_size=1031), "pure-bf16", "full", "sdpa", 4, 1024, 0.0),
    ("ernie4_5", dict(head_dim=64, use_bias=True), "amp-bf16", "none", "eager", 2, 256, 0.1),
    ("glm4", dict(head_dim=64), "fp32", "none", "sdpa", 2, 256, 0.0),
    ("glm4", dict(head_dim=64, attention_bias=False, partial_rotary_factor=1.0), "amp-bf16", "none", "sdpa", 2, 256,
     0.0),
    ("olmo3", dict(sliding_window=128, layer_types=["sliding_attention", "full_attention"]), "pure-bf16", "none",
     "eager", 2, 256, 0.0),
    ("cohere2", dict(sliding_window=128, sliding_window_pattern=2), "amp-bf16", "full", "eager", 2, 256, 0.0),
    ("cohere2", dict(sliding_window=128, sliding_window_pattern=2, attention_bias=True), "fp32", "none", "sdpa", 2,
     256, 0.0),
]


@slow
@pytest.mark.parametrize("model_type, extra, recipe, checkpointing, attention, batch, seq, dropout", NEWER_FAMILIES)
def test_newer_families_within_one_percent_of_the_trace(model_type, extra, recipe, checkpointing, attention, batch,
                                                         seq, dropout):
    _check(model_type, extra, recipe, checkpointing, attention, batch, seq, dropout)


# StarCoder2 (modeling_starcoder2.py): Mistral's attention with biases and one sliding window for every layer,
# LayerNorms, a plain c_fc -> gelu_pytorch_tanh -> c_proj MLP, residual and embedding dropout. Its narrow MLP puts
# the forward's peak at the last layer's softmax, where the math kernel's and eager attention's locals (the caller's
# rotated q beside the matmul's copy; the scaled q, the causal mask, k expanded to every head) were once 1.3-2.0%
# short.
STARCODER2 = [
    ({}, "fp32", "none", "sdpa", 0.0),
    ({}, "fp32", "none", "eager", 0.0),
    ({}, "pure-bf16", "none", "eager", 0.0),
    # (-1.45% at the forward peak, 2026-12-03, before the dropout inside Starcoder2MLP and the undropped embeddings
    # Starcoder2Model.forward holds in inputs_embeds were modelled)
    ({"sliding_window": 512}, "amp-bf16", "none", "eager", 0.1),
    ({"sliding_window": 512, "use_bias": False}, "fp32", "full", "sdpa", 0.0),
]


@slow
@pytest.mark.parametrize("extra, recipe, checkpointing, attention, dropout", STARCODER2)
def test_starcoder2_within_one_percent_of_the_trace(extra, recipe, checkpointing, attention, dropout):
    _check("starcoder2", dict({"vocab_size": 1031}, **extra), recipe, checkpointing, attention, 4, 1024, dropout)


# StableLM (modeling_stablelm.py): Phi's attention (partial rotary joined by torch.cat, optional q/k/v biases),
# Llama's gated MLP, LayerNorms, sequential or parallel residual, dropout on the MLP output only; the attention
# output StableLmDecoderLayer holds through the MLP. (Not yet within 1%: dropout under autocast with eager
# attention, -1.4% to -2.6%: docs/accuracy.md.)
STABLELM = [
    ({}, "amp-bf16", "full", "sdpa", 0.0),
    ({"use_qkv_bias": True}, "fp32", "none", "eager", 0.1),
    ({"use_parallel_residual": True}, "pure-bf16", "none", "sdpa", 0.0),
    ({"use_parallel_residual": True, "partial_rotary_factor": 0.5}, "amp-bf16", "full", "eager", 0.0),
]


@slow
@pytest.mark.parametrize("extra, recipe, checkpointing, attention, dropout", STABLELM)
def test_stablelm_within_one_percent_of_the_trace(extra, recipe, checkpointing, attention, dropout):
    _check("stablelm", dict({"vocab_size": 1031}, **extra), recipe, checkpointing, attention, 4, 1024, dropout)


def test_stablelm_with_per_head_qk_layernorms_takes_the_traced_path():
    from trainmem.models import UnsupportedModelType, spec_from_config

    with pytest.raises(UnsupportedModelType, match="qk_layernorm"):
        spec_from_config(dict(_SMALL, model_type="stablelm", qk_layernorm=True))


# GPT-J (modeling_gptj.py): parallel attention and MLP on one LayerNorm, partial rotary (rotary_dim) rotated in
# interleaved pairs with each layer's repeat_interleave'd sin and cos, eager scores from fp32 casts of q and k, the
# probabilities cast to v's dtype, the LM head's bias, the fp32 sinusoidal position buffer. Each case missed by
# 2-14% before the operation it checks was modelled (the buffer in every phase; under checkpointing the undropped
# embeddings GPTJModel.forward keeps, and the half cast of the probabilities beside the fp32 scores).
GPTJ_SMALL = dict(n_embd=256, n_layer=2, n_head=4, vocab_size=1031, n_positions=4096, rotary_dim=32, bos_token_id=1,
                  eos_token_id=2)
GPTJ = [
    ({}, "fp32", "none", "sdpa", 0.0),
    ({}, "amp-bf16", "full", "eager", 0.0),
    ({}, "pure-bf16", "none", "eager", 0.0),
    ({"rotary_dim": 64, "n_inner": 688}, "mixed-bf16", "none", "sdpa", 0.1),
    ({"tie_word_embeddings": True}, "fp32", "full", "sdpa", 0.1),
]


def _check_gpt_style(model_type, extra, recipe, checkpointing, attention, dropout):
    base = GPTJ_SMALL if model_type == "gptj" else {k: v for k, v in GPTJ_SMALL.items() if k != "rotary_dim"}
    config = dict(base, model_type=model_type, **extra)
    settings = make_settings(recipe=recipe, checkpointing=checkpointing, batch=4, seq=1024, optimizer="adamw",
                             dropout=dropout, attention=attention)
    _every_phase_within_one_percent(config, settings)


@slow
@pytest.mark.parametrize("extra, recipe, checkpointing, attention, dropout", GPTJ)
def test_gptj_within_one_percent_of_the_trace(extra, recipe, checkpointing, attention, dropout):
    _check_gpt_style("gptj", extra, recipe, checkpointing, attention, dropout)


# GPT-BigCode (modeling_gpt_bigcode.py): GPT-2's block with nn.Linear, multi-query c_attn (one k and one v head, the
# matmuls' copies to every head; q a view of c_attn's output, held by the attention's locals), Llama's eager softmax,
# learned positions one (1, s, h) row for the batch, the causal bool buffer. Each case missed by 1.1-4.3% before
# the operation it checks was modelled (the repeated views, v's copy after the softmax, the shared position row).
BIGCODE = [
    ({}, "fp32", "none", "eager", 0.0),
    ({}, "amp-bf16", "full", "eager", 0.0),
    ({}, "fp32", "full", "sdpa", 0.1),
    ({"multi_query": False}, "amp-bf16", "none", "eager", 0.1),
    ({"n_inner": 688}, "pure-bf16", "none", "sdpa", 0.0),
]


@slow
@pytest.mark.parametrize("extra, recipe, checkpointing, attention, dropout", BIGCODE)
def test_gpt_bigcode_within_one_percent_of_the_trace(extra, recipe, checkpointing, attention, dropout):
    _check_gpt_style("gpt_bigcode", extra, recipe, checkpointing, attention, dropout)


# OLMo-1 (modeling_olmo.py): Llama's modules with OlmoLayerNorm (no weight or bias, over an fp32 copy of its input,
# also the final norm), OLMo-2's rotary (fp32 tables, q and k cast back), clip_qkv's in-place clamps. Each case missed
# by 1-12.7% before the operation it checks was modelled (the final norm without parameters; the fp32 copy a half
# layer input is normalised from, not shared with the checkpoint; the clamps' saved inputs).
OLMO = [
    ({}, "fp32", "none", "sdpa", 0.0),
    ({}, "amp-bf16", "full", "eager", 0.0),
    ({}, "mixed-bf16", "full", "sdpa", 0.0),
    ({"clip_qkv": 8.0, "num_key_value_heads": 2}, "amp-bf16", "none", "eager", 0.1),
    ({"clip_qkv": 8.0, "attention_bias": True, "tie_word_embeddings": True}, "pure-bf16", "full", "sdpa", 0.0),
]


@slow
@pytest.mark.parametrize("extra, recipe, checkpointing, attention, dropout", OLMO)
def test_olmo_within_one_percent_of_the_trace(extra, recipe, checkpointing, attention, dropout):
    _check("olmo", dict({"num_key_value_heads": 4, "vocab_size": 1031}, **extra), recipe, checkpointing, attention,
           4, 1024, dropout)


# GPT-OSS (modeling_gpt_oss.py): the sinks' softmax (no upcast, one more column, ``attn_weights`` and
# ``combined_logits`` bound beside it), the top-k router with a bias, the grouped_mm experts with biases and the
# clamped SwiGLU (9 expert-wide tensors at its product). Sequences cross the 128-token window; SDPA runs eager
# (GptOssPreTrainedModel._supports_sdpa is False). Experts narrower than the width, as in no real model, so that
# the expert and the hidden widths are told apart.
GPT_OSS = dict(_SMALL, intermediate_size=384, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=128, vocab_size=1031)
GPT_OSS_CASES = [
    ({}, "fp32", "none", "eager", 2, 256, 0.0),
    ({}, "fp32", "full", "eager", 1, 1024, 0.0),
    ({}, "fp32", "none", "eager", 1, 1024, 0.0),
    ({}, "amp-bf16", "none", "sdpa", 2, 256, 0.0),
    ({}, "amp-bf16", "full", "eager", 2, 256, 0.0),
    ({}, "amp-bf16", "full", "eager", 1, 1024, 0.0),
    ({}, "amp-bf16", "full", "eager", 2, 256, 0.1),
    ({}, "mixed-bf16", "none", "eager", 2, 512, 0.0),
    ({}, "mixed-bf16", "full", "sdpa", 2, 512, 0.0),
    ({}, "mixed-bf16", "selective", "eager", 1, 256, 0.0),
    (dict(tie_word_embeddings=True, attention_bias=False, num_hidden_layers=4, num_local_experts=8,
          num_experts_per_tok=4, vocab_size=4103), "fp32", "full", "eager", 2, 256, 0.0),
    (dict(tie_word_embeddings=True, attention_bias=False, num_hidden_layers=4, num_local_experts=8,
          num_experts_per_tok=4, vocab_size=4103), "mixed-bf16", "selective", "eager", 2, 384, 0.0),
]


@slow
@pytest.mark.parametrize("extra, recipe, checkpointing, attention, batch, seq, dropout", GPT_OSS_CASES)
def test_gpt_oss_within_one_percent_of_the_trace(extra, recipe, checkpointing, attention, batch, seq, dropout):
    config = dict(GPT_OSS, model_type="gpt_oss", **extra)
    settings = make_settings(recipe=recipe, checkpointing=checkpointing, batch=batch, seq=seq, optimizer="adamw",
                             dropout=dropout, attention=attention)
    _every_phase_within_one_percent(config, settings)


def test_gpt_oss_has_no_sdpa_path():
    """GptOssPreTrainedModel._supports_sdpa is False and transformers' default for it is eager: --attention sdpa is
    estimated as eager, as the trace builds it."""
    from trainmem.activations import effective_kernel
    from trainmem.catalog import catalog_spec

    assert effective_kernel(catalog_spec("gpt-oss-20b"), "sdpa") == "eager"


def test_gptj_refuses_a_rotary_width_its_tables_cannot_take():
    from trainmem.errors import ModelError
    from trainmem.models import spec_from_config

    for rotary in (0, 7, 128):  # (n_embd 256 over 4 heads: 64 wide)
        with pytest.raises(ModelError, match="rotary_dim"):
            spec_from_config(dict(GPTJ_SMALL, model_type="gptj", rotary_dim=rotary))
    with pytest.raises(ModelError, match="null only with one head"):
        spec_from_config(dict(GPTJ_SMALL, model_type="gptj", rotary_dim=None))


# transformers' count of each checkpoint's parameters (sum of numel over a meta-device PhiForCausalLM built from the
# catalog's config.json), written out so that the test fails if either side moves.
EXACT_COUNTS = {
    "phi-2": 2_779_683_840,
    "phi-1_5": 1_418_270_720,
    "granite-3-8b-instruct": 8_170_864_640,
    "starcoder2-3b": 3_030_371_328,
    "starcoder2-7b": 7_173_923_840,
    "starcoder2-15b": 15_655_899_136,
    "stablelm-3b-4e1t": 2_795_443_200,
    "stablelm-zephyr-3b": 2_795_443_200,
    "stablelm-2-1_6b": 1_644_515_328,
}
EXACT_COUNTS.update({
    "smollm3-3b": 3_075_098_624,
    "internlm3-8b-instruct": 8_804_241_408,
    "ernie-4.5-0.3b": 360_748_032,
    "glm-4-9b-0414": 9_400_279_040,
    "olmo-3-7b": 7_298_011_136,
    "c4ai-command-r7b-12-2024": 8_028_033_024,
})
EXACT_COUNTS.update({
    "gpt-j-6b": 6_050_882_784,
    "gpt_bigcode-santacoder": 1_124_886_528,
    "starcoderbase-1b": 1_137_207_296,
    "starcoder": 15_517_456_384,
    "olmo-1b-hf": 1_176_764_416,
    "olmo-7b-hf": 6_888_095_744,
    "olmo-7b-0424-hf": 6_888_095_744,
})


EXACT_COUNTS.update({
    # (OpenAI's model card: 20.91B and 116.83B parameters in total)
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
})


@pytest.mark.parametrize("name", sorted(EXACT_COUNTS))
def test_exact_parameter_counts_of_the_real_checkpoints(name):
    from hf import hf_num_parameters

    from trainmem.catalog import catalog_config, catalog_spec

    assert hf_num_parameters(catalog_config(name)) == EXACT_COUNTS[name]
    assert catalog_spec(name).num_parameters == EXACT_COUNTS[name]


def test_a_trained_copy_of_phis_tied_head_is_the_embedding_and_the_bias():
    """peft's modules_to_save deep-copies the whole lm_head Linear: tied, its weight (the embedding) and Phi's bias."""
    from tiny_configs import TINY_CONFIGS

    from trainmem.lora import LoraOptions, copy_groups
    from trainmem.models import spec_from_config

    spec = spec_from_config(TINY_CONFIGS["phi-gqa-qk-norm-tied"])
    (group,) = copy_groups(spec, LoraOptions(rank=8, train_modules=("lm_head",)))
    assert sorted(t.shape for t in group.tensors) == [(211,), (211, 64)]
