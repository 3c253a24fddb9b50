"""In-flight prefix sharing: a waiting request whose next uncached prompt blocks a running request is computing
waits for them and then hits. Without it, requests arriving together with one cold prefix all compute it (the hash
map knows a block only once its KV is written); the n samples of a request are the same case.
"""

from __future__ import annotations

from kvprefix.cache import BlockHash, cdiv
from kvprefix.engine.request import Request


class InflightPrefixes:
    """Which running request (the leader) will compute each not-yet-cached full prompt block, by block hash.

    A follower waits at most the steps computing those blocks itself would take, so sharing never delays it; a
    leader that leaves the running set leaves the map at once, and its followers are admitted that same step.
    """

    def __init__(self, block_size: int, max_num_batched_tokens: int):
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self._leader_of: dict[BlockHash, Request] = {}
        self.num_waits = 0  # waits behind a leader (each counted once, however many steps it lasted)

    def add(self, req: Request) -> None:
        """A request was admitted: the full prompt blocks after its hits are in flight (first leader kept)."""
        leader_of = self._leader_of
        for h in req.block_hashes[req.num_computed_tokens // self.block_size : self._num_prompt_blocks(req)]:
            leader_of.setdefault(h, req)

    def remove(self, req: Request) -> None:
        """A request left the running set (finished, aborted or preempted): it leads nothing any more."""
        leader_of = self._leader_of
        for h in req.block_hashes[: self._num_prompt_blocks(req)]:
            if leader_of.get(h) is req:
                del leader_of[h]

    def should_wait(self, req: Request, num_hit_blocks: int, step: int) -> bool:
        """True while ``req``'s next uncached block is in flight and its wait (bounded when it starts) has not run
        out. A wait that ends in hits may be followed by one for a later block, never the same one."""
        hashes = req.block_hashes
        max_blocks = (req.num_tokens - 1) // self.block_size  # the block of the last token is never a hit
        leader_of = self._leader_of
        if num_hit_blocks >= max_blocks or hashes[num_hit_blocks] not in leader_of:
            return False
        wait = req.inflight_wait
        if wait is None or wait[0] != num_hit_blocks:  # a new wait (an earlier one ended in hits: progress)
            run = num_hit_blocks
            while run < max_blocks and hashes[run] in leader_of:
                run += 1
            tokens = (run - num_hit_blocks) * self.block_size
            wait = req.inflight_wait = (num_hit_blocks, step + cdiv(tokens, self.max_num_batched_tokens))
            self.num_waits += 1
        return step < wait[1]

    def _num_prompt_blocks(self, req: Request) -> int:
        return min(req.num_prompt_tokens // self.block_size, len(req.block_hashes))
