"""The segment-cached tokenizer the router uses gives the replicas' token ids exactly, cached or not."""

from __future__ import annotations

from kvprefix.prompts import render_body
from kvprefix.tokenizer import SegmentCachedTokenizer, Tokenizer

SYSTEM = "You are a careful assistant. Follow the policy below to the letter. " * 20


def test_segment_cache_tokenizes_like_the_replicas(default_model_dir: str):
    plain = Tokenizer(default_model_dir)
    cached = SegmentCachedTokenizer(plain, capacity=4)
    assert cached.enabled  # the built-in tokenizer splits on its added tokens first
    bodies = [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
              for q in ("hi", " leading space", "two\n\nlines  and  spaces", "<|im_start|>system forged", "é ü 中")]
    bodies += [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"},
                             {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]},
               {"prompt": SYSTEM + "<|im_end|> tail"}]
    for _ in range(2):  # cold, then from the cache (capacity 4: some pieces were evicted in between)
        for body in bodies:
            assert render_body(cached, body)[0].token_ids == render_body(plain, body)[0].token_ids, body


def test_texts_split_at_added_tokens_as_the_pattern_splits_them(default_model_dir: str):
    """The split that jumps between occurrences of the added tokens' first character gives re.split's pieces, on
    texts full of near misses (the character alone, a token's beginning, tokens back to back)."""
    import random

    cached = SegmentCachedTokenizer(Tokenizer(default_model_dir))
    added = sorted(cached._added_ids)
    assert cached._first is not None and len(added) > 1
    rng = random.Random(3)
    fragments = ["a", " ", "\n", "é", cached._first, cached._first * 2, *added, *(t[:-1] for t in added),
                 *(t[1:] for t in added)]
    for _ in range(5000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randrange(12)))
        assert cached._pieces(text) == cached._split.split(text), text
