"""How the doctor hashes a rendering: in the request's namespace, with a LoRA adapter in every block's extra keys,
as the engine hashes it, under the identity the renderer was given (``Renderer.hasher``)."""

from __future__ import annotations

from collections.abc import Callable

from kvprefix.cache import BlockHasher
from kvprefix.doctor.divergence import Rendered
from kvprefix.logs import AdapterNames, LogEntry, adapter_extras

Space = tuple[str, str]  # where a request's blocks live: (namespace, adapter; "" = the base model)


def space_of(entry: LogEntry, adapters: AdapterNames) -> Space:
    """The entry's namespace and adapter."""
    return entry.namespace, adapters.adapter(entry.model)


class Hashing:
    """Hashes renderings at one block size (or with another hasher), an adapter's by its name (``logs.adapters``).
    ``hasher_of(block_size)`` is asked only when a rendering is hashed: a hashes-only log loads no tokenizer."""

    def __init__(self, block_size: int, hasher_of: Callable[[int], BlockHasher]):
        self.block_size = block_size
        self._hasher_of = hasher_of

    def __call__(self, rendered: Rendered, space: Space, hasher: BlockHasher | None = None) -> list[bytes]:
        salt, adapter = space
        return (hasher or self._hasher_of(self.block_size)).with_salt(salt).hash_blocks(
            rendered.token_ids, extras=adapter_extras(adapter))
