"""The doctor's replays without the planner's pool equal the planner's: an unbounded replay equals the planner at
a capacity that never evicts, and the in-flight pass equals the rule it implements, block by block."""

from array import array

import pytest
import support.doctor_logs as logs

from kvprefix.doctor.analysis import open_log
from kvprefix.doctor.attribute import replay_order
from kvprefix.doctor.diagnosis import Options
from kvprefix.doctor.fixing import fix
from kvprefix.doctor.observe import Observation, observe
from kvprefix.doctor.replaying import PREFILL_TOKENS_PER_S, Replayer, Setting, Timing, planner_replay, unbounded_replay
from kvprefix.tokenizer import Tokenizer

CORPUS = {
    "clean": logs.clean, "multi-turn": logs.multi_turn, "volatile": logs.volatile, "shuffled tools": logs.shuffled_tools,
    "whitespace drift": logs.whitespace_drift, "short prefix": logs.short_prefix, "unique": logs.unique,
    "evicting": logs.evicting, "scattered": logs.scattered, "concurrent": logs.concurrent, "tenants": logs.tenants,
    "few-shot": logs.few_shot, "rag": logs.rag, "default system": logs.default_system, "adapters": logs.adapters,
    "identical prompts": lambda: [logs.chat(logs.STABLE, "the same question")] * 12,
    # requests a few milliseconds apart, each while earlier ones still compute (about 2 ms per 20 tokens)
    "burst": lambda: [logs.chat(logs.handbook(i % 3), logs.question(i % 7), timestamp=i * 3) for i in range(60)],
}


def _passes(tmp_path, tokenizer_dir, rows, block_size: int | None = None) -> Observation:
    """The observation after both passes over ``rows``: every variant of the log, rendered and hashed."""
    log = open_log(str(logs.write_jsonl(tmp_path / "log.jsonl", rows)), lambda: Tokenizer(str(tokenizer_dir)),
                   Options(block_size))
    obs = observe(log)
    fix(log, obs)
    return obs


def _groups(obs: Observation) -> tuple[list[int], list[list[int]]]:
    _, order, groups = replay_order(obs.requests)
    return order, groups


@pytest.mark.parametrize("block_size", [16, 1])  # 1: every prompt fills its last block, so a repeat hits all but one
@pytest.mark.parametrize("name", CORPUS)
def test_unbounded_replay_equals_the_planner_that_never_evicts(tmp_path, tokenizer_dir, name, block_size):
    obs = _passes(tmp_path, tokenizer_dir, CORPUS[name](), block_size)
    order, groups = _groups(obs)
    hits = 0
    for variant in obs.variants.values():
        if len(variant) != len(order):  # a variant the pass left partial is never replayed
            continue
        never_evicts = variant.distinct_blocks + variant.max_blocks + 1
        for members in [order, *groups]:
            fast, planner = (array("q", bytes(8 * len(variant))) for _ in range(2))
            unbounded_replay(variant, members, fast)
            planner_replay(variant, members, never_evicts, planner)
            assert fast == planner, (variant.name, members)
            hits += sum(fast)
    assert hits > 0 or name == "unique"


def _in_flight_by_definition(variant, order, cached, timing) -> array:
    """Block by block: a hit stops at the first block whose first computation ends after the request arrives."""
    bs, tree = variant.block_size, variant.tree
    ready: dict[int, float] = {}
    out = array("q", cached)
    for i in order:
        t = timing.arrival[i]
        chain = tree.chain(variant.leaves[i])
        hit = next((b for b in range(out[i] // bs) if ready.get(chain[b], t) > t), out[i] // bs)
        out[i] = hit * bs
        logged = timing.prefill_s[i] if timing.prefill_s is not None else None
        done = t + (logged if logged is not None else (variant.tokens[i] - hit * bs) / PREFILL_TOKENS_PER_S)
        for node in chain[hit:]:
            ready[node] = min(ready.get(node, done), done)
    return out


# (log, prefill duration logged per request (None: from the prompt's length), whether some hit is in flight);
# a negative duration (a bad log) is ready at once, as a zero one.
IN_FLIGHT = [("burst", None, True), ("burst", 0.02, True), ("concurrent", None, True), ("scattered", None, False), ("evicting", None, False),
             ("concurrent", 0.5, True), ("identical prompts", 0.5, True), ("identical prompts", 0.0, False),
             ("concurrent", -0.5, False)]


@pytest.mark.parametrize("name,prefill_s,in_flight", IN_FLIGHT)
def test_in_flight_hits_dropped_as_the_rule_says(tmp_path, tokenizer_dir, name, prefill_s, in_flight):
    rows = CORPUS[name]()
    rows = [{**r, "timestamp": r.get("timestamp", 0)} for r in rows]
    obs = _passes(tmp_path, tokenizer_dir, rows)
    order, groups = _groups(obs)
    n = len(order)
    timing = Timing(obs.requests.arrival, None if prefill_s is None else [prefill_s] * n)
    base = obs.variants["as is"]
    replayer = Replayer(order, groups, timing, base.block_size)
    dropped = 0
    for capacity in (None, base.max_blocks + 2):
        for per_replica in (False, True):
            raw = replayer.cached_tokens(base, Setting(capacity, per_replica, in_flight=False))
            after = replayer.cached_tokens(base, Setting(capacity, per_replica, in_flight=True))
            assert after == _in_flight_by_definition(base, order, raw, timing)
            dropped += sum(raw) - sum(after)
    assert (dropped > 0) == in_flight
