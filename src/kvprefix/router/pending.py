"""What has been routed to a replica and has not finished: the load a policy weighs credit against.

Per replica: requests in flight, the prompt blocks those requests still have to prefill (the blocks the policy did
not predict cached; queued prefill), and their block hashes as a multiset (``PendingBlocks``). A view counts the
pending hashes as cached, as a router that remembers where it sent prefixes sees them; without this a burst of
requests with one new prefix looks uncached everywhere until the first of them finishes prefill. Used by the
planner's view, the HTTP router's and the Ray Serve router's alike; each ``Routed`` is settled exactly once.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Sequence

from kvprefix.cache import leading_blocks_in


class PendingBlocks:
    """The blocks of the requests in flight, as a multiset of chains: which blocks are pending here.

    Block hashes are parent-chained (a hash names its whole prefix: the router's ``BlockHasher``, the planner's
    ``ChainedIds``), so the chains in flight form a tree, kept flat: each block's parent and its references (the
    chains that end at it, plus its child blocks). Adding a request walks back from its last block to the first
    one already pending, dropping it walks back while blocks lose their last reference, so both touch only the
    blocks that no other request in flight has (a shared system prompt's blocks are counted once, not once per
    request). The blocks pending are exactly those of the chains in flight."""

    def __init__(self) -> None:
        self._refs: dict[Hashable, int] = {}
        self._parent: dict[Hashable, Hashable | None] = {}

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    def add(self, block_hashes: Sequence[Hashable]) -> None:
        refs, parent = self._refs, self._parent
        # One reference to the last block (the chain ends there), one to each earlier block from its child.
        for i in range(len(block_hashes) - 1, -1, -1):
            h = block_hashes[i]
            if h in refs:  # already pending, and so is every block before it
                refs[h] += 1
                return
            refs[h] = 1
            parent[h] = block_hashes[i - 1] if i else None

    def drop(self, block_hashes: Sequence[Hashable]) -> None:
        if not block_hashes:
            return
        refs, parent = self._refs, self._parent
        h = block_hashes[-1]
        while h is not None:
            if refs[h] > 1:
                refs[h] -= 1
                return
            del refs[h]
            h = parent.pop(h)

    def cached_prefix_blocks(self, block_hashes: Sequence[Hashable], held: Container[Hashable] | None = None) -> int:
        """How many leading blocks of ``block_hashes`` are pending here or in ``held`` (what the replica caches):
        the longest prefix of blocks each in one or the other. The pending blocks are whole chains, so they are a
        prefix of the request's (found by bisection); the cached ones may follow them, and no pending block can
        follow those (it would make the blocks before it pending too)."""
        n = leading_blocks_in(self._refs, block_hashes, prefix_closed=True)
        if held is not None and n < len(block_hashes):
            n += leading_blocks_in(held, block_hashes[n:])
        return n


class Outstanding:
    """One replica's unfinished work: ``requests`` in flight and ``queued_prefill_blocks`` still to compute."""

    def __init__(self) -> None:
        self.requests = 0
        self.queued_prefill_blocks = 0
        self.blocks = PendingBlocks()

    def add(self, block_hashes: Sequence[Hashable], prefill_blocks: float) -> Routed:
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

    def __init__(self, of: Outstanding, block_hashes: Sequence[Hashable], prefill_blocks: float):
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
