"""Mooncake-format traces: ``timestamp`` (ms), ``input_length``, ``output_length`` and parent-chained ``hash_ids``
(one per prompt block of a stated block size, the last one possibly partial). See docs/planner.md, "Trace formats"."""

from __future__ import annotations

import re
from pathlib import Path

from kvprefix.cache import cdiv
from kvprefix.logs import iter_rows
from kvprefix.sim.trace import (
    ChainedIds,
    TimestampCheck,
    Trace,
    TraceError,
    TraceRequest,
    coarsen,
    coarsening_factor,
    require,
)

MOONCAKE_BLOCK_SIZE = 512
KEPT_FIELDS = ("session_id", "turn", "group")


def infer_block_size(path: str | Path) -> int:
    """The block size a file's name states (``*_bs16.jsonl``), else Mooncake's own 512."""
    m = re.search(r"_bs(\d+)\.jsonl$", str(path))
    return int(m.group(1)) if m else MOONCAKE_BLOCK_SIZE


def read_mooncake(path: str | Path, source_block_size: int | None = None, block_size: int | None = None) -> Trace:
    """Reads a Mooncake JSONL trace whose ids are for ``source_block_size``-token blocks, converted exactly to
    ``block_size`` (a multiple of it; default: no conversion)."""
    src = source_block_size or infer_block_size(path)
    bs = block_size or src
    factor = coarsening_factor(path, src, bs)
    check_time = TimestampCheck(path)
    chain = ChainedIds()
    requests = []
    for line, row in iter_rows(path):
        ts = require(row, "timestamp", path, line, (int, float))
        check_time(ts, line)
        n = require(row, "input_length", path, line, minimum=1)
        out = require(row, "output_length", path, line)
        ids = require(row, "hash_ids", path, line, list, minimum=None)
        expected = cdiv(n, src)
        if len(ids) != expected:
            raise TraceError(
                path,
                line,
                f"{len(ids)} hash_ids for input_length {n}, but {src}-token blocks need {expected} "
                "(is the trace block size right? see --trace-block-size)",
            )
        if not all(type(h) is int for h in ids):
            raise TraceError(path, line, "hash_ids must be integers")
        extra = {k: row[k] for k in KEPT_FIELDS if k in row}
        requests.append(
            TraceRequest(
                timestamp=ts / 1000.0,
                input_length=n,
                output_length=out,
                block_hashes=coarsen(chain(ids), factor, n // bs),
                num_blocks=cdiv(n, bs),
                session=row.get("session_id"),
                extra=extra,
            )
        )
    return Trace(Path(path).name, bs, requests)
