"""The numeric option types: what each accepts, and one message for everything else."""

import argparse

import pytest

from kvprefix.paths import fraction, positive_float, positive_int


@pytest.mark.parametrize("text, value", [("1", 1), ("16", 16), ("2e6", 2_000_000), ("3.0", 3)])
def test_positive_int_accepts_whole_numbers(text, value):
    assert positive_int(text) == value


@pytest.mark.parametrize("check, text", [
    (positive_int, "0"), (positive_int, "-2"), (positive_int, "1.5"), (positive_int, "nan"), (positive_int, "x"),
    (positive_int, "inf"), (positive_float, "0"), (positive_float, "nan"), (positive_float, "inf"),
    (positive_float, "s"), (fraction, "1.1"), (fraction, "-0.1"), (fraction, "nan"), (fraction, "half"),
])
def test_bad_numbers_are_one_line_naming_the_value(check, text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"expected a .*, got '{text}'$"):
        check(text)


def test_good_floats_and_fractions():
    assert positive_float("0.5") == 0.5 and fraction("0") == 0.0 and fraction("1") == 1.0
