"""Floating-point formats computed from their bit layouts (no table typed in), and how a value is stored in each.

For a binary format with ``e`` exponent bits and ``m`` mantissa bits (bias ``2**(e-1) - 1``):
the largest finite value is ``(2 - 2**-m) * 2**emax`` with ``emax = 2**e - 2 - bias`` (IEEE: the all-ones exponent
is inf/NaN); the smallest normal ``2**(1 - bias)``; the smallest subnormal ``2**(1 - bias - m)``; machine epsilon
``2**-m``; decimal digits ``floor(m * log10(2))``. fp8 e4m3fn ("fn": finite, no inf) keeps the all-ones exponent for
numbers and gives up only the all-ones mantissa there (NaN), so its max is ``1.75 * 2**8 = 448``
(OCP 8-bit floating point specification, 2023). TF32 is fp32's range with fp16's 10-bit mantissa (NVIDIA Ampere).
tests/test_dtypes.py checks every figure against ``torch.finfo``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any



@dataclass(frozen=True)
class FloatFormat:
    name: str
    exponent_bits: int
    mantissa_bits: int
    storage_bytes: int
    finite_only: bool = False
    """e4m3fn: no infinities; the all-ones exponent encodes numbers except its all-ones mantissa (NaN)."""
    torch_name: str | None = None

    @property
    def bias(self) -> int:
        return int(2 ** (self.exponent_bits - 1) - 1)

    @property
    def max(self) -> float:
        m = self.mantissa_bits
        if self.finite_only:
            emax = 2**self.exponent_bits - 1 - self.bias
            return float((2 - 2 ** (1 - m)) * 2.0**emax)  # all-ones mantissa is NaN: the top value has mantissa 1...10
        emax = 2**self.exponent_bits - 2 - self.bias
        return float((2 - 2.0**-m) * 2.0**emax)

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        return 2.0**-self.mantissa_bits

    @property
    def decimal_digits(self) -> int:
        return int(math.floor(self.mantissa_bits * math.log10(2)))

    def round(self, x: float) -> float:
        """The nearest value of this format (round half to even); inf past the max (finite-only formats
        saturate to their max, infinities included, as torch's conversion does); 0 below half the smallest
        subnormal."""
        if math.isnan(x) or x == 0:
            return x
        sign = -1.0 if x < 0 else 1.0
        a = abs(x)
        if math.isinf(a):
            return sign * self.max if self.finite_only else x  # torch saturates e4m3fn, infinities included
        exp = max(math.floor(math.log2(a)), 1 - self.bias)  # subnormals share the smallest exponent
        quantum = 2.0 ** (exp - self.mantissa_bits)
        q = a / quantum
        rounded = math.floor(q)
        rest = q - rounded
        if rest > 0.5 or (rest == 0.5 and rounded % 2 == 1):
            rounded += 1
        value = rounded * quantum
        if value > self.max:
            # Values that round up past the largest finite one overflow (or saturate without an inf).
            return sign * (self.max if self.finite_only else math.inf)
        return sign * value


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("fp32", 8, 23, 4, torch_name="float32"),
        FloatFormat("tf32", 8, 10, 4),
        FloatFormat("fp16", 5, 10, 2, torch_name="float16"),
        FloatFormat("bf16", 8, 7, 2, torch_name="bfloat16"),
        FloatFormat("fp8-e4m3fn", 4, 3, 1, finite_only=True, torch_name="float8_e4m3fn"),
        FloatFormat("fp8-e5m2", 5, 2, 1, torch_name="float8_e5m2"),
    )
}


def describe(value: float) -> list[dict[str, Any]]:
    """How ``value`` is stored in every format: the nearest representable value and the relative error."""
    rows = []
    for f in FORMATS.values():
        stored = f.round(value)
        if math.isnan(value):
            outcome = "not a number (NaN)"
        elif value == 0:
            outcome = "zero"
        elif math.isinf(value) and math.isinf(stored):
            outcome = "infinity"
        elif math.isinf(stored):
            outcome = "overflow (inf)"
        elif math.isnan(stored):
            outcome = "overflow (NaN)"
        elif f.finite_only and abs(stored) == f.max and abs(value) > f.max:
            outcome = "saturated (max)"
        elif stored == 0 and value != 0:
            outcome = "underflow (0)"
        elif abs(stored) < f.smallest_normal:
            outcome = "subnormal"
        else:
            outcome = "normal"
        error = abs(stored - value) / abs(value) if value and math.isfinite(stored) else None
        rows.append({"format": f.name, "stored": stored, "relative_error": error, "outcome": outcome})
    return rows
