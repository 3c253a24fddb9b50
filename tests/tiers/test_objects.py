"""The object format round-trips, and any change to a stored object's bytes, or a load under another identity,
is an ObjectError (a miss), never a wrong block or a crash."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.tier_blocks import SPEC, chain, expected

from kvprefix.tiers.objects import FORMAT_VERSION, MAGIC, ObjectError, decode, encode, verify

BLOCK = chain(1)[0]
DATA = encode(BLOCK)


def test_round_trip() -> None:
    obj = decode(DATA)
    assert obj == BLOCK
    verify(obj, SPEC, expected(BLOCK))
    assert DATA[:4] == MAGIC and int.from_bytes(DATA[4:6], "little") == FORMAT_VERSION


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(DATA) * 8 - 1))
def test_any_flipped_bit_is_refused(bit: int) -> None:
    data = bytearray(DATA)
    data[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(ObjectError):
        decode(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(DATA) - 1))
def test_any_truncation_is_refused(length: int) -> None:
    with pytest.raises(ObjectError) as exc:
        decode(DATA[:length])
    assert exc.value.reason in ("truncated", "magic", "version", "bounds")


def test_another_format_version_is_refused() -> None:
    data = bytearray(DATA)
    data[4:6] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    with pytest.raises(ObjectError, match="version"):
        decode(bytes(data))


def test_sizes_are_bounded_before_reading() -> None:
    data = bytearray(DATA)
    data[12:20] = (1 << 40).to_bytes(8, "little")  # a payload length of a terabyte
    with pytest.raises(ObjectError) as exc:
        decode(bytes(data))
    assert exc.value.reason == "bounds"


@pytest.mark.parametrize("change, reason", [
    (dict(model="other-model"), "identity"),
    (dict(kv_dtype="bfloat16"), "identity"),
    (dict(num_layers=3), "identity"),
])
def test_another_identity_is_refused(change, reason) -> None:
    with pytest.raises(ObjectError) as exc:
        verify(decode(DATA), dataclasses.replace(SPEC, **change), expected(BLOCK))
    assert exc.value.reason == reason


@pytest.mark.parametrize("change, reason", [
    (dict(namespace="fedcba9876543210"), "namespace"),
    (dict(parent_hash=b"x" * 32), "chain"),
    (dict(block_hash=b"y" * 32), "chain"),
    (dict(token_ids=(1, 2, 3, 4)), "tokens"),
])
def test_another_block_is_refused(change, reason) -> None:
    with pytest.raises(ObjectError) as exc:
        verify(decode(DATA), SPEC, dataclasses.replace(expected(BLOCK), **change))
    assert exc.value.reason == reason


def test_swapped_payloads_are_refused() -> None:
    a, b = chain(2, seed=5)
    ea, eb = encode(a), encode(b)
    header_end = len(ea) - 16 - len(a.payload)
    swapped = ea[:header_end] + eb[header_end:]  # a's header, b's payload and checksum
    with pytest.raises(ObjectError, match="checksum"):
        decode(swapped)
