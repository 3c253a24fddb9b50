"""Beam search with vLLM's names and rules: its parameters, its result types and the search itself, as pure Python.

``BeamSearch`` only decides: given each live beam's candidates for its next token (the sampled token and the 2 x width
most likely, with their raw logprobs), which beams live on. Who computes the candidates is the caller's business:
the engine forks beams on the block pool (``LLMEngine``), the benchmark runs vLLM's way of one request per beam and
step (``benchmarks/bench_beam.py``); both drive this one class.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kvprefix.engine.outputs import Logprob
from kvprefix.engine.sampling_params import SamplingParams, _check_int, _check_number
from kvprefix.tiers.retention import check_retention


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters. ``beam_width`` beams are kept after every step; each step looks at
    ``2 * beam_width`` candidates per beam (plus the token sampled at ``temperature``: 0 is greedy, so the
    candidates are the most likely tokens alone). A beam that samples EOS ends ("stop") unless ``ignore_eos``; the
    rest end after ``max_tokens`` ("length"). The best ``beam_width`` by ``cum_logprob / length ** length_penalty``
    (the length counts the prompt, and not a final EOS: vLLM's) are returned, best first.
    ``kv_retention`` (kvprefix's, as in ``SamplingParams``): how the prompt's blocks are kept below the pool."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    kv_retention: str | None = None

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, minimum=1)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature, "a number >= 0", lambda v: v >= 0)
        _check_number("length_penalty", self.length_penalty, "a finite number", lambda v: True)
        check_retention(self.kv_retention)

    @property
    def num_candidates(self) -> int:
        """Top tokens looked at per beam and step (vLLM's 2 x width: enough that EOS candidates cannot starve the
        beams)."""
        return 2 * self.beam_width

    def step_params(self, max_tokens: int) -> SamplingParams:
        """What each beam samples with at each step: the temperature, and logprobs of the candidates (raw)."""
        return SamplingParams(temperature=self.temperature, logprobs=self.num_candidates, max_tokens=max_tokens)

    def output_params(self) -> SamplingParams:
        """How a result's text is decoded (and its logprobs kept, so ``cumulative_logprob`` is the beam's)."""
        return SamplingParams(logprobs=self.num_candidates, max_tokens=self.max_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens)


@dataclass
class BeamSearchSequence:
    """One result of ``LLM.beam_search`` (vLLM's): ``tokens`` are the prompt's then the generated ones (a final EOS
    included), ``logprobs`` each step's candidates, ``text`` the whole sequence decoded."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: object | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]


def beam_search_score(num_tokens: int, last_token: int, cum_logprob: float, eos_token_ids: Collection[int],
                      length_penalty: float) -> float:
    """vLLM's ranking of finished beams: the cumulative logprob over the length (prompt included, a final EOS not)
    to the power ``length_penalty``."""
    length = num_tokens - 1 if last_token in eos_token_ids else num_tokens
    return cum_logprob / (length**length_penalty)


@dataclass
class _Step:
    """One token of a beam, linked to the steps before it (beams share their history instead of copying it)."""

    token: int
    entry: dict[int, Logprob]
    before: _Step | None


@dataclass
class Beam:
    cum_logprob: float = 0.0
    last: _Step | None = None
    num_tokens: int = 0  # generated so far

    def token_ids(self) -> list[int]:
        return [s.token for s in self._steps()]

    def logprobs(self) -> list[dict[int, Logprob]]:
        return [s.entry for s in self._steps()]

    def _steps(self) -> list[_Step]:
        out, step = [], self.last
        while step is not None:
            out.append(step)
            step = step.before
        return out[::-1]


@dataclass
class Finished:
    beam: Beam
    finish_reason: str
    stop_reason: int | None = None


@dataclass
class BeamSearch:
    """The search for one prompt. Call ``step`` with every live beam's candidates until ``done``, then ``results``."""

    params: BeamSearchParams
    num_prompt_tokens: int
    eos_token_ids: frozenset[int]
    max_tokens: int  # the params' max_tokens, capped by the room the model leaves
    live: list[Beam] = field(default_factory=lambda: [Beam()])
    finished: list[Finished] = field(default_factory=list)
    num_steps: int = 0

    @property
    def done(self) -> bool:
        return not self.live

    def step(self, entries: Sequence[dict[int, Logprob]]) -> list[tuple[int, int]]:
        """``entries``: per live beam, in order, its candidates {token: logprob} (the sampler's logprobs entry).
        Candidates ending in EOS finish (all of them, as vLLM's); of the rest, the ``beam_width`` with the highest
        cumulative logprob live on (ties: the earlier beam and the entry's order). Returns the new live beams as
        (index of the beam it extends, token), best first; empty once the search is done."""
        if len(entries) != len(self.live):
            raise ValueError(f"beam search step: {len(entries)} candidate sets for {len(self.live)} live beams")
        stops = frozenset() if self.params.ignore_eos else self.eos_token_ids
        candidates: list[tuple[float, int, int]] = []
        for i, (beam, entry) in enumerate(zip(self.live, entries, strict=True)):
            for token, lp in entry.items():
                cum = beam.cum_logprob + lp.logprob
                if token in stops:
                    self.finished.append(Finished(self._extend(beam, token, entry, cum), "stop", token))
                else:
                    candidates.append((cum, i, token))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam and entry order
        chosen = candidates[: self.params.beam_width]
        self.live = [self._extend(self.live[i], token, entries[i], cum) for cum, i, token in chosen]
        self.num_steps += 1
        if self.num_steps >= self.max_tokens:
            self.finished += [Finished(beam, "length") for beam in self.live]
            self.live = []
        return [(i, token) for _, i, token in chosen] if self.live else []

    @staticmethod
    def _extend(beam: Beam, token: int, entry: dict[int, Logprob], cum: float) -> Beam:
        return Beam(cum, _Step(token, entry, beam.last), beam.num_tokens + 1)

    def results(self) -> list[Finished]:
        """The ``beam_width`` best finished beams by ``beam_search_score``, best first (ties: finishing order)."""
        p, prompt, eos = self.params, self.num_prompt_tokens, self.eos_token_ids

        def score(f: Finished) -> float:
            last = f.beam.last.token if f.beam.last is not None else -1
            return beam_search_score(prompt + f.beam.num_tokens, last, f.beam.cum_logprob, eos, p.length_penalty)

        return sorted(self.finished, key=score, reverse=True)[: p.beam_width]
