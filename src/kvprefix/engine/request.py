"""A request as the engine sees it: the cache's token/hash state plus the sampling and stopping state of one sample."""

from __future__ import annotations

import copy
import enum
from collections.abc import Sequence
from typing import Any

from kvprefix.cache import BlockHasher, CacheRequest
from kvprefix.engine.outputs import Logprob
from kvprefix.engine.sampling_params import SamplingParams
from kvprefix.engine.text import SampleText
from kvprefix.model.lora import LoraAdapter
from kvprefix.tokenizer import Tokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request(CacheRequest):
    """One sample of a user request (``index`` 0..n-1); samples share the prompt's blocks like any common prefix."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        hasher: BlockHasher,
        *,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        tokenizer: Tokenizer,
        index: int = 0,
        eviction_group: str | None = None,
        lora: LoraAdapter | None = None,
        lora_name: str | None = None,
    ):
        super().__init__(request_id, prompt_token_ids, hasher, eviction_group=eviction_group)
        self.params = params
        self.index = index
        self.lora = lora  # the adapter it runs with (held to the end, whatever is unloaded meanwhile), and its name
        self.lora_name = lora_name
        # Waiting behind a running request's in-flight prompt blocks: (first uncached block, step the wait ends).
        self.inflight_wait: tuple[int, int] | None = None
        self.queued_step = 0  # the scheduler step it was queued at (cache-aware admission ages requests by it)
        self.num_preemptions = 0  # times it lost its blocks and went back to the queue
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.ended_by_token = False  # finished by an EOS or stop token (whose text shows only if asked for)
        self.generator: Any = None  # a torch.Generator for seeded sampling, made by the sampler on first use
        # Only a sample whose text decides when it stops is detokenized on the engine thread.
        self.text = SampleText(tokenizer, prompt_token_ids, params) if params.text_decides_stop else None
        # Per prompt position: that token's logprobs (none at 0), filled by prefill; only sample 0 scores the prompt.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] * self.num_prompt_tokens if params.prompt_logprobs is not None and index == 0 else None)
        self.matcher: Any = None  # an llguidance matcher under structured outputs (engine.structured)
        self.tier_tokens: dict[str, int] = {}  # prompt tokens loaded from each lower tier before first admission
        self.tier_probe: tuple[int, int] | None = None  # the block range last asked of the tiers (asked once)

    def fork(self, request_id: str) -> Request:
        """Another beam of the same search (engine beam search): its tokens and their block hashes so far (copied,
        not rehashed), its progress and its sampling (a seeded search's beams draw from one generator); nothing the
        scheduler keeps. The caller gives it blocks (``Scheduler.fork``) or queues it to recompute from hits."""
        child = copy.copy(self)
        child.request_id = request_id
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        child.inflight_wait = None
        child.num_preemptions = 0
        child.tier_tokens, child.tier_probe = {}, None
        return child

    def cached_tokens_by_tier(self) -> dict[str, int]:
        """Of the cached tokens at first admission, those loaded from each lower tier (the rest came from the pool);
        empty when none was."""
        left, out = max(0, self.num_cached_tokens), {}
        for tier, n in self.tier_tokens.items():
            out[tier] = min(n, left)
            left -= out[tier]
        return out

    @property
    def skips_cache_reads(self) -> bool:
        """Prompt logprobs need every prompt token's logits, which a cache hit would not compute (until they are
        taken)."""
        return self.prompt_logprobs is not None

    def under_minimum(self) -> bool:
        """Whether the next token must not be EOS or a stop token: min_tokens or min_characters not reached yet."""
        return self.num_output_tokens < self.params.min_tokens or self._under_min_characters()

    def _under_min_characters(self) -> bool:
        return self.text is not None and len(self.text.text) < self.params.min_characters

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        """Appends a sampled token and decides whether the sample is finished."""
        self.append_token_ids([token_id])
        if self.matcher is not None and not self.matcher.consume_token(token_id):
            raise ValueError(f"structured outputs: token {token_id} left the grammar: {self.matcher.get_error()}")
        params = self.params
        text = self.text
        # An EOS or stop token ends the sample; its text is shown only with include_stop_str_in_output.
        # Nothing stops it yet (the sampler keeps EOS out): under min_tokens counting this token, or under
        # min_characters before it.
        if self.num_output_tokens < params.min_tokens or self._under_min_characters():
            if text is not None:
                text.add(token_id, find_stops=False)
            if self.num_output_tokens >= self.max_tokens:
                self._finish("length", None)
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            self._finish("stop", None, token_id)
        elif token_id in params.stop_token_set:
            self._finish("stop", token_id, token_id)
        elif text is not None and (stop := text.add(token_id)) is not None:
            self._finish("stop", stop)
        elif self.num_output_tokens >= self.max_tokens:
            self._finish("length", None)
        if not self.finished and self.matcher is not None and self.matcher.is_stopped():
            self._finish("stop", None)  # the grammar allows nothing more

    def _finish(self, reason: str, stop_reason: int | str | None, final_token: int | None = None) -> None:
        if final_token is not None and self.text is not None:
            self.text.add_final(final_token, self.params.include_stop_str_in_output)
        self.ended_by_token = final_token is not None
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.status = RequestStatus.FINISHED

    def abort(self) -> None:
        self.finish_reason = "abort"
        self.status = RequestStatus.FINISHED

    def set_prompt_logprobs(self, first_position: int, entries: list[dict[int, Logprob]]) -> None:
        """Stores the logprobs of prompt tokens ``first_position`` on (recomputed after a preemption: overwritten)."""
        self.prompt_logprobs[first_position : first_position + len(entries)] = entries

    def take_prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt logprobs, once: the request then reads the cache like any other."""
        out, self.prompt_logprobs = self.prompt_logprobs, None
        return out
