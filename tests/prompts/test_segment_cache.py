"""The segment-cached tokenizer the router uses gives the replicas' token ids exactly, cached or not."""

from __future__ import annotations

from kvprefix.prompts import SegmentCachedTokenizer, Tokenizer, render_body

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
