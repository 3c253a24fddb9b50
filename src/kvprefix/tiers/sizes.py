"""Byte sizes as people write them: "20GiB", "500MB", "1.5T", "1048576"."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS[_p + "b"] = 1000**_i  # KB, MB, GB, TB: decimal
    _UNITS[_p + "ib"] = 1024**_i  # KiB, MiB, GiB, TiB: binary
    _UNITS[_p + "i"] = 1024**_i
    _UNITS[_p] = 1024**_i  # a bare K, M, G, T: binary, as docker and most tools read it
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in ``text``; ValueError naming it and the accepted forms otherwise."""
    match = _SIZE.fullmatch(text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional unit "
                         "(B, KB, MB, GB, TB for powers of 1000; KiB, MiB, GiB, TiB or K, M, G, T for 1024)")
    size = int(float(match.group(1)) * unit)
    if size < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return size


def size_argument(text: str) -> int:
    """``parse_size`` as an argparse type: a bad size is the option's one-line usage error."""
    import argparse

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_size(num_bytes: int) -> str:
    """``num_bytes`` as people read a power-of-two size: "64MiB", "1.5GiB", "512B" (``parse_size`` reads it back
    within rounding)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g}{unit}"
    return f"{num_bytes}B"
