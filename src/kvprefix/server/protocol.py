"""Request bodies of the OpenAI API subset we serve, validated strictly: a wrong type or an unknown field is a
400 that names the field, never a silent coercion or a crash deep in the engine."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvprefix.engine.sampling_params import MAX_SEED, MAX_STOP_TOKEN_IDS, MAX_TOP_K, StructuredOutputsParams
from kvprefix.http.errors import APIError
from kvprefix.tiers.retention import longest

MAX_N = 16  # choices per request; each one is a sequence in the engine
MAX_STOP = 4  # as in the OpenAI API
MAX_ID_LEN = 256  # user, prompt_cache_key
MAX_PROMPTS = 256  # prompts in one completions batch (each is an engine request)
MAX_MESSAGES = 4096  # messages in one chat request
MAX_CONTENT_PARTS = 256  # content parts in one message
MAX_TOKEN_ID = 2**31 - 1  # token ids in a prompt or in stop_token_ids; real vocabularies are far smaller
MIN_SEED = -(2**63)  # vLLM takes any int64 seed; a negative one is folded into the engine's range
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_LOGPROB_TOKEN_IDS = 1024  # tokens named in logprob_token_ids (each step's entry holds them all)
MAX_DETOKENIZE = 2**20  # token ids in one /detokenize body (a long context's worth, and then some)
MAX_TOOLS = 128  # functions in one request, as in the OpenAI API
MAX_TOOL_CALLS = 128  # past calls in one assistant message
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names

TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)]


class _Body(BaseModel):
    # strict: "5" is not an integer and true is not 1; inf/NaN are not sampling values.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    _not_nullable: typing.ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._not_nullable = frozenset(name for name, f in cls.model_fields.items() if not _nullable(f.annotation))

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI's API reads null as "not sent" for every optional field (clients send "n": null, "stream": null)."""
        if isinstance(data, dict) and any(v is None and k in cls._not_nullable for k, v in data.items()):
            data = {k: v for k, v in data.items() if v is not None or k not in cls._not_nullable}
        return data


def _nullable(annotation: Any) -> bool:
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_nullable(a) for a in typing.get_args(annotation))
    return False


class StructuredOutputs(_Body):
    """vLLM's structured_outputs (exactly one; engine.structured bounds and compiles them)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # "json" would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(_Body):
    name: str = Field("response", max_length=MAX_ID_LEN)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: usage so far on every chunk; needs include_usage.
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's sampling extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)
    ] | None = None
    stop_token_ids: Annotated[
        list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(max_length=MAX_STOP_TOKEN_IDS)
    ] | None = None
    ignore_eos: bool = False
    # vLLM's request extensions that the engine honours (docs/server.md).
    min_tokens: int = Field(0, ge=0)
    min_characters: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary; capped by --max-logprobs
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k prompt tokens; -1: max_model_len
    truncation_side: Literal["left", "right"] | None = None  # "right": keep the first k instead
    # With logprobs: these tokens' logprobs at each step (after the sampled one's) instead of the top k.
    logprob_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]],
                                 Field(min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)] | None = None
    # vLLM's: token offsets on its /render endpoints only; generation endpoints ignore it, as vLLM's do.
    return_token_offsets: bool | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    # vLLM's fields that this server accepts only at their neutral value; supported.py says why.
    priority: Any = None
    kv_transfer_params: Any = None
    spaces_between_special_tokens: Any = None
    # vLLM's beam search: n (or best_of) beams, ranked by cum_logprob / length ** length_penalty (engine.beam_search).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    bad_words: Any = None
    allowed_token_ids: Any = None
    logits_processors: Any = None
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    # vLLM's older names for structured_outputs' fields.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    ec_transfer_params: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_ID_LEN)
    prompt_cache_key: str | None = Field(None, max_length=MAX_ID_LEN)
    # OpenAI's: how long the prompt's KV is kept below the pool (docs/tiers.md#retention); "in-memory" is the
    # spelling of clients older than openai-python's fix.
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    # Subdivides the caller's tenant cache namespace; validated in tenancy.py.
    cache_salt: str | None = None
    # vLLM's: names the response (and the engine requests) when no x-request-id header does.
    request_id: str | None = None
    # kvprefix extension (docs/server.md): per-prompt cache diagnosis in usage.cache_detail.
    cache_detail: bool = False
    # {token id as text: bias in [-100, 100]} added to the logits before sampling; checked in engine_call.
    logit_bias: dict[str, Any] | None = None
    # Accepted and ignored: they change nothing in the response.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The one structured-outputs request among response_format, structured_outputs and guided_*, and the
        field it came from."""
        found: list[tuple[StructuredOutputsParams, str]] = []

        def add(field: str, **spec: Any) -> None:
            try:  # an empty schema, choice list or pattern is no structured output: the request's 400
                found.append((StructuredOutputsParams(**spec), field))
            except ValueError as exc:
                raise APIError(400, f"'{field}': {exc}", param=field) from None

        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            add("response_format", json_object=True)
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise APIError(400, "'response_format' of type json_schema needs 'json_schema'",
                               param="response_format.json_schema")
            add("response_format", json=rf.json_schema.schema_)
        if self.structured_outputs is not None:
            add("structured_outputs", **self.structured_outputs.model_dump(exclude_none=True, by_alias=True))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                add(f"guided_{name}", **{name: value})
        if len(found) > 1:
            raise APIError(400, f"give one structured output, not {', '.join(f for _, f in found)}",
                           param=found[1][1])
        return found[0] if found else (None, None)

    def kv_retention(self) -> str | None:
        """The retention the request asks for (``prompt_cache_retention``), or None: the server's
        ``--kv-retention``."""
        return "in_memory" if self.prompt_cache_retention == "in-memory" else self.prompt_cache_retention

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt alone, scored (vLLM's)
    # Top alternatives per token (legacy API); capped by --max-logprobs; -1: the whole vocabulary (vLLM's).
    logprobs: int | None = Field(None, ge=-1)
    echo: bool = False  # the prompt's text (and its logprobs) before the completion's
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a batch: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)


class CacheControl(_Body):
    """Anthropic's cache breakpoint (LiteLLM, LangChain pass it on): every full block is cached anyway; a ``ttl``
    asks the tiers below the pool to keep the prompt that long (docs/tiers.md#retention)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


# Content part types of OpenAI's API that a text-only model cannot take, and what to tell the caller.
_UNSUPPORTED_PARTS = {"image_url": "images are", "input_image": "images are", "image": "images are",
                      "input_audio": "audio is", "file": "files are", "video_url": "videos are"}


class FunctionCall(_Body):
    name: str = Field(max_length=MAX_ID_LEN)
    arguments: str  # JSON text, as the model wrote it (kvprefix.prompts.tools checks that it parses)


class ToolCall(_Body):
    """A call the assistant made, carried back into the next turn."""

    id: str | None = Field(None, max_length=MAX_ID_LEN)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    # vLLM's leniency: any role the chat template renders, and keys beyond these ignored (not rendered).
    model_config = ConfigDict(extra="ignore")
    role: str = Field(min_length=1, max_length=MAX_ID_LEN)
    content: str | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    # What the openai client's message.model_dump() carries into the next turn: tool calls render, audio is refused in
    # check_supported(), refusal and annotations have nothing to render.
    refusal: str | None = None
    annotations: list[Any] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: str | None = Field(None, max_length=MAX_ID_LEN)  # a tool result: the call it answers
    function_call: Any = None
    audio: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Before the union is tried, so an image part does not get the str member's error.
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _UNSUPPORTED_PARTS:
                    raise ValueError(f"{_UNSUPPORTED_PARTS[kind]} not supported: this model takes text parts only")
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content part type {kind!r} is not supported; send 'text' parts")
        return content


class FunctionDefinition(_Body):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none: an object of any fields
    strict: bool | None = None  # the arguments always match under tool_choice required or named (docs/server.md)


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class _ChatTemplateFields(_Body):
    """How the messages are rendered (vLLM's names; kvprefix.prompts.render_chat checks the kwargs)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the tokenizer's own special tokens (BOS) before the rendered text
    documents: Annotated[list[dict[str, str]], Field(max_length=MAX_MESSAGES)] | None = None  # for RAG templates
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ToolDefinition], Field(min_length=1, max_length=MAX_TOOLS)] | None = None


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, strict=False)  # vLLM's leniency: "true" too
    top_logprobs: int | None = Field(None, ge=-1)  # capped by --max-logprobs; -1: the whole vocabulary (vLLM's)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None
    echo: bool = False  # the last message's content before the reply, when it is the reply's role (vLLM's)
    include_reasoning: bool = True  # vLLM's: no reasoning is parsed out here, so there is nothing to leave out
    reasoning_effort: Any = None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def kv_retention(self) -> str | None:
        """``prompt_cache_retention``, else the longest ``cache_control.ttl`` of the messages' text parts."""
        return super().kv_retention() or longest(
            part.cache_control.ttl for m in self.messages if isinstance(m.content, list) for part in m.content
            if part.cache_control is not None)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(_Body):
    """vLLM's /tokenize with a prompt."""

    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)]
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatTemplateFields):
    """vLLM's /tokenize with messages, rendered as /v1/chat/completions renders them."""

    model: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(max_length=MAX_DETOKENIZE)]


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter body: the adapter's name (what requests put in ``model``) and its directory;
    ``load_inplace`` replaces an adapter loaded under that name (its new weights are a new cache namespace)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter body (``lora_int_id`` is accepted and not used: names identify adapters)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_int_id: int | None = None
