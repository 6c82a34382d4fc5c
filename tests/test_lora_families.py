"""LoRA activations in every family: no supported model type answers with static memory only any more (fast), and
peft's real step traced against the estimate on a scaled-down config of each family (slow: one set-up per family,
a few more on GPT-NeoX), every phase within 3%."""

import pytest

from tiny_configs import TINY_CONFIGS

from trainmem.stepmodel import estimate_model
from trainmem.lora import FineTune, LoraOptions
from trainmem.models import spec_from_config
from trainmem.settings import make_settings

_MOE_ATTENTION_ONLY = {"mixtral", "qwen3_moe", "deepseek_v3"}
"""Types whose experts peft adapts as parameters under all-linear (lora._PEFT_MOE_CONVERSION), which it refuses
with lora dropout: these get q,v adapters with dropout."""


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
@pytest.mark.parametrize("attention, checkpointing", [("sdpa", "none"), ("eager", "full")])
def test_every_family_answers_a_lora_step_with_its_activations(name, attention, checkpointing):
    """The config's own dropout (GPT-2's 0.1, transformers' defaults elsewhere), lora dropout, eager and SDPA,
    with and without checkpointing: a peak, and no 'not modelled yet' note."""
    config = TINY_CONFIGS[name]
    spec = spec_from_config(config)
    targets = ("q", "v") if config["model_type"] in _MOE_ATTENTION_ONLY else ("all-linear",)
    settings = make_settings(recipe="mixed-bf16", batch=2, seq=64, dropout=None, attention=attention,
                             checkpointing=checkpointing)
    est = estimate_model(spec, settings, finetune=FineTune(LoraOptions(8, targets=targets, dropout=0.05)))
    assert est.peak is not None, est.notes
    assert not any("not modelled yet" in note for note in est.notes)
    assert est.activations is not None and est.activations.layers_bytes > 0


def test_a_frozen_moe_keeps_neither_the_experts_inputs_nor_their_product():
    """Attention-only LoRA on Mixtral: grouped_mm with a frozen expert weight keeps no input for its weight's
    gradient, so the routed experts keep their gate_up output and activation only, not the gathered tokens nor
    the product (the down projection's input), which a full fine-tune keeps."""
    from trainmem.activations import Precision, estimate_activations
    from trainmem.lora import lora_activations
    from trainmem.recipes import get_recipe

    spec = spec_from_config(TINY_CONFIGS["mixtral"])
    recipe, settings = get_recipe("pure-bf16"), make_settings(recipe="pure-bf16", batch=2, seq=64, dropout=0.0)
    full = estimate_activations(spec, recipe, settings)
    lora = lora_activations(full, spec, Precision.of(recipe), FineTune(LoraOptions(8, targets=("q", "v"))))
    moe = spec.layer_runs[0][0].moe
    h, i, k = spec.hidden_size, moe.expert_intermediate_size, moe.top_k
    experts = ("expert_input", "expert_down_input")
    assert sum(t.bytes_per_token * t.input_share for t in full.layers[-1].terms if t.input_of in experts) == \
        2 * k * (h + i)  # bf16
    assert not [t for t in lora.layers[-1].terms if t.input_of == "expert_input"]
    # the gate_up output and the activation stay (the activation's and the product's backward need them)
    assert sum(t.bytes_per_token for t in lora.layers[-1].terms if t.module == "routed_experts") == \
        2 * k * (2 * i + i + h)  # bf16 gate_up output (2I), activation (I), weighted outputs (h)


def _traced_within(label: str, tolerance: float = 0.03, **set_up):
    pytest.importorskip("peft")
    from trainmem.validate import compare, matrix_config, scale_down

    targets = set_up.pop("targets", ("q", "v"))
    lora_dropout = set_up.pop("lora_dropout", 0.0)
    settings = make_settings(batch=2, seq=64, optimizer="adamw", optimizer_impl="foreach", **set_up)
    row = compare(scale_down(matrix_config(label)), settings, label,
                  FineTune(LoraOptions(16, targets=targets, dropout=lora_dropout)))
    for phase, est, traced in ((row.phase, row.estimate, row.trace), *row.other_phases):
        error = (sum(est.values()) - sum(traced.values())) / sum(traced.values())
        assert abs(error) <= tolerance, (phase, error, est, traced)


FAMILY_SET_UPS = {
    # label -> one set-up each (recipe, attention, checkpointing, dropout: the config's own where None)
    "gpt_neox": dict(recipe="pure-bf16-bf16states", targets=("all-linear",), dropout=0.0),
    "falcon": dict(recipe="amp-bf16", dropout=None),
    "falcon-new": dict(recipe="pure-bf16-bf16states", targets=("all-linear",), attention="eager", dropout=0.0),
    "bloom": dict(recipe="fp32", checkpointing="full", dropout=None),
    "gemma2": dict(recipe="pure-bf16-bf16states", targets=("all-linear",), dropout=0.0),
    "gemma3_text": dict(recipe="mixed-bf16", dropout=0.0),
    "mixtral": dict(recipe="pure-bf16-bf16states", dropout=0.0),
    "qwen2_moe": dict(recipe="pure-bf16-bf16states", targets=("all-linear",), dropout=0.0),
    "qwen3_moe": dict(recipe="pure-bf16-bf16states", checkpointing="full", dropout=0.0),
    "deepseek_v3": dict(recipe="pure-bf16-bf16states", targets=("all-linear",), dropout=0.0),
    "gpt2": dict(recipe="pure-bf16-bf16states", targets=("all-linear",), attention="eager", dropout=None),
}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(FAMILY_SET_UPS))
def test_lora_step_of_each_family_is_within_3_percent_of_the_trace(label):
    _traced_within(label, **dict(FAMILY_SET_UPS[label]))


@pytest.mark.slow
@pytest.mark.parametrize("set_up", [
    dict(recipe="pure-bf16-bf16states", attention="eager", dropout=None, targets=("q", "k", "v", "o"),
         lora_dropout=0.05),
    dict(recipe="mixed-bf16", targets=("all-linear",), dropout=0.0),
], ids=["eager-dropouts", "mixed-all-linear"])
def test_gpt_neox_lora_set_ups_are_within_3_percent_of_the_trace(set_up):
    _traced_within("gpt_neox", **dict(set_up))
