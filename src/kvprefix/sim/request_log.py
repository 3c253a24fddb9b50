"""kvprefix's own server request log (JSONL), as specified in docs/request-log.md.

Fields used: ``timestamp`` (seconds), ``tenant`` (hashed), ``prompt_tokens``, ``block_hashes`` (hex strings, one per
full prompt block, parent-chained), ``output_tokens``; ``cached_tokens`` and ``timings`` are kept for comparison.
An optional ``block_size`` field overrides the block size given by the caller.
"""

from __future__ import annotations

from pathlib import Path

from kvprefix.sim.trace import (
    TimestampCheck,
    Trace,
    TraceError,
    TraceRequest,
    coarsen,
    coarsening_factor,
    iter_rows,
    require,
)

KEPT_FIELDS = ("tenant", "cached_tokens", "timings")


def read_request_log(path: str | Path, source_block_size: int, block_size: int | None = None) -> Trace:
    """Reads a request log written with ``source_block_size``-token blocks, converted exactly to ``block_size``.

    Hashes are namespaced by tenant, so two tenants never share a block in the replay.
    """
    bs = block_size or source_block_size
    check_time = TimestampCheck(path)
    requests = []
    t0 = None
    for line, row in iter_rows(path):
        ts = require(row, "timestamp", path, line, (int, float))
        check_time(ts, line)
        t0 = ts if t0 is None else t0
        n = require(row, "prompt_tokens", path, line, minimum=1)
        out = require(row, "output_tokens", path, line)
        hashes = require(row, "block_hashes", path, line, list, minimum=None)
        src = require(row, "block_size", path, line, minimum=1) if "block_size" in row else source_block_size
        if len(hashes) != n // src:
            raise TraceError(
                path, line, f"{len(hashes)} block_hashes for {n} prompt tokens, but {src}-token blocks give {n // src}"
            )
        if not all(isinstance(h, str) for h in hashes):
            raise TraceError(path, line, "block_hashes must be hex strings")
        tenant = row.get("tenant")
        keys = coarsen(hashes, coarsening_factor(path, src, bs, line), n // bs)
        if tenant:
            keys = [f"{tenant}/{h}" for h in keys]
        requests.append(
            TraceRequest(
                timestamp=ts - t0,
                input_length=n,
                output_length=out,
                block_hashes=keys,
                num_blocks=-(-n // bs),
                session=tenant,
                extra={k: row[k] for k in KEPT_FIELDS if k in row},
            )
        )
    return Trace(Path(path).name, bs, requests)
