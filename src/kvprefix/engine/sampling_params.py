"""How to sample a completion, with vLLM's names and ranges. Pure Python, so the server can validate without torch."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from kvprefix.tiers.retention import check_retention

# Below this temperature sampling is greedy (vLLM uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5
# What the sampler's tensors and generators can hold: integers beyond these overflow torch (int64, seeds).
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_STOP_TOKEN_IDS = 256  # stop tokens per request: checked per sampled token, so the work is bounded
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: top alternatives per token a request may ask for


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one of a JSON schema (dict or JSON text), a regex, a list of choices, a
    Lark grammar, or any JSON object. Sampling is constrained to it (kvprefix.engine.structured)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"structured outputs need exactly one of json, regex, choice, grammar or json_object, "
                             f"got {given or 'none'}")


@dataclass
class SamplingParams:
    """Sampling settings for one prompt (vLLM's). Invalid values raise ``ValueError`` naming the field and range.

    ``top_k`` 0 or -1: off; ``max_tokens`` None: up to the context length; ``logprobs`` k: the k most likely tokens
    per step plus the sampled one (raw distribution); ``min_tokens``: nothing stops a sample before it;
    ``min_characters``: nor before its text is that long (vLLM's).
    ``prompt_logprobs`` k: such a request reads nothing from the prefix cache (cached tokens have no logits).
    ``structured_outputs``: the output stays in the language; the sample stops when it allows nothing more.
    ``kv_retention``: how the prompt's blocks are kept below the pool ("in_memory", "5m", "1h", "24h"; None: the
    engine's ``kv_retention``; docs/tiers.md#retention).
    ``logit_bias``: {token id: bias} added to those logits before sampling (logprobs stay the raw distribution's).
    ``logprob_token_ids``: with ``logprobs``, each step's entry holds these tokens after the sampled one, instead
    of the k most likely (vLLM's: scoring a fixed label set).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    min_characters: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    kv_retention: str | None = None
    logit_bias: dict[int, float] | None = None
    logprob_token_ids: list[int] | None = None
    # Normalized forms, filled in by __post_init__.
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    stop_token_set: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_number("temperature", self.temperature, "a number >= 0", lambda v: v >= 0)
        _check_number("top_p", self.top_p, "a number in (0, 1]", lambda v: 0 < v <= 1)
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        _check_int("top_k", self.top_k, minimum=0, accepted=f"0 or -1 (disabled) or an integer in [1, {MAX_TOP_K}]",
                   maximum=MAX_TOP_K)
        _check_number("min_p", self.min_p, "a number in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0, accepted=f"an integer in [0, {MAX_SEED}] or None", maximum=MAX_SEED)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), "a number in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_number("repetition_penalty", self.repetition_penalty, "a number > 0", lambda v: v > 0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1, accepted="an integer >= 1 or None")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        _check_int("min_characters", self.min_characters, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0, accepted="an integer >= 0 or None")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}")
        self.stop_strings = tuple(stops)
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids or []:
            _check_int("stop_token_ids", t, minimum=0, accepted="a list of token ids >= 0")
        self.stop_token_set = frozenset(self.stop_token_ids or ())
        check_retention(self.kv_retention)
        for t in self.logprob_token_ids or []:
            _check_int("logprob_token_ids", t, minimum=0, accepted="a list of token ids >= 0")
        for t, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", t, minimum=0, accepted="a dict of token ids >= 0 to numbers")
            _check_number("logit_bias", bias, "a finite number per token", lambda v: True)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of an n > 1 request: n=1 and a distinct but reproducible seed. A copy,
        not a re-validation: the request's fields were checked once."""
        params = copy.copy(self)
        params.n = 1
        if self.seed is not None:
            params.seed = (self.seed + index) % (MAX_SEED + 1)
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def text_decides_stop(self) -> bool:
        """Whether the sample's text decides when it may stop (stop strings, min_characters): the engine thread then
        detokenizes it, and readers take its text from the engine."""
        return bool(self.stop_strings) or self.min_characters > 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _check_int(name: str, value, minimum: int | None, accepted: str | None = None, maximum: int | None = None) -> None:
    ok = (isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)
          and (maximum is None or value <= maximum))
    if not ok:
        raise ValueError(f"{name} must be {accepted or f'an integer >= {minimum}'}, got {value!r}")


def _check_number(name: str, value, accepted: str, in_range) -> None:
    # Finite only: inf and NaN turn every logit into NaN.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not in_range(value):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
