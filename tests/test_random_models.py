"""Differential test: random small models of every supported type under random training set-ups, each traced (the
real transformers model, a real step, fake tensors) and estimated; every phase must be within 3% in total and 5%
per category. The draws are the ones ``trainmem validate --random`` makes (``validate.random_case``), here from
hypothesis with a fixed seed so that CI runs the same few dozen cases on every machine, and a few more of a seed
picked per run (printed, and named by a failure), so that each run also checks models none has seen; a failure
prints the config and the command that reproduces it."""

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # every test here traces a model or runs real steps

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trainmem.validate import random_case, run_random_case  # noqa: E402


@settings(max_examples=12, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_estimate_matches_the_trace_of_a_random_model(data):
    from trainmem.validate import DRAW_BEFORE_2026_12_02

    # (the space this fixed draw was green in; today's wider one is the per-run draw's below)
    config, training = random_case(lambda label, options: data.draw(st.sampled_from(tuple(options)), label=label),
                                   space=DRAW_BEFORE_2026_12_02)
    result = run_random_case(config, training)
    assert result.row is not None, result.describe()
    assert result.ok, result.describe()


FRESH_CASES = 8
"""Cases of the per-run draw (the fixed draw above has 22, so that CI's time stays what it was with 30)."""


def test_fresh_random_models_of_a_seed_picked_per_run(record_property):
    """Each run checks models no run has seen: ``trainmem validate --random`` cases of a seed picked now (or
    TRAINMEM_RANDOM_SEED's, to rerun one), printed and named in the failure, every phase within tolerance."""
    import os

    from trainmem.validate import random_case_for

    seed = int(os.environ.get("TRAINMEM_RANDOM_SEED") or int.from_bytes(os.urandom(4), "big"))
    print(f"random-model seed {seed} (rerun: TRAINMEM_RANDOM_SEED={seed})")
    record_property("random_model_seed", seed)
    failures = [result.describe() for result in (run_random_case(*random_case_for(seed, index), index)
                                                 for index in range(FRESH_CASES)) if not result.ok]
    assert not failures, (f"seed {seed}: {len(failures)} of {FRESH_CASES} out of tolerance; reproduce with "
                          f"`trainmem validate --random {FRESH_CASES} --seed {seed}` or TRAINMEM_RANDOM_SEED={seed}\n"
                          + "\n".join(failures))


def test_a_failure_names_the_config_and_the_command():
    from trainmem.validate import random_case_for

    config, training = random_case_for(0, 0)
    text = run_random_case(config, training).describe()
    assert '"model_type"' in text and "trainmem trace config.json --recipe" in text


REGRESSIONS = {
    # seed: cases of `trainmem validate --random N --seed S` that were once outside tolerance, each for a reason
    # the estimate (or the trace) now models: checkpointed recomputes of MoE, MLA, eager attention with dropout,
    # Falcon, BLOOM, Gemma 2; stride-0 key/value views; SDPA masks; OPT's projections; tied embeddings.
    7: (5, 8, 11, 12, 33, 43, 76, 86, 140, 148, 168),
    11: (24, 25, 50, 56, 78, 84, 85, 86, 103, 104, 110, 169),
    2026: (80, 152, 191, 209, 210, 245, 273),
    99: (168, 175, 185, 263),
}


@pytest.mark.parametrize("seed, index", [(seed, i) for seed, cases in REGRESSIONS.items() for i in cases])
def test_random_cases_that_once_failed(seed, index):
    from trainmem.validate import DRAW_BEFORE_2026_12_02, TYPES_BEFORE_OLMO2, random_case_for

    # (the draws as they were recorded)
    config, training = random_case_for(seed, index, TYPES_BEFORE_OLMO2, DRAW_BEFORE_2026_12_02)
    result = run_random_case(config, training, index)
    assert result.ok, result.describe()


FALCON_ALIBI = {"model_type": "falcon", "vocab_size": 6144, "tie_word_embeddings": True, "pad_token_id": 0,
                "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 384, "num_attention_heads": 4,
                "num_hidden_layers": 2, "bias": False, "attention_dropout": 0.1, "hidden_dropout": 0.1,
                "max_position_embeddings": 4096, "ffn_hidden_size": 768, "alibi": True, "multi_query": False,
                "parallel_attn": False, "new_decoder_architecture": False}


@pytest.mark.parametrize("config, training", [
    ({}, {}), ({"multi_query": True}, {}), ({}, {"recipe": "amp-bf16"}), ({"parallel_attn": True}, {"dropout": 0.0}),
    ({}, {"batch": 2}), ({"new_decoder_architecture": True, "num_kv_heads": 2, "parallel_attn": True}, {}),
])
def test_falcon_eager_attention_keeps_the_fused_projection_its_views_read(config, training):
    """FalconAttention's eager matmuls read q (and without a cache k and v) as views of the fused query_key_value
    output: with one sequence they keep all of it (a random case of a later draw was -1.89% at the forward peak,
    1.5 MB of 80 MB missing: each layer's fused output beside the cache's k and v). Every phase within 0.1%."""
    from trainmem.validate import _total_error

    settings = {"recipe": "pure-bf16-bf16states", "optimizer": "adam", "batch": 1, "seq": 512, "attention": "eager",
                "checkpointing": "none", "dropout": 0.1, "grad_accum": 1, **training}
    result = run_random_case({**FALCON_ALIBI, **config}, settings)
    assert result.row is not None, result.describe()
    row = result.row
    for name, estimate, trace in ((row.phase, row.estimate, row.trace), *row.other_phases):
        assert abs(_total_error(estimate, trace)) < 0.001, (name, result.describe())


# Cases of `trainmem validate --random N --seed S` (2026-12-02, 19 model types) that were out of tolerance, written
# out so that a change of the draw (new types, new options) keeps them: (config, settings, why it was off).
# Seed 20261203's case 4 of ``validate --random`` (Falcon, parallel attention with one norm, tied embeddings, 2
# layers unless a layout says otherwise) and the neighbours traced around it (docs/accuracy.md, "Falcon attention,
# layout by layout")
FALCON_CASE_4 = {"model_type": "falcon", "vocab_size": 800, "tie_word_embeddings": True, "pad_token_id": 0,
                 "bos_token_id": 1, "eos_token_id": 2, "bias": False, "attention_dropout": 0.0,
                 "hidden_dropout": 0.0, "max_position_embeddings": 4096, "ffn_hidden_size": None,
                 "parallel_attn": True, "num_ln_in_parallel_attn": 1, "num_hidden_layers": 2}


def _falcon_neighbour(layout: dict, recipe: str, batch: int, attention: str, checkpointing: str) -> tuple[dict, dict]:
    """A Falcon case of RANDOM_MISSES: FALCON_CASE_4 with ``layout``, 1,000 tokens, Adam, no dropout."""
    return dict(FALCON_CASE_4, **layout), {"recipe": recipe, "optimizer": "adam", "batch": batch, "seq": 1000,
                                           "attention": attention, "checkpointing": checkpointing, "dropout": 0.0,
                                           "grad_accum": 1}


RANDOM_MISSES = {
    "falcon-alibi-recompute": (
        {"model_type": "falcon", "vocab_size": 2311, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 144, "num_attention_heads": 4, "num_hidden_layers": 1,
         "bias": True, "attention_dropout": 0.1, "hidden_dropout": 0.1, "max_position_embeddings": 4096,
         "ffn_hidden_size": 384, "alibi": True, "multi_query": True, "parallel_attn": True,
         "new_decoder_architecture": False},
        {"recipe": "mixed-fp16", "optimizer": "adam", "batch": 4, "seq": 1000, "attention": "eager",
         "checkpointing": "full", "dropout": None, "grad_accum": 2},
        # (seed 4242 case 3: -51.95% at the backward peak; the recompute of the eager ALiBi attention holds its three
        # fp32 s x s locals, as the checkpointed forward did, which no backward moment had)
    ),
    "gemma3-one-rotary-pair": (
        {"model_type": "gemma3_text", "vocab_size": 768, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 96, "num_attention_heads": 1, "num_key_value_heads": 1,
         "num_hidden_layers": 1, "intermediate_size": 192, "max_position_embeddings": 4096,
         "attention_dropout": 0.0, "head_dim": 128, "sliding_window": 2048, "query_pre_attn_scalar": 96},
        {"recipe": "amp-bf16", "optimizer": "sgd", "batch": 1, "seq": 512, "attention": "eager",
         "checkpointing": "full", "dropout": 0.1, "grad_accum": 1},
        # (seed 4242 case 28: +6.78% at the forward peak; one layer, which slides, so Gemma3TextModel builds one
        # pair of rotary tables, not one for local and one for global layers)
    ),
    "qwen3-efficient-mask-copies": (
        {"model_type": "qwen3", "vocab_size": 1024, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
         "num_hidden_layers": 3, "intermediate_size": 336, "max_position_embeddings": 4096,
         "attention_dropout": 0.0, "head_dim": 64, "use_sliding_window": True, "sliding_window": 500,
         "max_window_layers": 0, "attention_bias": True},
        {"recipe": "fp32", "optimizer": "adam", "batch": 1, "seq": 1000, "attention": "sdpa",
         "checkpointing": "full", "dropout": 0.0, "grad_accum": 1},
        # (seed 6262 case 6: -1.57% at the forward peak; inside a checkpointed layer the memory-efficient kernel's
        # float mask and its padded copy are alive at once)
    ),
    "mixtral-recompute-routing-locals": (
        {"model_type": "mixtral", "vocab_size": 263, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 32, "num_attention_heads": 1, "num_key_value_heads": 1,
         "num_hidden_layers": 1, "intermediate_size": 64, "max_position_embeddings": 4096, "attention_dropout": 0.1,
         "sliding_window": None, "num_local_experts": 2, "num_experts_per_tok": 2},
        {"recipe": "amp-bf16", "optimizer": "sgd", "batch": 4, "seq": 128, "attention": "eager",
         "checkpointing": "full", "dropout": None, "grad_accum": 1},
        # (seed 9191 case 7: -2.58% at the backward peak; the recompute of the routed experts ends at the gather back
        # to token order, with the router logits, the top-k weights, the sorted expert ids, histc's input, the arange
        # written into inv_perm and the block's fp32 argument alive in locals)
    ),
    "deepseek-v3-zero-width-shared-experts-first": (
        {"model_type": "deepseek_v3", "vocab_size": 263, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "intermediate_size": 128, "max_position_embeddings": 4096, "attention_dropout": 0.0,
         "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 0,
         "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "q_lora_rank": None, "kv_lora_rank": 16,
         "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "attention_bias": False},
        {"recipe": "fp32", "optimizer": "sgd", "batch": 2, "seq": 128, "attention": "sdpa", "checkpointing": "full",
         "dropout": 0.0, "grad_accum": 1},
        # (tiny MoE draw: -2.40% at the backward peak; the zero-wide shared-expert MLP DeepSeek builds anyway runs its
        # backward before the routed experts', making the MoE input's gradient; its group selection saves nothing)
    ),
    "deepseek-v3-shared-experts-free-their-casts": (
        {"model_type": "deepseek_v3", "vocab_size": 263, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "intermediate_size": 128, "max_position_embeddings": 4096, "attention_dropout": 0.0,
         "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
         "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "q_lora_rank": None, "kv_lora_rank": 16,
         "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "attention_bias": False},
        {"recipe": "amp-bf16", "optimizer": "sgd", "batch": 2, "seq": 128, "attention": "sdpa",
         "checkpointing": "full", "dropout": 0.0, "grad_accum": 1},
        # (+4.38% at the backward peak: the shared experts' backward, first, frees their input and weight casts)
    ),
    "qwen2-moe-unused-sliding-mask": (
        {"model_type": "qwen2_moe", "vocab_size": 263, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
         "num_hidden_layers": 1, "intermediate_size": 128, "max_position_embeddings": 4096, "attention_dropout": 0.0,
         "num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
         "mlp_only_layers": [], "norm_topk_prob": False, "shared_expert_intermediate_size": 32, "qkv_bias": True},
        {"recipe": "fp32", "optimizer": "sgd", "batch": 2, "seq": 128, "attention": "sdpa", "checkpointing": "full",
         "dropout": 0.0, "grad_accum": 1},
        # (-1.11% at the forward peak: Qwen2MoeModel builds the sliding SDPA mask, window 0 without
        # use_sliding_window, for no layer)
    ),
    "qwen2-moe-shared-gate-cast": (
        {"model_type": "qwen2_moe", "vocab_size": 263, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
         "num_hidden_layers": 1, "intermediate_size": 128, "max_position_embeddings": 4096, "attention_dropout": 0.0,
         "num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
         "mlp_only_layers": [], "norm_topk_prob": False, "shared_expert_intermediate_size": 32, "qkv_bias": True},
        {"recipe": "amp-bf16", "optimizer": "sgd", "batch": 2, "seq": 128, "attention": "sdpa",
         "checkpointing": "full", "dropout": 0.0, "grad_accum": 1},
        # (+1.57% at the backward peak: shared_expert_gate's backward frees its half input cast before the routed
        # experts' weighting)
    ),
    "qwen3-moe-gather-back-in-checkpointed-forward": (
        {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 96,
         "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
         "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True, "vocab_size": 512,
         "max_position_embeddings": 256, "attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-06,
         "rope_theta": 1000000.0, "tie_word_embeddings": False, "router_aux_loss_coef": 0.001, "pad_token_id": 0},
        {"recipe": "amp-bf16", "optimizer": "sgd", "batch": 2, "seq": 64, "attention": "eager",
         "checkpointing": "full", "dropout": None, "grad_accum": 1},
        # (the scaled-down Qwen3-MoE row of `trainmem validate`, -4.13% at the forward peak: with experts narrower
        # than the width the checkpointed forward's worst moment is the gather back to token order, not the product)
    ),
    "opt-softmax-cast-beside-the-scores": (
        {"model_type": "opt", "vocab_size": 576, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 36, "num_attention_heads": 1, "num_hidden_layers": 2, "ffn_dim": 96,
         "max_position_embeddings": 4096, "do_layer_norm_before": False, "enable_bias": False, "dropout": 0.0,
         "attention_dropout": 0.0, "word_embed_proj_dim": None, "activation_function": "relu"},
        {"recipe": "amp-bf16", "optimizer": "sgd", "batch": 1, "seq": 1000, "attention": "eager",
         "checkpointing": "none", "dropout": 0.0, "grad_accum": 1},
        # (seed 4711 case 24, here at batch 1: -7.7% at the forward peak; ``softmax(attn_weights, dtype=float32)
        # .to(query.dtype)`` makes the half copy while the fp32 scores are still bound, q being the half q_proj output)
    ),
    "olmo2-fp32-rotary-tables": (
        {"model_type": "olmo2", "vocab_size": 1600, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 100, "num_attention_heads": 1, "num_key_value_heads": 1,
         "num_hidden_layers": 1, "intermediate_size": 256, "max_position_embeddings": 4096, "attention_dropout": 0.1,
         "attention_bias": True},
        {"recipe": "pure-bf16", "optimizer": "adam", "batch": 1, "seq": 1000, "attention": "sdpa",
         "checkpointing": "selective", "dropout": 0.1, "grad_accum": 2},
        # (seed 1234 case 83: -1.88% at the forward peak; Olmo2RotaryEmbedding returns fp32 cos and sin, uncast)
    ),
    "falcon-math-kernel-checkpointed-forward": (
        {"model_type": "falcon", "vocab_size": 3200, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 400, "num_attention_heads": 4, "num_hidden_layers": 1,
         "bias": True, "attention_dropout": 0.0, "hidden_dropout": 0.0, "max_position_embeddings": 4096,
         "ffn_hidden_size": None, "multi_query": False, "parallel_attn": False, "new_decoder_architecture": False},
        {"recipe": "amp-fp16", "optimizer": "adafactor", "batch": 1, "seq": 1000, "attention": "sdpa",
         "checkpointing": "full", "dropout": None, "grad_accum": 1},
        # (seed 3968174417 case 7: -17.88% at the forward peak; head dim 100 under fp16 runs the math kernel, whose
        # scores, fp32 copies and float mask sit beside FalconAttention's locals and autocast's half q, k, v casts)
    ),
    "falcon-alibi-math-kernel-checkpointed-forward": (
        {"model_type": "falcon", "vocab_size": 3200, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 400, "num_attention_heads": 4, "num_hidden_layers": 1,
         "bias": True, "attention_dropout": 0.0, "hidden_dropout": 0.0, "max_position_embeddings": 4096,
         "ffn_hidden_size": None, "alibi": True, "multi_query": False, "parallel_attn": False,
         "new_decoder_architecture": False},
        {"recipe": "amp-fp16", "optimizer": "adafactor", "batch": 1, "seq": 1000, "attention": "sdpa",
         "checkpointing": "full", "dropout": None, "grad_accum": 1},
        # (the case above with ALiBi, a neighbour: -18.38% at the forward peak; the math kernel reads the float ALiBi
        # bias, which autocast casts to half, and FalconModel builds the rotary tables anyway, kept by the checkpoint)
    ),
    "mistral-math-kernel-autocast-casts": (
        {"model_type": "mistral", "vocab_size": 256, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 400, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "intermediate_size": 1024, "max_position_embeddings": 4096, "head_dim": 100,
         "sliding_window": 512, "attention_dropout": 0.0},
        {"recipe": "amp-fp16", "optimizer": "sgd", "batch": 1, "seq": 2000, "attention": "sdpa",
         "checkpointing": "full", "dropout": 0.0, "grad_accum": 1},
        # (a neighbour of the Falcon case, not a draw: -1.76% at the forward peak; the math kernel's forward lacked
        # the half casts of the fp32 rotated q and repeated k autocast's wrapper holds through the call)
    ),
    "starcoder2-dropout-zero-reaches-every-dropout": (
        {"model_type": "starcoder2", "vocab_size": 263, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
         "num_hidden_layers": 1, "intermediate_size": 512, "max_position_embeddings": 4096,
         "attention_dropout": 0.1, "residual_dropout": 0.1, "embedding_dropout": 0.1, "sliding_window": None,
         "use_bias": True, "hidden_act": "gelu_pytorch_tanh"},
        {"recipe": "mixed-bf16-fp32grads", "optimizer": "adamw", "batch": 2, "seq": 256, "attention": "sdpa",
         "checkpointing": "none", "dropout": 0.0, "grad_accum": 1},
        # (seed 20261202 case 51 at a smaller vocabulary and shape: -1.40% there, -2.54% here, at the forward peak;
        # --dropout 0 left Starcoder2Config's residual_dropout and embedding_dropout at the config's 0.1, so the
        # trace kept three dropout masks the estimate, told 0, did not: probe.build_model now sets them too)
    ),
    "qwen3-sliding-mask-freed-and-recompute-stop": (
        {"model_type": "qwen3", "vocab_size": 2055, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 688, "max_position_embeddings": 4096,
         "attention_dropout": 0.1, "head_dim": 128, "use_sliding_window": True, "sliding_window": 256,
         "max_window_layers": 1, "attention_bias": True},
        {"recipe": "amp-fp16", "optimizer": "adafactor", "batch": 1, "seq": 256, "attention": "eager",
         "checkpointing": "full", "dropout": 0.1, "grad_accum": 1},
        # (seed 2718 case 29: +1.25% at the backward peak, layer 0's recompute; the top layer's sliding mask dies
        # with its checkpoint, before the lower layer's recompute, and the recompute stops at down_proj's saved
        # inputs, before its output exists)
    ),
    "phi-recompute-ends-at-fc2-beside-its-locals": (
        {"model_type": "phi", "vocab_size": 263, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 512, "max_position_embeddings": 4096, "attention_dropout": 0.0,
         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "partial_rotary_factor": 1.0, "qk_layernorm": False},
        {"recipe": "amp-bf16", "optimizer": "adafactor", "batch": 1, "seq": 256, "attention": "eager",
         "checkpointing": "full", "dropout": 0.1, "grad_accum": 1},
        # (seed 20261202 case 59 at a smaller width and shape: -1.07% there, -3.96% here, at the backward peak; the
        # recompute's worst moment is fc2's output, with PhiDecoderLayer's dropped attn_outputs and gelu_new's fp32
        # output, fc2's argument, alive and unsaved)
    ),
    "gemma2-selective-keeps-the-checkpointed-layers-masks": (
        {"model_type": "gemma2", "vocab_size": 263, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 256, "max_position_embeddings": 4096,
         "attention_dropout": 0.0, "head_dim": 64, "sliding_window": 256, "query_pre_attn_scalar": 64,
         "attn_logit_softcapping": None, "final_logit_softcapping": 30.0},
        {"recipe": "mixed-fp16", "optimizer": "sgd-momentum", "batch": 1, "seq": 512, "attention": "eager",
         "checkpointing": "selective", "dropout": 0.1, "grad_accum": 1},
        # (seed 2718 case 27 at a smaller width and shape: +1.92% there, +3.66% here, at the forward peak; under
        # selective checkpointing only the checkpointed sliding layer's mask outlives the forward, the full one
        # dies with it)
    ),
    "falcon-alibi-eager-recompute-saves-as-it-goes": (
        {"model_type": "falcon", "vocab_size": 263, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 1,
         "bias": True, "attention_dropout": 0.0, "hidden_dropout": 0.0, "max_position_embeddings": 4096,
         "ffn_hidden_size": None, "alibi": True, "multi_query": False, "parallel_attn": False,
         "new_decoder_architecture": False},
        {"recipe": "amp-fp16", "optimizer": "adafactor", "batch": 1, "seq": 512, "attention": "eager",
         "checkpointing": "full", "dropout": None, "grad_accum": 1},
        # (the ALiBi neighbour of seed 3968174417 case 7 with eager attention, narrower and shorter: -3.33% there,
        # -4.56% here, at the backward peak, the recompute's softmax; the recompute saves q, k and query_key_value's
        # half input as it goes, which the first forward drops, and FalconLinear's bias add casts the output's
        # gradient to half before the recompute starts)
    ),
    "stablelm-one-head-output-needs-no-contiguous-copy": (
        {"model_type": "stablelm", "vocab_size": 2048, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1,
         "num_hidden_layers": 2, "intermediate_size": 512, "max_position_embeddings": 4096,
         "attention_dropout": 0.0, "hidden_dropout": 0.0, "use_qkv_bias": False, "use_parallel_residual": True,
         "partial_rotary_factor": 1.0},
        {"recipe": "pure-bf16", "optimizer": "adamw", "batch": 2, "seq": 512, "attention": "sdpa",
         "checkpointing": "none", "dropout": 0.0, "grad_accum": 1},
        # (seed 31415 case 37: +1.19% at the forward peak; with one head the flash output's transpose is contiguous,
        # so o_proj keeps it, not a copy)
    ),
    "stablelm-parallel-recompute-ends-at-the-mlp-dropout": (
        {"model_type": "stablelm", "vocab_size": 1031, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 688, "max_position_embeddings": 4096,
         "use_parallel_residual": True},
        {"recipe": "amp-bf16", "optimizer": "adamw", "batch": 1, "seq": 512, "attention": "eager",
         "checkpointing": "full", "dropout": 0.1, "grad_accum": 1},
        # (docs/accuracy.md's StableLM miss at 1 x 512: -1.32% at the backward peak; the recompute ends at the MLP
        # dropout's mask, beside the down projection's output and its dropped copy, and the partial sums' backward
        # made two half casts of the gradient before it)
    ),
    # seed 20261203 case 4: -23.41% at the forward peak; the memory-efficient kernel's float (b, 1, s, s) mask
    # converted from the boolean one and its copy padded to 16 columns, alive together in a checkpointed forward
    "falcon-efficient-kernel-checkpointed-forward-mask": _falcon_neighbour(
        {"hidden_size": 100, "num_attention_heads": 1, "num_kv_heads": 1, "num_hidden_layers": 1,
         "new_decoder_architecture": True}, "fp32", 1, "sdpa", "selective"),
    # a neighbour: -24.5% at the forward peak; the math kernel's softmax without checkpointing, beside
    # FalconAttention's locals, the kernel's fp32 copies, the scaled q's contiguous copy and autocast's mask cast
    "falcon-math-kernel-softmax-locals": _falcon_neighbour(
        {"hidden_size": 200, "num_attention_heads": 4, "num_kv_heads": 4, "alibi": True,
         "new_decoder_architecture": False}, "amp-fp16", 2, "sdpa", "none"),
    # a neighbour: -8.6% at the forward peak, then -1.0% at the backward one; only the attention's input
    # projections' weight casts exist at the softmax, one-head v saved and its gradient summed to one head, and
    # the MLP's gradient of the shared norm output waits for the attention's
    "falcon-multi-query-math-kernel-v-broadcast": _falcon_neighbour(
        {"hidden_size": 256, "num_attention_heads": 4, "num_kv_heads": 1, "multi_query": True,
         "new_decoder_architecture": False}, "amp-bf16", 1, "sdpa", "none"),
    # a neighbour: -15.5% at the backward peak; ALiBi's fp32 logits make the cast's and the scale's backward two
    # fp32 s x s gradients after the softmax's backward frees its output
    "falcon-alibi-eager-half-hidden-states": _falcon_neighbour(
        {"hidden_size": 200, "num_attention_heads": 4, "num_kv_heads": 2, "alibi": True,
         "new_decoder_architecture": True}, "pure-bf16", 2, "eager", "none"),
    # a neighbour: -4.8% at the backward peak; with one head per group q is a view of the fused output, which its
    # matmul keeps whole
    "falcon-one-head-eager-query-view": _falcon_neighbour(
        {"hidden_size": 100, "num_attention_heads": 1, "num_kv_heads": 1, "alibi": True,
         "new_decoder_architecture": True}, "fp32", 2, "eager", "none"),
    "cohere-recompute-saves-norms-and-float-rotary": (
        {"model_type": "cohere", "vocab_size": 1159, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 144, "num_attention_heads": 4, "num_key_value_heads": 4,
         "num_hidden_layers": 3, "intermediate_size": 288, "max_position_embeddings": 4096, "attention_dropout": 0.0,
         "head_dim": 64, "attention_bias": True, "use_qk_norm": True, "logit_scale": 1.0},
        {"recipe": "amp-bf16", "optimizer": "adafactor", "batch": 4, "seq": 1000, "attention": "sdpa",
         "checkpointing": "full", "dropout": 0.0, "grad_accum": 1},
        # (seed 20261203 case 160: -10.93% at the backward peak; the recompute has saved the input norm's and the
        # q/k norms' tensors by attention, and apply_rotary_pos_emb holds fp32 copies of q and k, rotated in fp32)
    ),
    "bloom-recompute-saves-the-fp32-softmax": (
        {"model_type": "bloom", "vocab_size": 1159, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 144, "n_head": 4, "n_layer": 3, "hidden_dropout": 0.0,
         "attention_dropout": 0.0, "apply_residual_connection_post_layernorm": True},
        {"recipe": "amp-bf16", "optimizer": "sgd", "batch": 2, "seq": 512, "attention": "eager",
         "checkpointing": "full", "dropout": 0.1, "grad_accum": 1},
        # (seed 20261203 case 229: -7.32% at the backward peak; in the recompute the softmax saves its fp32 output,
        # which the checkpointed forward freed at the cast back, alive at the attention dropout)
    ),
    "gpt2-autocast-dropout-reads-half-probabilities": (
        {"model_type": "gpt2", "vocab_size": 2304, "tie_word_embeddings": False, "bos_token_id": 1,
         "eos_token_id": 2, "n_embd": 144, "n_head": 4, "n_layer": 2, "n_positions": 4096, "n_inner": 384,
         "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "activation_function": "relu"},
        {"recipe": "amp-bf16", "optimizer": "adamw", "batch": 4, "seq": 1000, "attention": "eager",
         "checkpointing": "full", "dropout": None, "grad_accum": 1},
        # (seed 20261203 case 241: +9.95% at the forward peak; ``.type(value.dtype)`` casts the fp32 probabilities
        # to bf16 and frees them before the dropout, which then holds half probabilities, not fp32 ones)
    ),
    "falcon-alibi-math-kernel-returns-half-probabilities": (
        {"model_type": "falcon", "vocab_size": 295, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 36, "num_attention_heads": 1, "num_hidden_layers": 2, "bias": True,
         "attention_dropout": 0.0, "hidden_dropout": 0.0, "max_position_embeddings": 4096, "ffn_hidden_size": 144,
         "alibi": True, "multi_query": False, "parallel_attn": True, "new_decoder_architecture": False},
        {"recipe": "mixed-fp16", "optimizer": "sgd-momentum", "batch": 2, "seq": 1000, "attention": "sdpa",
         "checkpointing": "none", "dropout": 0.1, "grad_accum": 2},
        # (seed 20261203 case 55: -3.98% at the forward peak; the math kernel returns the product with v and a half
        # copy of the dropped probabilities, made beside everything it saved, before SDPA drops the second output)
    ),
    "gpt-oss-top-1-sinks-dropout-recompute": (
        {"model_type": "gpt_oss", "vocab_size": 1024, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
         "num_hidden_layers": 3, "intermediate_size": 128, "max_position_embeddings": 4096, "attention_dropout": 0.1,
         "head_dim": 64, "attention_bias": True, "sliding_window": 2048, "num_local_experts": 3,
         "num_experts_per_tok": 1},
        {"recipe": "fp32", "optimizer": "adafactor", "batch": 1, "seq": 512, "attention": "eager",
         "checkpointing": "full", "dropout": None, "grad_accum": 2},
        # (seed 20261203 case 276: -13.34% at the forward peak, then +1.16% at the backward one; the sinks softmax
        # with dropout holds the dropped copy and its mask beside the scores, logits and probabilities, and with one
        # expert per token no gradient of the weighted outputs exists before the recompute: both are views)
    ),
    "falcon-math-kernel-recompute-saves-the-scores-matmul-copies": (
        {"model_type": "falcon", "vocab_size": 583, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 72, "num_attention_heads": 2, "num_hidden_layers": 2, "bias": True,
         "attention_dropout": 0.1, "hidden_dropout": 0.1, "max_position_embeddings": 4096, "ffn_hidden_size": None,
         "multi_query": False, "parallel_attn": False, "new_decoder_architecture": False},
        {"recipe": "amp-bf16", "optimizer": "adam", "batch": 4, "seq": 256, "attention": "sdpa",
         "checkpointing": "full", "dropout": 0.1, "grad_accum": 2},
        # (seed 20261204 case 73: -3.52% at the backward peak; in the recompute the math kernel's scores matmul saves
        # its contiguous copies of the scaled q and k, and the layer's hidden dropout runs its backward before the
        # biased Linear's half cast of the gradient)
    ),
    "qwen2-moe-shared-expert-output-held-in-forward": (
        {"model_type": "qwen2_moe", "vocab_size": 6151, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 768, "num_attention_heads": 8, "num_key_value_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 2064, "max_position_embeddings": 4096, "attention_dropout": 0.1,
         "head_dim": 64, "num_experts": 3, "num_experts_per_tok": 3, "moe_intermediate_size": 192,
         "decoder_sparse_step": 2, "mlp_only_layers": [0], "norm_topk_prob": True,
         "shared_expert_intermediate_size": 768, "qkv_bias": False},
        {"recipe": "fp32", "optimizer": "sgd-momentum", "batch": 4, "seq": 512, "attention": "eager",
         "checkpointing": "full", "dropout": None, "grad_accum": 1},
        # (seed 20261205 case 66: -2.05% at the forward peak; Qwen2MoeSparseMoeBlock runs its shared expert first,
        # and its output is a local while the routed experts run in the checkpointed forward)
    ),
    "deepseek-v3-recompute-past-the-gather-back": (
        {"model_type": "deepseek_v3", "vocab_size": 2567, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 320, "num_attention_heads": 4, "num_key_value_heads": 4,
         "num_hidden_layers": 3, "intermediate_size": 848, "moe_intermediate_size": 160, "n_routed_experts": 4,
         "num_experts_per_tok": 4, "n_shared_experts": 0, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
         "q_lora_rank": 160, "kv_lora_rank": 80, "qk_nope_head_dim": 64, "qk_rope_head_dim": 16, "v_head_dim": 64,
         "max_position_embeddings": 4096, "attention_dropout": 0.1, "attention_bias": True},
        {"recipe": "amp-fp16", "optimizer": "sgd", "batch": 2, "seq": 512, "attention": "eager",
         "checkpointing": "full", "dropout": None, "grad_accum": 1},
        # (seed 20261205 case 4: -4.05% at the backward peak; the shared experts' later saves keep the recompute
        # going through the gather back to token order, the fp32 dropped probabilities MLA returns are held by the
        # decoder layer, and the shared experts' backward, first, starts the recompute before the routed sum's)
    ),
}

RANDOM_CATEGORY_MISSES = {
    "granite-scaled-branch-gradient": (
        {"model_type": "granite", "vocab_size": 8199, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 1024, "num_attention_heads": 16,
         "num_key_value_heads": 4, "num_hidden_layers": 2, "intermediate_size": 2048, "max_position_embeddings": 4096,
         "attention_dropout": 0.0, "attention_bias": True, "mlp_bias": True, "embedding_multiplier": 12.0,
         "residual_multiplier": 1.0, "attention_multiplier": 0.0078125, "logits_scaling": 1.0},
        {"recipe": "mixed-fp16", "optimizer": "adafactor", "batch": 1, "seq": 512, "attention": "eager",
         "checkpointing": "full", "dropout": 0.1, "grad_accum": 2},
        # (seed 20261204 case 59: -0.00% in total but 26 MiB of activations counted as temporaries, the peak at
        # another moment: ``hidden_states * residual_multiplier``'s backward makes a gradient of its own, alive
        # through the down projection's backward, which was 1 MiB short)
    ),
    "glm4-fused-gate-up-backward": (
        {"model_type": "glm4", "vocab_size": 8199, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 3, "intermediate_size": 2752, "max_position_embeddings": 4096,
         "attention_dropout": 0.1, "head_dim": 128, "attention_bias": False, "partial_rotary_factor": 1.0},
        {"recipe": "fp32", "optimizer": "adamw", "batch": 1, "seq": 256, "attention": "eager",
         "checkpointing": "full", "dropout": 0.1, "grad_accum": 2},
        # (seed 20261204 case 217: -0.38%, 13 MiB of temporaries counted as activations; the peak is the fused
        # gate_up projection's backward: chunk's concatenated gradient and the weight's gradient beside the tied
        # head's)
    ),
    "gpt-oss-half-residual-and-full-mask": (
        {"model_type": "gpt_oss", "vocab_size": 2560, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 320, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "intermediate_size": 320, "max_position_embeddings": 4096, "attention_dropout": 0.1,
         "head_dim": 80, "attention_bias": True, "sliding_window": 4096, "num_local_experts": 2,
         "num_experts_per_tok": 2, "layer_types": ["sliding_attention"]},
        {"recipe": "mixed-fp16", "optimizer": "sgd-momentum", "batch": 2, "seq": 256, "attention": "eager",
         "checkpointing": "full", "dropout": None, "grad_accum": 1},
        # (seed 20261204 case 469: -0.22% in total, 7.5 MiB in the wrong category; at the recompute's end the
        # decoder layer's half residual is alive beside the post-attention norm's fp32 copy, and the down
        # projection's gathered biases in grouped_mm_experts_forward's locals)
    ),
    "gpt-oss-recompute-saves-casts-and-mask": (
        {"model_type": "gpt_oss", "vocab_size": 2055, "tie_word_embeddings": True, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
         "num_hidden_layers": 3, "intermediate_size": 128, "max_position_embeddings": 4096, "attention_dropout": 0.1,
         "head_dim": 32, "attention_bias": True, "sliding_window": 1024, "num_local_experts": 2,
         "num_experts_per_tok": 1},
        {"recipe": "amp-fp16", "optimizer": "adafactor", "batch": 1, "seq": 256, "attention": "eager",
         "checkpointing": "full", "dropout": 0.1, "grad_accum": 2},
        # (seed 765427750 case 6, CI's per-run draw: -0.20% in total, its peak at the loss instead of the top
        # layer's recomputed sinks softmax, where the scores matmul's half q and k and the dropout mask are saved)
    ),
    "bloom-embedding-norm-freed-before-the-embedding-backward": (
        {"model_type": "bloom", "vocab_size": 10240, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 1280, "n_head": 16, "n_layer": 3, "hidden_dropout": 0.0,
         "attention_dropout": 0.0, "apply_residual_connection_post_layernorm": False},
        {"recipe": "fp32", "optimizer": "sgd-momentum", "batch": 4, "seq": 128, "attention": "sdpa",
         "checkpointing": "full", "dropout": 0.1, "grad_accum": 1},
        # (seed 2699630643 case 1, CI's per-run draw: +0.02% in total, its peak at the embedding's backward instead
        # of the bottom layer's MLP: the embedding moment held word_embeddings_layernorm's saved input, 2.5 MiB,
        # which that norm's backward, run before the embedding's, had freed)
    ),
}


@pytest.mark.parametrize("name", sorted(RANDOM_CATEGORY_MISSES))
def test_random_category_misses_are_within_tolerance_in_every_category(name):
    """Cases whose total was right at another moment than the trace's peak: every phase and category within
    validate's tolerance, and each phase's total within 1%."""
    config, settings = RANDOM_CATEGORY_MISSES[name]
    result = run_random_case(config, settings)
    assert result.row is not None and result.ok, result.describe()
    _assert_every_phase_within_one_percent(name, result)


def _assert_every_phase_within_one_percent(name, result, tolerance=0.01):
    from trainmem.validate import _total_error

    row = result.row
    for phase, estimate, trace in ((row.phase, row.estimate, row.trace), *row.other_phases):
        assert abs(_total_error(estimate, trace)) < tolerance, (name, phase, result.describe())


@pytest.mark.parametrize("name", sorted(RANDOM_MISSES))
def test_random_misses_are_within_one_percent(name):
    config, settings, *_ = RANDOM_MISSES[name]
    result = run_random_case(config, settings)
    assert result.row is not None, result.describe()
    _assert_every_phase_within_one_percent(name, result)


# Misses found on 2026-12-03, each fixed in the operation whose lifetime was wrong: every phase within 0.1%.
PHI3_CASE_113 = (
    {"model_type": "phi3", "vocab_size": 2304, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id":
     1, "eos_token_id": 2, "hidden_size": 288, "num_attention_heads": 8, "num_key_value_heads": 4,
     "num_hidden_layers": 1, "intermediate_size": 1152, "max_position_embeddings": 4096, "attention_dropout":
     0.1, "head_dim": 128, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "sliding_window": None,
     "partial_rotary_factor": 1.0},
    {"recipe": "amp-fp16", "optimizer": "sgd-momentum", "batch": 1, "seq": 128, "attention": "sdpa",
     "checkpointing": "full", "dropout": None, "grad_accum": 2},
)
"""Seed 7730419 case 113 of ``validate --random``: Phi-3, amp-fp16, full checkpointing."""
TIGHT_MISSES = {
    "falcon-recompute-stops-before-fc2": (
        {"model_type": "falcon", "vocab_size": 3207, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id":
         1, "eos_token_id": 2, "hidden_size": 400, "num_attention_heads": 4, "num_hidden_layers": 2, "bias": True,
         "attention_dropout": 0.0, "hidden_dropout": 0.0, "max_position_embeddings": 4096, "ffn_hidden_size": 1600,
         "multi_query": True, "parallel_attn": False, "new_decoder_architecture": False},
        {"recipe": "amp-fp16", "optimizer": "adamw", "batch": 4, "seq": 512, "attention": "eager", "checkpointing":
         "full", "dropout": None, "grad_accum": 1},
        # (seed 7730419 case 175: +2.99% at the backward peak; without hidden dropout the recompute stops at
        # fc2's matmul, whose output never exists)
    ),
    # (seed 7730419 case 113: +2.02% at the backward peak; the fused gate_up backward counted an fp32 weight
    # gradient beside the half one's inputs, and down_proj's copy, freed by then)
    "phi3-gate-up-weight-gradient-cast": PHI3_CASE_113,
    "phi3-down-projection-forward": (
        dict(PHI3_CASE_113[0], vocab_size=256, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
             num_hidden_layers=2, intermediate_size=8192, head_dim=64),
        dict(PHI3_CASE_113[1], seq=32, grad_accum=1),
        # (case 113 with an MLP 64x the width and 32 tokens: -2.14% at the forward peak; a checkpointed
        # layer's forward at its down projection holds the weight copy autocast makes there)
    ),
    "llama-gate-and-up-weight-gradient-cast": (
        {"_name_or_path": "meta-llama/Llama-3.2-1B", "model_type": "llama", "architectures": ["LlamaForCausalLM"],
         "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "hidden_size": 2048, "intermediate_size":
         8192, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
         "vocab_size": 512, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
         "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16"},
        {"recipe": "amp-bf16", "optimizer": "adamw", "batch": 1, "seq": 64, "attention": "sdpa", "checkpointing":
         "full", "dropout": 0.0, "grad_accum": 1},
        # (Llama-3.2-1B's layers with a 512-token vocabulary: -0.64% at the backward peak; the second input
        # projection's weight gradient cast, the first's gradient accumulated)
    ),
    "opt-post-norm-attention-reads-the-layer-input": (
        {"model_type": "opt", "vocab_size": 3000, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 1, "ffn_dim": 2048,
         "max_position_embeddings": 4096, "do_layer_norm_before": False, "enable_bias": False, "dropout": 0.0,
         "attention_dropout": 0.0, "word_embed_proj_dim": None, "activation_function": "relu"},
        {"recipe": "fp32", "optimizer": "sgd", "batch": 2, "seq": 512, "attention": "eager", "checkpointing": "full",
         "dropout": 0.1, "grad_accum": 2},
        # (seed 574929143 case 31, narrower: +2.15% at the forward peak there; with do_layer_norm_before false
        # attention reads the layer input, no norm output beside it: models.FamilyTraits.norm_after_residual)
    ),
    "opt-relu-output-read-by-its-backward": (
        {"model_type": "opt", "vocab_size": 3000, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 3, "ffn_dim": 1024,
         "max_position_embeddings": 4096, "do_layer_norm_before": True, "enable_bias": False, "dropout": 0.0,
         "attention_dropout": 0.0, "word_embed_proj_dim": None, "activation_function": "relu"},
        {"recipe": "fp32", "optimizer": "sgd", "batch": 2, "seq": 256, "attention": "eager", "checkpointing": "full",
         "dropout": 0.0, "grad_accum": 1},
        # (-5.16% at the backward peak: ReluBackward0 saves the ReLU's output, alive through threshold_backward
        # beside the gradients of both its sides; the MLP moment had freed it with fc2's backward)
    ),
    "opt-post-norm-saves-freed-by-the-block-they-follow": (
        {"model_type": "opt", "vocab_size": 3000, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 3, "ffn_dim": 1024,
         "max_position_embeddings": 4096, "do_layer_norm_before": False, "enable_bias": False, "dropout": 0.0,
         "attention_dropout": 0.0, "word_embed_proj_dim": None, "activation_function": "relu"},
        {"recipe": "fp32", "optimizer": "sgd", "batch": 2, "seq": 256, "attention": "eager", "checkpointing": "full",
         "dropout": 0.0, "grad_accum": 1},
        # (-3.91% at the backward peak: beside the ReLU's output, final_layer_norm's input freed before the MLP's
        # backward and self_attn_layer_norm's before attention's, as the blocks they follow)
    ),
}


@pytest.mark.parametrize("name", sorted(TIGHT_MISSES))
def test_tight_misses_are_within_a_tenth_of_a_percent(name):
    config, settings = TIGHT_MISSES[name]
    result = run_random_case(config, settings)
    assert result.row is not None, result.describe()
    _assert_every_phase_within_one_percent(name, result, tolerance=0.001)
