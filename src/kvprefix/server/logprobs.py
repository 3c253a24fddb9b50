"""Engine logprobs (per token: {token id: Logprob}, the token's own first, each with its ``decoded_token``) in
OpenAI's two response shapes. Token texts are the engine's decoding, never decoded again here (except a prompt's
first token, which has no entry)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvprefix.engine import Logprob


def token_text(token_id: int, lp: Logprob, as_ids: bool) -> str:
    """vLLM's return_tokens_as_token_ids: tokens that do not decode alone stay identifiable."""
    return f"token_id:{token_id}" if as_ids else lp.decoded_token


# What JSON can carry for -inf (a token the model rules out), as OpenAI's API and vLLM write it.
MIN_LOGPROB = -9999.0


def _value(lp: Logprob) -> float:
    return max(lp.logprob, MIN_LOGPROB)


def _ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely alternatives, best first (the engine adds the sampled token, which may rank lower)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda item: item[1].rank)[:k]


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int, as_ids: bool,
                  in_order: bool = False) -> dict:
    """Chat shape: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``: the k most likely,
    or with ``in_order`` the entry's first k (the sampled token, then the ones named by logprob_token_ids, as
    vLLM lists them)."""

    def item(token_id: int, lp: Logprob) -> dict:
        text = token_text(token_id, lp, as_ids)
        return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [
        {**item(t, entry[t]), "top_logprobs": [item(a, lp) for a, lp in (
            list(entry.items())[:k] if in_order else _ranked(entry, k))]}
        for t, entry in zip(token_ids, entries, strict=False)
    ]}


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], k: int, as_ids: bool,
                        offset: int = 0, decode: Callable[[int], str] | None = None) -> dict:
    """Legacy completions shape: parallel lists; ``text_offset`` counts characters of the decoded tokens from
    ``offset`` (per-token decoding, so it can differ from the joint text around multi-byte characters). As vLLM,
    ``top_logprobs`` holds the token itself and the k most likely (so ``logprobs: 0`` still gives the token's
    entry), and a token without an entry (an echoed prompt's first) has null logprobs and its text by ``decode``."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for t, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            text = f"token_id:{t}" if as_ids else decode(t)
            token_logprobs.append(None)
            top.append(None)
        else:
            text = token_text(t, entry[t], as_ids)
            token_logprobs.append(_value(entry[t]))
            top.append({token_text(a, lp, as_ids): _value(lp) for a, lp in list(entry.items())[: k + 1]})
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs(entries: Sequence[dict[int, Logprob] | None], as_ids: bool) -> list[dict | None]:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    return [None if entry is None else {
        str(t): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": token_text(t, lp, as_ids)}
        for t, lp in entry.items()} for entry in entries]
