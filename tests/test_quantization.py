"""Quantized base weights: trainmem's stored bytes against bitsandbytes' own quantized tensors on the CPU."""

import pytest

from trainmem.errors import ConfigError
from trainmem.quantization import bytes_per_value, stored_bytes

SHAPES = [(1000, 4096), (256, 11008), (7, 13), (32000, 64), (1, 3)]


def _real_4bit(torch, shape, quant, double_quant):
    from bitsandbytes.nn import Params4bit

    weight = Params4bit(torch.randn(*shape, dtype=torch.bfloat16), requires_grad=False,
                        compress_statistics=double_quant, quant_type=quant)._quantize("cpu")
    state = weight.quant_state

    def nbytes(t):
        return t.numel() * t.element_size()

    total = nbytes(weight.data) + nbytes(state.absmax) + nbytes(state.code)
    if state.nested:
        total += nbytes(state.state2.absmax) + nbytes(state.state2.code) + nbytes(state.offset)
    return total


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("quant", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_4bit_weights_store_what_bitsandbytes_stores(shape, quant, double_quant):
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    assert stored_bytes(shape, quant, double_quant) == _real_4bit(torch, shape, quant, double_quant)


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_weights_store_what_bitsandbytes_stores(shape):
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Int8Params

    weight = Int8Params(torch.randn(*shape, dtype=torch.float16), requires_grad=False,
                        has_fp16_weights=False)._quantize("cpu")
    real = weight.numel() * weight.element_size() + weight.SCB.numel() * weight.SCB.element_size()
    assert stored_bytes(shape, "int8") == real


def test_per_value_figures_and_refusals():
    assert bytes_per_value("nf4") == 0.5 + 4 / 64  # 4.5 bits
    assert bytes_per_value("nf4", True) == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))  # about 4.127 bits
    big = (1 << 14, 1 << 14)
    assert stored_bytes(big, "nf4", True) / (big[0] * big[1]) == pytest.approx(bytes_per_value("nf4", True), rel=1e-4)
    with pytest.raises(ConfigError, match="accepted: nf4, fp4, int8"):
        stored_bytes((4, 4), "int4")
