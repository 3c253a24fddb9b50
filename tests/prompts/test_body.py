"""The body adapter's meaning of the fields vLLM reads: truncation against the context length, documents and
special tokens for chat, a request chat template refused; and the batch renderer gives what one by one gives."""

from __future__ import annotations

import pytest

from kvprefix.prompts import PromptError, render_bodies, render_body, render_chat
from kvprefix.tokenizer import Tokenizer

CHAT = [{"role": "system", "content": "Answer from the documents."}, {"role": "user", "content": "What is up?"}]
DOCS_TEMPLATE = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                 "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: str) -> Tokenizer:
    return Tokenizer(tiny_llama_path)


def test_truncation_keeps_the_context_length_and_refuses_what_no_replica_runs(tokenizer: Tokenizer) -> None:
    body = {"prompt": "one two three four five six seven", "truncate_prompt_tokens": -1}
    full = tokenizer.encode(body["prompt"])
    (kept,) = render_body(tokenizer, body, max_model_len=4)
    assert kept.token_ids == full[-4:]
    (whole,) = render_body(tokenizer, body, max_model_len=4096)
    assert whole.token_ids == full
    for bad, max_model_len, message in ((-1, None, "not known here"), (0, 8, "-1"), (-2, 8, "-1"), (True, 8, "-1"),
                                        (9, 8, r"over this model's maximum context length \(8\)")):
        with pytest.raises(PromptError, match=message) as refused:
            render_body(tokenizer, {**body, "truncate_prompt_tokens": bad}, max_model_len)
        assert refused.value.param == "truncate_prompt_tokens"


def test_refuse_long_unless_truncated(tokenizer: Tokenizer) -> None:
    long = {"prompt": "word " * 2000}
    with pytest.raises(PromptError) as refused:
        render_body(tokenizer, long, 16, refuse_long=True)
    assert refused.value.code == "context_length_exceeded"
    assert len(render_body(tokenizer, long, 16)[0].token_ids) > 16  # the router and planner only read
    (kept,) = render_body(tokenizer, {**long, "truncate_prompt_tokens": 8}, 16, refuse_long=True)
    assert len(kept.token_ids) == 8


def test_chat_special_tokens_documents_and_a_request_template(tokenizer: Tokenizer, tmp_path) -> None:
    plain = render_chat(tokenizer, CHAT)
    (special,) = render_body(tokenizer, {"messages": CHAT, "add_special_tokens": True})
    assert special.token_ids == tokenizer.encode(plain.text, add_special_tokens=True)
    assert render_body(tokenizer, {"messages": CHAT, "add_special_tokens": False})[0] == plain
    tokenizer.hf.chat_template = DOCS_TEMPLATE
    try:
        docs = [{"title": "Weather", "text": "Sunny all week."}]
        (with_docs,) = render_body(tokenizer, {"messages": CHAT, "documents": docs})
        assert with_docs.text.startswith("[Weather: Sunny all week.]<|im_start|>system")
        with pytest.raises(PromptError) as refused:
            render_body(tokenizer, {"messages": CHAT, "documents": [{"title": 1}]})
        assert refused.value.param == "documents"
    finally:
        tokenizer.hf.chat_template = plain_template(tokenizer)
    with pytest.raises(PromptError) as refused:
        render_body(tokenizer, {"messages": CHAT, "chat_template": "{{ messages }}"})
    assert refused.value.param == "chat_template"


def plain_template(tokenizer: Tokenizer) -> str:
    return Tokenizer(tokenizer.hf.name_or_path).chat_template


def test_batches_render_as_one_by_one(tokenizer: Tokenizer) -> None:
    bodies = [{"messages": CHAT}, {"messages": CHAT, "truncate_prompt_tokens": -1},
              {"messages": CHAT, "add_special_tokens": True}, {"messages": CHAT, "add_generation_prompt": False},
              {"prompt": "one two"}]
    assert render_bodies(tokenizer, bodies, 6) == [render_body(tokenizer, b, 6) for b in bodies]
