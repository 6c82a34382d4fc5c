"""What transformers fills in for a key that ``config.json`` leaves out, per model type, as data.

The parsers in :mod:`trainmem.models` read every optional key through this table and nowhere else, so the
table is the whole list of assumptions the estimator makes about a config. ``tests/test_config_defaults.py``
builds each type's transformers config class without the key and checks that it fills in the same value.
Values are the dataclass defaults of transformers 5's ``models/<type>/configuration_<type>.py`` (or, where
a config class leaves ``None`` for the model to resolve, what ``modeling_<type>.py`` does with it).

Architecture sizes (hidden size, heads, layers, vocabulary, MLP width, expert counts, MLA ranks) are not here:
a config.json without them is rejected instead of being read as some reference model's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Derived:
    """A default computed from other fields, as a config class's ``__post_init__`` (or the model) does."""

    rule: str
    compute: Callable[[Callable[..., Any]], Any]  # receives req(*keys) -> value of the first key present


HEADS = Derived("num_attention_heads", lambda req: req("num_attention_heads", "n_head"))
HEAD_DIM = Derived(
    "hidden_size // num_attention_heads",
    lambda req: req("hidden_size", "n_embd", "n_embed") // req("num_attention_heads", "n_head"),
)
FOUR_HIDDEN = Derived("4 * hidden_size", lambda req: 4 * req("hidden_size", "n_embd", "n_embed"))
HIDDEN = Derived("hidden_size", lambda req: req("hidden_size"))

_LLAMA_FAMILY: dict[str, Any] = {
    "num_key_value_heads": HEADS,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}
_QWEN_WINDOWS: dict[str, Any] = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
_QWEN_MOE: dict[str, Any] = {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}

CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_FAMILY, "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 2048},
    "mistral": {**_LLAMA_FAMILY, "num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096},
    "mixtral": {**_LLAMA_FAMILY, "num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": None},
    "qwen2": {**_LLAMA_FAMILY, "num_key_value_heads": 32, "max_position_embeddings": 32768, **_QWEN_WINDOWS},
    "qwen2_moe": {
        **_LLAMA_FAMILY, "num_key_value_heads": 16, "max_position_embeddings": 32768, **_QWEN_WINDOWS, **_QWEN_MOE,
        "shared_expert_intermediate_size": 5632, "qkv_bias": True,
    },
    "qwen3": {**_LLAMA_FAMILY, "num_key_value_heads": 32, "head_dim": 128, "attention_bias": False,
              "max_position_embeddings": 32768, **_QWEN_WINDOWS},
    "qwen3_moe": {**_LLAMA_FAMILY, "num_key_value_heads": 4, "attention_bias": False, "max_position_embeddings": 32768,
                  "use_sliding_window": False, "sliding_window": 4096, **_QWEN_MOE},
    "gemma": {**_LLAMA_FAMILY, "num_key_value_heads": 16, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
              "attention_bias": False, "tie_word_embeddings": True, "max_position_embeddings": 8192},
    "gemma2": {
        **{k: v for k, v in _LLAMA_FAMILY.items() if k != "hidden_act"}, "hidden_activation": "gelu_pytorch_tanh",
        "num_key_value_heads": 4, "head_dim": 256, "attention_bias": False, "tie_word_embeddings": True,
        "max_position_embeddings": 8192, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {
        **{k: v for k, v in _LLAMA_FAMILY.items() if k != "hidden_act"}, "hidden_activation": "gelu_pytorch_tanh",
        "num_key_value_heads": 4, "head_dim": 256, "attention_bias": False, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "sliding_window": 4096, "sliding_window_pattern": 6,
        "use_bidirectional_attention": False, "attn_logit_softcapping": None, "final_logit_softcapping": None,
    },
    "phi3": {**_LLAMA_FAMILY, "max_position_embeddings": 4096, "sliding_window": None, "resid_pdrop": 0.0,
             "embd_pdrop": 0.0, "partial_rotary_factor": 1.0},
    "granite": {**_LLAMA_FAMILY, "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 2048},
    "olmo2": {**_LLAMA_FAMILY, "attention_bias": False, "max_position_embeddings": 2048},
    "cohere": {**_LLAMA_FAMILY, "attention_bias": False, "tie_word_embeddings": True, "max_position_embeddings": 8192,
               "use_qk_norm": False, "logit_scale": 0.0625},
    "smollm3": {**_LLAMA_FAMILY, "num_key_value_heads": 4, "attention_bias": False, "mlp_bias": False,
                "tie_word_embeddings": True, "max_position_embeddings": 32768, "use_sliding_window": False,
                "sliding_window": None, "no_rope_layer_interval": 4},
    "internlm3": {**_LLAMA_FAMILY, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": False,
                  "mlp_bias": False, "max_position_embeddings": 32768},
    "ernie4_5": {**{k: v for k, v in _LLAMA_FAMILY.items() if k != "attention_dropout"}, "num_key_value_heads": 2,
                 "head_dim": 128, "use_bias": False, "tie_word_embeddings": True, "max_position_embeddings": 131072},
    "glm4": {**_LLAMA_FAMILY, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": True,
             "max_position_embeddings": 131072, "partial_rotary_factor": 0.5},
    "olmo3": {**_LLAMA_FAMILY, "attention_bias": False, "max_position_embeddings": 2048, "sliding_window": 4096},
    "cohere2": {**_LLAMA_FAMILY, "attention_bias": False, "tie_word_embeddings": True, "max_position_embeddings": 8192,
                "logit_scale": 0.0625, "sliding_window": 4096, "sliding_window_pattern": 4},
    "deepseek_v3": {
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "attention_dropout": 0.0,
        "max_position_embeddings": 4096, "q_lora_rank": 1536, "norm_topk_prob": True, "n_group": 8, "topk_group": 4,
        "n_shared_experts": 1, "first_k_dense_replace": 3,
    },
    "gpt2": {"n_inner": FOUR_HIDDEN, "activation_function": "gelu_new", "tie_word_embeddings": True,
             "n_positions": 1024, "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1},
    "gpt_neox": {"hidden_act": "gelu", "attention_bias": True, "tie_word_embeddings": False,
                 "max_position_embeddings": 2048, "attention_dropout": 0.0, "hidden_dropout": 0.0,
                 "use_parallel_residual": True, "partial_rotary_factor": 0.25},
    "falcon": {"num_kv_heads": HEADS, "multi_query": True, "new_decoder_architecture": False, "parallel_attn": True,
               "bias": False, "alibi": False, "num_ln_in_parallel_attn": None, "ffn_hidden_size": FOUR_HIDDEN,
               "activation": "gelu", "tie_word_embeddings": True, "max_position_embeddings": 2048,
               "attention_dropout": 0.0, "hidden_dropout": 0.0},
    "opt": {"activation_function": "relu", "tie_word_embeddings": True, "attention_dropout": 0.0, "dropout": 0.1,
            "max_position_embeddings": 2048, "enable_bias": True, "layer_norm_elementwise_affine": True,
            "word_embed_proj_dim": HIDDEN, "do_layer_norm_before": True, "_remove_final_layer_norm": False},
    "bloom": {"tie_word_embeddings": True, "attention_dropout": 0.0, "hidden_dropout": 0.0},
    # configuration_gpt_oss.py (GptOssConfig; its head_dim is 64 whatever hidden_size says; hidden_act is read by no
    # module, the experts' SwiGLU is their own)
    "gpt_oss": {**_LLAMA_FAMILY, "num_key_value_heads": 8, "head_dim": 64, "attention_bias": True,
                "max_position_embeddings": 131072, "sliding_window": 128},
    # configuration_phi.py (PhiConfig; rope_parameters' partial_rotary_factor defaults to 0.5 there)
    "phi": {"num_key_value_heads": HEADS, "head_dim": HEAD_DIM, "hidden_act": "gelu_new", "tie_word_embeddings": False,
            "max_position_embeddings": 2048, "attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "partial_rotary_factor": 0.5, "qk_layernorm": False},
    # configuration_gptj.py (GPTJConfig; n_inner None is 4 * n_embd in GPTJBlock, rotary_dim None rotates whole heads)
    "gptj": {"n_inner": FOUR_HIDDEN, "activation_function": "gelu_new", "tie_word_embeddings": False,
             "n_positions": 2048, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "rotary_dim": 64},
    # configuration_gpt_bigcode.py (GPTBigCodeConfig; n_inner None is 4 * n_embd in GPTBigCodeBlock)
    "gpt_bigcode": {"n_inner": FOUR_HIDDEN, "activation_function": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                    "n_positions": 1024, "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1,
                    "multi_query": True},
    # configuration_olmo.py (OlmoConfig; the head width is hidden_size // heads in OlmoAttention)
    "olmo": {"num_key_value_heads": HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu", "tie_word_embeddings": False,
             "max_position_embeddings": 2048, "attention_dropout": 0.0, "attention_bias": False, "clip_qkv": None},
    # configuration_starcoder2.py (Starcoder2Config; the head width is hidden_size // heads in Starcoder2Attention)
    "starcoder2": {"num_key_value_heads": 2, "head_dim": HEAD_DIM, "hidden_act": "gelu_pytorch_tanh",
                   "tie_word_embeddings": True, "max_position_embeddings": 4096, "sliding_window": None,
                   "attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0, "use_bias": True},
    # configuration_stablelm.py (StableLmConfig; __post_init__ sets partial_rotary_factor 0.25)
    "stablelm": {"num_key_value_heads": 32, "hidden_act": "silu", "tie_word_embeddings": False,
                 "max_position_embeddings": 4096, "use_qkv_bias": False, "qk_layernorm": False,
                 "use_parallel_residual": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                 "partial_rotary_factor": 0.25},
}
"""model_type -> {config key: the value transformers assumes when the key is missing (or a :class:`Derived`)}."""


def default_for(model_type: str, key: str, req: Callable[..., Any]) -> Any:
    """The value transformers fills in for ``key`` of a ``model_type`` config; ``req`` reads required fields."""
    value = CONFIG_DEFAULTS[model_type][key]  # a KeyError here is a parser reading a key the table lacks
    if isinstance(value, Derived):
        return value.compute(req)
    return list(value) if isinstance(value, list) else value
