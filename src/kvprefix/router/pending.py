"""What has been routed to a replica and has not finished: the load a policy weighs credit against.

Per replica: requests in flight, the prompt blocks those requests still have to prefill (the blocks the policy did
not predict cached; queued prefill), and their block hashes as a multiset (``PendingBlocks``). A view counts the
pending hashes as cached, as a router that remembers where it sent prefixes sees them; without this a burst of
requests with one new prefix looks uncached everywhere until the first of them finishes prefill. Used by the
planner's view, the HTTP router's and the Ray Serve router's alike; each ``Routed`` is settled exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence


class PendingBlocks:
    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}  # a plain dict: a subclass (Counter) makes every lookup slower

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._count

    def __len__(self) -> int:
        return len(self._count)

    def add(self, block_hashes: Sequence[Hashable]) -> None:
        count = self._count
        for h in block_hashes:
            count[h] = count.get(h, 0) + 1

    def drop(self, block_hashes: Sequence[Hashable]) -> None:
        count = self._count
        for h in block_hashes:
            if count[h] == 1:
                del count[h]
            else:
                count[h] -= 1

    def cached_prefix_blocks(self, block_hashes: Sequence[Hashable],
                             held: Callable[[Sequence[Hashable]], int] | None = None) -> int:
        """How many leading blocks of ``block_hashes`` are pending here or, by ``held`` (a replica's leading cached
        blocks of a chain), cached: the longest prefix of blocks each in one or the other, scanned in runs so that
        every lookup is an inline one (a view does this per replica and request, over every block)."""
        count, n = self._count, 0
        while True:
            for h in block_hashes[n:] if n else block_hashes:
                if h not in count:
                    break
                n += 1
            more = held(block_hashes[n:]) if held is not None and n < len(block_hashes) else 0
            if not more:
                return n
            n += more


class Outstanding:
    """One replica's unfinished work: ``requests`` in flight and ``queued_prefill_blocks`` still to compute."""

    def __init__(self) -> None:
        self.requests = 0
        self.queued_prefill_blocks = 0
        self.blocks = PendingBlocks()

    def add(self, block_hashes: Sequence[Hashable], prefill_blocks: int) -> Routed:
        """Counts one routed request: its hashes and the ``prefill_blocks`` it was not credited with."""
        self.requests += 1
        self.queued_prefill_blocks += prefill_blocks
        self.blocks.add(block_hashes)
        return Routed(self, block_hashes, prefill_blocks)


class Routed:
    """One request's share of a replica's ``Outstanding``. ``prefilled`` when its first token is out (its prefill
    no longer queues), ``finish`` however it ends (finished, failed, retried elsewhere, abandoned); both are
    idempotent, so every path may call them."""

    __slots__ = ("_of", "_block_hashes", "_prefill_blocks", "_finished")

    def __init__(self, of: Outstanding, block_hashes: Sequence[Hashable], prefill_blocks: int):
        self._of = of
        self._block_hashes = block_hashes
        self._prefill_blocks = prefill_blocks
        self._finished = False

    def prefilled(self) -> None:
        if self._prefill_blocks:
            self._of.queued_prefill_blocks -= self._prefill_blocks
            self._prefill_blocks = 0

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self.prefilled()
        self._of.requests -= 1
        self._of.blocks.drop(self._block_hashes)
