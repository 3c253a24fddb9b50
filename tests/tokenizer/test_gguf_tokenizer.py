"""The tokenizer rebuilt from a GGUF file tokenizes as llama.cpp's rules say (the independent reference in
llama_cpp_bpe.py) for each supported pre-tokenizer, on strings where the rules matter; unknown ones are refused."""

import numpy as np
import pytest
from gguf import GGUFWriter
from support.llama_cpp_bpe import PARITY_STRINGS, encode

from kvprefix.cache.default_model import default_model_path
from kvprefix.tokenizer import Tokenizer
from kvprefix.tokenizer.gguf_file import open_gguf


def write_tokenizer_gguf(path: str, pre: str, model: str = "gpt2", bos: str | None = None) -> str:
    """A GGUF file with only a tokenizer: the built-in byte-level BPE (trained on a fixed English text)."""
    import json

    from kvprefix.tokenizer.builtin import build_tokenizer

    tok = build_tokenizer(1024)
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {t.content for t in tok.added_tokens_decoder.values()}
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    if bos is not None:
        writer.add_bos_token_id(vocab[bos])
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_ids(path: str, text: str) -> list[int]:
    gguf = open_gguf(path)
    tokens, types = gguf.require("tokenizer.ggml.tokens"), gguf.require("tokenizer.ggml.token_type")
    specials = [t for t, k in zip(tokens, types, strict=True) if k in (3, 4)]
    return encode(text, tokens, gguf.require("tokenizer.ggml.merges"), gguf.require("tokenizer.ggml.pre"), specials)


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2"])
def test_matches_llama_cpp_rules(tmp_path, pre) -> None:
    path = write_tokenizer_gguf(str(tmp_path / f"{pre}.gguf"), pre)
    tok = Tokenizer(path)
    mismatched = [s for s in PARITY_STRINGS if tok.encode(s, add_special_tokens=False) != llama_cpp_ids(path, s)]
    assert mismatched == []
    # The rules differ where they should: SmolLM splits every numeral, Llama 3 groups three, Qwen2 splits too.
    pieces = [p for p, _ in tok.hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str("1234567")]
    assert pieces == {"smollm": list("1234567"), "llama-bpe": ["123", "456", "7"], "qwen2": list("1234567")}[pre]


def test_special_tokens_and_template_come_from_the_metadata(tmp_path) -> None:
    tok = Tokenizer(write_tokenizer_gguf(str(tmp_path / "t.gguf"), "smollm"))
    assert "<|im_start|>" in tok.special_tokens and tok.eos_token_ids == {tok.hf.convert_tokens_to_ids("<|im_end|>")}
    start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert tok.encode("<|im_start|>user")[0] == start
    assert start not in tok.encode_literal("<|im_start|>user")  # typed text never becomes a control token


def test_llama3_vocabularies_start_with_bos_unless_told_not_to(tmp_path) -> None:
    tok = Tokenizer(write_tokenizer_gguf(str(tmp_path / "t.gguf"), "llama-bpe", bos="<|endoftext|>"))
    bos = tok.hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.bos_token_id == bos
    assert tok.encode("hi") == [bos] + tok.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize(("pre", "model", "message"), [
    ("unknown-pre", "gpt2", "pre-tokenizer (tokenizer.ggml.pre) 'unknown-pre' is not supported"),
    ("smollm", "bert", "tokenizer.ggml.model 'bert' is not supported"),
])
def test_unsupported_tokenizer_is_a_one_line_error(tmp_path, pre, model, message) -> None:
    path = write_tokenizer_gguf(str(tmp_path / "t.gguf"), pre, model)
    with pytest.raises(ValueError) as exc:
        Tokenizer(path)
    assert message in str(exc.value) and path in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.slow
def test_default_model_tokenizes_as_llama_cpp() -> None:
    path = default_model_path()
    tok = Tokenizer(path)
    assert [s for s in PARITY_STRINGS if tok.encode(s, add_special_tokens=False) != llama_cpp_ids(path, s)] == []


@pytest.mark.slow
def test_a_gguf_tokenizes_without_torch(tmp_path) -> None:
    """A router or planner given a .gguf file tokenizes and fingerprints it without loading a model."""
    import subprocess
    import sys

    path = write_tokenizer_gguf(str(tmp_path / "t.gguf"), "smollm")
    code = ("import sys; from kvprefix.tokenizer import Tokenizer; from kvprefix.cache import context_for_checkpoint; "
            f"t = Tokenizer({path!r}); c = context_for_checkpoint({path!r}, '', t.chat_template); "
            "print(len(t.encode('hello 123')), bool(c.model), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == [str(len(Tokenizer(path).encode("hello 123"))), "True", "False"]
