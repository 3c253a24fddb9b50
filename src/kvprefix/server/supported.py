"""What this server parses but does not implement: refused with a 400 that says why, never silently ignored."""

from __future__ import annotations

from typing import Any

from kvprefix.http.errors import APIError
from kvprefix.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest

# vLLM field -> (the values that ask for nothing, why anything else is refused).
_REFUSED: dict[str, tuple[tuple, str]] = {
    "priority": ((0,), "priority scheduling is not enabled: requests are served first come, first served (as in "
                 "vLLM without --scheduling-policy priority)"),
    "kv_transfer_params": ((), "disaggregated prefill (KV transfer between servers) is not supported"),
    "spaces_between_special_tokens": ((True,), "special tokens are always decoded as the tokenizer joins them"),
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
    if req.use_beam_search:
        _check_beam_search(req)
    elif req.length_penalty != 1:
        raise APIError(400, "'length_penalty' applies to beam search only: send it with 'use_beam_search': true",
                       param="length_penalty")
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
            "best_of": req.best_of not in (None, req.n) and not req.use_beam_search,
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


# Fields beam search does not apply, and their values that ask for nothing. vLLM ignores them under beam search;
# kvprefix refuses anything else, so that nothing asked for is silently dropped (docs/server.md#beam-search).
_NOT_WITH_BEAMS: dict[str, tuple] = {
    "stop": (None, [], ""), "stop_token_ids": (None, []), "top_p": (None, 1.0), "top_k": (None, 0, -1),
    "min_p": (None, 0.0), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0), "logit_bias": (None, {}), "min_tokens": (0,), "prompt_logprobs": (None,),
    "logprob_token_ids": (None,), "seed": (None,),
}


def _check_beam_search(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Beam search takes n beams (completions: best_of beams, the n best returned), a temperature, max_tokens,
    ignore_eos, length_penalty, include_stop_str_in_output, skip_special_tokens and logprobs."""
    for name, neutral in _NOT_WITH_BEAMS.items():
        if getattr(req, name) not in neutral:
            raise APIError(400, f"'{name}' does not apply to beam search (vLLM ignores it there; this server refuses "
                           "it rather than drop it)", param=name)
    structured, field = req.structured()
    if structured is not None:
        raise APIError(400, f"'{field}' cannot be combined with beam search: beams are not constrained to a grammar "
                       "here", param=field)
    if isinstance(req, ChatCompletionRequest):
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "'tool_choice' required or named constrains the output to a grammar, which beam "
                           "search does not do here; use \"auto\"", param="tool_choice")
        return
    if req.echo and req.logprobs is not None:
        raise APIError(400, "'echo' with 'logprobs' scores the prompt, which beam search does not; send it without "
                       "'use_beam_search'", param="echo")
    if req.best_of is not None and not req.n <= req.best_of <= MAX_N:
        raise APIError(400, f"'best_of' (the beam width) must be at least 'n' ({req.n}) and at most {MAX_N}, got "
                       f"{req.best_of}", param="best_of")
