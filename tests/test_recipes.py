"""Bytes per parameter: the seed article's worked numbers, the ZeRO/Megatron figures, and optimizer states
checked against the state tensors real torch optimizers create."""


import pytest

from tiny_configs import TINY_CONFIGS
from trainmem import estimate
from trainmem.errors import ConfigError
from trainmem.models import nominal_spec, spec_from_config
from trainmem.stepmodel import estimate_model
from trainmem.optimizers import get_optimizer
from trainmem.recipes import RECIPES
from trainmem.settings import make_settings


@pytest.mark.parametrize(
    "params, recipe, expected_gb",
    [(7e9, "pure-bf16", 84), (13e9, "pure-bf16", 156), (70e9, "pure-bf16", 840), (7e9, "fp32", 112)],
)
def test_seed_article_worked_numbers(params, recipe, expected_gb):
    est = estimate_model(nominal_spec(int(params)), make_settings(recipe=recipe, optimizer="adamw"))
    assert est.static_bytes == expected_gb * 10**9


def test_seed_saving_of_mixed_precision_on_7b_is_28_gb():
    fp32 = estimate_model(nominal_spec(7 * 10**9), make_settings(recipe="fp32")).static_bytes
    pure = estimate_model(nominal_spec(7 * 10**9), make_settings(recipe="pure-bf16")).static_bytes
    assert fp32 - pure == 28 * 10**9


# ZeRO paper section 3.1 (2 + 2 + K with K = 12) and Megatron's theoretical_memory_usage.py (18).
@pytest.mark.parametrize(
    "recipe, per_param",
    [("fp32", 16), ("amp-bf16", 16), ("amp-fp16", 16), ("mixed-bf16", 16), ("mixed-fp16", 16),
     ("mixed-bf16-fp32grads", 18), ("pure-bf16", 12), ("pure-bf16-bf16states", 8)],
)
def test_adamw_bytes_per_parameter_per_recipe(recipe, per_param):
    est = estimate("llama-2-7b", recipe=recipe, optimizer="adamw")
    assert est.static_bytes == per_param * 6_738_415_616


def test_every_recipe_is_tested():
    assert len(RECIPES) == 8


def _torch_state_bytes(model, optimizer) -> int:
    """Bytes of every state tensor a real torch optimizer keeps after one step (the step counters aside)."""
    import torch

    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()
    optimizer.step()
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                total += value.numel() * value.element_size()
    return total


TORCH_OPTIMIZERS = {
    "adamw": lambda torch, ps: torch.optim.AdamW(ps, foreach=False),
    "adam": lambda torch, ps: torch.optim.Adam(ps),
    "sgd": lambda torch, ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda torch, ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adafactor": lambda torch, ps: torch.optim.Adafactor(ps),
}


@pytest.mark.parametrize("optimizer", sorted(TORCH_OPTIMIZERS))
@pytest.mark.parametrize("config", ["llama", "mixtral", "gpt2", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_optimizer_states_match_torch(optimizer, config, dtype):
    torch = pytest.importorskip("torch")
    from hf import hf_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(TINY_CONFIGS[config]))
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    expected = _torch_state_bytes(model, TORCH_OPTIMIZERS[optimizer](torch, list(model.parameters())))
    spec = spec_from_config(TINY_CONFIGS[config])
    ours = get_optimizer(optimizer).state_bytes(spec.param_groups, 4 if dtype == "fp32" else 2)
    assert ours == expected


def test_muon_states_match_torch_muon_plus_adamw():
    torch = pytest.importorskip("torch")
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    from hf import hf_config
    from transformers import AutoModelForCausalLM

    cfg = TINY_CONFIGS["llama"]
    model = AutoModelForCausalLM.from_config(hf_config(cfg))
    # The split the Muon docs recommend: 2-D weights of hidden layers to Muon, everything else to AdamW.
    hidden_2d = [p for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and ".layers." in n)]
    muon, adamw = torch.optim.Muon(hidden_2d), torch.optim.AdamW(rest)
    loss = sum((p ** 2).sum() for p in model.parameters())
    loss.backward()
    muon.step()
    adamw.step()
    expected = sum(
        v.numel() * v.element_size()
        for opt in (muon, adamw) for st in opt.state.values() for k, v in st.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )
    assert get_optimizer("muon").state_bytes(spec_from_config(cfg).param_groups, 4) == expected


def test_adamw_8bit_is_about_2_bytes_per_param_plus_block_scales():
    spec = nominal_spec(256 * 10**6)
    states = get_optimizer("adamw-8bit").state_bytes(spec.param_groups, 4)
    # 2 uint8 states + 2 fp32 absmax per 256 elements = 2 + 8/256 bytes per parameter, plus two 256-entry maps.
    assert states == 256 * 10**6 * 2 + 2 * (10**6) * 4 + 2 * 256 * 4


def test_small_tensors_keep_32bit_states_in_8bit_adam():
    spec = spec_from_config(TINY_CONFIGS["llama"])  # every tensor of the tiny model is under 4096 elements?
    opt = get_optimizer("adamw-8bit")
    small = [t for g in spec.param_groups for t in g.tensors if t.numel < 4096]
    assert small, "the tiny model has small tensors"
    for t in small:
        assert opt.state_fn(t, 2) == 8 * t.numel


def test_unknown_recipe_and_optimizer_list_what_is_accepted():
    with pytest.raises(ConfigError, match="accepted: fp32, amp-bf16"):
        make_settings(recipe="bf16-mixed-ish")
    with pytest.raises(ConfigError, match="accepted: adamw, adam, sgd"):
        make_settings(optimizer="adagrad")
