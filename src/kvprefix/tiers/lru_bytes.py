"""The byte budget's view of a tier: every stored item's size, least recently used first, and their total.

One implementation for the disk tier (``DiskStore``, under its lock) and the planner's simulated tier
(``kvprefix simulate --disk-capacity``), so the simulation evicts exactly as the tier does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator


class LRUBytes:
    """``touch(key, size)`` records an item as most recently used, ``victims(n)`` names the least recently used
    ones whose sizes add up to at least ``n`` bytes (passing over those ``keep`` says to keep), ``forget`` drops
    one. Not thread-safe: its owner locks."""

    def __init__(self, entries: Iterable[tuple[Hashable, int]] = ()):
        self._sizes: OrderedDict[Hashable, int] = OrderedDict()
        self.usage = 0
        for key, size in entries:
            self.touch(key, size)

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sizes

    def __iter__(self) -> Iterator[Hashable]:
        """Keys, least recently used first."""
        return iter(self._sizes)

    def size(self, key: Hashable) -> int:
        """The item's size, 0 if it is not held."""
        return self._sizes.get(key, 0)

    def touch(self, key: Hashable, size: int) -> None:
        """Records (or refreshes) the item as most recently used, with its size."""
        old = self._sizes.pop(key, None)
        self.usage += size - (old or 0)
        self._sizes[key] = size

    def refresh(self, key: Hashable) -> None:
        """Makes a held item the most recently used (nothing if it is not held)."""
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def forget(self, key: Hashable) -> int | None:
        """Drops the item; its size, or None if it was not held."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self.usage -= size
        return size

    def room_needed(self, key: Hashable, size: int, budget: int) -> int:
        """Bytes to free before ``key`` of ``size`` bytes fits in ``budget`` (an item stored again replaces itself:
        it is neither room to make nor a victim, so it is refreshed first)."""
        self.refresh(key)
        return self.usage - self.size(key) + size - budget

    def victims(self, num_bytes: int, keep: Callable[[Hashable], bool] | None = None) -> list[tuple[Hashable, int]]:
        """Least recently used items (key, size) adding up to ``num_bytes`` or more, or all there are; those
        ``keep`` says to keep are passed over. Nothing is dropped: the caller forgets what it deleted."""
        out, planned = [], 0
        for key, size in self._sizes.items():
            if planned >= num_bytes:
                break
            if keep is None or not keep(key):
                out.append((key, size))
                planned += size
        return out
