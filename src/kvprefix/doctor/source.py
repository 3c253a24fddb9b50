"""What every pass reads the log with (``Log``): its path and format, the block size, the renderer and the hashing;
and the log's entries in batches, with progress on stderr."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvprefix.doctor.hashing import Hashing
from kvprefix.doctor.rendering import Renderer
from kvprefix.logs import BODIES, REQUEST_LOG, LogEntry, LogError, SharedTools, detect_format, iter_entries

BATCH = 256  # entries rendered together: fewer calls into the template and the tokenizer, little memory


def log_format(path: str) -> str:
    """``BODIES`` or ``REQUEST_LOG``; any other trace is refused."""
    fmt = detect_format(path)
    if fmt not in (BODIES, REQUEST_LOG):
        raise LogError(path, None, f"kvprefix doctor reads OpenAI request bodies (JSONL with 'messages' or "
                                   f"'prompt') or a kvprefix request log, not a {fmt} trace")
    return fmt


@dataclass
class Log:
    """The log as every pass reads it."""

    path: str
    fmt: str
    block_size: int
    renderer: Renderer  # loads the tokenizer when first used: a hashes-only log needs none
    progress: str = "off"  # as ``Options.progress``
    progress_every_s: float = 10.0
    tools: SharedTools = field(default_factory=SharedTools)  # both passes read the same lists
    hashing: Hashing = field(init=False)

    def __post_init__(self) -> None:
        self.hashing = Hashing(self.block_size, self.renderer.hasher)

    @property
    def bodies(self) -> bool:
        return self.fmt == BODIES

    def chunks(self, desc: str) -> Iterator[list[LogEntry]]:
        """The entries, ``BATCH`` at a time; a bad line ends the entries after the ones before it were given."""
        entries = self._entries(desc)
        while True:
            chunk: list[LogEntry] = []
            error = None
            try:
                for e in entries:
                    chunk.append(e)
                    if len(chunk) == BATCH:
                        break
            except LogError as exc:
                error = exc
            if chunk:
                yield chunk
            if error is not None:
                raise error
            if len(chunk) < BATCH:
                return

    def _entries(self, desc: str) -> Iterator[LogEntry]:
        entries = iter_entries(self.path, self.fmt, self.tools)
        if self.progress == "lines":
            return _progress_lines(entries, desc, self._num_lines(), self.path, self.progress_every_s)
        if self.progress != "bar":
            return entries
        from tqdm import tqdm

        return tqdm(entries, desc=desc, unit="req", total=self._num_lines(), mininterval=0.5, leave=False)

    def _num_lines(self) -> int:
        with open(self.path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def _progress_lines(entries: Iterator[LogEntry], desc: str, lines: int, path: str,
                    every_s: float) -> Iterator[LogEntry]:
    """The entries, with a progress line on stderr every ``every_s`` seconds (for stderr to a file or pipe); a
    short job prints nothing."""
    start = time.monotonic()
    last = start
    for n, e in enumerate(entries, 1):
        if not n & 255:
            now = time.monotonic()
            if now - last >= every_s:
                last = now
                print(f"kvprefix doctor: {os.path.basename(path)}: {desc}: line {e.line} of {lines} "
                      f"({e.line / max(lines, 1):.0%}), {now - start:.0f} s", file=sys.stderr, flush=True)
        yield e
