"""One adapter from a body to a prompt: the same bodies, sent to a real `kvprefix serve` and read by the router's,
the planner's and the doctor's readers, give identical token ids and block hashes everywhere (every field that
changes the prompt, in the caller's tenant and salt namespace). Fields vLLM knows but this server refuses get the
same answer from every reader."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx
import pytest
from support.servers import ADMIN_KEY, TLS, Server, start_server, stop_server

from kvprefix.cache.event_wire import loads
from kvprefix.doctor.rendering import Renderer
from kvprefix.logs import BODIES, iter_entries
from kvprefix.prompts import PromptError, render_body
from kvprefix.router.hashing import RequestHasher
from kvprefix.sim.openai_bodies import read_openai_bodies, read_replica_model, replica_model_for
from kvprefix.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # every test asks a real replica (started once, ~3.5 s)

KEYS = {"key-acme": "acme", "key-beta": "beta"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SYSTEM = "You are a careful assistant. Answer in one short sentence, and never more. " * 4
CHAT = [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                               {"type": "text", "text": "there?"}]}]
PROMPT = "Once upon a time, in a land of many blocks and hashes, " * 4
# (name, body, the tenant the request is sent as): every field that changes the prompt
ROWS = [
    ("chat", {"messages": CHAT}, "beta"),
    ("tenant and salt", {"messages": CHAT, "cache_salt": "s3cret"}, "acme"),
    ("tools", {"messages": CHAT, "tools": [WEATHER], "tool_choice": "auto"}, "beta"),
    ("tool calls in history", {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4 C"}], "tools": [WEATHER]}, "acme"),
    ("chat_template_kwargs", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}, "beta"),
    ("no generation prompt", {"messages": CHAT, "add_generation_prompt": False}, "beta"),
    ("continue_final_message", {"messages": [*CHAT, {"role": "assistant", "content": "Well, the answer"}],
                                "add_generation_prompt": False, "continue_final_message": True}, "beta"),
    ("truncate_prompt_tokens", {"messages": CHAT, "truncate_prompt_tokens": 37}, "beta"),
    ("truncate_prompt_tokens -1", {"messages": CHAT, "truncate_prompt_tokens": -1}, "beta"),
    ("completion", {"prompt": PROMPT}, "beta"),
    ("completion without special tokens", {"prompt": PROMPT, "add_special_tokens": False}, "acme"),
    ("completion token ids, truncated", {"prompt": list(range(3, 90)), "truncate_prompt_tokens": 50}, "beta"),
    ("completion truncated -1", {"prompt": PROMPT, "truncate_prompt_tokens": -1, "cache_salt": "x"}, "beta"),
]
# Fields that change the prompt in vLLM and that this server refuses: every reader refuses them too, or (the
# planner and the doctor read vLLM's logs) renders them as vLLM does.
REFUSED = [("chat_template", "{{ messages }}"), ("truncate_prompt_tokens", 0)]


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("one-adapter")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS))
    server = start_server(tmp, "--num-gpu-blocks", "512", "--api-keys-file", str(keys), "--admin-key", ADMIN_KEY,
                          request_log=True)
    yield server
    stop_server(server)


def served(replica: Server) -> list[tuple[list[int], list[str]]]:
    """Each row's prompt token ids (return_token_ids) and block hashes (the request log) as the replica ran it."""
    out = []
    for _, body, tenant in ROWS:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        key = next(k for k, t in KEYS.items() if t == tenant)
        r = replica.post(path, {**body, "max_tokens": 1, "return_token_ids": True},
                         headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        reply = r.json()
        ids = reply["prompt_token_ids"] if "messages" in body else reply["choices"][0]["prompt_token_ids"]
        out.append(ids)
    deadline = time.monotonic() + 10
    while len(records := replica.request_log.read_text().splitlines()) < len(ROWS) and time.monotonic() < deadline:
        time.sleep(0.05)  # the log is written after the response
    records = [json.loads(line) for line in records]
    assert len(records) == len(ROWS)
    return [(ids, rec["block_hashes"]) for ids, rec in zip(out, records, strict=True)]


def test_server_router_planner_and_doctor_agree(replica: Server, default_model_dir: str, tmp_path) -> None:
    expected = served(replica)
    assert expected[7][0] == expected[0][0][-37:]  # truncation happened
    # The router: the replica's hello (its identity), its tokenizer found from the identity alone.
    with httpx.stream("GET", replica.url + "/v1/kv_events", headers={"authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=10, verify=TLS) as r:
        hello = loads(next(r.iter_lines()))
    router = RequestHasher.for_replica(hello)
    # The planner and the doctor: the replica's /v1/models entry (identity and context length), kept in a file.
    listing = httpx.get(replica.url + "/v1/models", headers={"authorization": "Bearer key-acme"}, verify=TLS).json()
    (tmp_path / "model.json").write_text(json.dumps(listing))
    model = read_replica_model(str(tmp_path / "model.json"))
    assert model.identity == replace(hello.identity, checkpoint="")  # tenants are not told the replica's path
    assert model.max_model_len == hello.max_model_len == router.max_model_len
    log = tmp_path / "bodies.jsonl"
    log.write_text("".join(json.dumps({**body, "tenant": tenant}) + "\n" for _, body, tenant in ROWS))
    planner = read_openai_bodies(log, default_model_dir, None, replica=model).requests
    tokenizer = Tokenizer(default_model_dir)
    replica = replica_model_for(default_model_dir, tokenizer, 16, replica=model)
    doctor = Renderer(lambda: (tokenizer, replica), str(log))
    entries = list(iter_entries(log, BODIES))
    rendered = doctor.entries(entries)
    bs = hello.block_size
    for k, (name, body, tenant) in enumerate(ROWS):
        ids, hashes = expected[k]
        assert len(hashes) == len(ids) // bs >= 2, name
        routed, blocks = router.hash_prompt(body, tenant)
        assert [h.hex() for h in routed] == hashes and blocks == -(-len(ids) // bs), name
        assert planner[k].block_hashes == [bytes.fromhex(h) for h in hashes], name
        assert planner[k].input_length == len(ids), name
        assert rendered[k].token_ids == ids, name
        doctor_hashes = doctor.hasher(bs).with_salt(entries[k].namespace).hash_blocks(ids)
        assert [h.hex() for h in doctor_hashes] == hashes, name


@pytest.mark.parametrize("field, value", REFUSED)
def test_refused_fields_are_refused_by_every_reader(replica: Server, default_model_dir: str, field, value) -> None:
    body = {"messages": CHAT, field: value}
    r = replica.post("/v1/chat/completions", {**body, "max_tokens": 1}, headers={"authorization": "Bearer key-acme"})
    assert r.status_code == 400 and field in r.text
    with pytest.raises(PromptError) as refused:
        render_body(Tokenizer(default_model_dir), body, 4096)
    assert refused.value.param == field
