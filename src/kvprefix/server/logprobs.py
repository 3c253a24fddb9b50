"""Engine logprobs (per generated token: {token id: Logprob}) in OpenAI's two response shapes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvprefix.engine import Logprob

Decode = Callable[[int], str]


def _ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely alternatives, best first (the engine adds the sampled token, which may rank lower)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda item: item[1].rank)[:k]


def chat_logprobs(decode: Decode, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int) -> dict:
    """Chat shape: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""

    def item(token_id: int, lp: Logprob) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [
        {**item(t, entry[t]), "top_logprobs": [item(a, lp) for a, lp in _ranked(entry, k)]}
        for t, entry in zip(token_ids, entries, strict=False)
    ]}


def completion_logprobs(decode: Decode, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int,
                        offset: int = 0) -> dict:
    """Legacy completions shape: parallel lists; ``text_offset`` counts characters of the decoded tokens from
    ``offset`` (per-token decoding, so it can differ from the joint text around multi-byte characters)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for t, entry in zip(token_ids, entries, strict=False):
        text = decode(t)
        tokens.append(text)
        token_logprobs.append(entry[t].logprob)
        top.append({decode(a): lp.logprob for a, lp in _ranked(entry, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
