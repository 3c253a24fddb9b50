"""A request as the engine sees it: the cache's token/hash state plus the sampling and stopping state of one sample."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from kvprefix.cache import BlockHasher, CacheRequest
from kvprefix.engine.sampling_params import SamplingParams
from kvprefix.engine.text import SampleText
from kvprefix.prompts import Tokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request(CacheRequest):
    """One sample of a user request (a request with ``n`` samples becomes ``n`` of these, ``index`` 0..n-1).

    Samples of one prompt share its blocks like any requests with a common prefix: the later ones wait behind
    the first while it computes them (``InflightPrefixes``), then hit them.
    """

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
    ):
        super().__init__(request_id, prompt_token_ids, hasher, eviction_group=eviction_group)
        self.params = params
        self.index = index
        # Waiting behind a running request's in-flight prompt blocks: (first uncached block, step the wait ends).
        self.inflight_wait: tuple[int, int] | None = None
        self.queued_step = 0  # the scheduler step it was queued at (cache-aware admission ages requests by it)
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator: Any = None  # a torch.Generator for seeded sampling, made by the sampler on first use
        # Only a sample with stop strings is detokenized on the engine thread: its text decides when it stops. The
        # others are detokenized by whoever reads the outputs (OutputState), off the model step.
        self.text = SampleText(tokenizer, prompt_token_ids, params) if params.stop_strings else None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        """Appends a sampled token and decides whether the sample is finished."""
        self.append_token_ids([token_id])
        params = self.params
        # An EOS or stop token ends the sample; its text is shown only with include_stop_str_in_output.
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self._finish("stop", None, token_id)
        elif token_id in params.stop_token_set:
            self._finish("stop", token_id, token_id)
        elif self.text is not None and (stop := self.text.add(token_id)) is not None:
            self._finish("stop", stop)
        elif self.num_output_tokens >= self.max_tokens:
            self._finish("length", None)

    def _finish(self, reason: str, stop_reason: int | str | None, final_token: int | None = None) -> None:
        if final_token is not None and self.text is not None:
            self.text.add_final(final_token, self.params.include_stop_str_in_output)
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.status = RequestStatus.FINISHED

    def abort(self) -> None:
        self.finish_reason = "abort"
        self.status = RequestStatus.FINISHED
