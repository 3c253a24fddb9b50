"""Picks the reader for a trace file: by name, or by the fields of its first row (``kvprefix.logs.detect_format``)."""

from __future__ import annotations

from pathlib import Path

from kvprefix.logs import BODIES, MOONCAKE, REQUEST_LOG, detect_format
from kvprefix.sim.trace import Trace

FORMATS = ("auto", MOONCAKE, REQUEST_LOG, BODIES)


def load_trace(
    path: str | Path,
    fmt: str = "auto",
    block_size: int | None = None,
    trace_block_size: int | None = None,
    tokenizer: str | None = None,
    replica=None,
    chat_template=None,
) -> Trace:
    """Reads a trace at ``block_size`` (default: the trace's own). ``trace_block_size`` is the block size the
    trace's ids were made with (Mooncake default: from the file name, else 512; request log: each row's own).
    ``replica`` (``openai_bodies.ReplicaModel``): the identity OpenAI bodies are hashed under; ``chat_template``
    (``tokenizer.chat_template.ChatTemplate``): the one they are rendered with, where not the checkpoint's."""
    if fmt == "auto":
        fmt = detect_format(path)
    if chat_template is not None and fmt != BODIES:
        raise ValueError(f"--chat-template and its content format render OpenAI request bodies; {path} is a {fmt} "
                         "trace, whose blocks are hashed already")
    if fmt == MOONCAKE:
        from kvprefix.sim.mooncake import read_mooncake

        return read_mooncake(path, trace_block_size, block_size)
    if fmt == REQUEST_LOG:
        from kvprefix.sim.request_log import read_request_log

        return read_request_log(path, trace_block_size, block_size)
    if fmt == BODIES:
        from kvprefix.sim.openai_bodies import read_openai_bodies

        if tokenizer is None:
            raise ValueError("OpenAI request bodies need --tokenizer (a local Hugging Face tokenizer directory)")
        return read_openai_bodies(path, tokenizer, block_size, replica=replica, chat_template=chat_template)
    raise ValueError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
