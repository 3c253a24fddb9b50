"""The doctor's memoized tokenization gives exactly the tokenizer's ids, through the one renderer."""

import doctor_logs as logs

from kvprefix.doctor.tokens import SegmentMemoTokenizer
from kvprefix.prompts import Tokenizer, render_body

TEXTS = [
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi  there\n\n<|im_end|>\n",
    "no special tokens at all, just   spaces\tand tabs\n",
    "<|im_start|><|im_end|><|endoftext|>",
    "Привет, мир. こんにちは世界 🙂🚀<|im_end|>digits 0123456789",
    "",
]


def test_memoized_encode_equals_the_tokenizer(tokenizer_dir):
    plain = Tokenizer(str(tokenizer_dir))
    memo = SegmentMemoTokenizer(plain)
    for _ in range(2):  # the second round comes from the memo
        for text in TEXTS:
            assert memo.encode(text, add_special_tokens=False) == plain.encode(text, add_special_tokens=False)
            assert memo.encode(text) == plain.encode(text)
    assert memo.enabled


def test_rendering_through_the_memo_equals_rendering_without(tokenizer_dir):
    plain = Tokenizer(str(tokenizer_dir))
    memo = SegmentMemoTokenizer(plain)
    for body in logs.shuffled_tools(10) + logs.multi_turn(2, 3) + logs.short_prefix(3):
        assert render_body(memo, body)[0] == render_body(plain, body)[0]
