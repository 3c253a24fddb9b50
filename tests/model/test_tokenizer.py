"""Tokenizer wrapper: round trip, chat template, EOS ids, and streaming detokenization."""

import pytest

from kvprefix.model import IncrementalDetokenizer, Tokenizer

TEXT = "Hello, prefix cache! Caché über naïve — 你好，世界 🙂🚀 end"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: str) -> Tokenizer:
    return Tokenizer(tiny_llama_path)


def test_round_trip(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == TEXT


def test_chat_template(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    im_start = tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3  # special tokens are single ids, not spelled out
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_eos_ids_come_from_tokenizer_and_generation_config(tokenizer: Tokenizer) -> None:
    ids = tokenizer.hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.eos_token_ids == frozenset(ids)


def test_incremental_detokenization_never_splits_characters(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Say: ")
    ids = tokenizer.encode(TEXT)
    # The tokenizer is byte-level: some multi-byte characters really do span several tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) == detok.text == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenization_skips_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🙂") + list(tokenizer.eos_token_ids)
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add([i]) for i in ids) == "ok 🙂"
