"""The argparse types of every command's numeric options: one message for each way a number can be wrong."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer >= 1, also written as a whole number in exponent form (2e6, for capacities in tokens)."""
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not number.is_integer():
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
        value = int(number)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, rates, sizes)."""
    return _float(text, lambda v: v > 0 and not math.isinf(v), "a positive number")  # `v > 0` also refuses NaN


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    return _float(text, lambda v: 0.0 <= v <= 1.0, "a fraction in [0, 1]")


def _float(text: str, valid, expected: str) -> float:
    """``text`` as a float that ``valid`` accepts, else one message naming what was ``expected``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not valid(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value
