"""kvprefix's own server request log, read by ``kvprefix.logs.iter_request_log``, as a planner trace.

Fields used: ``timestamp`` (arrival), ``prompt_tokens``, ``block_size``, ``block_hashes`` (hex, one per full prompt
block, parent-chained), ``output_tokens``; ``prompt_cache_key``, ``user`` or ``tenant`` (in that order) is the
session key for routing. ``tenant``, ``cached_tokens``, ``timings``, ``status``, ``namespace`` and ``replica`` are
kept for comparison.

The hashes are used as they are: the server keys them in each request's namespace exactly as its cache does, so
the replay shares a block between tenants only where the real cache could.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvprefix.cache import cdiv
from kvprefix.logs import iter_request_log
from kvprefix.sim.trace import Trace, TraceError, TraceRequest, coarsen, coarsening_factor

KEPT_FIELDS = ("tenant", "cached_tokens", "timings", "status", "namespace", "replica")
SESSION_FIELDS = ("prompt_cache_key", "user", "tenant")


def read_request_log(path: str | Path, source_block_size: int | None = None, block_size: int | None = None) -> Trace:
    """Reads a request log, converted exactly to ``block_size`` (default: the first row's).

    Rows carry their own ``block_size`` (``source_block_size`` is only a fallback for hand-made logs without it).
    The server writes a line when a request finishes, so arrivals are out of order in the file: requests are
    sorted by arrival. Lines torn by a crash are skipped, with a warning.
    """
    rows = []
    torn: list[int] = []
    for e in iter_request_log(path, torn, source_block_size, " (or give --trace-block-size)"):
        rec, src, n = e.record, e.source_block_size, e.prompt_tokens
        block_size = block_size or src
        rows.append(
            TraceRequest(
                timestamp=rec.timestamp,
                input_length=n,
                output_length=rec.output_tokens,
                block_hashes=coarsen(rec.block_hashes, coarsening_factor(path, src, block_size, e.line),
                                     n // block_size),
                num_blocks=cdiv(n, block_size),
                session=next((getattr(rec, k) for k in SESSION_FIELDS if getattr(rec, k)), None),
                extra={k: getattr(rec, k) for k in KEPT_FIELDS},
            )
        )
    if torn:
        print(f"{path}: skipped {len(torn)} torn line(s) (a crash mid-write): {torn[:5]}", file=sys.stderr)
    if not rows:
        raise TraceError(path, None, "the request log is empty")
    rows.sort(key=lambda r: r.timestamp)  # stable: simultaneous arrivals keep their file order
    t0 = rows[0].timestamp
    for r in rows:
        r.timestamp -= t0
    return Trace(Path(path).name, block_size, rows)
