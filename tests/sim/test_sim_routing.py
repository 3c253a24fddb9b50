"""Routing over replicas: no router beats one shared pool of the same total size, and routing by cached prefix
beats spreading blindly when prompts share prefixes."""

import pytest

from kvprefix.router.policies import POLICIES, ConsistentHash, PrefixAffinity, RandomChoice, RoundRobin, make_policy
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
def test_prefix_affinity_beats_round_robin_on_shared_prefixes(load, run, name, capacity, mode):
    trace = load(name)
    replicas = 4
    rr = run(trace, capacity_blocks=capacity, replicas=replicas, routing="round-robin", mode=mode)
    pa = run(trace, capacity_blocks=capacity, replicas=replicas, routing="prefix-affinity", mode=mode)
    assert pa.token_hit_rate > rr.token_hit_rate + 0.05, (pa.token_hit_rate, rr.token_hit_rate)
    assert pa.load_imbalance <= 1.5  # the load cap keeps it balanced


class View:
    """A fleet whose replicas hold given hash sets, with given loads."""

    def __init__(self, held: list[set], loads: list[float]):
        self.held, self.loads, self.num_replicas = held, loads, len(held)

    def cached_prefix_blocks(self, replica, block_hashes):
        n = 0
        for h in block_hashes:
            if h not in self.held[replica]:
                break
            n += 1
        return n

    def load(self, replica):
        return self.loads[replica]


def req(hashes, session=None) -> TraceRequest:
    return TraceRequest(0.0, 16 * len(hashes) + 1, 0, list(hashes), len(hashes) + 1, session)


def test_round_robin_cycles():
    view, policy = View([set()] * 3, [0, 0, 0]), RoundRobin()
    assert [policy.choose(req([1]), view) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_reproducible_with_a_seed():
    view = View([set()] * 5, [0] * 5)
    a, b = RandomChoice(7), RandomChoice(7)
    picks = [a.choose(req([i]), view) for i in range(50)]
    assert picks == [b.choose(req([i]), view) for i in range(50)]
    assert len(set(picks)) == 5


def test_consistent_hash_keeps_sessions_and_moves_few_keys():
    policy = ConsistentHash()
    four, five = View([set()] * 4, [0] * 4), View([set()] * 5, [0] * 5)
    before = {s: policy.choose(req([s], session=f"s{s}"), four) for s in range(400)}
    assert all(policy.choose(req([99], session=f"s{s}"), four) == r for s, r in before.items())
    after = {s: policy.choose(req([s], session=f"s{s}"), five) for s in range(400)}
    moved = sum(before[s] != after[s] for s in before)
    assert 0 < moved < 400 * 0.35  # about 1/5 of the keys move to the new replica, none between old ones
    assert all(after[s] == 4 for s in before if before[s] != after[s])


def test_prefix_affinity_prefers_the_longest_prefix_within_the_load_cap():
    policy = PrefixAffinity(load_cap=1.25)
    view = View([{1}, {1, 2, 3}, set()], [0, 0, 0])
    assert policy.choose(req([1, 2, 3, 4]), view) == 1
    view.loads = [1, 9, 2]  # replica 1 is far above the mean (4): skipped
    assert policy.choose(req([1, 2, 3, 4]), view) == 0
    assert policy.choose(req([7]), View([set()] * 3, [3, 1, 2])) == 1  # no prefix anywhere: least loaded


def test_make_policy_names_the_choices():
    assert set(POLICIES) == {"round-robin", "random", "consistent-hash", "prefix-affinity"}
    with pytest.raises(ValueError, match="round-robin"):
        make_policy("fastest")
