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
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or math.isinf(value):  # `not >` also refuses NaN
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value
