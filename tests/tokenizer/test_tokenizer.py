"""Tokenizer wrapper: round trip, chat template, EOS ids, and streaming detokenization."""

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from kvprefix.tokenizer import IncrementalDetokenizer, Tokenizer

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


@pytest.fixture(scope="module")
def sentencepiece_style(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Llama-2/Mistral style: "▁" for spaces, byte-fallback tokens, and a decoder that strips the leading space, so
    a token decoded alone loses its space and only decoding with left context gets it right."""
    # Byte tokens are ordinary vocabulary (not special), ASCII characters are their own tokens, and nothing else is:
    # every non-ASCII character is spelled as byte tokens.
    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + [chr(c) for c in range(33, 127)]
    raw = RawTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True, unk_token="<unk>"))
    raw.add_special_tokens(specials)
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    path = tmp_path_factory.mktemp("sp-style")
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return Tokenizer(str(path))


@pytest.mark.parametrize("which", ["tokenizer", "sentencepiece_style"])
def test_incremental_detokenization_never_splits_characters(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    ids = tok.encode("Say: " + TEXT, add_special_tokens=False)
    prompt, generated = ids[:3], ids[3:]
    # Some multi-byte characters really do span several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in generated)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([i]) for i in generated]
    assert "".join(deltas) == detok.text == tok.decode(ids)[len(tok.decode(prompt)) :]
    assert detok.text.endswith(TEXT)
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenization_skips_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🙂") + list(tokenizer.eos_token_ids)
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add([i]) for i in ids) == "ok 🙂"
