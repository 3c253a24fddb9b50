"""A request as the engine sees it: the cache's token/hash state plus sampling and output state of one sample."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from kvprefix.cache import BlockHasher, CacheRequest
from kvprefix.engine.outputs import CompletionOutput, Logprob
from kvprefix.engine.sampling_params import SamplingParams
from kvprefix.model.tokenizer import IncrementalDetokenizer
from kvprefix.prompts import Tokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request(CacheRequest):
    """One sample of a user request (a request with ``n`` samples becomes ``n`` of these, ``index`` 0..n-1).

    ``leader`` is sample 0 of the same prompt: the other samples wait until its prompt blocks are cached, then
    share them through the prefix cache instead of computing the prompt again.
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
        leader: Request | None = None,
        eviction_group: str | None = None,
    ):
        super().__init__(request_id, prompt_token_ids, hasher, eviction_group=eviction_group)
        self.params = params
        self.index = index
        self.leader = leader
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.generator: Any = None  # a torch.Generator for seeded sampling, made by the sampler on first use
        # Per prompt position: the logprobs of that prompt token (position 0 has none), filled as prefill runs.
        # Only sample 0 scores the prompt; the others share its blocks.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] * self.num_prompt_tokens if params.prompt_logprobs is not None and index == 0 else None)
        self.matcher: Any = None  # an llguidance matcher under structured outputs (engine.structured)
        self.detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_token_ids), params.skip_special_tokens)
        self.text = ""  # the detokenized output, trimmed at a stop string
        # Characters held back from reported text while they might still start a stop string (vLLM semantics).
        self._stop_hold = max(map(len, params.stop_strings), default=1) - 1
        if params.include_stop_str_in_output:
            self._stop_hold = 0

    @property
    def skips_cache_reads(self) -> bool:
        """Prompt logprobs need every prompt token's logits, which a cache hit would not compute."""
        return self.prompt_logprobs is not None

    def under_min_tokens(self) -> bool:
        """Whether the next token must not be EOS or a stop token (min_tokens not reached yet)."""
        return self.num_output_tokens < self.params.min_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def needs_prompt_from_leader(self) -> bool:
        """True while this sample should wait for its leader's prompt blocks to be cached."""
        leader = self.leader
        return leader is not None and not leader.finished and leader.num_computed_tokens < leader.num_prompt_tokens

    def append_output(self, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        """Appends a sampled token, updates the text, and decides whether the sample is finished."""
        self.append_token_ids([token_id])
        if self.matcher is not None and not self.matcher.consume_token(token_id):
            raise ValueError(f"structured outputs: token {token_id} left the grammar: {self.matcher.get_error()}")
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id].logprob
        params = self.params
        # An EOS or stop token ends the sample; its text is shown only with include_stop_str_in_output.
        if self.num_output_tokens < params.min_tokens:  # nothing stops it yet (the sampler keeps EOS out)
            self.text += self.detokenizer.add([token_id])
            if self.num_output_tokens >= self.max_tokens:
                self._finish("length", None)
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            self._finish("stop", None, token_id if params.include_stop_str_in_output else None)
        elif token_id in params.stop_token_set:
            self._finish("stop", token_id, token_id if params.include_stop_str_in_output else None)
        else:
            delta = self.detokenizer.add([token_id])
            stop = find_stop(self.text + delta, len(delta), params.stop_strings, params.include_stop_str_in_output)
            if stop is not None:
                self.text, stop_str = stop
                self._finish("stop", stop_str)
            else:
                self.text += delta
                if self.num_output_tokens >= self.max_tokens:
                    self._finish("length", None)
        if not self.finished and self.matcher is not None and self.matcher.is_stopped():
            self._finish("stop", None)  # the grammar allows nothing more

    def _finish(self, reason: str, stop_reason: int | str | None, show_token: int | None = None) -> None:
        if show_token is not None:
            self.text += self.detokenizer.add([show_token])
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.status = RequestStatus.FINISHED

    def abort(self) -> None:
        self.finish_reason = "abort"
        self.status = RequestStatus.FINISHED

    def completion(self) -> CompletionOutput:
        text = self.text
        if not self.finished and self._stop_hold:
            text = text[: max(0, len(text) - self._stop_hold)]
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.output_token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def set_prompt_logprobs(self, first_position: int, entries: list[dict[int, Logprob]]) -> None:
        """Stores the logprobs of prompt tokens ``first_position`` on (recomputed after a preemption: overwritten)."""
        self.prompt_logprobs[first_position : first_position + len(entries)] = entries


def find_stop(text: str, num_new_chars: int, stops: Sequence[str], include: bool) -> tuple[str, str] | None:
    """If the last ``num_new_chars`` characters of ``text`` complete a stop string, returns (the text trimmed at
    it, the stop string). Trimmed before the stop string unless ``include``. Only the new tail is searched."""
    for stop in stops:
        i = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if i != -1:
            return (text[: i + len(stop)] if include else text[:i]), stop
    return None
