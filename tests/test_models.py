"""Parameter counts: the analytic spec against transformers itself and against published figures."""

import json

import pytest

from conftest import CONFIGS
from tiny_configs import TINY_CONFIGS
from trainmem.catalog import catalog_config, catalog_names, catalog_spec, resolve_model
from trainmem.errors import ModelError
from trainmem.models import SUPPORTED_MODEL_TYPES, spec_from_config


def test_tiny_configs_cover_every_supported_model_type():
    assert {c["model_type"] for c in TINY_CONFIGS.values()} == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_config_count_equals_transformers(name):
    from hf import hf_num_parameters

    cfg = TINY_CONFIGS[name]
    assert spec_from_config(cfg).num_parameters == hf_num_parameters(cfg)


@pytest.mark.parametrize("name", catalog_names())
def test_catalog_count_equals_transformers_on_meta_device(name):
    from hf import hf_num_parameters

    assert catalog_spec(name).num_parameters == hf_num_parameters(catalog_config(name))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_parameter_tensors_match_transformers_shapes(name):
    """Same multiset of shapes as model.parameters(): what Adafactor/Muon/8-bit states depend on."""
    from collections import Counter

    from hf import meta_model

    ours = Counter()
    for group in spec_from_config(TINY_CONFIGS[name]).param_groups:
        for t in group.tensors:
            ours[tuple(sorted(t.shape))] += group.repeat
    theirs = Counter(tuple(sorted(p.shape)) for p in meta_model(TINY_CONFIGS[name]).parameters())
    assert ours == theirs


# ../shared/reference/README.md: sum(p.numel()) of the Hugging Face models.
PUBLISHED = {
    "Llama-2-7b.json": (6_738_415_616, 6_738_415_616),
    "Meta-Llama-3-8B.json": (8_030_261_248, 8_030_261_248),
    "Mistral-7B-v0.1.json": (7_241_732_096, 7_241_732_096),
    "Mixtral-8x7B-v0.1.json": (46_702_792_704, 12_879_925_248),
    "Qwen2.5-0.5B.json": (494_032_768, 494_032_768),
    "gpt2.json": (124_439_808, 124_439_808),
}


@pytest.mark.parametrize("filename", sorted(PUBLISHED))
def test_published_counts(filename):
    total, active = PUBLISHED[filename]
    spec = resolve_model(str(CONFIGS / filename))
    assert spec.num_parameters == total
    assert spec.num_active_parameters == active


# Model cards and papers (rounded figures as published, so compared at their precision).
PUBLISHED_ROUNDED = {
    "llama-2-13b": (13.0e9, None), "llama-2-70b": (69.0e9, None), "llama-3.1-405b": (405.9e9, None),
    "llama-3.2-1b": (1.24e9, None), "llama-3.2-3b": (3.21e9, None), "qwen2.5-7b": (7.62e9, None),
    "qwen2.5-72b": (72.7e9, None), "qwen3-8b": (8.19e9, None), "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "mixtral-8x22b": (140.6e9, 39.2e9), "qwen1.5-moe-a2.7b": (14.3e9, 2.7e9), "gemma-2-9b": (9.24e9, None),
    "gemma-2-27b": (27.2e9, None), "phi-3-mini-4k": (3.82e9, None), "gpt2-xl": (1.56e9, None),
    "falcon-7b": (6.92e9, None), "opt-1.3b": (1.32e9, None), "bloom-560m": (0.559e9, None),
    "pythia-6.9b": (6.86e9, None), "deepseek-v3": (671e9, 37e9),
    "olmo-2-1124-7b": (7.30e9, None), "c4ai-command-r-v01": (35.0e9, None), "c4ai-command-r-plus": (104e9, None),
    # (the Hub model pages' safetensors counts: Phi-2 2.78B, Phi-1.5 1.42B)
    "phi-2": (2.78e9, None), "phi-1_5": (1.42e9, None),
    # (the StarCoder2 paper and model cards: 3.03B and 7.17B)
    "starcoder2-3b": (3.03e9, None), "starcoder2-7b": (7.17e9, None),
    # (the model cards: StableLM-3B-4E1T 2,795,443,200, StableLM 2 1.6B 1,644,515,328)
    "stablelm-3b-4e1t": (2.795e9, None), "stablelm-2-1_6b": (1.645e9, None),
    # (the GPT-J-6B model card: 6,053,381,344, mesh-transformer-jax's count)
    "gpt-j-6b": (6.053e9, None),
    # (the StarCoder paper, Li et al. 2023: 15.5B; SantaCoder, Allal et al. 2023: 1.1B)
    "starcoder": (15.5e9, None), "gpt_bigcode-santacoder": (1.12e9, None),
    # (the OLMo paper, Groeneveld et al. 2024, and the model cards: OLMo-1B 1.18B, OLMo-7B 6.89B)
    "olmo-1b-hf": (1.18e9, None), "olmo-7b-hf": (6.89e9, None),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_ROUNDED))
def test_published_rounded_counts(name):
    total, active = PUBLISHED_ROUNDED[name]
    spec = catalog_spec(name)
    assert spec.num_parameters == pytest.approx(total, rel=0.006)
    if active:
        assert spec.num_active_parameters == pytest.approx(active, rel=0.03)


def test_catalog_has_at_least_25_models_and_required_families():
    names = catalog_names()
    assert len(names) >= 25
    assert {catalog_spec(n).model_type for n in names} == set(SUPPORTED_MODEL_TYPES)


def test_hub_id_alias_and_folder_and_file(tmp_path):
    assert resolve_model("meta-llama/Llama-2-7b-hf").num_parameters == 6_738_415_616
    assert resolve_model("LLAMA-2-7B").name == "llama-2-7b"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text((CONFIGS / "gpt2.json").read_text())
    assert resolve_model(str(folder)).num_parameters == 124_439_808
    assert resolve_model(str(folder / "config.json")).num_parameters == 124_439_808


def test_largest_layer_is_the_embedding_for_big_vocabularies():
    spec = catalog_spec("llama-3-8b")
    assert spec.largest_layer_parameters == 128256 * 4096


def test_deepseek_has_dense_first_layers_and_no_mtp():
    spec = catalog_spec("deepseek-v3")
    kinds = [(layer.moe is not None, count) for layer, count in spec.layer_runs]
    assert kinds == [(False, 3), (True, 58)]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "llama", "hidden_size": 64}, "config has no 'num_attention_heads'"),
        ({"hidden_size": 64}, "config has no 'model_type'"),
        ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3,
          "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 8}, "must divide"),
        ({"model_type": "llama", "hidden_size": -64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "vocab_size": 10, "intermediate_size": 8}, "'hidden_size' is -64"),
        ({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "vocab_size": 10, "intermediate_size": 8, "num_local_experts": 2, "num_experts_per_tok": 4}, "exceeds"),
    ],
)
def test_bad_configs_name_the_problem(config, message):
    with pytest.raises(ModelError, match=message):
        spec_from_config(config, source="x.json")


def test_unknown_model_type_is_counted_by_transformers(tmp_path):
    pytest.importorskip("transformers")
    from hf import hf_num_parameters

    cfg = {"model_type": "arcee", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 96, "vocab_size": 100, "pad_token_id": 1, "eos_token_id": 2, "bos_token_id": 3}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = resolve_model(str(path))
    assert not spec.has_architecture
    assert spec.num_parameters == hf_num_parameters(cfg)


def test_unknown_model_name_suggests_catalog_names():
    with pytest.raises(ModelError, match="closest: llama-2-7b"):
        resolve_model("llama-2-7")


def test_formulas_read_family_traits_not_model_type():
    """Family behaviour is in FamilyTraits, filled by the parser: no formula module compares model_type."""
    import re
    from pathlib import Path

    import trainmem
    from trainmem.models import FAMILY_TRAITS, SUPPORTED_MODEL_TYPES

    src = Path(trainmem.__file__).parent
    for module in ("activations", "timeline", "stepmodel", "estimate", "kernels", "optimizers", "recipes", "planner"):
        text = (src / f"{module}.py").read_text()
        found = re.findall(r"model_type\s*(?:==|!=|\bin\b|\.startswith)", text)
        assert not found, f"{module}.py tests model_type: {found}"
    assert set(FAMILY_TRAITS) <= set(SUPPORTED_MODEL_TYPES)


@pytest.mark.slow
@pytest.mark.parametrize("name, alias, canonical", [
    ("gpt2", "num_hidden_layers", "n_layer"), ("gpt2", "hidden_size", "n_embd"),
    ("bloom", "num_hidden_layers", "n_layer"), ("mixtral", "num_experts", "num_local_experts"),
    ("deepseek_v3", "num_local_experts", "n_routed_experts"),
])
def test_a_config_with_an_alias_and_its_field_counts_as_transformers_builds_it(name, alias, canonical):
    """transformers' attribute_map aliases write the field after it, so where a config has both (and they differ)
    the alias wins; trainmem reads them the same way."""
    from tiny_configs import TINY_CONFIGS

    config = dict(TINY_CONFIGS[name])
    base = config.get(canonical, config.get(alias))
    if base is None:
        base = {"num_hidden_layers": 2, "n_layer": 2, "num_experts": 4, "num_local_experts": 4}.get(alias, 4)
    config[canonical], config[alias] = base, base * 2  # (head counts are left out: they change no count here)
    from hf import hf_num_parameters

    assert spec_from_config(config).num_parameters == hf_num_parameters(config)
