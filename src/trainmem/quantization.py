"""Quantized base weights (QLoRA and 8-bit bases): the bytes bitsandbytes really stores for one weight.

bitsandbytes 0.50 (bitsandbytes/functional.py ``quantize_4bit``, nn/modules.py ``Params4bit``, ``Int8Params``),
checked byte for byte against real quantized tensors on the CPU (tests/test_quantization.py):
- 4-bit (``nf4``, ``fp4``): two values per byte (uint8 of ceil(n / 2)); one fp32 ``absmax`` per block of 64
  values; the 16-entry fp32 ``code`` table. With double quantization (``compress_statistics``, QLoRA's default)
  the absmax values are themselves quantized to one uint8 each, with one fp32 absmax per block of 256 of them,
  their 256-entry fp32 code table and an fp32 offset.
- 8-bit (``int8``, LLM.int8()): one int8 per value and one fp32 scale per output row (``SCB``).
transformers' ``BitsAndBytesConfig`` quantizes every ``nn.Linear`` of the decoder except the output layer
(``llm_int8_skip_modules``: the LM head stays in the compute dtype); embeddings and norms are not Linears.
"""

from __future__ import annotations

from .errors import ConfigError

QUANT_TYPES = ("nf4", "fp4", "int8")
BLOCK = 64
"""Values per absmax block of a 4-bit weight (bitsandbytes' default blocksize)."""
NESTED_BLOCK = 256
"""absmax values per block of the second level (double quantization)."""
FP32 = 4


def stored_bytes(shape: tuple[int, ...], quant: str, double_quant: bool = False) -> int:
    """Bytes bitsandbytes stores for a weight of ``shape`` (out_features, in_features) quantized as ``quant``."""
    if quant not in QUANT_TYPES:
        raise ConfigError(f"unknown base quantization {quant!r}; accepted: {', '.join(QUANT_TYPES)}")
    numel = 1
    for d in shape:
        numel *= d
    if quant == "int8":
        return numel + FP32 * shape[0]  # CB (int8) and SCB, one fp32 scale per row
    blocks = -(-numel // BLOCK)
    packed = -(-numel // 2)
    code = 16 * FP32
    if not double_quant:
        return packed + FP32 * blocks + code
    nested = -(-blocks // NESTED_BLOCK)
    return packed + blocks + FP32 * nested + 256 * FP32 + FP32 + code


def bytes_per_value(quant: str, double_quant: bool = False) -> float:
    """Bytes per value of a large 4-bit or 8-bit weight (the tables leave out the per-tensor constants)."""
    if quant == "int8":
        return 1.0
    return 0.5 + (1 / BLOCK + FP32 / (BLOCK * NESTED_BLOCK) if double_quant else FP32 / BLOCK)
