"""Logs with one planted cause each (or two, or none), written by the tests, and a small tokenizer whose chat
template renders tools, so a shuffled tools list shows in the prompt, and writes a default system prompt when a
request sends none (as SmolLM2's and Qwen2.5's do); and ``doctor``, the doctor's JSON report on a log."""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvprefix.cli import main
from kvprefix.tokenizer.builtin import build_tokenizer

DEFAULT_SYSTEM = "You are a helpful assistant."


def tools_template(default_system: str = DEFAULT_SYSTEM) -> str:
    return (
        "{%- if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
        "<|im_end|>\n{% endif %}"
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + default_system + "<|im_end|>\n{% endif %}"
        + TURNS)


TURNS = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

STABLE = (
    "You are the support assistant of a company that runs a prefix cache for language models. Answer in two "
    "sentences, cite the documentation page you used, and never invent a configuration option. The cache keeps "
    "the keys and values of a shared prompt prefix so that later requests skip straight to their suffix. Blocks "
    "are hashed in a chain, and the least recently used free block is evicted first when memory runs out."
)


def write_tokenizer(path: Path, default_system: str = DEFAULT_SYSTEM) -> Path:
    tok = build_tokenizer(1024)
    tok.chat_template = tools_template(default_system)
    tok.save_pretrained(str(path))
    return path


def tool(name: str, params: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ')} for the user",
        "parameters": {"type": "object", "properties": {p: {"type": "string", "description": f"the {p}"}
                                                        for p in params}, "required": params[:1]}}}


TOOLS = [tool("get_weather", ["city", "unit"]), tool("search_docs", ["query", "page"]),
         tool("open_ticket", ["title", "body", "priority"]), tool("convert_units", ["value", "from", "to"])]


def question(i: int) -> str:
    return f"Question {i}: why did request number {i * 7919 % 1000} miss the cache?"


def chat(system: str, user: str, **extra) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}], **extra}


def doctor(capsys, path, tokenizer_dir, *extra) -> dict:
    """`kvprefix doctor PATH --model TOKENIZER_DIR --json`: its one JSON object, checked for the report's shape."""
    assert main(["doctor", str(path), "--model", str(tokenizer_dir), "--json", *extra]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object
    report = json.loads(out)
    assert set(report) == {"requests", "block_size", "hit_rate", "causes"}
    for cause in report["causes"]:
        assert set(cause) == {"kind", "requests", "tokens_lost", "example", "fix", "hit_rate_after"}
        assert type(cause["requests"]) is int and type(cause["tokens_lost"]) is int
    fixable = [c for c in report["causes"] if c["kind"] != "no-sharing"]
    assert report["causes"][: len(fixable)] == fixable  # fixable causes first ...
    assert [c["tokens_lost"] for c in fixable] == sorted((c["tokens_lost"] for c in fixable), reverse=True)
    assert len({c["kind"] for c in report["causes"]}) == len(report["causes"])  # ... one entry per kind
    return report


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def clean(n: int = 40) -> list[dict]:
    return [chat(STABLE, question(i), tools=TOOLS, timestamp=i * 1000) for i in range(n)]


def multi_turn(users: int = 4, turns: int = 5) -> list[dict]:
    rows = []
    histories = {u: [{"role": "system", "content": STABLE}] for u in range(users)}
    t = 0
    for turn in range(turns):
        for u in range(users):
            h = histories[u]
            h.append({"role": "user", "content": f"User {u}, turn {turn}: " + question(u * 10 + turn)})
            rows.append({"messages": [dict(m) for m in h], "timestamp": t})
            t += 1000
            h.append({"role": "assistant", "content": f"Answer {turn} for user {u}: the block was evicted."})
    return rows


def volatile(n: int = 40) -> list[dict]:
    return [chat(f"Current time: 2026-12-01T12:{i // 60:02d}:{i % 60:02d}Z. {STABLE}", question(i),
                 timestamp=i * 1000) for i in range(n)]


def shuffled_tools(n: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [chat(STABLE, question(i), tools=rng.sample(TOOLS, len(TOOLS)), timestamp=i * 1000) for i in range(n)]


def reordered_keys(n: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        tools = json.loads(json.dumps(TOOLS))
        for t in tools:
            props = t["function"]["parameters"]["properties"]
            keys = list(props)
            rng.shuffle(keys)
            t["function"]["parameters"]["properties"] = {k: props[k] for k in keys}
        rows.append(chat("Be helpful.", question(i), tools=tools, timestamp=i * 1000))
    return rows


def whitespace_drift(users: int = 6) -> list[dict]:
    """Each user's second turn sends the first answer back with its whitespace normalised."""
    rows, t = [], 0
    for u in range(users):
        answer = f"Answer for user {u}:\n\n  the block   was evicted,  then   recomputed. " + STABLE
        first = [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": question(u)}]
        rows.append({"messages": first, "timestamp": t})
        second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": question(u + 50)}]
        rows.append({"messages": second, "timestamp": t + 1000})
        third = first + [{"role": "assistant", "content": " ".join(answer.split())},
                         {"role": "user", "content": question(u + 50)}, {"role": "assistant", "content": "Yes."},
                         {"role": "user", "content": question(u + 90)}]
        rows.append({"messages": third, "timestamp": t + 2000})
        t += 3000
    return rows


def short_prefix(n: int = 40) -> list[dict]:
    return [{"prompt": f"Q: {question(i)}", "timestamp": i * 1000} for i in range(n)]


def unique(n: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = STABLE.split()
    return [{"prompt": " ".join(rng.choice(words) for _ in range(60)), "timestamp": i * 1000} for i in range(n)]


def handbook(group: int) -> str:
    """A long system prompt of its own per group (no text in common with another group's)."""
    rng = random.Random(1000 + group)
    words = STABLE.split()
    return " ".join(rng.choice(words) for _ in range(70))


def evicting(groups: int = 8, rounds: int = 4) -> list[dict]:
    """Round-robin over groups with distinct long system prompts: a small cache evicts each before it returns."""
    rows, t = [], 0
    for r in range(rounds):
        for g in range(groups):
            rows.append(chat(handbook(g), question(r * groups + g), timestamp=t))
            t += 1000
    return rows


def scattered(groups: int = 10, per_group: int = 4, replicas: int = 4) -> list[dict]:
    """A load balancer that sends each group's requests to a different replica every time."""
    rows, t = [], 0
    for r in range(per_group):
        for g in range(groups):
            rows.append(chat(handbook(g), question(r * groups + g), timestamp=t, replica=f"replica-{(g + r) % replicas}"))
            t += 1000
    return rows


def concurrent(groups: int = 5, copies: int = 8) -> list[dict]:
    """Each group's requests arrive together (same millisecond), a second apart from the next group."""
    return [chat(handbook(g), question(g * copies + c), timestamp=g * 1000) for g in range(groups)
            for c in range(copies)]


def tenants(n: int = 40, count: int = 10) -> list[dict]:
    return [chat(STABLE, question(i), timestamp=i * 1000, tenant=f"tenant-{i % count}") for i in range(n)]


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    pool = STABLE.split()
    return " ".join(rng.choice(pool) for _ in range(n))


EXAMPLES = [(f"Example {k}: {words(200 + k, 24)}?", f"Answer {k}: {words(300 + k, 24)}.") for k in range(4)]


def few_shot(n: int = 40, seed: int = 0, shuffled: bool = True) -> list[dict]:
    """The same four few-shot examples (user/assistant pairs) before each question, in another order each time."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        examples = rng.sample(EXAMPLES, len(EXAMPLES)) if shuffled else EXAMPLES
        messages = [{"role": "system", "content": "Answer like the examples."}]
        for user, assistant in examples:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        rows.append({"messages": messages + [{"role": "user", "content": question(i)}], "timestamp": i * 1000})
    return rows


DOCUMENTS = [words(400 + k, 40) for k in range(12)]
LAYOUTS = {
    "tags": lambda docs: "\n".join(f'<document index="{k + 1}">{d}</document>' for k, d in enumerate(docs)),
    "numbered": lambda docs: "\n".join(f"[{k + 1}] {d}" for k, d in enumerate(docs)),
    "blank lines": lambda docs: "\n\n".join(docs),
}


def rag(n: int = 40, seed: int = 0, layout: str = "tags", shuffled: bool = True, topics: int = 3) -> list[dict]:
    """Each question with its topic's four retrieved documents in the user message (shuffled: in another order
    each time, as a retriever whose scores tie would send them)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        docs = DOCUMENTS[4 * (i % topics) : 4 * (i % topics) + 4]
        if shuffled:
            docs = rng.sample(docs, len(docs))
        user = f"Answer from these documents.\n\n{LAYOUTS[layout](docs)}\n\nQuestion: {question(i)}"
        rows.append(chat("Be helpful.", user, timestamp=i * 1000))
    return rows


def default_system(n: int = 40) -> list[dict]:
    """The same conversation (a long instruction, then a question) sent by two clients: one with an explicit
    system message, one with none (the template writes its default system prompt)."""
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": STABLE}, {"role": "assistant", "content": "Understood."},
                    {"role": "user", "content": question(i)}]
        if i % 2:
            messages = [{"role": "system", "content": "You are the support assistant."}, *messages]
        rows.append({"messages": messages, "timestamp": i * 1000})
    return rows


def adapters(n: int = 40, count: int = 4) -> list[dict]:
    """The same prompts for several LoRA adapters (``model`` names one; the first request's is the base)."""
    return [chat(STABLE, question(i), timestamp=i * 1000, model=f"support-lora-{i % count}") for i in range(n)]
