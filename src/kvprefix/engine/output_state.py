"""The reader's side of one request: folds the engine's ``RequestDelta``s into a ``RequestOutput`` of the kind the
reader asked for. Runs where outputs are read, not on the engine thread, and detokenizes only when an output is
asked for, so text of steps nobody reads is decoded once, in one go.
"""

from __future__ import annotations

import dataclasses

from kvprefix.engine.outputs import (
    CompletionOutput,
    Logprob,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from kvprefix.engine.sampling_params import SamplingParams
from kvprefix.engine.text import SampleText, hold_back
from kvprefix.tokenizer import Tokenizer


class _Sample:
    def __init__(self, index: int, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.index = index
        self.params = params
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.ended_by_token = False
        self.hold = hold_back(params)
        # Samples whose text decides when they stop come with it from the engine; the others are detokenized here.
        self._text = None if params.text_decides_stop else SampleText(tokenizer, prompt_token_ids, params)
        self.engine_text = ""
        self._num_decoded = 0  # tokens whose text (and logprob entries' decoded_token) is done
        self._tokenizer = tokenizer
        self.changed = False  # since the last delta output
        self._sent_tokens = 0  # tokens in delta outputs so far
        self._sent_chars = 0  # characters of text in delta outputs so far
        self.stamped = 0  # tokens whose arrival time is counted (OutputState.stamp)
        self.last_token_at: float | None = None

    def apply(self, delta) -> None:
        self.changed = True
        self.token_ids += delta.token_ids
        if delta.logprobs is not None and self.logprobs is not None:
            for token, entry in zip(delta.token_ids, delta.logprobs, strict=True):
                self.logprobs.append(entry)
                self.cumulative_logprob += entry[token].logprob
        if delta.text is not None:
            self.engine_text = delta.text
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.ended_by_token = delta.ended_by_token

    def completion(self) -> CompletionOutput:
        return self._output(self._reported_text(), self.token_ids, self.logprobs)

    def delta(self) -> CompletionOutput:
        """What is new since the previous delta: text past the characters already given, the new tokens."""
        text, start = self._reported_text(), self._sent_tokens
        new_text = text[self._sent_chars :]
        self._sent_chars, self._sent_tokens, self.changed = len(text), len(self.token_ids), False
        return self._output(new_text, self.token_ids[start:], None if self.logprobs is None else self.logprobs[start:])

    def _reported_text(self) -> str:
        self._decode_pending()
        text = self._text.text if self._text is not None else self.engine_text
        if self.finish_reason is None and self.hold:
            text = text[: max(0, len(text) - self.hold)]
        return text

    def _output(self, text: str, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def _decode_pending(self) -> None:
        start, end = self._num_decoded, len(self.token_ids)
        if start == end:
            return
        self._num_decoded = end
        if self.logprobs is not None:
            decode_entries(self._tokenizer, self.logprobs[start:end])
        text = self._text
        if text is None:
            return
        # A token that stopped the sample by itself (EOS or a stop token): its text only if asked for.
        last_stops = self.ended_by_token
        for i in range(start, end):
            if last_stops and i == end - 1:
                text.add_final(self.token_ids[i], self.params.include_stop_str_in_output)
            else:
                text.add(self.token_ids[i])
        if self.finish_reason is not None:
            text.finish()


class OutputState:
    """Made by ``LLMEngine.add_request`` and kept by whoever reads the request's outputs (never by the engine)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sample_params: list[SamplingParams],
        tokenizer: Tokenizer,
        prompt_block_hashes: list[bytes],
        namespace_id: str,
        arrival_time: float,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_block_hashes = prompt_block_hashes
        self.namespace_id = namespace_id
        self._tokenizer = tokenizer
        self.samples = [_Sample(i, tokenizer, prompt_token_ids, p) for i, p in enumerate(sample_params)]
        self.finished = False
        self.num_cached_tokens = 0
        self.cached_tokens_by_tier: dict[str, int] = {}
        self.metrics = RequestMetrics(arrival_time)
        self.token_gaps: list[float] = []
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._prompt_logprobs_decoded = False

    def apply(self, delta: RequestDelta) -> None:
        for d in delta.samples:
            self.samples[d.index].apply(d)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.cached_tokens_by_tier = delta.cached_tokens_by_tier
        self.metrics = delta.metrics

    def stamp(self, now: float) -> None:
        """The deltas applied since the last stamp reached the reader at ``now``: records each sample's gaps between
        tokens (tokens that arrive together share the time since the sample's previous ones)."""
        for s in self.samples:
            new = len(s.token_ids) - s.stamped
            if new > 0:
                if s.last_token_at is not None:
                    self.token_gaps += [(now - s.last_token_at) / new] * new
                s.stamped, s.last_token_at = len(s.token_ids), now

    def output(self, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> RequestOutput:
        """The request's output now: under ``DELTA``, only the samples that changed since the previous output, each
        with only its new text and tokens; otherwise every sample, cumulative."""
        if self.prompt_logprobs is not None and not self._prompt_logprobs_decoded:
            self._prompt_logprobs_decoded = True
            decode_entries(self._tokenizer, [e for e in self.prompt_logprobs if e is not None])
        if kind is RequestOutputKind.DELTA:
            outputs = [s.delta() for s in self.samples if s.changed]
        else:
            outputs = [s.completion() for s in self.samples]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            cached_tokens_by_tier=self.cached_tokens_by_tier,
            metrics=dataclasses.replace(self.metrics, token_gaps=self.token_gaps),
            prompt_block_hashes=self.prompt_block_hashes,
            namespace_id=self.namespace_id,
            prompt_logprobs=self.prompt_logprobs,
        )


def decode_entries(tokenizer: Tokenizer, entries: list[dict[int, Logprob]]) -> None:
    """Fills each logprob entry's ``decoded_token`` (the sampler leaves it empty: decoding is the reader's work)."""
    decode = tokenizer.decode
    for entry in entries:
        for t, lp in entry.items():
            lp.decoded_token = decode([t])
