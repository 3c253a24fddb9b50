"""The request log: one versioned JSONL schema, written by the server, read by the planner and the doctor.

One line per prompt, written when its request ends: what a miss diagnosis needs, and the prompt text only when
asked for. docs/request-log.md documents every field.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

from kvprefix.logs.rows import LogError

FORMAT_VERSION = 2
_log = logging.getLogger("kvprefix.logs")


@dataclass
class RequestRecord:
    """One prompt. The first four fields are what any replay needs; the server writes every field."""

    timestamp: float  # arrival, Unix epoch seconds
    prompt_tokens: int
    block_hashes: list[str]  # hex, full prompt blocks only, parent-chained, in the request's namespace
    output_tokens: int  # sum over the n choices
    block_size: int | None = None  # None only in hand-made logs (readers then need it given)
    hash_algo: str = ""
    cached_tokens: int = 0  # also the position of the first uncached token: the cache serves a prefix
    request_id: str = ""
    endpoint: str = ""  # "completions" or "chat"
    model: str = ""
    tenant: str = ""  # pseudonym (http.tenancy.pseudonym)
    n: int = 1
    finish_reasons: list[str] = field(default_factory=list)
    timings: dict[str, float | None] = field(default_factory=dict)  # seconds: ttft_s (None: no token), e2e_s
    status: str = "ok"  # or "aborted" (client went away or server shut down)
    salted: bool = False  # True when a tenant or cache_salt salted the hashes (they then match no unsalted hash)
    prompt_cache_key: str | None = None
    user: str | None = None  # pseudonymized like the tenant
    prompt: str | None = None  # rendered text, only with --request-log-prompts
    # since v2:
    finish_time: float | None = None  # Unix epoch seconds
    namespace: str = ""  # public namespace id (cache.identity.namespace_id), never the salt
    replica: str = ""  # the server's --replica-id
    miss_reason: str | None = None  # why the tokens after cached_tokens missed (a cache_detail reason code)
    message_spans: list[list[int] | None] | None = None  # chat, with the prompt: [start, end) of each message
    disk_cached_tokens: int = 0  # of cached_tokens, those loaded from the disk tier (--kv-disk)
    shared_cached_tokens: int = 0  # of cached_tokens, those loaded from the shared tier (--kv-shared)
    v: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> RequestRecord:
        """Validates a parsed line (any version up to ours); raises ValueError naming the bad field."""
        version = row.get("v", 1)
        if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
            raise ValueError(f"unsupported request-log version {version!r} (this reader knows 1 to {FORMAT_VERSION})")
        missing = next((name for name in _REQUIRED if name not in row), None)
        if missing is not None:
            raise ValueError(f"missing field {missing!r}")
        for name, kinds in _TYPES.items():
            value = row.get(name)
            if name in row and (isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds)):
                raise ValueError(f"field {name!r} has the wrong type: {value!r}")
        if row["prompt_tokens"] < 1:
            raise ValueError("field 'prompt_tokens' must be >= 1")
        block_size = row.get("block_size")
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 1):
            raise ValueError(f"field 'block_size' must be an integer >= 1, got {block_size!r}")
        if not all(isinstance(h, str) for h in row["block_hashes"]):
            raise ValueError("block_hashes must be hex strings")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in known})


# Fields every record has, with their JSON types: what a replay cannot do without.
_REQUIRED: dict[str, tuple[type, ...]] = {
    "timestamp": (int, float),
    "prompt_tokens": (int,),
    "block_hashes": (list,),
    "output_tokens": (int,),
}
_NUMBER_OR_NULL = (int, float, type(None))
_STR_OR_NULL = (str, type(None))
# The JSON types of every field a reader may use, checked where present.
_TYPES: dict[str, tuple[type, ...]] = _REQUIRED | {
    "cached_tokens": (int,), "n": (int,), "finish_time": _NUMBER_OR_NULL, "namespace": (str,), "replica": (str,),
    "tenant": (str,), "miss_reason": _STR_OR_NULL, "prompt": _STR_OR_NULL, "prompt_cache_key": _STR_OR_NULL,
    "user": _STR_OR_NULL, "timings": (dict,), "status": (str,), "message_spans": (list, type(None)),
    "disk_cached_tokens": (int,), "shared_cached_tokens": (int,),
}


def iter_records(path: str | Path, torn: list[int] | None = None) -> Iterator[tuple[int, RequestRecord]]:
    """(line number, record) for each record of a request log.

    A non-JSON line (torn by a crash mid-write) is skipped, its number appended to ``torn``; a JSON line that is
    not a valid record is an error.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError:
                if torn is not None:
                    torn.append(line_no)
                continue
            if not isinstance(row, dict):
                raise LogError(path, line_no, f"expected a JSON object, got {type(row).__name__}")
            try:
                yield line_no, RequestRecord.from_dict(row)
            except (ValueError, TypeError) as exc:
                raise LogError(path, line_no, str(exc)) from None


class RequestLogWriter:
    """Appends records as JSON lines, one write call per line so the file can be tailed while serving.

    A failed write loses that record, never the request: it is counted (``errors``, ``on_error``), warned about
    once, and the next record starts a new line, so the cut one stays a torn line readers skip.
    """

    def __init__(self, path: str, include_prompts: bool = False, on_error: Callable[[], None] | None = None):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.include_prompts = include_prompts
        self.errors = 0
        self._on_error = on_error
        # Unbuffered: a failed write leaves nothing pending that a later write would emit half of.
        self._file: IO[bytes] | None = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._torn = _ends_torn(path)  # a crash cut the last line: end it before the next record

    def write(self, record: RequestRecord) -> None:
        if self._file is None:
            return
        if not self.include_prompts:
            record.prompt = None
            record.message_spans = None
        rest = memoryview((("\n" if self._torn else "") + record.to_json() + "\n").encode())
        try:
            while rest:  # a write may be partial
                rest = rest[self._file.write(rest):]
        except OSError as exc:
            self._torn = True
            self.errors += 1
            if self.errors == 1:
                _log.warning("request log %s: cannot write (%s); requests are served on, and lost records are "
                             "counted in kvprefix:request_log_errors_total", self.path, exc)
            if self._on_error is not None:
                self._on_error()
            return
        self._torn = False

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _ends_torn(path: str) -> bool:
    size = os.path.getsize(path)
    if size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) != b"\n"
