"""Tokenizer: a checkpoint's tokenizer and chat template, via transformers (which needs no torch for this); for a
.gguf file, the tokenizer rebuilt from its metadata (kvprefix.prompts.gguf_tokenizer)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from kvprefix.prompts.gguf_file import is_gguf, open_gguf


class Tokenizer:
    def __init__(self, path: str) -> None:
        if is_gguf(path):
            from kvprefix.prompts.gguf_tokenizer import gguf_eos_token_ids, gguf_tokenizer

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
        template = self.hf.chat_template
        return None if template is None else str(template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``[encode(t) for t in texts]`` in one call into the tokenizer (fewer crossings into Rust)."""
        return self.hf(texts, add_special_tokens=add_special_tokens)["input_ids"] if texts else []

    def encode_literal(self, text: str) -> list[int]:
        """Tokenizes ``text`` as plain text: a special token's spelling in it ("<|im_start|>") stays text."""
        return self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The spellings of the special (control) tokens, which text typed by users must never turn into."""
        return tuple(t.content for t in self.hf.added_tokens_decoder.values() if t.special)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of text one token can stand for, so that a prompt's length in
        characters bounds its length in tokens from below without tokenizing it."""
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
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tokenize: bool = True, **kwargs: Any
    ) -> list[int] | str:
        """Renders messages with the checkpoint's template; token ids by default, the text with tokenize=False."""
        if not self.hf.chat_template:
            raise ValueError(f"the tokenizer of {self.hf.name_or_path!r} has no chat template; use a plain prompt")
        text = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        # The template already contains any BOS it wants; adding special tokens again would double it.
        return self.encode(text, add_special_tokens=False) if tokenize else text


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
