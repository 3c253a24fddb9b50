"""What a request returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``. Pure Python."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What a request's output stream carries, as vLLM's: every output cumulative (``LLM``), only what is new since
    the previous output (streamed responses), or only the final output (responses sent whole)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's ``n`` samples: everything generated so far (under ``RequestOutputKind.DELTA``, only what
    is new). While the request runs, ``token_ids`` and ``logprobs`` are the request's own growing lists: copy them
    to keep a snapshot. ``finish_reason``: "stop" (EOS, stop token or string), "length" or "abort";
    ``stop_reason``: the stop string or token id that ended it (None for EOS).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times in seconds of ``time.monotonic()``; None until the event happened."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # times its samples were preempted (set when it ends)
    # Seconds between consecutive tokens of each sample as the reader received them (AsyncLLM; filled by
    # OutputState, never by the engine).
    token_gaps: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token (of any of the n samples)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """One request after an engine step. ``num_cached_tokens``: prompt tokens served from the prefix cache at
    admission (the first sample's). ``prompt_block_hashes``: the prompt's full blocks' keys in its namespace
    (public id ``namespace_id``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # Of num_cached_tokens, those loaded from each lower tier ({"disk": n}); the rest came from the pool.
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    prompt_block_hashes: list[bytes] = field(default_factory=list)
    namespace_id: str = ""
    # With SamplingParams.prompt_logprobs: per prompt token, {token id: Logprob} (None for the first token).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class SampleDelta:
    """What one engine step (or an abort) added to one sample. ``text``: the whole text so far when the engine
    detokenizes (samples whose text decides when they stop: stop strings, min_characters), else None (the reader
    does)."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The last token ended the sample by itself (EOS or stop token): its text shows only with
    # include_stop_str_in_output.
    ended_by_token: bool = False


@dataclass
class RequestDelta:
    """The engine's output for one request and step: only the samples that changed (``OutputState`` folds them)."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # With prompt_logprobs: the whole list, once, in the delta that computed the last prompt token (or the abort).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
