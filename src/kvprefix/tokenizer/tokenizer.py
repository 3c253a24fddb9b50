"""Tokenizer: a checkpoint's tokenizer and chat template via transformers (no torch); for a .gguf file, rebuilt from
its metadata (gguf_tokenizer), or for a SentencePiece vocabulary, llama.cpp-exact (SpmTokenizer over gguf_spm)."""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Callable
from typing import Any

from kvprefix.tokenizer.chat_template import ChatTemplate, detect_content_format
from kvprefix.tokenizer.gguf_file import is_gguf, open_gguf


class Tokenizer:
    # Set by ``with_chat_template`` on a copy: the template rendering uses instead of the checkpoint's, and how
    # message content reaches it.
    _template_override: str | None = None
    _content_format_option: str = "auto"

    def __new__(cls, path: str = "") -> Tokenizer:  # the default: unpickling calls __new__ without arguments
        # A GGUF SentencePiece vocabulary is tokenized by kvprefix's own code, not by a Hugging Face tokenizer.
        if cls is Tokenizer and is_gguf(path) and open_gguf(path).get("tokenizer.ggml.model") == "llama":
            cls = SpmTokenizer
        return super().__new__(cls)

    def __init__(self, path: str) -> None:
        if is_gguf(path):
            from kvprefix.tokenizer.gguf_tokenizer import gguf_eos_token_ids, gguf_tokenizer

            gguf = open_gguf(path)
            self.hf = gguf_tokenizer(gguf)
            self.eos_token_ids: frozenset[int] = gguf_eos_token_ids(gguf)
            self.bos_token_id: int | None = self.hf.bos_token_id
            self.vocab_size: int = len(self.hf)
            return
        if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(
            os.path.join(path, "tokenizer_config.json")
        ):
            raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {path!r}")
        from transformers import AutoTokenizer  # imported here: a process that never tokenizes never loads it

        self.hf = AutoTokenizer.from_pretrained(path)
        self.eos_token_ids: frozenset[int] = _eos_token_ids(path, self.hf.eos_token_id)
        self.bos_token_id: int | None = self.hf.bos_token_id
        self.vocab_size: int = len(self.hf)

    @property
    def chat_template(self) -> str | None:
        """The template text (part of the cache identity: another template renders other tokens)."""
        if self._template_override is not None:
            return self._template_override
        template = self.hf.chat_template
        return None if template is None else str(template)

    def with_chat_template(self, template: ChatTemplate) -> Tokenizer:
        """This tokenizer rendering with ``template``'s text (None: the checkpoint's own, which a tokenizer with
        several named ones picks by request) and content format (vLLM's ``--chat-template`` and
        ``--chat-template-content-format``)."""
        out = copy.copy(self)
        out.__dict__.pop("_plain_content_format", None)  # resolved for this tokenizer's template, not the new one
        if template.text is not None:
            out._template_override = template.text
        out._content_format_option = template.content_format
        return out

    def content_format(self, tools: Any = None) -> str:
        """How message content reaches the template a request with ``tools`` renders with: "string" (one text) or
        "openai" (a list of text parts); "auto" resolves by the template (``detect_content_format``)."""
        if self._content_format_option != "auto":
            return self._content_format_option
        return self._plain_content_format if tools is None else self._detected_format(tools)

    @functools.cached_property
    def _plain_content_format(self) -> str:  # every request without tools asks: resolved once
        return self._detected_format(None)

    def _detected_format(self, tools: Any) -> str:
        try:
            return detect_content_format(self._template_for(tools))
        except ValueError:  # no template at all: nothing renders messages
            return "string"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``[encode(t) for t in texts]`` in one call into the tokenizer (fewer crossings into Rust)."""
        return self.hf(texts, add_special_tokens=add_special_tokens)["input_ids"] if texts else []

    def encode_literal(self, text: str) -> list[int]:
        """Tokenizes ``text`` as plain text: a special token's spelling in it ("<|im_start|>") stays text."""
        return self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """One text in parts, each (text, whether special tokens in it are parsed), without BOS/EOS; each part is
        tokenized on its own (a fast tokenizer cannot change rule mid-text)."""
        return [i for text, parse in parts if text
                for i in (self.encode(text, add_special_tokens=False) if parse else self.encode_literal(text))]

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The spellings of the special (control) tokens, which text typed by users must never turn into."""
        return tuple(t.content for t in self.hf.added_tokens_decoder.values() if t.special)

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """Spelling -> id of every token that ``encode`` splits out of the text before tokenizing the rest."""
        return {t.content: i for i, t in self.hf.added_tokens_decoder.items()}

    @functools.cached_property
    def tokenizes_between_added_tokens(self) -> bool:
        """Whether the text between two added tokens tokenizes on its own, whatever surrounds it (no normalizer
        over the whole text, no added token that strips the spaces beside it)."""
        return self.hf.backend_tokenizer.normalizer is None and not any(
            t.lstrip or t.rstrip or t.single_word for t in self.hf.added_tokens_decoder.values())

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters one token stands for: a prompt's length bounds its tokens from below."""
        vocab = sorted(self.hf.get_vocab().items(), key=lambda item: len(item[0]), reverse=True)
        # The longest entries decoded exactly; every other entry is shorter than the last of those, and a vocab
        # character never stands for more than one text character (4 covers any unusual vocab encoding).
        longest = max((len(self.hf.decode([i])) for _, i in vocab[:256]), default=1)
        rest = len(vocab[256][0]) * 4 if len(vocab) > 256 else 0
        return max(longest, rest, 1)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's vocabulary entry (vLLM's ``token_strs`` of /tokenize)."""
        return self.hf.convert_ids_to_tokens(token_ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]], add_generation_prompt: bool = True,
        tokenize: bool = True, **kwargs: Any
    ) -> list[int] | str | list[str]:
        """Renders messages with the checkpoint's template: token ids by default, the text with tokenize=False; a
        list of conversations renders to a list of texts. Uses transformers' renderer without its wrapper's copy of
        every message; plain conversations go straight to the compiled template (same result, no copy)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        refused = WRAPPER_ARGUMENTS.intersection(kwargs)
        if refused:
            raise TypeError(f"apply_chat_template does not take {sorted(refused)}")
        template = self._template_for(kwargs.get("tools"))
        batched = bool(messages) and isinstance(messages[0], (list, tuple))
        # transformers' wrapper drops None-valued keys first: templates test for a key, not for None
        conversations = [[{k: v for k, v in m.items() if v is not None} for m in c]
                         for c in (messages if batched else [messages])]
        tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
        continue_final_message = kwargs.pop("continue_final_message", False)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        if not all(conversations):
            raise ValueError("cannot render an empty conversation")
        variables = {**self._template_variables, **kwargs}
        if tools is None and documents is None and not continue_final_message and _plain(conversations, variables):
            render = _direct_renderer(template)
            texts = [render({"messages": c, "tools": None, "documents": None,
                             "add_generation_prompt": add_generation_prompt, **variables}) for c in conversations]
        else:
            texts, _ = render_jinja_template(
                conversations=conversations, tools=tools, documents=documents, chat_template=template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **variables)
        if batched:
            return texts
        # The template already contains any BOS it wants; adding special tokens again would double it.
        return self.encode(texts[0], add_special_tokens=False) if tokenize else texts[0]

    def _template_for(self, tools: Any) -> str:
        """The template transformers would pick (a tokenizer may have several by name: "tool_use" with tools); the
        one given in its place, whatever the request."""
        if self._template_override is not None:
            return self._template_override
        if not self.hf.chat_template:
            raise ValueError(f"the tokenizer of {self.hf.name_or_path!r} has no chat template; use a plain prompt")
        return self.hf.get_chat_template(None, tools)

    @functools.cached_property
    def _template_variables(self) -> dict[str, Any]:
        """What a template sees beside the messages: the special tokens by name (bos_token, eos_token, ...)."""
        return dict(self.hf.special_tokens_map)


# transformers' apply_chat_template arguments that are not template variables: this renderer does not take them
# (the template is the checkpoint's; it renders text, and never sanitizes: kvprefix.prompts.render keeps typed
# special tokens as text itself).
WRAPPER_ARGUMENTS = frozenset({
    "chat_template", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "conversation",
})
_PLAIN_MESSAGE_KEYS = frozenset({"role", "content", "tool_call_id"})
_PLAIN_VALUES = (str, bool, int, float, type(None))


def _plain(conversations: list[list[dict[str, Any]]], variables: dict[str, Any]) -> bool:
    """Whether transformers' renderer would hand the template exactly these objects (no tools, documents or message
    to continue): string messages under keys it passes as they are, variables of plain types."""
    return all(type(k) is str and k in _PLAIN_MESSAGE_KEYS and type(v) is str
               for c in conversations for m in c for k, v in m.items()) and all(
        type(v) in _PLAIN_VALUES or type(v) is list and all(type(x) is str for x in v) for v in variables.values())


@functools.lru_cache(maxsize=32)
def _direct_renderer(template: str) -> Callable[[dict[str, Any]], str]:
    """``variables -> text``, as ``jinja2.Template.render(**variables)`` for transformers' compiled ``template``, with
    its globals merged once (Jinja would copy its ChainMap of globals into every render's context)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template(template)
    merged_globals = dict(compiled.globals)
    environment = compiled.environment

    def render(variables: dict[str, Any]) -> str:
        context = compiled.new_context({**merged_globals, **variables}, shared=True)  # what render() builds
        try:
            return environment.concat(compiled.root_render_func(context))
        except Exception:
            return environment.handle_exception()  # raises, with the template's lines in the traceback, as render()

    return render


def _eos_token_ids(path: str, tokenizer_eos: int | None) -> frozenset[int]:
    """Union of the tokenizer's EOS and eos_token_id in generation_config.json and config.json (int or list)."""
    ids = set() if tokenizer_eos is None else {tokenizer_eos}
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                value = json.load(f).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return frozenset(ids)


class SpmTokenizer(Tokenizer):
    """A GGUF file's SentencePiece vocabulary (kvprefix.tokenizer.gguf_spm) behind the same methods; ``hf`` is None.
    The chat template is rendered as for any tokenizer, with the special tokens' spellings as its variables."""

    def __init__(self, path: str) -> None:
        from kvprefix.tokenizer.gguf_spm import SpmVocab
        from kvprefix.tokenizer.gguf_tokenizer import gguf_eos_token_ids

        gguf = open_gguf(path)
        self.hf = None
        self.name_or_path = path
        self.spm = SpmVocab(gguf)
        eos = self.spm.special.eos  # llama.cpp's default id when the file names none
        self.eos_token_ids = gguf_eos_token_ids(gguf) | (frozenset() if eos is None else {eos})
        self.bos_token_id = self.spm.special.bos
        self.vocab_size = len(self.spm.tokens)
        self._template = gguf.get("tokenizer.chat_template")

    @property
    def chat_template(self) -> str | None:
        if self._template_override is not None:
            return self._template_override
        return None if self._template is None else str(self._template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.spm.encode(text, add_special=add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.spm.encode(t, add_special=add_special_tokens) for t in texts]

    def encode_literal(self, text: str) -> list[int]:
        return self.spm.encode(text, add_special=False, parse_special=False)

    def encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Tokenized as one text (llama.cpp's rules run on across the parts), specials parsed where a part says."""
        return self.spm.encode_parts(parts)

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        from kvprefix.tokenizer.gguf_spm import CONTROL, UNKNOWN

        return tuple(t for t, kind in zip(self.spm.tokens, self.spm.types, strict=True) if kind in (CONTROL, UNKNOWN))

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        from kvprefix.tokenizer.gguf_spm import CONTROL, UNKNOWN, USER_DEFINED

        kinds = (CONTROL, UNKNOWN, USER_DEFINED)
        return {t: i for i, (t, kind) in enumerate(zip(self.spm.tokens, self.spm.types, strict=True)) if kind in kinds}

    # Every run of text between split-out tokens gets its own leading space (llama.cpp's rule), so a run tokenizes
    # the same alone as in context.
    tokenizes_between_added_tokens = True

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        return max((len(t) for t in self.spm.tokens), default=1)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.spm.tokens[i] for i in token_ids]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.spm.decode(token_ids, special=not skip_special_tokens)

    def _template_for(self, tools: Any) -> str:
        if self._template_override is not None:
            return self._template_override
        if not self._template:
            raise ValueError(f"the tokenizer of {self.name_or_path!r} has no chat template; use a plain prompt")
        return self._template

    @functools.cached_property
    def _template_variables(self) -> dict[str, Any]:
        tokens = self.spm.tokens
        names = {"bos_token": self.spm.special.bos, "eos_token": self.spm.special.eos,
                 "unk_token": self.spm.special.unk}
        return {name: tokens[i] for name, i in names.items() if i is not None}
