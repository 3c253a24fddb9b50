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
    """One of a request's ``n`` samples. Cumulative: ``text`` and ``token_ids`` hold everything generated so far.
    While the request runs, ``token_ids`` and ``logprobs`` are the request's own lists, which later tokens extend
    (no per-step copy); copy them to keep a snapshot. Under ``RequestOutputKind.DELTA`` they hold only what is new
    since the previous output, and ``logprobs`` entries come with their ``decoded_token``.

    ``finish_reason`` is "stop" (EOS, a stop token or a stop string), "length" (max_tokens or the context limit)
    or "abort"; ``stop_reason`` is the stop string or stop token id that ended it (None for EOS).
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
    # Seconds between consecutive tokens of each sample, as the reader received them (AsyncLLM streams; tokens that
    # arrive together share the gap since the sample's previous ones). Filled by OutputState, never by the engine.
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
    """The state of one request after an engine step. ``num_cached_tokens``: prompt tokens served from the prefix
    cache at admission (for n > 1, those of the first sample). ``prompt_block_hashes``: the hashes the cache keys
    the prompt's full blocks by, in its namespace (public id ``namespace_id``), computed once by the engine."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    prompt_block_hashes: list[bytes] = field(default_factory=list)
    namespace_id: str = ""
    # With SamplingParams.prompt_logprobs: per prompt token, {token id: Logprob} (None for the first token).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class SampleDelta:
    """What one engine step (or an abort) added to one sample: its new tokens (and their logprobs entries, when
    requested), and how it finished. ``text`` is the sample's whole text so far when the engine detokenizes it
    (samples with stop strings: their text decides when they stop), else None: the reader detokenizes."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Whether the last token ended the sample by itself (EOS or a stop token): its text is shown only with
    # include_stop_str_in_output. False when a stop string, the length or the grammar ended it.
    ended_by_token: bool = False


@dataclass
class RequestDelta:
    """The engine's output for one request and step: only the samples that changed. ``OutputState`` folds these
    into the cumulative ``RequestOutput`` the APIs return."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs: the whole list (as RequestOutput's), sent once, in the delta of the
    # step that computed the last prompt token (or of the abort); None in every other delta.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
