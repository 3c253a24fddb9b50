"""The renderer's fast searches give what the plain ones give: ``_find`` is ``str.find``, and the first-character
filter in front of the special-token pattern never hides a spelling."""

import random

from kvprefix.prompts import render


def test_find_is_str_find():
    rng = random.Random(0)
    for _ in range(3000):
        # a tiny alphabet: heads that match where the whole content does not, overlaps, misses, the fallback
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 400)))
        content = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 200)))
        if text and rng.random() < 0.5:  # often a content that is in the text
            start = rng.randrange(len(text))
            content = text[start : start + rng.randrange(1, 200)]
        start = rng.randrange(0, len(text) + 2)
        assert render._find(text, content, start) == text.find(content, start), (text, content, start)


def test_find_on_runs_of_one_letter():
    # a head at every position: the content starts one, two, ... past the first one, before and after the fallback
    for n in range(render._HEAD, render._HEAD + 12):
        for k in range(render._HEAD - 2, n + 2):
            text, content = "a" * n + "b", "a" * k + "b"
            for start in range(3):
                assert render._find(text, content, start) == text.find(content, start), (n, k, start)


class Spellings:
    def __init__(self, special_tokens):
        self.special_tokens = tuple(special_tokens)


def test_a_content_with_a_special_spelling_is_always_found():
    rng = random.Random(1)
    alphabet = "ab<|>[]x "
    for spellings in (["<|im_start|>", "<|im_end|>"], ["<s>", "[INST]", "|x|"], ["a", "b", "<", "[", "|"],
                      ["<s>", "</s>", "[a]", "|b|", "xy", " z"]):  # ... the last has too many first characters
        tokenizer = Spellings(spellings)
        for _ in range(500):
            messages = [{"content": "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))}
                        for _ in range(rng.randrange(1, 3))]
            if rng.random() < 0.3:
                messages[-1]["content"] += rng.choice(spellings)
            expected = any(s in m["content"] for s in spellings for m in messages)
            assert render._needs_literal_spans(tokenizer, [m["content"] for m in messages]) == expected, (spellings, messages)
