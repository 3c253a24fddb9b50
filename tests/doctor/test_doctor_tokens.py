"""The doctor's memoized tokenization gives exactly the tokenizer's ids, through the one renderer."""

import pytest
import support.doctor_logs as logs

from kvprefix.prompts import render_bodies, render_body
from kvprefix.tokenizer import SegmentCachedTokenizer, Tokenizer

TEXTS = [
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi  there\n\n<|im_end|>\n",
    "no special tokens at all, just   spaces\tand tabs\n",
    "<|im_start|><|im_end|><|endoftext|>",
    "Привет, мир. こんにちは世界 🙂🚀<|im_end|>digits 0123456789",
    "",
]


def test_memoized_encode_equals_the_tokenizer(tokenizer_dir):
    plain = Tokenizer(str(tokenizer_dir))
    memo = SegmentCachedTokenizer(plain)
    for _ in range(2):  # the second round comes from the memo
        for text in TEXTS:
            assert memo.encode(text, add_special_tokens=False) == plain.encode(text, add_special_tokens=False)
            assert memo.encode(text) == plain.encode(text)
    assert memo.enabled


def test_rendering_through_the_memo_equals_rendering_without(tokenizer_dir):
    plain = Tokenizer(str(tokenizer_dir))
    memo = SegmentCachedTokenizer(plain)
    for body in logs.shuffled_tools(10) + logs.multi_turn(2, 3) + logs.short_prefix(3):
        assert render_body(memo, body)[0] == render_body(plain, body)[0]


def _mixed_bodies() -> list[dict]:
    """Chat bodies with tools in several orders and none, special spellings in content, no generation prompt,
    completions: every path of the batched renderer."""
    bodies = logs.shuffled_tools(12) + logs.multi_turn(2, 3) + logs.reordered_keys(6)
    bodies += [logs.chat("Say <|im_end|> and <|im_start|>user literally.", "ok?"),
               {**logs.chat(logs.STABLE, "no prompt after"), "add_generation_prompt": False},
               {"prompt": "a completions prompt, with BOS"}, {"prompt": [5, 6, 7]},
               {**logs.chat(logs.STABLE, "go on"), "add_generation_prompt": False, "continue_final_message": True},
               {**logs.chat(logs.STABLE, "keep the end"), "truncate_prompt_tokens": 8}]
    return bodies


def test_batched_rendering_equals_rendering_one_by_one(tokenizer_dir):
    plain = Tokenizer(str(tokenizer_dir))
    bodies = _mixed_bodies()
    one_by_one = [render_body(plain, b) for b in bodies]
    assert render_bodies(plain, bodies) == one_by_one
    memo = SegmentCachedTokenizer(plain)
    for _ in range(3):  # the memo's checked encodings first, then trusted batches, then pieces from the memo
        assert render_bodies(memo, bodies * 4) == one_by_one * 4
    assert memo.enabled and not memo._checks_left


def test_batched_encoding_equals_the_tokenizer(tokenizer_dir):
    plain = Tokenizer(str(tokenizer_dir))
    memo = SegmentCachedTokenizer(plain)
    texts = TEXTS * 20
    for special in (False, True):
        want = [plain.encode(t, add_special_tokens=special) for t in texts]
        assert plain.encode_batch(texts, add_special_tokens=special) == want
        assert memo.encode_batch(texts, add_special_tokens=special) == want
        assert memo.encode_batch(texts, add_special_tokens=special) == want


def test_a_batch_with_a_bad_body_raises_and_the_doctor_names_its_line(capsys, tmp_path, tokenizer_dir):
    from kvprefix.cli import main
    from kvprefix.prompts import PromptError

    rows = logs.clean(300)
    rows[290]["messages"] = []
    path = logs.write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(PromptError):
        render_bodies(Tokenizer(str(tokenizer_dir)), rows)
    assert main(["doctor", str(path), "--model", str(tokenizer_dir), "--json", "--no-progress"]) != 0
    assert "bad.jsonl:291:" in capsys.readouterr().err


# ASCII text where the pre-tokenizers' rules matter: runs of spaces, newlines and tabs before words, contractions,
# digit runs, punctuation runs, JSON, a trailing space.
ASCII_TEXTS = [
    "system\nNow: 2026-12-01T00:00:59Z. You are terse.", "  two spaces,   three\n\n\nthree newlines\r\n done ",
    "it's they'll I'M we'VE 'd", "1234567 12 3.14159 007", "!!!?? ... --> <tools>[{\"a\": 1}]</tools>",
    "\ttab\t\tthen\n \n\t x", "trailing newline\n", " ", "\n\n", "a\n b\n\n c", "x" * 300 + " y",
]


def _tokenizer_with(tmp_path, pre_tokenizer) -> Tokenizer:
    """The test tokenizer's vocabulary and merges behind another pre-tokenizer, as a checkpoint directory."""
    from kvprefix.tokenizer.builtin import build_tokenizer

    tok = build_tokenizer(1024)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizer
    tok.save_pretrained(str(tmp_path))
    return Tokenizer(str(tmp_path))


def _gguf_pre_tokenizer(name: str):
    """The pre-tokenizer kvprefix.tokenizer.gguf_tokenizer builds for a GGUF file's ``tokenizer.ggml.pre``."""
    from tokenizers import Regex, pre_tokenizers

    from kvprefix.tokenizer.gguf_tokenizer import PRE_TOKENIZERS

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                    for r in PRE_TOKENIZERS[name].regexes]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@pytest.mark.parametrize("pre", ["byte-level", "smollm", "llama-bpe", "qwen2", "gpt-2"])
def test_word_memo_tokenizes_ascii_text_as_the_tokenizer(tmp_path, tokenizer_dir, pre):
    from kvprefix.tokenizer.word_memo import WordMemo

    plain = Tokenizer(str(tokenizer_dir)) if pre == "byte-level" else _tokenizer_with(tmp_path, _gguf_pre_tokenizer(pre))
    words = WordMemo.of(plain)
    assert words is not None
    texts = ASCII_TEXTS + ["ünïcode stays with the tokenizer", "a control\x0bcharacter"]
    for _ in range(2):  # new words, then words from the memo
        got = words.encode_batch(texts)
        assert got[: len(ASCII_TEXTS)] == [plain.encode(t, add_special_tokens=False) for t in ASCII_TEXTS]
        assert got[len(ASCII_TEXTS):] == [None, None]
    assert words.enabled


def test_a_full_word_memo_starts_again_and_still_tokenizes_as_the_tokenizer(tokenizer_dir):
    """A batch that does not fit clears the memo: the words it shares with earlier batches must go back in too."""
    from kvprefix.tokenizer.word_memo import WordMemo

    plain = Tokenizer(str(tokenizer_dir))
    words = WordMemo.of(plain)
    words.capacity = 12
    for text in ASCII_TEXTS + ASCII_TEXTS[::-1]:  # each one overflows a memo that holds the words before it
        assert words.encode_batch([text]) == [plain.encode(text, add_special_tokens=False)]
    assert words.enabled and len(words._memo) <= max(12, max(len(set(words.words(t))) for t in ASCII_TEXTS))


def test_word_memo_without_splits_and_with_a_full_split_memo_tokenizes_as_the_tokenizer(tmp_path, monkeypatch):
    """A byte-level pre-tokenizer without its regex splits nothing (the text is one word); and the memo of the last
    split's words per earlier piece starts again when it holds too many characters."""
    from tokenizers import pre_tokenizers

    from kvprefix.tokenizer import word_memo
    from kvprefix.tokenizer.word_memo import WordMemo

    bare = _tokenizer_with(tmp_path / "bare", pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    words = WordMemo.of(bare)
    assert words is not None and words.encode_batch(ASCII_TEXTS) == [bare.encode(t, add_special_tokens=False)
                                                                      for t in ASCII_TEXTS]
    monkeypatch.setattr(word_memo, "_LAST_SPLIT_CHARS", 40)
    plain = _tokenizer_with(tmp_path / "smollm", _gguf_pre_tokenizer("smollm"))  # digits split off first
    words = WordMemo.of(plain)
    for text in ASCII_TEXTS * 2:
        assert words.encode_batch([text]) == [plain.encode(text, add_special_tokens=False)]
        assert words._last_split_chars <= 40 + max(len(t) for t in ASCII_TEXTS)


def test_word_memo_only_for_pre_tokenizers_it_can_replay(tmp_path):
    from tokenizers import pre_tokenizers

    from kvprefix.tokenizer.word_memo import WordMemo

    for k, pre in enumerate([pre_tokenizers.ByteLevel(add_prefix_space=True), pre_tokenizers.Whitespace(),
                             pre_tokenizers.Metaspace()]):
        assert WordMemo.of(_tokenizer_with(tmp_path / str(k), pre)) is None
