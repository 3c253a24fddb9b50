"""The planner's request record and what every trace reader shares: chaining and block-size coarsening of block
ids, and the checks a row must pass (rows and errors naming the line are ``kvprefix.logs``')."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvprefix.logs import LogError as TraceError  # the planner's name for it: a line it cannot use


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace, as the cache sees it.

    ``block_hashes`` are the keys of the prompt's *full* blocks (kvprefix never caches a partial block);
    ``num_blocks`` counts every prompt block, the partial tail included (the block-weighted denominator).
    """

    timestamp: float  # seconds since the trace started
    input_length: int
    output_length: int
    block_hashes: list[Hashable]
    num_blocks: int
    session: Hashable | None = None
    extra: dict = field(default_factory=dict)  # fields kept from the row (turn, group, tenant, ...)


@dataclass
class Trace:
    name: str
    block_size: int
    requests: list[TraceRequest]

    @property
    def num_block_refs(self) -> int:
        return sum(r.num_blocks for r in self.requests)


def coarsening_factor(path: str | Path, source_block_size: int, block_size: int, line: int | None = None) -> int:
    """m such that block_size = m x source_block_size; chained ids coarsen exactly only then."""
    if block_size % source_block_size:
        raise TraceError(
            path,
            line,
            f"cannot convert {source_block_size}-token blocks to {block_size}-token blocks exactly: "
            f"chained ids only coarsen to a multiple of {source_block_size} "
            f"(e.g. --block-size {source_block_size * max(1, block_size // source_block_size)})",
        )
    return block_size // source_block_size


class ChainedIds:
    """Gives every position of a trace's integer block ids a parent-chained identity (one per trace).

    An id names the whole prefix up to its block, so the same id after another parent (repeated within a row, or
    ids that were never chained) is another block. An id keeps its value after the first parent it is seen with,
    so a chained trace reads unchanged (consistent-hash placement included); after any other parent it becomes
    a fresh ``(id, n)`` tuple, which no integer id can equal.
    """

    def __init__(self) -> None:
        self._first_parent: dict[int, Hashable] = {}
        self._fresh: dict[tuple[Hashable, int], tuple[int, int]] = {}

    def __call__(self, ids: Sequence[int]) -> list[Hashable]:
        first_parent, fresh = self._first_parent, self._fresh
        out: list[Hashable] = []
        parent: Hashable = None  # the root
        for h in ids:
            c = h
            if first_parent.setdefault(h, parent) != parent:  # h came after another parent before
                c = fresh.get((parent, h))
                if c is None:
                    c = fresh[parent, h] = (h, len(fresh))
            out.append(c)
            parent = c
        return out


def coarsen(ids: Sequence[Hashable], factor: int, num_full_blocks: int) -> list[Hashable]:
    """Full-block ids at ``factor`` x the block size.

    A chained id stands for the whole prefix up to the end of its block, so the id of every factor-th block
    names the coarse block that ends there. The coarse tail (partial) block is not cached, so it needs no id.
    """
    if factor == 1:
        return list(ids[:num_full_blocks])
    return list(ids[factor - 1 :: factor][:num_full_blocks])


def require(row: dict, key: str, path: str | Path, line: int, kind: type | tuple = int, minimum: float | None = 0):
    """``row[key]``, checked for presence, type and lower bound."""
    if key not in row:
        raise TraceError(path, line, f"missing field {key!r}")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TraceError(path, line, f"field {key!r} must be {_kind_name(kind)}, got {value!r}")
    if minimum is not None and value < minimum:
        raise TraceError(path, line, f"field {key!r} must be >= {minimum}, got {value!r}")
    return value


def _kind_name(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", list: "a list"}[k] for k in kinds)


class TimestampCheck:
    """Rows must arrive in time order: replay relies on it and a shuffled log would silently change hit rates."""

    def __init__(self, path: str | Path):
        self.path = path
        self.last = float("-inf")

    def __call__(self, timestamp: float, line: int) -> None:
        if timestamp < self.last:
            raise TraceError(self.path, line, f"timestamp {timestamp} is earlier than the previous row's ({self.last})")
        self.last = timestamp
