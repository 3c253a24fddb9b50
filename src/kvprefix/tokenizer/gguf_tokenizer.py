"""The tokenizer inside a GGUF file, rebuilt as a Hugging Face fast tokenizer that tokenizes as llama.cpp does.

A GGUF names its pre-tokenizer only (``tokenizer.ggml.pre``); llama.cpp maps the name to regular expressions, each
splitting the pieces of the previous one. The table below is that mapping (src/llama-vocab.cpp). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvprefix.tokenizer.gguf_file import GGUFFile

# The GPT-2 regex, and the Llama 3 one (Qwen2 differs only in splitting numerals one by one, not in threes).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_DIGITS_APART = (r"\p{N}", _GPT2)


@dataclass(frozen=True)
class _Rules:
    regexes: tuple[str, ...]
    # llama.cpp's Llama 3 vocabularies: a piece that is itself a token is emitted whole, before any merge.
    ignore_merges: bool = False
    add_bos: bool = False  # the default when the file does not say (tokenizer.ggml.add_bos_token)


_LLAMA3_RULES = _Rules((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_RULES = _Rules((_QWEN2,))
_GPT2_RULES = _Rules((_GPT2,))
_DIGITS_APART_RULES = _Rules(_DIGITS_APART)
PRE_TOKENIZERS: dict[str, _Rules] = {
    "llama-bpe": _LLAMA3_RULES,
    "llama3": _LLAMA3_RULES,
    "llama-v3": _LLAMA3_RULES,
    "falcon3": _LLAMA3_RULES,
    "pixtral": _LLAMA3_RULES,
    "qwen2": _QWEN2_RULES,
    "deepseek-r1-qwen": _QWEN2_RULES,
    "stablelm2": _QWEN2_RULES,
    "gpt-2": _GPT2_RULES,
    "mpt": _GPT2_RULES,
    "olmo": _GPT2_RULES,
    "smollm": _DIGITS_APART_RULES,
    "starcoder": _DIGITS_APART_RULES,
    "refact": _DIGITS_APART_RULES,
    "command-r": _DIGITS_APART_RULES,
    "codeshell": _DIGITS_APART_RULES,
}
# GGUF token types (gguf.TokenType): control tokens are special, user-defined ones are matched in text as is.
_CONTROL, _USER_DEFINED = 3, 4


def gguf_tokenizer(gguf: GGUFFile) -> Any:
    """A ``PreTrainedTokenizerFast`` with the file's vocabulary, merges, special tokens and chat template."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    kind = gguf.require("tokenizer.ggml.model")
    if kind != "gpt2":  # "llama" (SentencePiece) vocabularies are kvprefix.tokenizer.gguf_spm's
        raise ValueError(f"{gguf.path}: tokenizer.ggml.model {kind!r} is not supported; accepted: 'gpt2' "
                         "(byte-level BPE), 'llama' (SentencePiece)")
    pre = gguf.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{gguf.path}: pre-tokenizer (tokenizer.ggml.pre) {pre!r} is not supported; accepted: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    rules = PRE_TOKENIZERS[pre]
    tokens = gguf.require("tokenizer.ggml.tokens")
    types = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=rules.ignore_merges))
    rust.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rules.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                             for i, t in enumerate(types) if t == _CONTROL])
    rust.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                     for i, t in enumerate(types) if t == _USER_DEFINED])
    special = {name: _token(gguf, tokens, f"tokenizer.ggml.{key}_token_id")
               for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                                 ("pad_token", "padding"))}
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", rules.add_bos)) and special["bos_token"] is not None
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False)) and special["eos_token"] is not None
    if add_bos or add_eos:
        bos, eos = special["bos_token"] if add_bos else None, special["eos_token"] if add_eos else None
        single = " ".join(t for t in (bos, "$A", eos) if t)
        rust.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {single.replace('$A', '$B:1')}",
            special_tokens=[(t, vocab[t]) for t in {bos, eos} if t])
    return PreTrainedTokenizerFast(
        tokenizer_object=rust,
        name_or_path=gguf.path,
        chat_template=gguf.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        **{name: value for name, value in special.items() if value is not None},
    )


def gguf_eos_token_ids(gguf: GGUFFile) -> frozenset[int]:
    """End of sequence, end of turn and end of message: llama.cpp stops generating at any of them."""
    ids = (gguf.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom"))
    return frozenset(int(i) for i in ids if i is not None)


def _token(gguf: GGUFFile, tokens: list[str], key: str) -> str | None:
    index = gguf.get(key)
    if index is None:
        return None
    if not 0 <= index < len(tokens):
        raise ValueError(f"{gguf.path}: {key} is {index}, outside the vocabulary of {len(tokens)} tokens")
    return tokens[index]
