"""Float formats against torch.finfo, value rounding against torch's own conversions, and the CLI."""

import json
import math
import random

import pytest

from trainmem.dtypes import FORMATS, describe

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.torch_name])
def test_format_constants_equal_torch_finfo(name):
    f = FORMATS[name]
    fi = torch.finfo(getattr(torch, f.torch_name))
    assert f.max == fi.max
    assert f.smallest_normal == fi.smallest_normal == fi.tiny
    assert f.smallest_subnormal == fi.smallest_normal * fi.eps  # 2**(emin - mantissa bits)
    assert f.eps == fi.eps
    assert f.exponent_bits + f.mantissa_bits + 1 == fi.bits == 8 * f.storage_bytes
    assert f.decimal_digits == round(-math.log10(fi.resolution))


def test_tf32_has_fp32_range_and_fp16_precision():
    tf32, fp32, fp16 = FORMATS["tf32"], FORMATS["fp32"], FORMATS["fp16"]
    assert tf32.smallest_normal == fp32.smallest_normal and tf32.eps == fp16.eps
    assert tf32.max == (2 - 2**-10) * 2.0**127


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.torch_name])
def test_rounding_matches_torch_conversion(name):
    f = FORMATS[name]
    dtype = getattr(torch, f.torch_name)
    rng = random.Random(0)
    values = [rng.choice([-1, 1]) * 10 ** rng.uniform(-12, 6) for _ in range(5000)]
    values += [f.max, f.smallest_subnormal, f.smallest_subnormal / 2, f.smallest_normal, 65504.0, 65520.0, 1e9]
    for x in values:
        expected = torch.tensor(x, dtype=torch.float64).to(dtype).to(torch.float64).item()
        got = f.round(x)
        assert got == expected or (math.isnan(got) and math.isnan(expected)), (name, x)


def test_describe_outcomes():
    rows = {r["format"]: r for r in describe(1e-8)}
    assert rows["fp16"]["outcome"] == "underflow (0)" and rows["bf16"]["outcome"] == "normal"
    rows = {r["format"]: r for r in describe(70000.0)}
    assert rows["fp16"]["outcome"] == "overflow (inf)" and rows["fp8-e4m3fn"]["outcome"] == "saturated (max)"
    rows = {r["format"]: r for r in describe(1e-6)}
    assert rows["fp16"]["outcome"] == "subnormal"


def test_dtypes_cli(run_cli):
    code, out, _ = run_cli("dtypes", "--json", "--value", "65519")
    doc = json.loads(out)
    assert code == 0 and [f["format"] for f in doc["formats"]] == list(FORMATS)
    fp16 = next(r for r in doc["stored"] if r["format"] == "fp16")
    assert fp16["stored"] == 65504.0  # 65519 rounds down; 65520 would overflow
    code, out, _ = run_cli("dtypes")
    assert code == 0 and "65504" in out and "fp8-e4m3fn" in out
