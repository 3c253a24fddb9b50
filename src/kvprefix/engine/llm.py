"""LLM: vLLM's offline API. Code written for ``vllm.LLM`` runs with ``from kvprefix import LLM, SamplingParams``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvprefix.cache.identity import chat_template_hash
from kvprefix.engine.args import EngineArgs
from kvprefix.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from kvprefix.engine.llm_engine import LLMEngine, PromptType
from kvprefix.engine.lora_request import LoRARequest
from kvprefix.engine.outputs import RequestOutput
from kvprefix.engine.sampling_params import SamplingParams
from kvprefix.prompts import render_chat
from kvprefix.tokenizer import Tokenizer
from kvprefix.tokenizer.chat_template import ChatTemplate

Conversation = list[dict[str, Any]]


class LLM:
    """Every keyword is an ``EngineArgs`` field; ``model``: None (the built-in default), a checkpoint directory, a
    .gguf file or a hub id."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        try:
            args = EngineArgs(model=model, **kwargs)
        except TypeError as e:
            raise TypeError(f"{e}; accepted keywords: {', '.join(EngineArgs.__dataclass_fields__)}") from None
        self.llm_engine = LLMEngine(args)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion (batched) and returns their outputs in the order given. ``lora_request``
        (with ``enable_lora=True``): one adapter for every prompt, or one (or None: the base model) per prompt."""
        prompts = _as_prompt_list(prompts)
        return self._run(prompts, sampling_params, use_tqdm, cache_salt, lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """One OpenAI-style conversation or a list of them, and ``tools``, rendered with the chat template exactly as
        the server renders them; as in vLLM's ``LLM.chat``, the output is not parsed for tool calls.
        ``chat_template`` (a Jinja file or the template text) and ``chat_template_content_format`` ("auto",
        "string", "openai") render these conversations otherwise than the LLM's template; their blocks are then
        that template's, apart from the LLM's own."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.llm_engine.tokenizer
        template_hash = None
        if chat_template is not None or chat_template_content_format != "auto":
            tokenizer = tokenizer.with_chat_template(ChatTemplate.given(chat_template, chat_template_content_format))
            template_hash = chat_template_hash(tokenizer.chat_template, tokenizer.content_format())
        prompts: list[PromptType] = []
        for conversation in conversations:
            rendered = render_chat(tokenizer, conversation, add_generation_prompt=add_generation_prompt, tools=tools)
            prompts.append({"prompt": rendered.text, "prompt_token_ids": rendered.token_ids})
        return self._run(prompts, sampling_params, use_tqdm, cache_salt, chat_template_hash=template_hash)

    def _run(self, prompts, sampling_params, use_tqdm: bool, cache_salt: str | None,
             lora_request=None, chat_template_hash: str | None = None) -> list[RequestOutput]:
        params_list = _one_each(SamplingParams() if sampling_params is None else sampling_params,
                                (SamplingParams, BeamSearchParams), prompts, "sampling_params")
        loras = _one_each(lora_request, LoRARequest, prompts, "lora_request")
        engine = self.llm_engine
        ids = [str(next(self._ids)) for _ in prompts]
        states = {}
        try:
            for request_id, prompt, params, lora in zip(ids, prompts, params_list, loras, strict=True):
                states[request_id] = engine.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                                        lora_request=lora, chat_template_hash=chat_template_hash)
            finals: dict[str, RequestOutput] = {}
            bar = _progress(len(ids)) if use_tqdm else None
            while len(finals) < len(ids):
                deltas = engine.step()
                for _, error in engine.take_failures():
                    raise error
                for delta in deltas:
                    state = states[delta.request_id]
                    state.apply(delta)
                    if delta.finished:  # text is decoded only now, once per request
                        finals[delta.request_id] = state.output()
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:
            for request_id in ids:  # leave no request (and no block) behind
                engine.abort_request(request_id)
            raise
        return [finals[i] for i in ids]

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
        cache_salt: str | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, the ``beam_width`` best sequences, best first (each with the prompt's
        tokens, the whole text, ``cum_logprob``). The prompts' searches run batched, at most ``concurrency_limit`` at
        a time (None: all); their beams share blocks on the pool (docs/engine.md#beam-search)."""
        prompts = _as_prompt_list(prompts)
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1 or None, got {concurrency_limit}")
        loras = _one_each(lora_request, LoRARequest, prompts, "lora_request")
        size = concurrency_limit or max(1, len(prompts))
        outputs: list[BeamSearchOutput] = []
        decode = self.llm_engine.tokenizer.decode
        for start in range(0, len(prompts), size):
            part = prompts[start : start + size]
            for out, lora in zip(self._run(part, params, use_tqdm, cache_salt, loras[start : start + size]),
                                 loras[start : start + size], strict=True):
                sequences = []
                for o in out.outputs:
                    tokens = [*out.prompt_token_ids, *o.token_ids]
                    sequences.append(BeamSearchSequence(tokens, o.logprobs, lora, o.cumulative_logprob,
                                                        decode(tokens, False), o.finish_reason, o.stop_reason))
                outputs.append(BeamSearchOutput(sequences))
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> dict[str, int | float]:
        return self.llm_engine.get_metrics()


def _one_each(value, kind: type | tuple[type, ...], prompts: list, name: str) -> list:
    """``value`` for every prompt when it is one ``kind`` (or None), else the sequence given, one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * len(prompts)
    values = list(value)
    if len(values) != len(prompts):
        raise ValueError(f"got {len(values)} {name} for {len(prompts)} prompts; give one or one each")
    return values


def _as_prompt_list(prompts) -> list[PromptType]:
    """A single prompt (text, token ids, or dict) becomes a list of one."""
    if not isinstance(prompts, (list, tuple)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts")
