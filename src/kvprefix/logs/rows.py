"""JSONL rows of a log or trace, errors that name the file and the line, and which kind of log a file is."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

MOONCAKE, REQUEST_LOG, BODIES = "mooncake", "request-log", "openai"


class LogError(ValueError):
    """A log (or trace) that cannot be used; the message names the file and the 1-based line (None: the file)."""

    def __init__(self, path: str | Path, line: int | None, message: str):
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")
        self.path = str(path)
        self.line = line


def iter_rows(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for each non-blank line of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise LogError(path, line_no, f"not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise LogError(path, line_no, f"expected a JSON object, got {type(row).__name__}")
            yield line_no, row


def detect_format(path: str | Path) -> str:
    """``MOONCAKE``, ``REQUEST_LOG`` or ``BODIES``, by the fields of the first row."""
    for line, row in iter_rows(path):
        if "hash_ids" in row:
            return MOONCAKE
        if "block_hashes" in row:
            return REQUEST_LOG
        if "messages" in row or "prompt" in row:
            return BODIES
        raise LogError(
            path,
            line,
            "unknown trace format: expected 'hash_ids' (Mooncake), 'block_hashes' (kvprefix request "
            "log) or 'messages'/'prompt' (OpenAI request bodies)",
        )
    raise LogError(path, None, "the trace is empty")
