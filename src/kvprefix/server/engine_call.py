"""Request -> engine call: the checks and limits of a completions or chat request, its sampling parameters and
its ids, decided before anything reaches the engine (so a bad request is a 400 before a stream starts)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from fastapi import Request

from kvprefix.engine import BeamSearchParams, SamplingParams
from kvprefix.engine.sampling_params import MAX_SEED
from kvprefix.engine.structured import grammar_for
from kvprefix.http.errors import bad_request
from kvprefix.http.request_ids import MAX_REQUEST_ID_LEN, request_id_of, valid_request_id
from kvprefix.http.tenancy import Caller, validate_client_salt
from kvprefix.prompts import RenderedPrompt
from kvprefix.server.model_info import ModelInfo
from kvprefix.server.protocol import MAX_LOGIT_BIAS, ChatCompletionRequest, CompletionRequest
from kvprefix.server.tools import ToolPlan

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")


@dataclass
class EngineCall:
    """One engine request per prompt (ids ``f"{engine_rid}-{i}"``), each with ``params``: n samples, or a beam search
    whose ``n`` best beams are the choices."""

    prompts: list[RenderedPrompt]
    params: SamplingParams | BeamSearchParams
    rid: str  # the response's id
    engine_rid: str
    n: int  # choices per prompt


async def engine_call(req: CompletionRequest | ChatCompletionRequest, caller: Caller, raw: Request, info: ModelInfo,
                      prompts: list[RenderedPrompt], param: str,
                      tools: ToolPlan | None) -> EngineCall:
    validate_client_salt(caller.client_salt)
    if not all(p.token_ids for p in prompts):
        raise bad_request(f"'{param}' is empty after tokenization", param=param)
    requested = req.max_new_tokens() if isinstance(req, ChatCompletionRequest) else req.max_tokens
    if requested == 0:
        if not req.echo:
            raise bad_request("'max_tokens' must be at least 1 (0 only with 'echo': the prompt alone)",
                              param="max_tokens")
        requested = 1  # vLLM's echo without generation: one token is run, and not shown
    max_tokens = min(_max_tokens(info.max_model_len, len(p.token_ids), requested, param) for p in prompts)
    if req.min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({req.min_tokens}) is more than the {max_tokens} tokens this request may "
                          "generate", param="min_tokens")
    structured, field_name = req.structured()
    if tools is not None and structured is not None:
        raise bad_request(f"'{field_name}' cannot be combined with tools unless 'tool_choice' is \"none\": both "
                          "would decide the same output", param=field_name)
    if tools is not None and tools.structured is not None:  # required or named: compiled in plan_tools
        structured = tools.structured
    elif structured is not None:  # compiled here first, so that a bad one is a 400 before any stream starts
        try:
            await asyncio.to_thread(grammar_for, structured)
        except ValueError as exc:
            raise bad_request(f"invalid '{field_name}': {exc}", param=field_name) from None
    if req.use_beam_search:  # supported.py refused what it does not take; a tool grammar was not planned
        params = _beam_search(req, max_tokens, info)
    else:
        params = _sampling(req, max_tokens, _logprobs(req, info), _logit_bias(req.logit_bias, info.vocab_size))
        params.structured_outputs = structured
    rid, engine_rid = _response_id(req, raw, "chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl")
    return EngineCall(prompts, params, rid, engine_rid, req.n)


def _max_tokens(limit: int, prompt_len: int, requested: int | None, param: str) -> int:
    if requested is None:
        if prompt_len >= limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens, but the prompt has "
                              f"{prompt_len} tokens", param=param, code="context_length_exceeded")
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise bad_request(
            f"this model's maximum context length is {limit} tokens, but you requested {prompt_len + requested} "
            f"tokens ({prompt_len} in the prompt, {requested} for the completion); reduce the prompt or "
            f"'max_tokens'", param=param, code="context_length_exceeded")
    return requested


def _logprobs(req: CompletionRequest | ChatCompletionRequest, info: ModelInfo) -> int | None:
    """Checks the sample and prompt logprobs against --max-logprobs as vLLM does (-1: the whole vocabulary, which
    counts as its size), turns a sample -1 into that size, and returns the prompt logprobs the engine computes: the
    request's, and for a completions echo with logprobs as many as the completion's (vLLM's)."""
    sample = _sample_logprobs(req, info)
    prompt = _check_logprobs("prompt", req.prompt_logprobs, "prompt_logprobs", info)
    wanted = [k for k in (prompt, sample if isinstance(req, CompletionRequest) and req.echo else None)
              if k is not None]
    return max(wanted) if wanted else None


def _sample_logprobs(req: CompletionRequest | ChatCompletionRequest, info: ModelInfo) -> int | None:
    """The sample logprobs checked against --max-logprobs, a -1 turned into the vocabulary size in the request too
    (what the engine computes and the response lists)."""
    param = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
    sample = _check_logprobs("sample", req.num_logprobs(), param, info)
    if sample is not None and sample != req.num_logprobs():
        setattr(req, param, sample)
    return sample


def _check_logprobs(kind: str, k: int | None, param: str, info: ModelInfo) -> int | None:
    """``k`` as a count (-1: the vocabulary size), if --max-logprobs allows it."""
    if k is None:
        return None
    count = info.vocab_size if k == -1 else k
    if info.max_logprobs == -1 or 0 <= count <= info.max_logprobs:
        return count
    if k == -1:
        raise bad_request(f"'{param}': -1 (the whole vocabulary, {info.vocab_size} tokens) needs a server started "
                          f"with --max-logprobs -1 or at least {info.vocab_size}", param=param)
    raise bad_request(f"Requested {kind} logprobs of {k}, which is greater than max allowed: {info.max_logprobs}",
                      param=param)


def _is_int_text(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return True


def _logit_bias(bias: dict | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias, {token id as text: bias}, checked with vLLM's messages (and OpenAI's value range)."""
    if not bias:
        return None
    not_ints = [key for key in bias if not _is_int_text(key)]
    if not_ints:  # every bad key at once, as vLLM reports them
        keys = ", ".join(f"`{key}`" for key in not_ints)
        raise bad_request(f"Found token_id {keys} in logit_bias but token_id must be an integer or string "
                          "representing an integer", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or abs(value) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key}",
                              param="logit_bias")
        out[token] = float(value)
    invalid = [t for t in out if not 0 <= t < vocab_size]
    if invalid:
        raise bad_request(f"token_id(s) {invalid} in logit_bias contain out-of-vocab token ids. Vocabulary size: "
                          f"{vocab_size}", param="logit_bias")
    return out


def _sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, prompt_logprobs: int | None,
              logit_bias: dict[int, float] | None) -> SamplingParams:
    kwargs = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
    # vLLM takes any int64 seed: a negative one is folded into the engine's range (still reproducible).
    seed = None if req.seed is None else req.seed & MAX_SEED
    try:
        return SamplingParams(n=req.n, max_tokens=max_tokens, stop=req.stop_list() or None,
                              stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                              logprobs=req.num_logprobs(), min_tokens=req.min_tokens,
                              min_characters=req.min_characters,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              skip_special_tokens=req.skip_special_tokens, prompt_logprobs=prompt_logprobs,
                              logit_bias=logit_bias, logprob_token_ids=req.logprob_token_ids, seed=seed,
                              kv_retention=req.kv_retention(), **kwargs)
    except ValueError as exc:  # the engine's own range checks, should ours ever be looser
        raise bad_request(str(exc)) from None


def _beam_search(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, info: ModelInfo
                 ) -> BeamSearchParams:
    """vLLM's: the beam width is n (completions: best_of when given, n of them returned), the temperature 1 unless
    the request names one."""
    _sample_logprobs(req, info)
    width = getattr(req, "best_of", None) or req.n
    try:
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                temperature=1.0 if req.temperature is None else req.temperature,
                                length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output,
                                skip_special_tokens=req.skip_special_tokens, kv_retention=req.kv_retention())
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _response_id(req, raw: Request, kind: str) -> tuple[str, str]:
    """(the response's id, the base of its engine ids): x-request-id, else the body's request_id, else the
    middleware's. A repeated client id gets a unique suffix for the engine."""
    header_id, chosen = request_id_of(raw)
    base = header_id if chosen or req.request_id is None else req.request_id
    if not valid_request_id(base):
        raise bad_request(f"'request_id' must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters without "
                          "spaces", param="request_id")
    rid = f"{kind}-{base}"
    return rid, (f"{rid}-{uuid.uuid4().hex[:12]}" if chosen or req.request_id is not None else rid)
