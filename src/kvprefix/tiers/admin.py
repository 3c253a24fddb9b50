"""An operator's tools for a tier directory: what it holds, a full checksum pass, an atomic clear.

They read the directory as any process does (no server needed, none stopped): ``summary`` reads each object's
header only, ``verify`` reads and checks every object whole (and can delete the bad ones), ``clear`` renames the
objects folder away in one step, so every object disappears at once for every reader, then deletes it.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvprefix.tiers import disk_layout as layout
from kvprefix.tiers.objects import MAX_HEADER_BYTES, PREFIX_SIZE, ObjectError, decode, decode_header

Progress = Callable[[int, int], None]  # (objects done, objects in all)


@dataclass
class Summary:
    bytes: int = 0
    blocks: int = 0
    unreadable: int = 0  # objects whose header does not parse (verify says why)
    namespaces: Counter = field(default_factory=Counter)  # namespace id -> blocks
    models: Counter = field(default_factory=Counter)  # "model fingerprint kv_dtype" -> blocks
    retained: Counter = field(default_factory=Counter)  # tenant -> blocks retained now (docs/tiers.md#retention)

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "blocks": self.blocks, "unreadable": self.unreadable,
                "namespaces": dict(self.namespaces), "models": dict(self.models), "retained": dict(self.retained)}


@dataclass
class Report:
    checked: int = 0
    ok: int = 0
    bytes: int = 0
    bad: Counter = field(default_factory=Counter)  # reason -> objects
    deleted: int = 0

    def to_dict(self) -> dict:
        return {"checked": self.checked, "ok": self.ok, "bytes": self.bytes, "bad": dict(self.bad),
                "deleted": self.deleted}


def _check_tier(root: str) -> None:
    if not layout.is_tier(root):
        raise ValueError(f"{root} is not a kvprefix tier directory (no {layout.MARKER} file)")


def summary(root: str) -> Summary:
    """Bytes, blocks, and blocks per namespace and per model, from the objects' headers; retained blocks per
    tenant, from the retention notes."""
    _check_tier(root)
    out = Summary()
    for e in layout.iter_objects(root):
        out.bytes += e.size
        out.blocks += 1
        try:
            with open(e.path, "rb") as f:
                head = decode_header(f.read(PREFIX_SIZE + MAX_HEADER_BYTES))
        except (OSError, ObjectError):
            out.unreadable += 1
            continue
        out.namespaces[head.namespace] += 1
        out.models[f"{head.spec.model} {head.spec.kv_dtype}"] += 1
    now = time.time()
    for _, until, tenant in layout.iter_retained(root):
        if until > now:
            out.retained[tenant] += 1
    return out


def verify(root: str, delete: bool = False, progress: Progress | None = None) -> Report:
    """Reads every object whole and checks its checksum, its header, and that it sits under its own hash."""
    _check_tier(root)
    entries = list(layout.iter_objects(root))
    report = Report()
    for i, e in enumerate(entries, start=1):
        report.checked += 1
        try:
            with open(e.path, "rb") as f:
                obj = decode(f.read())
            if obj.block_hash != e.block_hash:
                raise ObjectError("misplaced", "the object is another block's")
            report.ok += 1
            report.bytes += e.size
        except FileNotFoundError:
            report.checked -= 1  # evicted meanwhile
        except (OSError, ObjectError) as exc:
            report.bad[getattr(exc, "reason", "io")] += 1
            if delete:
                try:
                    os.unlink(e.path)
                    report.deleted += 1
                except OSError:
                    pass
        if progress is not None:
            progress(i, len(entries))
    return report


def clear(root: str) -> int:
    """Removes every object atomically (one rename); returns how many there were."""
    _check_tier(root)
    objects = os.path.join(root, layout.OBJECTS)
    doomed = os.path.join(root, f"{layout.OBJECTS}.cleared-{uuid.uuid4().hex}")
    os.rename(objects, doomed)
    os.makedirs(objects, mode=0o700, exist_ok=True)
    count = sum(len(files) for _, _, files in os.walk(doomed))
    shutil.rmtree(doomed, ignore_errors=True)
    return count
