"""Activation memory against what PyTorch actually saves for backward (saved_tensors_hooks on a real
forward of the transformers model, scaled-down configs of each family, on the CPU)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from scaled import SCALED  # noqa: E402
from tiny_configs import TINY_CONFIGS  # noqa: E402
from trainmem.activations import estimate_activations, layer_activations  # noqa: E402
from trainmem.models import spec_from_config  # noqa: E402
from trainmem.probe import saved_bytes_by_place, saved_tensors  # noqa: E402
from trainmem.recipes import get_recipe  # noqa: E402
from trainmem.settings import make_settings  # noqa: E402

RECIPES = ["fp32", "amp-bf16", "pure-bf16", "mixed-bf16"]
SHAPES = [(2, 24), (1, 40)]


def _layer_estimate(cfg, recipe, batch, seq, attention, index=1):
    spec = spec_from_config(cfg)
    first = 0
    for layer, count in spec.layer_runs:
        if first + count > index:
            break
        first += count
    la = layer_activations(spec, layer, 1, get_recipe(recipe),
                           make_settings(recipe=recipe, batch=batch, seq=seq, attention=attention, dropout=0.0))
    return la.bytes_per_token * batch * seq + la.constant_bytes


@pytest.mark.parametrize("family", sorted(SCALED))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("batch, seq", SHAPES)
def test_per_layer_saved_bytes_match_pytorch(family, recipe, attention, batch, seq):
    cfg = SCALED[family]
    measured = saved_bytes_by_place(saved_tensors(cfg, recipe, batch, seq, attention, dropout=0.0))["layer 1"]
    estimated = _layer_estimate(cfg, recipe, batch, seq, attention)
    assert estimated == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("family", sorted(SCALED))
@pytest.mark.parametrize("recipe", ["fp32", "amp-bf16", "pure-bf16"])
def test_whole_model_saved_bytes_match_pytorch(family, recipe):
    cfg = SCALED[family]
    measured = sum(t.nbytes for t in saved_tensors(cfg, recipe, 2, 24, "sdpa", dropout=0.0))
    acts = estimate_activations(spec_from_config(cfg), get_recipe(recipe),
                                make_settings(recipe=recipe, batch=2, seq=24, dropout=0.0))
    assert acts.saved_bytes == pytest.approx(measured, rel=0.02)


# The other families, on the tiny configs that exercise their features (GQA, qk-norm, sandwich norms,
# parallel residuals, fused projections, LayerNorm, MoE routing).
OTHER = ["qwen3", "qwen3_moe", "gemma", "gemma3_text", "phi3", "gpt_neox", "opt", "falcon-sequential", "olmo2",
         "olmo2-bias-tied", "cohere", "cohere-qk-norm-untied", "phi", "phi-gqa-qk-norm-tied", "granite", "gpt_oss", "gpt_oss-nobias-tied",
         "starcoder2-nobias-untied-window", "stablelm-bias-parallel-tied"]
OTHER += ["smollm3-window-bias-untied", "internlm3-bias", "ernie4_5", "glm4", "olmo3", "cohere2"]
OTHER += ["gptj", "gptj-inner-tied-full-rotary", "gpt_bigcode", "gpt_bigcode-mha-inner-untied", "olmo",
          "olmo-clip-bias-tied"]


@pytest.mark.parametrize("name", OTHER)
@pytest.mark.parametrize("recipe", ["fp32", "amp-bf16", "pure-bf16"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_other_families_match_pytorch(name, recipe, attention):
    cfg = TINY_CONFIGS[name]
    measured = sum(t.nbytes for t in saved_tensors(cfg, recipe, 2, 24, attention, dropout=0.0))
    acts = estimate_activations(spec_from_config(cfg), get_recipe(recipe),
                                make_settings(recipe=recipe, batch=2, seq=24, attention=attention, dropout=0.0))
    assert acts.saved_bytes == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("name", ["gemma2", "bloom"])
def test_models_without_sdpa_are_estimated_as_eager(name):
    """transformers 5 has no SDPA path for Gemma 2 and BLOOM; asking for sdpa gets eager's memory."""
    cfg = TINY_CONFIGS[name]
    measured = sum(t.nbytes for t in saved_tensors(cfg, "pure-bf16", 2, 24, "eager", dropout=0.0))
    acts = estimate_activations(spec_from_config(cfg), get_recipe("pure-bf16"),
                                make_settings(recipe="pure-bf16", batch=2, seq=24, attention="sdpa", dropout=0.0))
    assert acts.saved_bytes == pytest.approx(measured, rel=0.02)


def test_eager_with_dropout_differs_from_cuda_only_by_the_mask_dtype():
    """CPU dropout keeps a mask in the input's dtype; CUDA's fused kernel keeps a bool mask (1 byte). The estimate
    models CUDA, which the CUDA-emulating probe reproduces exactly; a plain CPU run exceeds it by the mask bytes x
    (c - 1)."""
    cfg = SCALED["Llama-2-7B"]
    b, s, c = 2, 24, 2
    spec = spec_from_config(cfg)
    la = layer_activations(spec, spec.layer_runs[0][0], 1, get_recipe("pure-bf16"),
                           make_settings(recipe="pure-bf16", batch=b, seq=s, attention="eager", dropout=0.1))
    mask = next(t for t in la.terms if "dropout mask" in t.name).bytes_per_token * b * s
    cuda = saved_bytes_by_place(saved_tensors(cfg, "pure-bf16", b, s, "eager", dropout=0.1))["layer 1"]
    cpu = saved_bytes_by_place(saved_tensors(cfg, "pure-bf16", b, s, "eager", dropout=0.1, emulate="cpu"))["layer 1"]
    assert la.bytes_per_token * b * s == cuda
    assert cpu - cuda == mask * (c - 1)


@pytest.mark.parametrize("family", ["Llama-3-8B", "Mixtral-8x7B", "GPT-2"])
@pytest.mark.parametrize("recipe", ["fp32", "amp-bf16", "pure-bf16"])
def test_full_checkpointing_saves_what_pytorch_saves(family, recipe):
    """gradient_checkpointing_enable (non-reentrant): autograd keeps each layer's input and nothing else."""
    cfg = SCALED[family]
    measured = saved_bytes_by_place(saved_tensors(cfg, recipe, 2, 24, "sdpa", dropout=0.0, checkpointing=True))
    acts = estimate_activations(spec_from_config(cfg), get_recipe(recipe),
                                make_settings(recipe=recipe, batch=2, seq=24, dropout=0.0, checkpointing="full"))
    expanded = [la for la in acts.layers for _ in range(la.count)]
    for index, la in enumerate(expanded):
        assert measured[f"layer {index}"] == acts.layer_saved_bytes(la)


def test_full_checkpointing_keeps_only_layer_inputs():
    cfg = SCALED["Llama-3-8B"]
    spec = spec_from_config(cfg)
    none = estimate_activations(spec, get_recipe("pure-bf16"), make_settings(recipe="pure-bf16", seq=64))
    full = estimate_activations(spec, get_recipe("pure-bf16"),
                                make_settings(recipe="pure-bf16", seq=64, checkpointing="full"))
    h = spec.hidden_size
    assert full.layers_bytes == spec.num_layers * 2 * h * 64
    assert full.recompute_bytes == max(none.layer_saved_bytes(la) for la in none.layers)
    assert none.recompute_bytes == 0


def test_activations_grow_with_batch_and_sequence():
    spec = spec_from_config(SCALED["Llama-2-7B"])
    r = get_recipe("mixed-bf16")
    base = estimate_activations(spec, r, make_settings(batch=1, seq=128)).saved_bytes
    assert estimate_activations(spec, r, make_settings(batch=2, seq=128)).saved_bytes > base
    assert estimate_activations(spec, r, make_settings(batch=1, seq=256)).saved_bytes > base
