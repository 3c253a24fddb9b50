"""GGUF SentencePiece vocabularies (tokenizer.ggml.model "llama", as in Llama 2 and Mistral v0.1 files): a real
SentencePiece BPE model trained at test time, written into a GGUF file as llama.cpp's converter writes it, tokenizes
to the ids sentencepiece itself gives, decodes back, and a tiny random Llama with it serves through the engine."""

import random
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from support.gguf_files import SPM_CONTROL, SPM_USER_DEFINED, add_spm_tokenizer, train_sentencepiece, write_gguf
from support.llama_cpp_bpe import PARITY_STRINGS

from kvprefix.prompts import render_bodies, render_body
from kvprefix.tokenizer import SegmentCachedTokenizer, Tokenizer

STRINGS = PARITY_STRINGS + (
    "ÿ þ ß ð",  # characters the vocabulary lacks: byte fallback
    "\u00a0non-breaking\u2003em space",
    "kato rienthe prefix stqu",  # pieces of the training text, so that long merges happen
    "    def f(x): return x * 7 + 49  # 7",
    "a" * 40,
    "▁ already escaped ▁▁",
)


@pytest.fixture(scope="module")
def sp():
    return train_sentencepiece()


def write_spm_gguf(path: str, sp, **flags) -> str:
    writer = GGUFWriter(path, "llama")
    add_spm_tokenizer(writer, sp, **flags)
    writer.add_tensor("token_embd.weight", np.zeros((sp.get_piece_size(), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tok(sp, tmp_path_factory) -> Tokenizer:
    return Tokenizer(write_spm_gguf(str(tmp_path_factory.mktemp("spm") / "spm.gguf"), sp))


def test_ids_equal_sentencepiece_on_the_fixed_strings(tok, sp) -> None:
    assert [s for s in STRINGS if tok.encode(s, add_special_tokens=False) != sp.encode(s)] == []
    assert len(tok.encode("kato rienthe prefix", add_special_tokens=False)) < len("kato rienthe prefix") / 2


def test_ids_equal_sentencepiece_on_random_strings(tok, sp) -> None:
    rng = random.Random(1)
    alphabet = list("aeiounrstkqh .,!?0123456789\n\t") + ["  ", "th", "ing", "ÿ", "你", "🙂", "é", "▁"]
    texts = ["".join(rng.choices(alphabet, k=rng.randint(1, 40))) for _ in range(400)]
    assert [t for t in texts if tok.encode(t, add_special_tokens=False) != sp.encode(t)] == []


def test_decoding_round_trips_and_agrees_with_sentencepiece(tok, sp) -> None:
    for s in STRINGS:
        ids = sp.encode(s)
        assert tok.decode(ids) == sp.decode(ids), s
        assert tok.decode(ids) == (s.replace("\u2581", " ") if "\u2581" in s else s)  # U+2581 reads as a space
    # A character split into byte tokens is whole again only once all its bytes are there.
    ids = tok.encode("你ÿ", add_special_tokens=False)
    assert tok.decode(ids[:-1]).endswith("\ufffd") and tok.decode(ids) == "你ÿ"
    assert tok.token_strings(tok.encode("ÿ", add_special_tokens=False))[-2:] == ["<0xC3>", "<0xBF>"]


def test_a_vocabulary_without_byte_tokens_gives_the_unknown_token(sp, tmp_path) -> None:
    tok = Tokenizer(write_spm_gguf(str(tmp_path / "no-bytes.gguf"), sp, byte_tokens=False))
    assert tok.encode("aÿb", add_special_tokens=False) == [sp.piece_to_id("▁a"), sp.unk_id(), sp.piece_to_id("b")]
    assert sp.encode("aÿb")[-3:] == [sp.piece_to_id("<0xC3>"), sp.piece_to_id("<0xBF>"), sp.piece_to_id("b")]
    assert tok.decode(tok.encode("aÿb", add_special_tokens=False)) == "ab"  # unused tokens read as nothing


def llama_cpp_ids(sp, text: str, split: tuple[str, ...]) -> list[int]:
    """llama.cpp's rule for the special tokens in a text: each is split out, and every run of text around them is
    tokenized on its own, so it gets a leading space of its own (sentencepiece alone adds one only at the start)."""
    pattern = "(" + "|".join(re.escape(s) for s in sorted(split, key=len, reverse=True)) + ")"
    return [i for run in re.split(pattern, text) if run
            for i in ([sp.piece_to_id(run)] if run in split else sp.encode(run))]


def test_special_tokens_in_text_are_split_out_as_llama_cpp_does(tok, sp) -> None:
    specials = ("<s>", "</s>", "<unk>", *SPM_CONTROL, *SPM_USER_DEFINED)
    texts = ["<s>[INST] Hi there [/INST] Hello</s>", "a<|user|>b<|end|> c", "<|user|><|user|>  two spaces<unk>",
             "x</s>", "no specials at all"]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == llama_cpp_ids(sp, text, specials), text
    # Typed text never becomes a control or unknown token; user-defined tokens are always split out.
    literal = tok.encode_literal("<s>a<|user|>b<|end|>")
    assert literal == llama_cpp_ids(sp, "<s>a<|user|>b<|end|>", SPM_USER_DEFINED)
    assert sp.bos_id() not in literal and sp.piece_to_id("<|user|>") in literal
    assert set(tok.special_tokens) == {"<s>", "</s>", "<unk>", *SPM_CONTROL}
    # Decoding shows control tokens only when asked; user-defined ones always.
    ids = tok.encode("<s>a<|user|>b<|end|>", add_special_tokens=False)
    assert tok.decode(ids) == " a<|user|> b" and tok.decode(ids, skip_special_tokens=False) == "<s> a<|user|> b<|end|>"


def test_bos_eos_and_space_prefix_follow_the_metadata(sp, tmp_path) -> None:
    default = Tokenizer(write_spm_gguf(str(tmp_path / "default.gguf"), sp))
    assert default.bos_token_id == sp.bos_id() and default.eos_token_ids == {sp.eos_id()}
    assert default.encode("hi") == [sp.bos_id(), *sp.encode("hi")]  # llama.cpp adds BOS to SentencePiece vocabs
    assert default.encode("") == [sp.bos_id()] and default.encode("", add_special_tokens=False) == []
    no_bos = Tokenizer(write_spm_gguf(str(tmp_path / "no-bos.gguf"), sp, add_bos=False))
    assert no_bos.encode("hi") == sp.encode("hi")
    bare = Tokenizer(write_spm_gguf(str(tmp_path / "bare.gguf"), sp, add_space_prefix=False))
    for s in ("hello world", "  two", "x"):  # no space of its own in front, and none taken off when decoding
        assert bare.encode(" " + s, add_special_tokens=False) == default.encode(s, add_special_tokens=False)
        assert bare.decode(bare.encode(s, add_special_tokens=False)) == s
        assert bare.decode(bare.encode(" " + s, add_special_tokens=False)) == " " + s


def test_chat_template_renders_with_the_files_bos_and_eos(tok, sp) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye <s>"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<s>[INST] Hi [/INST] Hello</s>[INST] Bye <s> [/INST]"
    [rendered] = render_body(tok, {"messages": messages})
    assert rendered.text == text
    # The user's "<s>" stays text, tokenized as part of the whole (no space of its own where the content starts);
    # the template's own BOS and EOS are tokens.
    bos, eos = sp.bos_id(), sp.eos_id()
    assert rendered.token_ids == [bos, *sp.encode("[INST] Hi [/INST] Hello"), eos,
                                  *sp.encode("[INST] Bye <s> [/INST]")]
    assert rendered.token_ids.count(bos) == 1
    [cont] = render_body(tok, {"messages": messages[:2], "continue_final_message": True,
                               "add_generation_prompt": False})
    assert cont.text == "<s>[INST] Hi [/INST] Hello"  # the reply goes on: no EOS after it
    assert tok.apply_chat_template([messages[:1], messages[:2]], tokenize=False) == [
        "<s>[INST] Hi [/INST]", "<s>[INST] Hi [/INST] Hello</s>"]


def test_segment_cache_is_exact_on_a_sentencepiece_vocabulary(tok) -> None:
    """Every run of text after a special token gets its own space prefix in llama.cpp, so tokenizing the runs
    apart is exact: the memo stays on past its checks and agrees with the plain tokenizer."""
    memo = SegmentCachedTokenizer(tok)
    assert memo.enabled
    texts = [f"<s>[INST] question {i} [/INST] answer {i % 3}</s><|user|> tail{i}" for i in range(80)]
    assert [memo.encode(t, add_special_tokens=False) for t in texts] == [
        tok.encode(t, add_special_tokens=False) for t in texts]
    assert memo.enabled and not memo._checks_left
    assert memo.encode_batch(texts[:5], add_special_tokens=False) == [
        tok.encode(t, add_special_tokens=False) for t in texts[:5]]
    # The doctor's and the router's path: many chat bodies rendered in a batch through the memo, as one by one.
    bodies = [{"messages": [{"role": "user", "content": f"shared question {i % 4}"},
                            {"role": "assistant", "content": "an answer"},
                            {"role": "user", "content": f"and <s> {i}" if i % 5 == 0 else f"then {i}"}]}
              for i in range(30)]
    assert render_bodies(memo, bodies) == [render_body(tok, b) for b in bodies]


@pytest.mark.slow
def test_a_sentencepiece_gguf_tokenizes_without_torch(tok) -> None:
    """A router or planner given a SentencePiece .gguf tokenizes, renders chats and fingerprints it without torch."""
    import subprocess
    import sys

    path = tok.name_or_path
    code = ("import sys; from kvprefix.tokenizer import Tokenizer; from kvprefix.prompts import render_body; "
            "from kvprefix.cache import context_for_checkpoint; "
            f"t = Tokenizer({path!r}); c = context_for_checkpoint({path!r}, '', t.chat_template); "
            "r = render_body(t, {'messages': [{'role': 'user', 'content': 'hello 123'}]})[0]; "
            "print(len(t.encode('hello 123')), len(r.token_ids), bool(c.model), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    expected = [len(tok.encode("hello 123")), len(tok.apply_chat_template([{"role": "user", "content": "hello 123"}]))]
    assert out.stdout.split() == [*map(str, expected), "True", "False"]


@pytest.fixture(scope="module")
def spm_llama(sp, tmp_path_factory) -> str:
    """A tiny random Llama with the SentencePiece vocabulary, as a Q8_0 GGUF file."""
    from kvprefix.model import write_random_checkpoint

    tmp = tmp_path_factory.mktemp("spm-llama")
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                  vocab_size=sp.get_piece_size())
    ckpt = write_random_checkpoint(str(tmp / "llama"), "llama", seed=7, **config)
    path = str(tmp / "spm-llama.gguf")
    write_gguf(path, ckpt, config, GGMLQuantizationType.Q8_0, spm=sp)
    return path


def test_a_random_llama_with_the_vocabulary_generates_through_the_engine(sp, spm_llama) -> None:
    from kvprefix import LLM, SamplingParams
    from kvprefix.engine.sampling_params import StructuredOutputsParams

    path = spm_llama
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(path, dtype="float32", num_gpu_blocks=64)
    out = llm.generate("The capital of France is", greedy)[0]
    assert out.prompt_token_ids == [sp.bos_id(), *sp.encode("The capital of France is")]
    assert len(out.outputs[0].token_ids) == 8
    tok = llm.get_tokenizer()
    whole = tok.decode(out.prompt_token_ids + out.outputs[0].token_ids)
    assert out.outputs[0].text == whole[len(tok.decode(out.prompt_token_ids)):]
    chat = llm.chat([{"role": "user", "content": "Hi!"}], greedy)[0]
    assert chat.prompt == "<s>[INST] Hi! [/INST]" and chat.prompt_token_ids[0] == sp.bos_id()
    # Structured outputs see the vocabulary's bytes: the random model can only say one of the choices.
    choices = ["yes please", "no thanks", "ÿ 123"]
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=16,
                                 structured_outputs=StructuredOutputsParams(choice=choices))
    texts = [o.outputs[0].text for o in llm.generate(["Answer:", "Say", "Well"], constrained)]
    assert all(t in choices for t in texts), texts


@pytest.mark.slow
def test_kvprefix_serve_on_a_sentencepiece_gguf(sp, spm_llama, tmp_path, monkeypatch) -> None:
    """The real server with the official client: chat (plain and streamed alike), prompt tokens as the renderer
    counts them, /tokenize and /detokenize on the file's vocabulary."""
    from support.servers import start_server, stop_server

    monkeypatch.setenv("KVPREFIX_TEST_MODEL", spm_llama)
    server = start_server(tmp_path)
    try:
        client, model = server.client(), "default-model-v1"
        messages = [{"role": "user", "content": "Hi <s> there"}]
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert whole.choices[0].message.content == streamed
        tok = Tokenizer(spm_llama)
        [rendered] = render_body(tok, {"messages": messages})
        assert whole.usage.prompt_tokens == len(rendered.token_ids)
        tokens = server.post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
        assert tokens["tokens"] == sp.encode("Hello world")
        assert server.post("/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    finally:
        assert stop_server(server) in (0, -15)
    assert "Traceback" not in server.log_path.read_text()
