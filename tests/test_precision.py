"""precision-check's fractions against a direct computation with torch's own fp16/bf16 conversions on the same
gradients and updates, the CLI on scaled-down Llama and GPT-2, and the amp demo's claims (docs/mixed-precision.md)."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from scaled import SCALED  # noqa: E402
from trainmem.precision import layer_type, precision_check, text_batches  # noqa: E402
from trainmem.probe import build_model  # noqa: E402
from trainmem.recipes import get_recipe  # noqa: E402


@pytest.mark.parametrize("family", ["Llama-2-7B", "GPT-2"])
def test_fractions_match_torch_conversions(family):
    torch.manual_seed(0)
    model = build_model(SCALED[family], get_recipe("fp32"), "sdpa", 0.0)
    captured = {}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: captured.__setitem__(name, g.detach().clone()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = text_batches(torch, None, SCALED[family]["vocab_size"], 2, 32, 1)
    report = precision_check(model, batches, steps=1, lr=1e-4)
    grads = torch.cat([g.flatten() for g in captured.values()])
    n = grads.numel()
    stats = report.gradient_stats(torch)
    # fp16 flushes a value to zero exactly when torch's conversion gives 0.
    flushed = ((grads != 0) & (grads.half() == 0)).sum().item() / n
    assert stats["underflow_to_zero"] == pytest.approx(flushed, abs=1e-6)
    subnormal = ((grads.half() != 0) & (grads.half().float().abs() < 2**-14)).sum().item() / n
    assert stats["subnormal"] == pytest.approx(subnormal, abs=1e-6)
    scaled = report.gradient_stats(torch, 1024.0)
    assert scaled["underflow_to_zero"] == pytest.approx(
        ((grads != 0) & ((grads * 1024).half() == 0)).sum().item() / n, abs=1e-6)
    # bf16: an update is lost when adding it to the bf16 weight in bf16 leaves the weight unchanged.
    lost = total = 0
    for name, p in model.named_parameters():
        w = before[name].bfloat16()
        delta = (p.detach() - before[name])
        moved = (w.float() + delta).bfloat16() != w
        lost += (~moved).sum().item()
        total += w.numel()
    assert report.bf16_lost_updates(torch) == pytest.approx(lost / total, abs=0.01)


def test_loss_scale_range_is_consistent_with_the_gradients():
    torch.manual_seed(0)
    model = build_model(SCALED["Llama-2-7B"], get_recipe("fp32"), "sdpa", 0.0)
    report = precision_check(model, text_batches(torch, None, 256, 2, 32, 1), steps=1)
    low, high = report.scale_range(torch)
    assert report.gradient_stats(torch, high)["overflow"] == 0
    assert report.gradient_stats(torch, high * 4)["max"] > 65504 / 2
    g = report.gradient_stats(torch, low)
    assert g["underflow_to_zero"] <= 0.001 + 1e-9


def test_layer_types():
    assert layer_type("model.layers.0.self_attn.q_proj.weight") == "attention"
    assert layer_type("transformer.h.0.mlp.c_fc.weight") == "mlp"
    assert layer_type("model.layers.1.input_layernorm.weight") == "norm"
    assert layer_type("transformer.wte.weight") == "embedding" and layer_type("lm_head.weight") == "lm_head"


@pytest.mark.slow
@pytest.mark.parametrize("model, extra", [("llama-2-7b", ["--layers", "2", "--hidden", "128"]),
                                          ("gpt2", ["--layers", "2", "--hidden", "128"])])
def test_precision_check_cli(run_cli, tmp_path, model, extra):
    text = tmp_path / "data.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    png = tmp_path / "g.png"
    code, out, err = run_cli("precision-check", model, *extra, "--data", str(text), "--seq", "64", "--steps", "2",
                             "--plot", str(png), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert {v["recipe"] for v in doc["verdict"]} == {"fp32", "amp-fp16 + GradScaler", "amp-bf16", "mixed-bf16",
                                                     "pure-bf16"}
    assert 0 <= doc["gradients"]["underflow_to_zero"] <= 1 and doc["loss_scale_range"]["smallest"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_precision_check_bad_input(run_cli):
    code, _, err = run_cli("precision-check", "gpt2", "--layers", "0")
    assert code == 2 and "--layers must be a positive integer" in err


@pytest.mark.slow
def test_amp_demo_claims():
    """The claims docs/mixed-precision.md makes, at the demo's CI size (about 45 s on 2 cores)."""
    from trainmem.amp_demo import run_all

    results, seconds = run_all(steps=200, batch=8, grad_scale_down=2.0**-20)
    r = {x.name: x for x in results}
    start = r["fp32"].losses[0]
    # fp16 without a scaler: every gradient flushes to zero and the model does not learn at all.
    assert r["fp16-autocast"].zero_grad_fraction > 0.99
    assert abs(r["fp16-autocast"].final_loss - start) < 0.01 * start
    # The dynamic GradScaler restores learning.
    assert r["fp16-autocast+scaler"].zero_grad_fraction < 0.05
    assert r["fp16-autocast+scaler"].final_loss < 0.6 * start
    # bf16 needs no scaler: its range is fp32's.
    for name in ("fp32", "bf16-autocast", "pure-bf16", "pure-bf16+master"):
        assert r[name].zero_grad_fraction < 0.01 and r[name].final_loss < 0.6 * start, name
    # fp32 master weights do at least as well as pure bf16.
    assert r["pure-bf16+master"].final_loss <= r["pure-bf16"].final_loss + 0.02
