"""The part of a request the KV cache manager needs: its tokens, their block hashes, and progress."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvprefix.cache.hashing import BlockExtras, BlockHash, BlockHasher


class CacheRequest:
    """A token sequence whose full blocks are hashed incrementally, once each, as tokens arrive.

    Trace replay builds one from hashes alone (``from_block_hashes``), which cannot grow. ``eviction_group`` (the
    tenant; None: shared) matters only with eviction groups.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hasher: BlockHasher | None,
        extras: BlockExtras | None = None,
        eviction_group: Hashable = None,
    ):
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.token_ids: list[int] | None = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self._num_tokens = self.num_prompt_tokens
        self.hasher = hasher
        self.block_size = hasher.block_size if hasher is not None else None  # of the hashes; None: no hashes
        self.extras = extras
        self.eviction_group = eviction_group
        self.block_hashes: list[BlockHash] = []
        # Tokens whose KV is in the cache (computed, or taken from cached blocks).
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission; -1 until admitted.
        self.num_cached_tokens = -1
        self._update_block_hashes()

    @classmethod
    def from_block_hashes(
        cls,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        block_size: int,
        eviction_group: Hashable = None,
    ) -> CacheRequest:
        """A request known only by its full-block hashes (trace replay). Hashes may be any hashable ids."""
        if num_tokens < 1:
            raise ValueError(f"request {request_id!r}: num_tokens must be >= 1, got {num_tokens}")
        if len(block_hashes) != num_tokens // block_size:
            raise ValueError(
                f"request {request_id!r}: {len(block_hashes)} block hashes for {num_tokens} tokens "
                f"(block size {block_size} gives {num_tokens // block_size} full blocks)"
            )
        req = cls.__new__(cls)
        req.request_id = request_id
        req.token_ids = None
        req.num_prompt_tokens = req._num_tokens = num_tokens
        req.hasher = None
        req.block_size = block_size
        req.extras = None
        req.eviction_group = eviction_group
        req.block_hashes = list(block_hashes)
        req.num_computed_tokens = 0
        req.num_cached_tokens = -1
        return req

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self._num_tokens - self.num_prompt_tokens

    def append_token_ids(self, token_ids: Sequence[int]) -> None:
        """Appends generated tokens and hashes any blocks they complete."""
        if self.token_ids is None:
            raise ValueError(f"request {self.request_id!r} was built from block hashes and cannot grow")
        self.token_ids.extend(token_ids)
        self._num_tokens = len(self.token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self.hasher is None:
            return
        bs = self.hasher.block_size
        done = len(self.block_hashes)
        start = done * bs
        if self._num_tokens - start < bs:
            return
        parent = self.block_hashes[-1] if done else None
        self.block_hashes += self.hasher.hash_blocks(
            self.token_ids[start:], parent=parent, first_block_index=done, extras=self.extras
        )
