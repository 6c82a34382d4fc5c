"""Sizes parsed from text (--gpu-memory), bytes rendered in every unit, and the GPU table's data-sheet cards."""

import math

import pytest
from hypothesis import given, strategies as st

from trainmem.errors import ConfigError
from trainmem.hardware import GPUS, THROUGHPUT, custom_gpu, get_gpu
from trainmem.units import MAX_MEMORY_BYTES, format_bytes, parse_size, parse_sized

UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4, "KB": 1000, "MB": 1000**2,
         "GB": 1000**3, "TB": 1000**4}


@given(st.integers(1, MAX_MEMORY_BYTES))
def test_plain_bytes_and_ints_are_bytes(n):
    assert parse_size(str(n)) == parse_size(n) == parse_size(f"{n} B") == parse_size(f"{n:,}B") == n


@given(st.integers(1, 10**5), st.sampled_from(sorted(UNITS)), st.sampled_from(["", " "]), st.booleans())
def test_a_whole_number_of_any_unit(k, unit, space, lower):
    text = f"{k}{space}{unit.lower() if lower else unit}"
    if k * UNITS[unit] > MAX_MEMORY_BYTES:
        with pytest.raises(ConfigError, match="at most"):
            parse_size(text)
    else:
        assert parse_size(text) == k * UNITS[unit]


@given(st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not (0 < x < 1e6)),
       st.sampled_from(["GiB", "GB", "MiB"]))
def test_non_positive_non_finite_or_huge_sizes_are_one_config_error(x, unit):
    text = f"{x}{unit}" if math.isfinite(x) else f"{'-' if x < 0 else ''}{x}{unit}"
    if math.isfinite(x) and 0 < x * UNITS[unit] <= MAX_MEMORY_BYTES:
        assert parse_size(text) == round(x * UNITS[unit])
        return
    with pytest.raises(ConfigError) as info:
        parse_size(text)
    assert "\n" not in str(info.value) and "gpu-memory" in str(info.value)


def test_fractions_with_a_unit_and_labels():
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size(".5 GiB") == 2**29
    assert parse_sized("48gib") == (48 * 2**30, "48 GiB")
    assert parse_sized("80GB") == (80 * 10**9, "80 GB")
    assert parse_sized(48 * 2**30)[1] == "48 GiB"
    for bad in ("1.5", "1e9", "48 XB", "GiB", "", " ", "48 GiB GiB", "-5", "0x10", "4" * 200):
        with pytest.raises(ConfigError):
            parse_size(bad)


@given(st.integers(0, 10**15))
def test_whole_bytes_print_as_integers_with_the_unit(n):
    assert format_bytes(n, "B") == f"{n:,} B"
    assert format_bytes(n + 0.4, "B") == f"{n:,} B"


def test_other_units_keep_their_decimals():
    assert format_bytes(2**30) == "1.00 GiB" and format_bytes(1234, "KB") == "1.23 KB"
    assert format_bytes(3 * 2**20, "MiB", 0) == "3 MiB"


def test_the_data_sheet_cards_and_their_aliases():
    expected = {"A6000": ("RTX-A6000", 49140 * 2**20), "RTX-A6000": ("RTX-A6000", 49140 * 2**20),
                "rtx a6000": ("RTX-A6000", 49140 * 2**20), "A40": ("A40", 48 * 10**9), "L40": ("L40", 48 * 10**9),
                "L40S": ("L40S", 46068 * 2**20), "H100-PCIe": ("H100-PCIe", 80 * 10**9),
                "H100 NVL": ("H100-NVL", 95830 * 2**20), "MI250X": ("MI250X", 64 * 10**9),
                "Gaudi 2": ("Gaudi-2", 96 * 10**9), "gaudi3": ("Gaudi-3", 128 * 10**9),
                "H100": ("H100-80GB", 81559 * 2**20), "h100-sxm": ("H100-80GB", 81559 * 2**20)}
    for name, (canonical, nbytes) in expected.items():
        gpu = get_gpu(name)
        assert (gpu.name, gpu.memory_bytes) == (canonical, nbytes), name
    assert get_gpu("A40").memory_source == "data sheet" and get_gpu("RTX-A6000").memory_source == "driver"
    with pytest.raises(ConfigError, match="did you mean A100-40GB or A100-80GB"):
        get_gpu("A100")
    assert set(THROUGHPUT) <= set(GPUS)
    for name in ("H100-PCIe", "H100-NVL", "RTX-A6000", "A40", "L40"):
        sheet = THROUGHPUT[name]
        assert 100 < sheet.dense_tflops < THROUGHPUT["H100-80GB"].dense_tflops and "data sheet" in sheet.source


def test_a_custom_card():
    card = custom_gpu(48 * 2**30)
    assert card.name == "custom 48 GiB" and card.memory_bytes == 48 * 2**30 and card.bf16 is None
    t4 = custom_gpu(24 * 10**9, get_gpu("T4"), "24 GB")
    assert t4.name == "T4 (24 GB)" and t4.memory_bytes == 24 * 10**9 and t4.bf16 is False
    assert get_gpu("T4").memory_bytes == 15360 * 2**20  # the table's card is untouched
