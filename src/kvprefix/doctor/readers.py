"""The two logs the doctor reads, as one stream of ``LogEntry``: JSONL of OpenAI request bodies as clients send
them, and kvprefix's own server request log (``kvprefix.logs``). Errors name the file and the line."""

from __future__ import annotations

import json
import marshal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvprefix.cache import namespace_salt
from kvprefix.logs import LogError, RequestRecord, detect_format, iter_records, iter_rows
from kvprefix.prompts import PromptError, completion_prompts

BODIES, REQUEST_LOG = "openai", "request-log"


class DoctorInputError(ValueError):
    """Bad input: the message names the file and the 1-based line."""


@dataclass
class LogEntry:
    """One prompt of the log. ``body`` (an OpenAI body with one prompt) or ``text`` (rendered text from a request
    log written with prompts) is what can be rendered again; a hashes-only record has neither."""

    line: int
    timestamp: float | None  # seconds; None when the log gives no times
    namespace: str  # bodies: the namespace salt (tenant + cache_salt); request log: the public namespace id
    replica: str
    prefill_s: float | None  # how long the prompt took to compute, when the log says (ttft)
    body: dict[str, Any] | None = None
    text: str | None = None
    message_spans: list | None = None
    add_special_tokens: bool = False  # text: completions prompts are tokenized with BOS, chat text is not
    block_hashes: list[str] | None = None  # request log: the logged hashes (at ``source_block_size``)
    source_block_size: int | None = None
    prompt_tokens: int = 0
    miss_reason: str | None = None
    model: str = ""  # the model (or adapter) the request named


def log_format(path: str | Path) -> str:
    try:
        fmt = detect_format(path)
    except LogError as exc:
        raise DoctorInputError(str(exc)) from None
    if fmt not in (BODIES, REQUEST_LOG):
        raise DoctorInputError(f"{path}: kvprefix doctor reads OpenAI request bodies (JSONL with 'messages' or "
                               f"'prompt') or a kvprefix request log, not a {fmt} trace")
    return fmt


class SharedTools:
    """Equal tools lists read as one list, which knows its JSON: a log sends a few lists again on every request,
    and the doctor needs a list's JSON several times (grouping for the template, the tools fix, comparisons),
    each a ``json.dumps`` as slow as parsing the whole body. Up to ``limit`` distinct lists and ``limit_chars``
    characters of their JSON (a log whose every list differs gains nothing here); the lists are the doctor's own
    (read from the log, never changed: a fix makes a new list)."""

    def __init__(self, limit: int = 4096, limit_chars: int = 1 << 23) -> None:
        self.limit = limit
        self.limit_chars = limit_chars
        self._chars = 0
        self._by_bytes: dict[bytes, list] = {}
        self._json_of: dict[int, str] = {}  # by id: every list here is held by _by_bytes, so its id stays its own

    def share(self, tools: list) -> list:
        # marshal's bytes tell JSON values apart as JSON does (key order, 1 / 1.0 / true) at a quarter of the
        # cost; version 2 writes no back-references, so equal lists give equal bytes.
        key = marshal.dumps(tools, 2)
        known = self._by_bytes.get(key)
        if known is None and len(self._by_bytes) < self.limit and self._chars < self.limit_chars:
            known = self._by_bytes[key] = tools
            text = self._json_of[id(tools)] = json.dumps(tools)
            self._chars += len(text)
        return tools if known is None else known

    def json(self, tools: list) -> str:
        """``json.dumps(tools)``; looked up for a shared list."""
        text = self._json_of.get(id(tools))
        return json.dumps(tools) if text is None else text


def iter_entries(path: str | Path, fmt: str, tools: SharedTools | None = None) -> Iterator[LogEntry]:
    """``tools``: where bodies' tools lists are shared (a fresh one per call otherwise)."""
    return _iter_bodies(path, tools or SharedTools()) if fmt == BODIES else _iter_request_log(path)


def _iter_bodies(path: str | Path, tools: SharedTools) -> Iterator[LogEntry]:
    try:
        for line, row in iter_rows(path):
            yield from _body_entries(path, line, row, tools)
    except LogError as exc:  # not JSON, not an object
        raise DoctorInputError(str(exc)) from None


def _body_entries(path, line: int, row: dict[str, Any], tools: SharedTools) -> Iterator[LogEntry]:
    def bad(message: str) -> DoctorInputError:
        return DoctorInputError(f"{path}:{line}: {message}")

    ts = row.get("timestamp")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0):
        raise bad(f"field 'timestamp' must be a number of milliseconds >= 0, got {ts!r}")
    for key in ("tenant", "cache_salt", "replica", "model"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise bad(f"field {key!r} must be a string, got {row[key]!r}")
    common = dict(line=line, timestamp=None if ts is None else ts / 1000.0,
                  namespace=namespace_salt(row.get("tenant"), row.get("cache_salt")),
                  replica=row.get("replica") or "", prefill_s=None, model=row.get("model") or "")
    if "messages" in row:
        if not isinstance(row["messages"], list) or not row["messages"]:
            raise bad("'messages' must be a non-empty list")
        if row.get("tools") is not None:
            if not isinstance(row["tools"], list):
                raise bad("'tools' must be a list")
            row["tools"] = tools.share(row["tools"])
        yield LogEntry(body=row, **common)
        return
    if "prompt" not in row:
        raise bad("a request body needs 'messages' (chat) or 'prompt' (completions)")
    try:
        prompts = completion_prompts(row["prompt"])
    except PromptError as exc:
        raise bad(str(exc)) from None
    for prompt in prompts:  # a batch of prompts is one request per prompt, as the server runs it
        yield LogEntry(body={**row, "prompt": prompt}, **common)


def _iter_request_log(path: str | Path) -> Iterator[LogEntry]:
    try:
        for line, rec in iter_records(path):
            yield _record_entry(path, line, rec)
    except LogError as exc:
        raise DoctorInputError(str(exc)) from None


def _record_entry(path, line: int, rec: RequestRecord) -> LogEntry:
    if rec.block_size is None:
        raise DoctorInputError(f"{path}:{line}: missing field 'block_size'")
    if len(rec.block_hashes) != rec.prompt_tokens // rec.block_size:
        raise DoctorInputError(f"{path}:{line}: {len(rec.block_hashes)} block_hashes for {rec.prompt_tokens} "
                               f"prompt tokens, but {rec.block_size}-token blocks give "
                               f"{rec.prompt_tokens // rec.block_size}")
    ttft = rec.timings.get("ttft_s") if isinstance(rec.timings, dict) else None
    if not isinstance(ttft, (int, float)):
        ttft = None if rec.finish_time is None else max(0.0, rec.finish_time - rec.timestamp)
    return LogEntry(
        line=line, timestamp=float(rec.timestamp), namespace=rec.namespace, replica=rec.replica, prefill_s=ttft,
        text=rec.prompt, message_spans=rec.message_spans, add_special_tokens=rec.endpoint != "chat",
        block_hashes=rec.block_hashes, source_block_size=rec.block_size, prompt_tokens=rec.prompt_tokens,
        miss_reason=rec.miss_reason, model=rec.model,
    )
