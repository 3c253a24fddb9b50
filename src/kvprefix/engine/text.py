"""A sample's output text: incremental detokenization (honouring skip_special_tokens), stop strings and
include_stop_str_in_output (vLLM semantics). Used by the engine thread for samples with stop strings (their text
stops them) and by ``OutputState`` for every other sample.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvprefix.engine.sampling_params import SamplingParams
from kvprefix.tokenizer import Tokenizer
from kvprefix.tokenizer.detokenizer import IncrementalDetokenizer


class SampleText:
    """``text`` is the detokenized output so far, trimmed at a stop string once one completes (``stop``)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_token_ids), params.skip_special_tokens)
        self._stops = params.stop_strings
        self._include = params.include_stop_str_in_output
        self.text = ""
        self.stop: str | None = None

    def add(self, token_id: int, find_stops: bool = True) -> str | None:
        """Appends one token's text; returns the stop string it completed, if any (the text is then final).
        ``find_stops`` False under min_tokens: no stop string ends the sample yet."""
        delta = self._detokenizer.add([token_id])
        if self._stops and find_stops:
            found = find_stop(self.text + delta, len(delta), self._stops, self._include)
            if found is not None:
                self.text, self.stop = found
                return self.stop
        self.text += delta
        return None

    def add_final(self, token_id: int, shown: bool) -> None:
        """A token that ended the sample by itself (EOS or a stop token): its text only if ``shown``."""
        if shown:
            self.text += self._detokenizer.add([token_id])

    def finish(self) -> None:
        """The sample ended: the text still held back for an incomplete character, as U+FFFD (unless a stop
        string fixed the text)."""
        if self.stop is None:
            self.text += self._detokenizer.flush()


def hold_back(params: SamplingParams) -> int:
    """Characters held back from a running sample's reported text while they might still start a stop string, so
    streamed text never has to be retracted."""
    if params.include_stop_str_in_output:
        return 0
    return max(map(len, params.stop_strings), default=1) - 1


def find_stop(text: str, num_new_chars: int, stops: Sequence[str], include: bool) -> tuple[str, str] | None:
    """If the last ``num_new_chars`` characters of ``text`` complete a stop string, returns (the text trimmed at
    it, the stop string). Trimmed before the stop string unless ``include``. Only the new tail is searched."""
    for stop in stops:
        i = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if i != -1:
            return (text[: i + len(stop)] if include else text[:i]), stop
    return None
