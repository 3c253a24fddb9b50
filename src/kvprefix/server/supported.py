"""What this server parses but does not implement: refused with a 400 that says why, never silently ignored."""

from __future__ import annotations

from typing import Any

from kvprefix.http.errors import APIError
from kvprefix.server.protocol import ChatCompletionRequest, CompletionRequest

# vLLM field -> (the values that ask for nothing, why anything else is refused).
_REFUSED: dict[str, tuple[tuple, str]] = {
    "priority": ((0,), "priority scheduling is not enabled: requests are served first come, first served (as in "
                 "vLLM without --scheduling-policy priority)"),
    "kv_transfer_params": ((), "disaggregated prefill (KV transfer between servers) is not supported"),
    "spaces_between_special_tokens": ((True,), "special tokens are always decoded as the tokenizer joins them"),
    "use_beam_search": ((False,), "beam search is not implemented; sample n choices instead"),
    "length_penalty": ((1, 1.0), "it applies to beam search, which is not implemented"),
    "bad_words": (([],), "banning words is not implemented"),
    "allowed_token_ids": (([],), "restricting sampling to given tokens is not implemented"),
    "logits_processors": (([],), "custom logits processors cannot run in this server"),
    "guided_decoding_backend": (("llguidance", "auto"), "structured outputs run on llguidance"),
    "guided_whitespace_pattern": ((), "JSON is generated compact: no whitespace pattern applies"),
    "vllm_xargs": (({},), "this server takes no extension arguments"),
    "mm_processor_kwargs": (({},), "the model takes text only"),
    "ec_transfer_params": ((), "encoder-cache disaggregation is not supported: the model takes text only"),
    "repetition_detection": ((), "detecting repeated n-grams is not implemented; use 'stop' or 'max_tokens'"),
    "thinking_token_budget": ((-1,), "no reasoning is parsed out here, so no thinking budget applies"),
}
_REFUSED_CHAT = {
    "reasoning_effort": ((), "the served model has no reasoning mode to set"),
}
_REFUSED_COMPLETIONS = {
    "prompt_embeds": ((), "prompt embeddings are not supported; send text or token ids"),
}


def _neutral(value: Any, neutral: tuple) -> bool:
    # By type too: 0 == False in Python, and "priority": false is not a priority.
    return value is None or any(type(value) is type(n) and value == n for n in neutral)


def check_supported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuses parameters that we parse but do not implement, instead of silently ignoring them."""
    refused = _REFUSED | (_REFUSED_CHAT if isinstance(req, ChatCompletionRequest) else _REFUSED_COMPLETIONS)
    for name, (neutral, why) in refused.items():
        if not _neutral(getattr(req, name), neutral):
            raise APIError(400, f"'{name}' is not supported: {why}", param=name)
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "'prompt_logprobs' cannot be streamed (as in vLLM); send it without 'stream'",
                       param="prompt_logprobs")
    if req.logprob_token_ids is not None and req.num_logprobs() is None:
        raise APIError(400, "'logprob_token_ids' requires 'logprobs' (as in vLLM): they name the tokens whose "
                       "logprobs it returns", param="logprob_token_ids")
    if req.truncate_prompt_tokens == 0:
        raise APIError(400, "'truncate_prompt_tokens' must be -1 (the context length) or at least 1",
                       param="truncate_prompt_tokens")
    unsupported: dict[str, bool] = {
        "stream_options": req.stream_options is not None and not req.stream,
    }
    if isinstance(req, CompletionRequest):
        unsupported |= {
            "suffix": bool(req.suffix),
            "best_of": req.best_of not in (None, req.n),
        }
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        unsupported |= {
            "functions": bool(req.functions),
            "function_call": req.function_call not in (None, "none"),
            "messages[].function_call": any(m.function_call is not None for m in req.messages),
            "messages[].audio": any(m.audio is not None for m in req.messages),
        }
    for name, bad in unsupported.items():
        if bad:
            if name == "stream_options":
                raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param=name)
            if name in ("functions", "function_call"):
                raise APIError(400, f"'{name}' (OpenAI's deprecated form) is not supported; send 'tools' and "
                               "'tool_choice'", param=name)
            raise APIError(400, f"'{name}' is not supported by this server", param=name)
