"""LLM(chat_template=...) and LLM.chat(chat_template=...), vLLM's offline options: the template renders the chat,
and a prompt rendered with another template than the LLM's lives in that template's namespace, even where the
tokens are the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprefix import SamplingParams
from kvprefix.prompts import render_chat

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
SYSTEM = "Answer in one short sentence, and never more than that, whatever you are asked. " * 3
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a block?"}]


def same_output_template(path: str) -> str:
    """The checkpoint's own template with a comment added: it renders every chat alike, yet is another template."""
    return (Path(path) / "chat_template.jinja").read_text() + "{# another template, the same text #}"


def test_llm_renders_with_its_template_and_hashes_under_it(make_llm, tiny_llama_path: str, tmp_path) -> None:
    file = tmp_path / "t.jinja"
    file.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    llm = make_llm(chat_template=str(file))
    own = make_llm()
    assert llm.get_tokenizer().chat_template == file.read_text()
    out = llm.chat(CHAT, GREEDY)[0]
    assert out.prompt_token_ids == own.get_tokenizer().encode(f"[system] {SYSTEM}\n[user] What is a block?\n",
                                                              add_special_tokens=False)
    assert llm.llm_engine.identity.context.chat_template != own.llm_engine.identity.context.chat_template
    assert llm.llm_engine.identity.context.model == own.llm_engine.identity.context.model
    with pytest.raises(ValueError, match="chat_template /no/such.jinja: no such file"):
        make_llm(chat_template="/no/such.jinja")


def test_a_call_with_another_template_hits_only_its_own_blocks(make_llm, tiny_llama_path: str) -> None:
    llm = make_llm()
    other = same_output_template(tiny_llama_path)
    first = llm.chat(CHAT, GREEDY)[0]
    again_other = llm.chat(CHAT, GREEDY, chat_template=other)[0]
    assert again_other.prompt_token_ids == first.prompt_token_ids  # the same tokens ...
    assert again_other.num_cached_tokens == 0  # ... under another template: another namespace
    third = llm.chat(CHAT, GREEDY, chat_template=other)[0]
    assert third.num_cached_tokens == len(first.prompt_token_ids) // 16 * 16 > 0  # its own blocks hit
    assert llm.chat(CHAT, GREEDY)[0].num_cached_tokens == third.num_cached_tokens  # and the LLM's own still do
    parts = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }};{% endfor %}{% endfor %}"
    split = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    out = llm.chat(split, GREEDY, chat_template=parts)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("a;b;", add_special_tokens=False)
    assert render_chat(llm.get_tokenizer(), split).token_ids != out.prompt_token_ids
