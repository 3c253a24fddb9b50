"""kvprefix's own server request log (JSONL), as docs/request-log.md and kvprefix.server.request_log define it.

Fields used: ``timestamp`` (arrival, Unix seconds), ``prompt_tokens``, ``block_size``, ``block_hashes`` (hex, one per
full prompt block, parent-chained), ``output_tokens``; ``prompt_cache_key``, ``user`` or ``tenant`` (in that order)
is the session key for routing. ``tenant``, ``cached_tokens``, ``timings`` and ``status`` are kept for comparison.

The hashes are used as they are: the server salts them exactly as its cache keys them (per tenant when tenants are
isolated), so the replay shares a block between tenants only where the real cache did.
"""

from __future__ import annotations

from pathlib import Path

from kvprefix.cache import cdiv
from kvprefix.sim.trace import Trace, TraceError, TraceRequest, coarsen, coarsening_factor, iter_rows, require

KEPT_FIELDS = ("tenant", "cached_tokens", "timings", "status")
SESSION_FIELDS = ("prompt_cache_key", "user", "tenant")


def read_request_log(path: str | Path, source_block_size: int | None = None, block_size: int | None = None) -> Trace:
    """Reads a request log, converted exactly to ``block_size`` (default: the first row's).

    Rows carry their own ``block_size``; ``source_block_size`` stands in for rows without one. The server writes a
    line when a request finishes, so arrivals are out of order in the file: requests are sorted by arrival.
    """
    rows = []
    for line, row in iter_rows(path):
        ts = require(row, "timestamp", path, line, (int, float))
        n = require(row, "prompt_tokens", path, line, minimum=1)
        out = require(row, "output_tokens", path, line)
        hashes = require(row, "block_hashes", path, line, list, minimum=None)
        if "block_size" in row:
            src = require(row, "block_size", path, line, minimum=1)
        elif source_block_size is not None:
            src = source_block_size
        else:
            raise TraceError(path, line, "missing field 'block_size' (or give --trace-block-size)")
        if len(hashes) != n // src:
            raise TraceError(
                path, line, f"{len(hashes)} block_hashes for {n} prompt tokens, but {src}-token blocks give {n // src}"
            )
        if not all(isinstance(h, str) for h in hashes):
            raise TraceError(path, line, "block_hashes must be hex strings")
        block_size = block_size or src
        session = next((row[k] for k in SESSION_FIELDS if row.get(k)), None)
        rows.append(
            TraceRequest(
                timestamp=ts,
                input_length=n,
                output_length=out,
                block_hashes=coarsen(hashes, coarsening_factor(path, src, block_size, line), n // block_size),
                num_blocks=cdiv(n, block_size),
                session=session,
                extra={k: row[k] for k in KEPT_FIELDS if k in row},
            )
        )
    if not rows:
        raise TraceError(path, None, "the request log is empty")
    rows.sort(key=lambda r: r.timestamp)  # stable: simultaneous arrivals keep their file order
    t0 = rows[0].timestamp
    for r in rows:
        r.timestamp -= t0
    return Trace(Path(path).name, block_size, rows)
