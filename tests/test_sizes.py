"""Human-readable sizes and counts: parse_size, parse_count and format_size."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from offload.sizes import format_size, parse_count, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1048576, 1 << 20),
        (0, 0),
        ("4096", 4096),
        ("0", 0),
        ("1GiB", GiB),
        ("512MiB", 512 * MiB),
        ("4 KiB", 4 * KiB),
        ("  4 KiB  ", 4 * KiB),
        ("1M", MiB),
        ("1m", MiB),
        ("64K", 64 * KiB),
        ("2T", 2 * TiB),
        ("1Gi", GiB),
        ("1TiB", TiB),
        ("1KB", 1000),
        ("100MB", 100_000_000),
        ("1GB", 10**9),
        ("1TB", 10**12),
        ("1e8", 100_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5K", 512),
        (".5M", MiB // 2),
        ("4096B", 4096),
        ("10 bytes", 10),
        ("1_048_576", MiB),
    ],
)
def test_parse_size_reads_binary_decimal_and_bare_forms(text, expected):
    """Binary units (KiB.., and bare K/M/G/T), decimal ones (KB..), exponents and plain ints all parse."""
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "error", "pattern"),
    [
        ("", ValueError, r"invalid size ''"),
        ("abc", ValueError, r"invalid size 'abc'.*e\.g\."),
        ("1..5M", ValueError, r"'1\.\.5M'"),
        ("1.5", ValueError, r"'1\.5'.*whole number of bytes"),
        ("0.3K", ValueError, r"'0\.3K'.*whole number of bytes"),
        ("-1M", ValueError, r"'-1M'.*negative"),
        (-5, ValueError, r"negative"),
        ("1 XB", ValueError, r"unknown unit 'XB'"),
        ("4 KiBx", ValueError, r"unknown unit 'KiBx'"),
        ("1e999", ValueError, r"exponent out of range"),
        (1.5, TypeError, r"int or a string"),
        (True, TypeError, r"int or a string"),
        (None, TypeError, r"int or a string"),
    ],
)
def test_parse_size_rejects_bad_input_naming_the_text(text, error, pattern):
    """Malformed, negative, fractional or non-string sizes raise with the offending text in the message."""
    with pytest.raises(error, match=pattern):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("64M", 64_000_000),
        ("1.5G", 1_500_000_000),
        ("7B", 7_000_000_000),
        ("1e8", 100_000_000),
        (1e8, 100_000_000),
        ("125K", 125_000),
        ("2t", 2 * 10**12),
        ("0", 0),
    ],
)
def test_parse_count_uses_decimal_suffixes(text, expected):
    """Counts of parameters are decimal: K=1e3, M=1e6, G/B=1e9, T=1e12, and whole floats like 1e8 pass."""
    assert parse_count(text) == expected


@pytest.mark.parametrize(
    ("text", "error", "pattern"),
    [
        ("1.5", ValueError, r"'1\.5'.*whole number"),
        (1.5, ValueError, r"whole number"),
        (float("nan"), ValueError, r"whole number"),
        ("64MiB", ValueError, r"unknown unit 'MiB'"),
        ("-3M", ValueError, r"negative"),
        ("many", ValueError, r"invalid count 'many'"),
        (False, TypeError, r"int or a string"),
        ([1], TypeError, r"int or a string"),
    ],
)
def test_parse_count_rejects_bad_input_naming_the_text(text, error, pattern):
    """Fractional, byte-unit, negative or non-numeric counts raise with the offending text in the message."""
    with pytest.raises(error, match=pattern):
        parse_count(text)


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (KiB, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (64 * MiB, "64.00 MiB"),
        (GiB, "1.00 GiB"),
        (5 * TiB, "5.00 TiB"),
        (MiB - 1, "1.00 MiB"),
        (-MiB, "-1.00 MiB"),
    ],
)
def test_format_size_uses_the_largest_binary_unit(nbytes, expected):
    """Sizes print with two decimals in the largest binary unit that keeps the number at least 1."""
    assert format_size(nbytes) == expected


def test_format_size_rejects_non_integers():
    """A float byte count is a caller's bug and raises TypeError rather than printing a rounded size."""
    with pytest.raises(TypeError, match="int number of bytes"):
        format_size(1.5)


@given(st.integers(min_value=0, max_value=1 << 50))
@example(8320)  # 8.125 KiB, an exact tie at two decimals: the error is the whole half unit
@example(5 * KiB // 4)  # "1.25 KiB" and "1.50 MiB": whole numbers of bytes, read back exactly
@example(3 * MiB // 2)
def test_format_size_reads_back_within_rounding(nbytes):
    """What format_size prints is within the half-unit rounding of two decimals, and parse_size reads
    it back as exactly the number shown (so within that rounding of ``nbytes``; exactly below 1 KiB)
    or, where the number shown is a fraction of a byte, refuses it rather than rounding."""
    text = format_size(nbytes)
    number, unit = text.split()
    scale = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "PiB": TiB * KiB}[unit]
    # Half a unit of the last printed digit, plus float rounding of the product itself.
    assert abs(float(number) * scale - nbytes) <= 0.005 * scale * (1 + 1e-12)
    if unit == "B":
        assert parse_size(text.replace(" ", "")) == nbytes
    shown = Fraction(number) * scale  # the exact value of the printed text
    if shown.denominator == 1:
        assert parse_size(text) == shown
        assert abs(shown - nbytes) <= Fraction(scale, 200)
    else:
        with pytest.raises(ValueError, match="not a whole number of bytes"):
            parse_size(text)
