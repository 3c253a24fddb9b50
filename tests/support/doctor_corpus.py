"""Request logs (OpenAI bodies) with one planted cause each, a few hundred requests, from a seed: the doctor's
planted-cause corpus (``benchmarks/make_doctor_corpus.py`` writes it, ``benchmarks/score_doctor_corpus.py`` scores
the doctor on it) and the shapes its tests try. Written apart from ``doctor_logs`` (the doctor's first tests): other
texts, lengths and layouts, so the doctor is scored on traffic it was not tuned on.

``SHAPES`` maps a shape's name to (its generator, the cause planted, the doctor's extra arguments); a generator
takes (requests, random.Random) and returns the bodies."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WORDS = (
    "account address answer billing cancel card charge check close code company contact copy customer data date "
    "delete delivery device discount document email error export file form help history invoice issue item key "
    "language limit list login message method number offer order page password payment phone plan policy price "
    "product profile receipt record refund report request reset return review rule search service setting "
    "shipment sign status store subscription support system team ticket time total tracking transfer update "
    "upgrade user value warranty always before carefully clearly never only please politely quickly when while "
    "with without after about into from over under your their this that each every other same new old first last "
    "open closed active pending late early free paid local global"
).split()
NAMES = [f"{first} {last}" for first in ("Ana", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan",
                                         "Jia", "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa",
                                         "Sven", "Tariq")
         for last in ("Alvarez", "Becker", "Costa", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad", "Ito",
                      "Jensen")]


def sentence(rng: random.Random, lo: int = 8, hi: int = 16) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + "."


def paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(sentences))


def question(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 18))).capitalize() + "?"


def timestamp(seconds: int) -> str:
    day, hour, minute = 1 + seconds // 86400 % 28, seconds // 3600 % 24, seconds // 60 % 60
    return f"2026-11-{day:02d}T{hour:02d}:{minute:02d}:{seconds % 60:02d}Z"


def _rules(seed: int, sentences: int = 14) -> str:
    """A long system prompt, the same for every request of a log (its own seed)."""
    return "You are the support assistant of an online store. " + paragraph(random.Random(seed), sentences)


def _tools(seed: int, count: int = 4) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for k in range(count):
        params = rng.sample(WORDS, 3)
        out.append({"type": "function", "function": {
            "name": f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{k}", "description": sentence(rng, 6, 10),
            "parameters": {"type": "object", "properties": {p: {"type": "string", "description": sentence(rng, 3, 6)}
                                                            for p in params}, "required": params[:1]}}})
    return out


def _chat(system: str | None, *turns: str, **extra) -> dict:
    messages = [] if system is None else [{"role": "system", "content": system}]
    roles = ("user", "assistant")
    messages += [{"role": roles[k % 2], "content": t} for k, t in enumerate(turns)]
    return {"messages": messages, **extra}


def _spaced(rows: list[dict], gap_ms: int = 2000) -> list[dict]:
    """Arrival times far enough apart that no request waits for another's prefill."""
    return [{**row, "timestamp": i * gap_ms} for i, row in enumerate(rows)]


# The causes of the doctor's first tests, in other words --------------------------------------------------------


def volatile_timestamp(n: int, rng: random.Random) -> list[dict]:
    rules, t = _rules(1), 0
    rows = []
    for _ in range(n):
        t += rng.randint(1, 90)
        rows.append(_chat(f"Current date and time: {timestamp(t)}.\n{rules}", question(rng)))
    return _spaced(rows)


def shuffled_tools(n: int, rng: random.Random) -> list[dict]:
    tools, rules = _tools(2, 5), _rules(2, 6)
    return _spaced([_chat(rules, question(rng), tools=rng.sample(tools, len(tools))) for _ in range(n)])


def reordered_keys(n: int, rng: random.Random) -> list[dict]:
    tools, rules = _tools(3, 4), _rules(3, 4)
    rows = []
    for _ in range(n):
        sent = json.loads(json.dumps(tools))
        for t in sent:
            props = t["function"]["parameters"]["properties"]
            t["function"]["parameters"]["properties"] = {k: props[k] for k in rng.sample(list(props), len(props))}
        rows.append(_chat(rules, question(rng), tools=sent))
    return _spaced(rows)


def _conversations(n: int, rng: random.Random, first_answer: Callable[[random.Random], str],
                   resent: Callable[[str], str]) -> list[dict]:
    """Three requests per conversation: the question; the first answer and a second question; the first answer as
    ``resent`` makes it, the second answer and a third question."""
    rules, rows = _rules(4, 3), []
    for _ in range(max(1, n // 3)):
        q1, q2, q3 = question(rng), question(rng), question(rng)
        a1, a2 = first_answer(rng), paragraph(rng, 2)
        rows += [_chat(rules, q1), _chat(rules, q1, a1, q2), _chat(rules, q1, resent(a1), q2, a2, q3)]
    return _spaced(rows[:n])


def whitespace_drift(n: int, rng: random.Random) -> list[dict]:
    def answer(r: random.Random) -> str:
        return "Here is what I found:\n\n  " + "\n  ".join(sentence(r) for _ in range(6)) + "\n\nAnything else?"

    return _conversations(n, rng, answer, lambda a: " ".join(a.split()))


def reasoning_dropped(n: int, rng: random.Random) -> list[dict]:
    def answer(r: random.Random) -> str:
        return f"<think>{paragraph(r, 5)}</think>{paragraph(r, 2)}"

    return _conversations(n, rng, answer, lambda a: a.split("</think>", 1)[1])


def default_system_prompt(n: int, rng: random.Random) -> list[dict]:
    """Conversations of five requests, each opening with a long instruction of its own: a client sends some of a
    conversation's requests with a system message and some without (the template writes its default one)."""
    ack, rows = "Understood, I will follow these instructions.", []
    for _ in range(max(1, n // 5)):
        instruction = paragraph(rng, 10)
        rows += [_chat("You answer for the store." if rng.random() < 0.5 else None, instruction, ack, question(rng))
                 for _ in range(5)]
    return _spaced(rows[:n])


def short_prefix_completions(n: int, rng: random.Random) -> list[dict]:
    return _spaced([{"prompt": f"Summarize the ticket below:\n{sentence(rng, 6, 12)}"}
                    for _ in range(n)])


def _groups(count: int, seed: int) -> list[str]:
    return [_rules(100 + seed * 50 + g, 10) for g in range(count)]


def eviction(n: int, rng: random.Random) -> list[dict]:
    """Round robin over twelve long system prompts: a small KV capacity evicts each before it comes back."""
    groups = _groups(12, 6)
    return _spaced([_chat(groups[i % len(groups)], question(rng)) for i in range(n)])


def routing(n: int, rng: random.Random) -> list[dict]:
    """Each group's requests land on another of four replicas every time (a round-robin balancer)."""
    groups = _groups(6, 7)
    return _spaced([_chat(groups[i % 6], question(rng), replica=f"replica-{(i // 6 + i) % 4}") for i in range(n)])


def concurrency(n: int, rng: random.Random) -> list[dict]:
    """Bursts of ten requests with one system prompt arriving in the same millisecond."""
    groups = _groups(max(1, n // 10), 8)
    return [{**_chat(groups[i // 10], question(rng)), "timestamp": (i // 10) * 5000} for i in range(n)]


def tenants(n: int, rng: random.Random) -> list[dict]:
    rules = _rules(9)
    return _spaced([_chat(rules, question(rng), tenant=f"team-{rng.randrange(12)}") for _ in range(n)])


def cache_salt(n: int, rng: random.Random) -> list[dict]:
    rules = _rules(10)
    return _spaced([_chat(rules, question(rng), cache_salt=f"user-{rng.randrange(25)}") for _ in range(n)])


def adapters(n: int, rng: random.Random) -> list[dict]:
    rules = _rules(11)
    models = ["store-base", "store-lora-de", "store-lora-fr", "store-lora-es"]
    return _spaced([_chat(rules, question(rng), model=models[0] if i == 0 else rng.choice(models))
                    for i in range(n)])


def few_shot_reordered(n: int, rng: random.Random) -> list[dict]:
    ex = random.Random(12)
    examples = [(question(ex), paragraph(ex, 2)) for _ in range(5)]
    rows = []
    for _ in range(n):
        turns = [t for pair in rng.sample(examples, len(examples)) for t in pair]
        rows.append(_chat("Answer in the style of the examples.", *turns, question(rng)))
    return _spaced(rows)


_LAYOUTS = {
    "tags": lambda docs: "\n".join(f"<document id=\"{k + 1}\">\n{d}\n</document>" for k, d in enumerate(docs)),
    "numbered": lambda docs: "\n".join(f"{k + 1}. {d}" for k, d in enumerate(docs)),
    "paragraphs": lambda docs: "\n\n".join(docs),
}


def _documents(layout: str) -> Callable[[int, random.Random], list[dict]]:
    def make(n: int, rng: random.Random) -> list[dict]:
        src = random.Random(13)
        topics = [[paragraph(src, 3) for _ in range(4)] for _ in range(4)]
        rows = []
        for _ in range(n):
            docs = rng.sample(topics[rng.randrange(len(topics))], 4)
            user = f"Use these search results.\n\n{_LAYOUTS[layout](docs)}\n\nQuestion: {question(rng)}"
            rows.append(_chat("You answer from search results only.", user))
        return _spaced(rows)

    return make


# The three the doctor did not explain (issue 27) ---------------------------------------------------------------


def two_volatile_lines(n: int, rng: random.Random) -> list[dict]:
    """A request id and the signed-in user's name and e-mail at the very top of the system prompt."""
    rules = _rules(14, 24)
    rows = []
    for _ in range(n):
        name = rng.choice(NAMES)
        email = f"{name.lower().replace(' ', '.')}{rng.randrange(100)}@example.com"
        rows.append(_chat(f"Request: req_{rng.getrandbits(48):012x}\nSigned in: {name} <{email}>\n{rules}",
                          question(rng)))
    return _spaced(rows)


def session_first_line(n: int, rng: random.Random) -> list[dict]:
    """A session id (a random UUID) as the first line of the user message, then one of eight shared articles."""
    src = random.Random(15)
    articles = [f"Help centre article {k + 1}: {paragraph(src, 16)}" for k in range(8)]
    return _spaced([_chat("You are the help-centre assistant.",
                          f"Session: {uuid.UUID(int=rng.getrandbits(128), version=4)}\n\n"
                          f"{rng.choice(articles)}\n\nMy question: {question(rng)}") for _ in range(n)])


def short_prefix_chat(n: int, rng: random.Random) -> list[dict]:
    """No system message; every user message starts with the same short instruction, then unique text."""
    return _spaced([_chat(None, f"Fix: {sentence(rng, 5, 12)}") for _ in range(n)])


# Other shapes ---------------------------------------------------------------------------------------------------


def volatile_mid_prompt(n: int, rng: random.Random) -> list[dict]:
    """A stable preamble, then a line with today's date and the time, then the long stable rules."""
    preamble, rules, t = "You are the support assistant of an online store.", paragraph(random.Random(16), 16), 0
    rows = []
    for _ in range(n):
        t += rng.randint(1, 300)
        rows.append(_chat(f"{preamble}\nLocal time: {timestamp(t)} (shift {rng.randrange(1, 4)}).\n{rules}",
                          question(rng)))
    return _spaced(rows)


def several_volatile_spans(n: int, rng: random.Random) -> list[dict]:
    """A trace id at the top and, between two long stable parts, the customer's name and account number."""
    src = random.Random(17)
    first, second = paragraph(src, 10), paragraph(src, 10)
    rows = []
    for _ in range(n):
        system = (f"Trace {rng.getrandbits(64):016x}\n{first}\nCustomer: {rng.choice(NAMES)}, account "
                  f"{rng.randrange(10**7, 10**8)}.\n{second}")
        rows.append(_chat(system, question(rng)))
    return _spaced(rows)


def volatile_tool_list(n: int, rng: random.Random) -> list[dict]:
    """One tool's description says when the data was last refreshed; the other tools and the prompt are stable."""
    tools, rules, t = _tools(18, 4), _rules(18, 8), 0
    rows = []
    for _ in range(n):
        t += rng.randint(1, 120)
        sent = json.loads(json.dumps(tools))
        fn = sent[0]["function"]
        fn["description"] = f"Order data refreshed at {timestamp(t)}. {fn['description']}"
        rows.append(_chat(rules, question(rng), tools=sent))
    return _spaced(rows)


def volatile_assistant_turn(n: int, rng: random.Random) -> list[dict]:
    """The conversation opens with a greeting whose answer names a session and the time, then a long shared
    instruction and a question."""
    instruction, t = paragraph(random.Random(19), 16), 0
    rows = []
    for _ in range(n):
        t += rng.randint(1, 60)
        greeting = f"Hello! This is session {rng.getrandbits(40):010x}, opened {timestamp(t)}. How can I help?"
        rows.append(_chat("You are the store's assistant.", "Hi", greeting, instruction, "Noted.", question(rng)))
    return _spaced(rows)


def clean(n: int, rng: random.Random) -> list[dict]:
    """A stable prompt and tools first, questions after, and conversations that grow turn by turn."""
    rules, tools, rows = _rules(20), _tools(20, 3), []
    while len(rows) < n:
        turns = [question(rng)]
        for _ in range(3):
            rows.append(_chat(rules, *turns, tools=tools))
            turns += [paragraph(rng, 2), question(rng)]
    return _spaced(rows[:n])


def unique(n: int, rng: random.Random) -> list[dict]:
    return _spaced([_chat(paragraph(rng, 4), question(rng)) for _ in range(n)])


@dataclass(frozen=True)
class Shape:
    make: Callable[[int, random.Random], list[dict]]
    cause: str  # the cause planted: the one the doctor should rank first
    args: tuple[str, ...] = ()  # the doctor's extra arguments


SHAPES: dict[str, Shape] = {
    "volatile-timestamp": Shape(volatile_timestamp, "volatile-prefix"),
    "shuffled-tools": Shape(shuffled_tools, "reordered"),
    "reordered-json-keys": Shape(reordered_keys, "reordered"),
    "whitespace-drift": Shape(whitespace_drift, "template-drift"),
    "reasoning-dropped": Shape(reasoning_dropped, "template-drift"),
    "default-system-prompt": Shape(default_system_prompt, "template-drift"),
    "short-prefix-completions": Shape(short_prefix_completions, "short-prefix"),
    "eviction": Shape(eviction, "eviction", ("--capacity", "1000")),
    "routing": Shape(routing, "routing"),
    "concurrency": Shape(concurrency, "concurrency"),
    "tenants": Shape(tenants, "namespace"),
    "cache-salt": Shape(cache_salt, "namespace"),
    "adapters": Shape(adapters, "namespace"),
    "few-shot-reordered": Shape(few_shot_reordered, "reordered"),
    "documents-in-tags": Shape(_documents("tags"), "reordered"),
    "documents-numbered": Shape(_documents("numbered"), "reordered"),
    "documents-paragraphs": Shape(_documents("paragraphs"), "reordered"),
    "two-volatile-lines": Shape(two_volatile_lines, "volatile-prefix"),
    "session-first-line": Shape(session_first_line, "volatile-prefix"),
    "short-prefix-chat": Shape(short_prefix_chat, "short-prefix"),
    "volatile-mid-prompt": Shape(volatile_mid_prompt, "volatile-prefix"),
    "several-volatile-spans": Shape(several_volatile_spans, "volatile-prefix"),
    "volatile-tool-list": Shape(volatile_tool_list, "volatile-prefix"),
    "volatile-assistant-turn": Shape(volatile_assistant_turn, "volatile-prefix"),
    "clean": Shape(clean, "no-sharing"),
    "unique": Shape(unique, "no-sharing"),
}
SEED = 27  # the number: the corpus is the same wherever it is written
REQUESTS = 300


def write(path: Path, name: str, n: int = REQUESTS, seed: int = SEED) -> Path:
    """The shape's log, one body per line."""
    rows = SHAPES[name].make(n, random.Random(f"{seed}:{name}"))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
