"""Routing over replicas: no router beats one shared pool of the same total size, and routing by cached prefix
beats spreading blindly when prompts share prefixes."""

import dataclasses
import json

import pytest

from kvprefix.router.policies import (
    POLICIES,
    Decision,
    Held,
    LeastLoad,
    PrefixScore,
    RandomChoice,
    RoundRobin,
    RoutedIndex,
    SessionAffinity,
    make_policy,
)
from kvprefix.sim.trace import TraceRequest

SHARED_PREFIX_TRACES = ["sglang_gsp_default_bs16.jsonl", "vllm_prefix_repetition_default_bs16.jsonl"]


def distinct_blocks(trace) -> int:
    return len({h for r in trace.requests for h in r.block_hashes})


@pytest.mark.parametrize(
    "name",
    [*SHARED_PREFIX_TRACES, "lmcache_multi_round_qa_example_bs16.jsonl", "mooncake_synthetic_trace.jsonl"],
)
@pytest.mark.parametrize("replicas", [2, 4])
def test_round_robin_never_beats_one_shared_pool(load, run, name, replicas):
    trace = load(name)
    largest = max(r.num_blocks for r in trace.requests)
    for fraction in (0.02, 0.1, 0.3):
        capacity = max(largest, int(fraction * distinct_blocks(trace) / replicas))
        rr = run(trace, capacity_blocks=capacity, replicas=replicas, routing="round-robin", mode="order")
        shared = run(trace, capacity_blocks=capacity, replicas=replicas, routing="shared", mode="order")
        assert rr.token_hit_rate <= shared.token_hit_rate, (fraction, rr.token_hit_rate, shared.token_hit_rate)
        assert rr.block_hit_rate <= shared.block_hit_rate


# Per-replica capacities where one replica holds its share of the prefixes but not all of them.
@pytest.mark.parametrize("name, capacity", [(SHARED_PREFIX_TRACES[0], 2000), (SHARED_PREFIX_TRACES[1], 64)])
@pytest.mark.parametrize("mode", ["order", "timed"])
@pytest.mark.parametrize("routing", ["prefix", "kv-events"])
def test_prefix_policies_beat_round_robin_and_approach_the_shared_pool(load, run, name, capacity, mode, routing):
    trace = load(name)
    replicas = 4
    rr = run(trace, capacity_blocks=capacity, replicas=replicas, routing="round-robin", mode=mode)
    pa = run(trace, capacity_blocks=capacity, replicas=replicas, routing=routing, mode=mode)
    shared = run(trace, capacity_blocks=capacity, replicas=replicas, routing="shared", mode=mode)
    assert pa.token_hit_rate > rr.token_hit_rate + 0.05, (pa.token_hit_rate, rr.token_hit_rate)
    assert pa.token_hit_rate >= 0.9 * shared.token_hit_rate, (pa.token_hit_rate, shared.token_hit_rate)
    assert pa.load_imbalance <= 1.5  # the load cap keeps it balanced


def without_sessions(trace):
    """The conversation shape with no session key: every request starts with the same system-prompt block."""
    return dataclasses.replace(trace, requests=[dataclasses.replace(r, session=None) for r in trace.requests])


@pytest.mark.parametrize("mode", ["order", "timed"])
def test_session_routing_does_not_herd(load, run, mode):
    # Mooncake's synthetic trace has no sessions and 1,107 requests shorter than one block; the LMCache shape
    # (stripped of its user ids) starts every request with one block. The old ring keyed both on the first
    # block and sent them all to one replica.
    mooncake = run(load("mooncake_synthetic_trace.jsonl"), capacity_blocks=6000, replicas=10, routing="session",
                   mode=mode)
    assert mooncake.load_imbalance < 1.5, mooncake.load_imbalance
    conversation = without_sessions(load("lmcache_multi_round_qa_example_bs16.jsonl"))
    s = run(conversation, replicas=4, routing="session", mode=mode)
    assert s.load_imbalance < 1.5, s.load_imbalance


class View:
    """A fleet whose replicas hold given hash sets, with given loads, queued prefill (and health)."""

    def __init__(self, held: list[set], loads: list[float], down: frozenset = frozenset(), queued=None):
        self.held, self.loads, self.num_replicas, self.down = held, loads, len(held), down
        self.queued = queued or [0] * len(held)

    def healthy(self, replica):
        return replica not in self.down

    def held_prefix(self, replica, block_hashes):
        n = 0
        for h in block_hashes:
            if h not in self.held[replica]:
                break
            n += 1
        return Held(n)

    def media(self, replica):
        return {}

    def load(self, replica):
        return self.loads[replica]

    def queued_prefill_blocks(self, replica):
        return self.queued[replica]


def req(hashes, session=None) -> TraceRequest:
    return TraceRequest(0.0, 16 * len(hashes) + 1, 0, list(hashes), len(hashes) + 1, session)


def test_round_robin_cycles():
    view, policy = View([set()] * 3, [0, 0, 0]), RoundRobin()
    assert [policy.choose(req([1]), view).replica for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_reproducible_with_a_seed():
    view = View([set()] * 5, [0] * 5)
    a, b = RandomChoice(7), RandomChoice(7)
    picks = [a.choose(req([i]), view).replica for i in range(50)]
    assert picks == [b.choose(req([i]), view).replica for i in range(50)]
    assert len(set(picks)) == 5


def test_round_robin_and_random_skip_unhealthy_replicas():
    view = View([set()] * 3, [0, 0, 0], down=frozenset({1}))
    rr, rnd = RoundRobin(), RandomChoice(3)
    assert [rr.choose(req([1]), view).replica for _ in range(4)] == [0, 2, 0, 2]
    assert {rnd.choose(req([1]), view).replica for _ in range(50)} == {0, 2}


def test_least_load_takes_the_lighter_of_two():
    view = View([set()] * 4, [5, 0, 5, 5])
    policy = LeastLoad(seed=1)
    picks = [policy.choose(req([1]), view).replica for _ in range(200)]
    assert picks.count(1) > 200 * 0.4  # replica 1 wins whenever it is drawn (half the pairs contain it)
    view.down = frozenset({1})
    assert 1 not in {policy.choose(req([1]), view).replica for _ in range(50)}


def test_session_keeps_sessions_and_moves_few_keys():
    policy = SessionAffinity(load_cap=1e9)  # unbounded: pure consistent hashing
    four, five = View([set()] * 4, [0] * 4), View([set()] * 5, [0] * 5)
    before = {s: policy.choose(req([s], session=f"s{s}"), four).replica for s in range(400)}
    assert all(policy.choose(req([99], session=f"s{s}"), four).replica == r for s, r in before.items())
    after = {s: policy.choose(req([s], session=f"s{s}"), five).replica for s in range(400)}
    moved = sum(before[s] != after[s] for s in before)
    assert 0 < moved < 400 * 0.35  # about 1/5 of the keys move to the new replica, none between old ones
    assert all(after[s] == 4 for s in before if before[s] != after[s])


def test_session_load_is_bounded():
    policy = SessionAffinity(load_cap=1.25)
    view = View([set()] * 4, [0] * 4)
    for _ in range(400):  # one hot session
        view.loads[policy.choose(req([1], session="hot"), view).replica] += 1
    assert max(view.loads) <= 1.25 * 400 / 4 + 1, view.loads
    home = SessionAffinity(load_cap=1.25).choose(req([1], session="hot"), View([set()] * 4, [0] * 4))
    assert home.reason == "session" and home.credited == 0
    home = home.replica
    assert view.loads[home] == max(view.loads)  # its home replica still takes the most


def test_kv_events_prefers_the_longest_prefix_within_the_load_cap():
    policy = PrefixScore("kv-events", load_cap=1.25)
    view = View([{1}, {1, 2, 3}, set()], [0, 0, 0])
    assert policy.choose(req([1, 2, 3, 4]), view) == Decision(1, 3, "cached_prefix")
    view.loads = [1, 9, 2]  # replica 1 is far above the mean (4): skipped
    assert policy.choose(req([1, 2, 3, 4]), view).replica == 0
    assert policy.choose(req([7]), View([set()] * 3, [3, 1, 2])) == Decision(1)  # no prefix anywhere: least loaded


def test_prefix_spreads_one_hot_prefix_and_breaks_ties_at_random():
    policy = PrefixScore("prefix", load_cap=1.25, seed=0, routed=RoutedIndex(1000))
    view = View([set()] * 4, [0] * 4)
    for _ in range(100):  # requests stay in flight: load grows where they go
        view.loads[policy.choose(req([1, 2, 3]), view).replica] += 1
    assert max(view.loads) <= 1.25 * 100 / 4 + 2, view.loads  # the cap spreads the hot prefix
    cold = PrefixScore("prefix", seed=5, routed=RoutedIndex(1000))
    assert len({cold.choose(req([i]), View([set()] * 4, [0] * 4)).replica for i in range(40)}) == 4  # new prefixes rotate


def test_prefix_stays_home_while_nothing_is_queued_and_spreads_when_the_wait_costs_more():
    # One request at a time: every request of a hot prefix goes where it is cached (spreading would only compute
    # it again).
    policy, counts = PrefixScore("kv-events", load_cap=1.25), [0] * 4
    held = View([{1, 2, 3, 4}, set(), set(), set()], [0] * 4)
    for _ in range(200):
        counts[policy.choose(req([1, 2, 3, 4, 5]), held).replica] += 1
    assert counts == [200, 0, 0, 0]
    # Queued prefill at home: it stays while the wait (queued blocks) costs less than computing the 4 cached
    # blocks elsewhere (the request's own block is computed anywhere), and moves once it costs more.
    held.queued = [3, 0, 0, 0]
    assert policy.choose(req([1, 2, 3, 4, 5]), held) == Decision(0, 4, "cached_prefix")
    held.queued = [5, 0, 0, 0]
    assert policy.choose(req([1, 2, 3, 4, 5]), held).replica != 0
    # A request cached nowhere for half its blocks is a new prefix: it goes by rotation, not to the short start.
    policy = PrefixScore("kv-events", load_cap=1.25)
    assert {policy.choose(req([1, 10 + i, 20 + i]), View([{1}, set(), set()], [0] * 3)).replica
            for i in range(3)} == {0, 1, 2}


def test_routed_index_is_lru_and_capped():
    index = RoutedIndex(3)
    index.record(0, [1, 2, 3])
    index.record(0, [1, 4])  # 1 refreshed; 3, the deepest of the older prefix, evicted
    assert index.cached_prefix_blocks(0, [1, 2, 3]) == 2 and index.cached_prefix_blocks(0, [1, 4]) == 2
    index.forget(0)
    assert index.cached_prefix_blocks(0, [1]) == 0


def test_routed_index_evicts_a_prefix_from_its_end():
    index = RoutedIndex(5)
    index.record(0, [1, 2, 3, 4, 5])
    index.record(0, [6, 7])  # two blocks must go: 5 and 4, so 1-3 still count as a cached prefix
    assert index.cached_prefix_blocks(0, [1, 2, 3, 4, 5]) == 3 and index.cached_prefix_blocks(0, [6, 7]) == 2


def test_make_policy_names_the_choices():
    assert set(POLICIES) == {"round-robin", "random", "least-load", "session", "prefix", "kv-events"}
    for gone in ("fastest", "consistent-hash", "prefix-affinity"):  # the earlier names are gone with their aliases
        with pytest.raises(ValueError, match="round-robin"):
            make_policy(gone)


@pytest.mark.parametrize("mode", ["order", "timed"])
def test_support_agents_keep_each_prompt_where_it_is_cached(traces_dir, tmp_path, capsys, mode):
    # Issue 27's workload (benchmarks/make_support_agents.py): 3 replicas of the built-in model's 256 MiB of KV (364
    # blocks), four system prompts of 60 rules, one request at a time. Spreading a prompt while nothing is queued
    # only computes it again: the prefix policies reach one shared pool's hit rate.
    from kvprefix.cache.default_model import default_model_path
    from kvprefix.cli import main

    out = tmp_path / "runs.json"
    assert main(["simulate", str(traces_dir.parent / "support_agents.jsonl"), "--tokenizer", default_model_path(),
                 "--replicas", "3", "--capacity-blocks", "364", "--mode", mode, "--no-progress", "--json", str(out),
                 "--routing", "round-robin,prefix,kv-events,shared"]) == 0
    capsys.readouterr()
    hit = {r["routing"]: r["token_hit_rate"] for r in json.loads(out.read_text())["runs"]}
    assert hit["round-robin"] < 0.7 * hit["shared"], hit
    assert hit["prefix"] >= 0.97 * hit["shared"] and hit["kv-events"] >= 0.97 * hit["shared"], hit
