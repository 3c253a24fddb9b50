"""How the doctor hashes a rendering: in the request's namespace, with a LoRA adapter in every block's extra keys,
as the engine hashes it. The doctor's hashes are only compared with each other."""

from __future__ import annotations

from kvprefix.cache import BlockExtras, BlockHasher, LoraKey
from kvprefix.doctor.divergence import Rendered
from kvprefix.logs import LogEntry

HASH_ALGO = "xxhash"  # the fast algorithm of kvprefix.cache: the doctor's hashes never leave it

Space = tuple[str, str]  # where a request's blocks live: (namespace, adapter; "" = the base model)


def doctor_hasher(block_size: int) -> BlockHasher:
    """The one place the doctor builds a hasher."""
    return BlockHasher(block_size, HASH_ALGO)


def space_of(entry: LogEntry, base_model: str) -> Space:
    """The entry's namespace and adapter: any model but the base model (the first request's) is an adapter."""
    return entry.namespace, "" if entry.model == base_model else entry.model


class Hashing:
    """Hashes renderings at one block size (or with another hasher), one ``BlockExtras`` per adapter."""

    def __init__(self, block_size: int):
        self.hasher = doctor_hasher(block_size)
        self._extras: dict[str, BlockExtras] = {}

    def __call__(self, rendered: Rendered, space: Space, hasher: BlockHasher | None = None) -> list[bytes]:
        salt, adapter = space
        extras = None
        if adapter:
            extras = self._extras.get(adapter) or self._extras.setdefault(adapter, BlockExtras(LoraKey(adapter, "")))
        return (hasher or self.hasher).with_salt(salt).hash_blocks(rendered.token_ids, extras=extras)
