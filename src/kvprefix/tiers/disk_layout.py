"""Where a disk tier keeps its objects, how its directory is checked at start, and the start-up scan.

``DIR/kvprefix-tier`` marks a tier directory (``cache clear`` refuses any other); ``DIR/objects/ab/<hash hex>``
holds one object per block, fanned out by the hash's first byte, and beside a retained one (``--kv-retention``)
``<hash hex>.ret``: its tenant's name, and as its mtime the time it is kept until; ``DIR/tmp/`` holds writes in progress, renamed
into place when complete (a kill -9 leaves only a temporary file, removed by a later start). Directories are
0700 and files 0600: a reader of the directory learns token ids and KV (docs/security.md).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvprefix.paths import check_writable_dir

MARKER = "kvprefix-tier"
OBJECTS = "objects"
TMP = "tmp"
SUFFIX = ".kvb"
RETAINED_SUFFIX = ".ret"
STALE_TMP_SECONDS = 600  # a temporary file this old belongs to a writer that died
PROGRESS_EVERY = 10_000


def object_path(root: str, block_hash: bytes) -> str:
    name = block_hash.hex()
    return os.path.join(root, OBJECTS, name[:2], name + SUFFIX)


def retention_path(root: str, block_hash: bytes) -> str:
    """The retention note beside a block's object (mtime: kept until; content: the tenant)."""
    return object_path(root, block_hash)[: -len(SUFFIX)] + RETAINED_SUFFIX


def hash_of(filename: str) -> bytes | None:
    """The block hash an object's file name carries, or None for anything else."""
    if not filename.endswith(SUFFIX):
        return None
    try:
        return bytes.fromhex(filename[: -len(SUFFIX)])
    except ValueError:
        return None


def prepare(root: str) -> str:
    """Creates or checks a tier directory; ValueError with one line saying why it cannot be used."""
    root = check_writable_dir(root, "--kv-disk")  # a PathError is a ValueError
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        for sub in (OBJECTS, TMP):
            os.makedirs(os.path.join(root, sub), mode=0o700, exist_ok=True)
        probe = os.path.join(root, TMP, f"probe.{os.getpid()}")
        with open(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
        marker = os.path.join(root, MARKER)
        if not os.path.exists(marker):
            with open(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write("a kvprefix KV tier (docs/tiers.md)\n")
    except OSError as exc:
        why = "read-only file system" if exc.errno == errno.EROFS else (exc.strerror or str(exc))
        raise ValueError(f"--kv-disk {root} cannot be written: {why}") from None
    return root


def is_tier(root: str) -> bool:
    return os.path.isfile(os.path.join(root, MARKER))


@dataclass(frozen=True)
class Entry:
    block_hash: bytes
    size: int
    mtime: float
    path: str


def _fanned_files(root: str) -> Iterator[os.DirEntry]:
    """Every file in the fan-out folders of ``root``'s objects, folder by folder (vanishing folders skipped)."""
    try:
        fans = sorted(os.scandir(os.path.join(root, OBJECTS)), key=lambda e: e.name)
    except FileNotFoundError:
        return
    for fan in fans:
        if not fan.is_dir(follow_symlinks=False):
            continue
        try:
            yield from list(os.scandir(fan.path))
        except FileNotFoundError:
            continue


def iter_objects(root: str) -> Iterator[Entry]:
    """Every object file under ``root``, in directory order (files vanishing meanwhile are skipped)."""
    for e in _fanned_files(root):
        h = hash_of(e.name)
        if h is None:
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        yield Entry(h, st.st_size, st.st_mtime, e.path)


def iter_retained(root: str) -> Iterator[tuple[bytes, float, str]]:
    """(block hash, kept until, tenant) of every retention note under ``root`` (vanishing ones skipped)."""
    for e in _fanned_files(root):
        if not e.name.endswith(RETAINED_SUFFIX):
            continue
        try:
            block_hash = bytes.fromhex(e.name[: -len(RETAINED_SUFFIX)])
            with open(e.path, "rb") as f:
                tenant = f.read(1024).decode("utf-8", "replace")
            yield block_hash, os.stat(e.path).st_mtime, tenant
        except (ValueError, OSError):
            continue


def scan(root: str, progress: Callable[[int], None] | None = None) -> list[Entry]:
    """Every object, least recently used first (by mtime, which loads touch); ``progress(n)`` every
    ``PROGRESS_EVERY`` files on a large directory. Removes stale temporary files."""
    out = []
    for e in iter_objects(root):
        out.append(e)
        if progress is not None and len(out) % PROGRESS_EVERY == 0:
            progress(len(out))
    remove_stale_tmp(root)
    out.sort(key=lambda e: e.mtime)
    return out


def remove_stale_tmp(root: str, older_than: float = STALE_TMP_SECONDS) -> int:
    """Deletes temporary files of writers that died (another live process's recent ones are left alone)."""
    removed, now = 0, time.time()
    try:
        entries = list(os.scandir(os.path.join(root, TMP)))
    except FileNotFoundError:
        return 0
    for e in entries:
        try:
            if now - e.stat(follow_symlinks=False).st_mtime > older_than:
                os.unlink(e.path)
                removed += 1
        except FileNotFoundError:
            pass
    return removed
