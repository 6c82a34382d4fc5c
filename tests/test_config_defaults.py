"""Each value the estimator assumes for a key missing from config.json equals what transformers fills in.

For every supported model type and every key of :data:`trainmem.config_defaults.CONFIG_DEFAULTS`, the type's
tiny config is built by transformers' own config class *without* that key, and the value transformers fills in
(on the config, or where the config leaves it to the model, on the built model) is compared with the table's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from trainmem.config_defaults import CONFIG_DEFAULTS, Derived, default_for  # noqa: E402
from trainmem.errors import ModelError  # noqa: E402
from trainmem.models import SUPPORTED_MODEL_TYPES, spec_from_config  # noqa: E402

from tiny_configs import TINY_CONFIGS  # noqa: E402


def _built_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _head_dim_of_built_model(config) -> int:
    return _built_model(config).model.layers[0].self_attn.head_dim


def _gpt2_inner_width(config) -> int:
    return _built_model(config).transformer.h[0].mlp.c_fc.weight.shape[1]  # Conv1D keeps (in, out)


# Where transformers keeps a value somewhere other than ``getattr(config, key)``.
_READ = {
    "partial_rotary_factor": lambda config: config.rope_parameters["partial_rotary_factor"],
    "sliding_window_pattern": lambda config: config._sliding_window_pattern,
}
# Values the config class leaves as None for the modeling file to resolve.
_RESOLVED_BY_MODEL = {
    ("gpt2", "n_inner"): _gpt2_inner_width,
    ("gptj", "n_inner"): lambda config: _built_model(config).transformer.h[0].mlp.fc_in.weight.shape[0],
    ("gpt_bigcode", "n_inner"): lambda config: _built_model(config).transformer.h[0].mlp.c_fc.weight.shape[0],
    **{(t, "head_dim"): _head_dim_of_built_model for t in ("mixtral", "qwen2", "qwen2_moe", "qwen3_moe", "phi3", "olmo2", "cohere", "phi", "granite",
                                                            "starcoder2")},
}
_RESOLVED_BY_MODEL.update({
    ("smollm3", "head_dim"): _head_dim_of_built_model, ("olmo3", "head_dim"): _head_dim_of_built_model,
    ("olmo", "head_dim"): _head_dim_of_built_model,
    # (Cohere2Config pops sliding_window_pattern from its kwargs into layer_types: the first full layer's place)
    ("cohere2", "sliding_window_pattern"): lambda config: config.layer_types.index("full_attention") + 1,
})
# Keys a config class rewrites unless another one is set (Qwen drops sliding_window without use_sliding_window).
_CONTEXT = {"sliding_window": {"qwen2": {"use_sliding_window": True}, "qwen2_moe": {"use_sliding_window": True},
                               "qwen3": {"use_sliding_window": True}, "qwen3_moe": {"use_sliding_window": True}}}

CASES = [(t, key) for t in CONFIG_DEFAULTS for key in CONFIG_DEFAULTS[t]]


def test_the_table_covers_every_supported_type():
    assert set(CONFIG_DEFAULTS) == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize(("model_type", "key"), CASES, ids=[f"{t}-{k}" for t, k in CASES])
def test_default_matches_transformers(model_type, key):
    raw = {k: v for k, v in TINY_CONFIGS[model_type].items() if k not in (key, "rotary_pct")}
    raw.update(_CONTEXT.get(key, {}).get(model_type, {}))
    ours = default_for(model_type, key, lambda *keys: next(raw[k] for k in keys if k in raw))
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    config = AutoConfig.for_model(model_type, **fields)
    if (model_type, key) in _RESOLVED_BY_MODEL:
        theirs = _RESOLVED_BY_MODEL[model_type, key](config)
    else:
        theirs = _READ.get(key, lambda c: getattr(c, key))(config)
    assert ours == theirs, f"{model_type}.{key}: trainmem assumes {ours!r}, transformers {theirs!r}"


@pytest.mark.parametrize("model_type", ["mistral", "qwen3", "gemma", "deepseek_v3"])
def test_a_config_without_the_key_is_read_with_the_default(model_type):
    """The parsers really use the table: the spec of a config missing a key has transformers' value."""
    raw = dict(TINY_CONFIGS[model_type])
    key = {"mistral": "num_key_value_heads", "qwen3": "head_dim", "gemma": "head_dim",
           "deepseek_v3": "first_k_dense_replace"}[model_type]
    raw.pop(key)
    if model_type == "mistral":
        raw["num_attention_heads"] = 8  # the default of 8 key/value heads must divide it
    spec = spec_from_config(raw)
    layer = spec.layer_runs[0][0]
    got = {"num_key_value_heads": layer.attention.num_kv_heads, "head_dim": layer.attention.head_dim,
           "first_k_dense_replace": sum(n for lyr, n in spec.layer_runs if lyr.mlp is not None)}[key]
    expected = CONFIG_DEFAULTS[model_type][key]
    if key == "first_k_dense_replace":
        expected = min(expected, spec.num_layers)
    assert got == expected and not isinstance(expected, Derived)


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_MODEL_TYPES))
@pytest.mark.parametrize("key", ["num_hidden_layers", "vocab_size"])
def test_zero_sizes_are_rejected_for_every_type(model_type, key):
    raw = dict(TINY_CONFIGS[model_type])
    alias = {"num_hidden_layers": ("n_layer", "num_hidden_layers")}.get(key, (key,))
    for name in alias:
        if name in raw or name == key:
            raw[name] = 0
    with pytest.raises(ModelError, match="positive"):
        spec_from_config(raw)


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "falcon", "opt", "bloom", "llama"])
def test_a_hidden_size_the_heads_do_not_divide_is_rejected(model_type):
    raw = dict(TINY_CONFIGS[model_type])
    for key in ("n_embd", "hidden_size"):
        if key in raw:
            raw[key] = 66
    with pytest.raises(ModelError, match="multiple"):
        spec_from_config(raw)
