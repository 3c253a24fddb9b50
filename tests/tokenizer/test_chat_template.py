"""The tokenizer's chat template renders as transformers' apply_chat_template does, through its direct path (the
template's renderer called without the wrapper) wherever that path is taken."""

import json

import pytest
from support.tokenizer_files import tokenizer_dir

from kvprefix.prompts import PromptError, render_chat
from kvprefix.tokenizer import Tokenizer
from kvprefix.tokenizer.tokenizer import _plain  # which chats take the direct path: both paths are compared

TEMPLATE = ("{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}{% for m in messages %}"
            "<|im_start|>{{ m['role'] }}{% if m.name is defined %}:{{ m.name }}{% endif %}\n{{ m['content'] }}"
            "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{% if think %}<think>{% endif %}"
            "{{ eos_token }}")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": None}]


class Text(str):  # a caller's own string type: transformers' renderer copies it to a plain string
    pass


def test_the_template_renders_as_transformers_apply_chat_template(tmp_path, tiny_llama_path: str) -> None:
    """The same text as the wrapper for tools, special-token variables, keys set to None, continuing a message and
    a batch; the wrapper's errors for what it refuses."""
    tokenizer_dir(tmp_path, tiny_llama_path, TEMPLATE)
    tok = Tokenizer(str(tmp_path))
    tools = TOOLS
    chats = [CHAT,
             [{"role": "user", "content": "Call f", "name": "ann"},
              {"role": "assistant", "content": "", "tool_calls": [{"id": None, "type": "function",
                                                                   "function": {"name": "f", "arguments": {}}}]},
              {"role": "assistant", "content": "Done wi"}],
             [{"role": "user", "content": Text("Hi")}]]
    assert [_plain([c], {}) for c in chats] == [False, False, False]  # chats[0] has a None: dropped first
    assert _plain([[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]], {"think": True})
    assert not _plain([[{Text("role"): "user", "content": "Hi"}]], {})  # a caller's key type would reach it
    for bad, error in (({"chat_template": "{{ 1 }}"}, TypeError), ({"sanitize_control_tokens": True}, TypeError),
                       ({"continue_final_message": True}, ValueError)):
        with pytest.raises(error):
            tok.apply_chat_template(chats[1], tokenize=False, **bad)
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([], tokenize=False)
    for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False, "tools": tools},
                   {"add_generation_prompt": False, "continue_final_message": True},
                   {"add_generation_prompt": True, "think": True}):
        for chat in chats:
            if kwargs.get("continue_final_message") and chat[-1]["role"] != "assistant":
                continue
            assert tok.apply_chat_template(chat, tokenize=False, **kwargs) == tok.hf.apply_chat_template(
                chat, tokenize=False, **kwargs)
    assert tok.apply_chat_template(chats, tokenize=False, tools=tools) == tok.hf.apply_chat_template(
        chats, tokenize=False, tools=tools, add_generation_prompt=True)
    assert tok.apply_chat_template(chats[0], tokenize=False).startswith(tok.hf.bos_token or "<|im_start|>")


def test_a_tokenizer_with_several_templates_renders_the_one_named(tmp_path, tiny_llama_path: str) -> None:
    """Several templates by name: "tool_use" when tools are given, else "default", as the wrapper picks them."""
    config = tokenizer_dir(tmp_path, tiny_llama_path)
    config["chat_template"] = [{"name": "default", "template": "plain{{ messages[0]['content'] }}"},
                               {"name": "tool_use", "template": "tools{{ tools | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    named = Tokenizer(str(tmp_path))
    assert isinstance(named.hf.chat_template, dict)
    for kwargs in ({}, {"tools": TOOLS}):
        kwargs["add_generation_prompt"] = True
        assert named.apply_chat_template(CHAT, tokenize=False, **kwargs) == named.hf.apply_chat_template(
            CHAT, tokenize=False, **kwargs)
    assert named.apply_chat_template(CHAT, tokenize=False, tools=TOOLS) == "tools1"


def test_the_direct_path_has_the_templates_globals_and_fails_as_the_wrapper(tmp_path, tiny_llama_path: str) -> None:
    """The template's globals (Jinja's namespace and range, transformers' raise_exception), and its errors."""
    config = tokenizer_dir(tmp_path, tiny_llama_path)
    config["chat_template"] = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                               "{% if m['content'] == 'boom' %}{{ raise_exception('no booms') }}{% endif %}"
                               "{% endfor %}{{ ns.n }}{% for i in range(2) %}{{ i }}{% endfor %}{{ bos_token }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with_globals = Tokenizer(str(tmp_path))
    plain = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    assert _plain([plain], with_globals._template_variables)
    assert with_globals.apply_chat_template(plain, tokenize=False) == with_globals.hf.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True) == "201" + (with_globals.hf.bos_token or "")
    failures = []
    for render in (with_globals.apply_chat_template, with_globals.hf.apply_chat_template):
        with pytest.raises(Exception) as info:
            render([{"role": "user", "content": "boom"}], tokenize=False)
        failures.append((type(info.value), str(info.value)))
    assert failures[0] == failures[1] and "no booms" in failures[0][1]
    with pytest.raises(PromptError, match="no booms"):
        render_chat(with_globals, [{"role": "user", "content": "boom"}])
