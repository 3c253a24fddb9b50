"""Picks the reader for a trace file: by name, or by the fields of its first row."""

from __future__ import annotations

from pathlib import Path

from kvprefix.sim.trace import Trace, TraceError, iter_rows

FORMATS = ("auto", "mooncake", "request-log", "openai")


def detect_format(path: str | Path) -> str:
    for line, row in iter_rows(path):
        if "hash_ids" in row:
            return "mooncake"
        if "block_hashes" in row:
            return "request-log"
        if "messages" in row or "prompt" in row:
            return "openai"
        raise TraceError(
            path,
            line,
            "unknown trace format: expected 'hash_ids' (Mooncake), 'block_hashes' (kvprefix request "
            "log) or 'messages'/'prompt' (OpenAI request bodies)",
        )
    raise TraceError(path, None, "the trace is empty")


def load_trace(
    path: str | Path,
    fmt: str = "auto",
    block_size: int | None = None,
    trace_block_size: int | None = None,
    tokenizer: str | None = None,
    replica=None,
) -> Trace:
    """Reads a trace at ``block_size`` (default: the trace's own). ``trace_block_size`` is the block size the
    trace's ids were made with (Mooncake default: from the file name, else 512; request log: each row's own).
    ``replica`` (``openai_bodies.ReplicaModel``): the identity OpenAI bodies are hashed under."""
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "mooncake":
        from kvprefix.sim.mooncake import read_mooncake

        return read_mooncake(path, trace_block_size, block_size)
    if fmt == "request-log":
        from kvprefix.sim.request_log import read_request_log

        return read_request_log(path, trace_block_size, block_size)
    if fmt == "openai":
        from kvprefix.sim.openai_bodies import read_openai_bodies

        if tokenizer is None:
            raise ValueError("OpenAI request bodies need --tokenizer (a local Hugging Face tokenizer directory)")
        return read_openai_bodies(path, tokenizer, block_size, replica=replica)
    raise ValueError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
