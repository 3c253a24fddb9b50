"""Load as the prefix policies weigh it: requests in flight and queued prefill, on the router's real view."""

from __future__ import annotations

import random

import pytest

from kvprefix.cache.event_index import BlockIndex, MediaIndex, StreamMirror
from kvprefix.cache.media import POOL
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.hashing import RouteRequest
from kvprefix.router.ledger import Ledger
from kvprefix.router.policies import Decision, make_policy


def fleet(n: int) -> FleetView:
    replicas = [Replica(f"http://replica-{i}") for i in range(n)]
    for rep in replicas:
        rep.healthy = True
    return FleetView(replicas)


def test_queued_prefill_is_counted_until_the_first_token_and_everything_settles_once():
    view = fleet(2)
    out = view.replicas[0].outstanding
    routed = out.add(["a", "b"], 5)
    assert (view.load(0), view.queued_prefill_blocks(0), view.cached_prefix_blocks(0, ["a", "b", "c"])) == (1, 5, 2)
    routed.prefilled()
    routed.prefilled()
    assert (view.load(0), view.queued_prefill_blocks(0)) == (1, 0)  # running, no longer queued
    early = out.add(["a"], 3)  # a stream the client leaves before its first token
    early.finish()
    routed.finish()
    routed.finish()
    early.finish()
    assert (out.requests, out.queued_prefill_blocks, len(out.blocks)) == (0, 0, 0)


def test_credit_is_weighed_against_queued_prefill():
    """A replica holding the prefix wins while its queue is short, and is passed over once its queued prefill
    exceeds what the prefix would cost elsewhere (its blocks, weighed 1 + the mean requests in flight: 8 x 9 =
    72 blocks here); the blocks it was not credited become queued prefill."""
    view, ledger = fleet(3), Ledger(make_policy("kv-events"))
    prefix = [f"h{i}" for i in range(8)]
    holder = view.replicas[1].outstanding
    first = holder.add(prefix, 8)  # a request computing the prefix there: its blocks count as cached
    request = RouteRequest(prefix + ["q1"], None, num_blocks=10)
    decision, second = ledger.route(request, view)
    assert decision == Decision(1, 8, "cached_prefix")
    assert view.queued_prefill_blocks(1) == 8 + 2
    for _ in range(6):  # 82 blocks queued there: more than the prefix's 72 elsewhere
        holder.add([], 12)
    for i in (0, 2):  # as many requests in flight elsewhere, all past prefill: only the queues differ
        for _ in range(8):
            view.replicas[i].outstanding.add([], 0)
    other = RouteRequest(prefix + ["q2"], None, num_blocks=10)
    choice = ledger.choose(other, view)
    assert choice.replica != 1 and choice.credited == 0 and choice.reason == "no_prefix"
    for r in (first, second):
        r.finish()
    assert view.load(1) == 6 and view.cached_prefix_blocks(1, prefix) == 0


def test_a_miss_goes_to_the_least_queued_replica():
    view, policy = fleet(3), make_policy("prefix")
    view.replicas[0].outstanding.add([], 40)
    view.replicas[2].outstanding.add([], 4)
    view.replicas[1].outstanding.add([], 9)
    assert policy.choose(RouteRequest(["x"], None, 1), view).replica == 2  # all load 1: the shortest prefill queue


def test_a_view_counts_a_prefix_cached_or_pending_block_by_block():
    """The view scans a chain in runs (pending blocks, then blocks the replica's events say it holds, then pending
    again...): the same count as asking of every block in turn whether it is pending or cached."""
    rng = random.Random(7)
    view = fleet(1)
    rep = view.replicas[0]
    rep.mirror = StreamMirror()
    rep.mirror.ready = True
    hashes = [f"b{i}" for i in range(40)]
    for _ in range(300):
        cached = {h for h in hashes if rng.random() < 0.5}
        rep.mirror.blocks = MediaIndex({POOL: BlockIndex({h: (None, "") for h in cached})})
        routed = [rep.outstanding.add(hashes[: rng.randrange(41)], 0) for _ in range(rng.randrange(3))]
        split = rng.randrange(41)  # a chain that shares the first blocks, then goes its own way
        routed.append(rep.outstanding.add(hashes[:split] + [f"c{split}-{j}" for j in range(rng.randrange(9))], 0))
        request = hashes[: rng.randrange(41)]
        if rng.random() < 0.3:
            request = request + [f"c{len(request)}-{j}" for j in range(rng.randrange(9))]
        expected = 0
        for h in request:
            if h not in rep.outstanding.blocks and h not in cached:
                break
            expected += 1
        assert view.cached_prefix_blocks(0, request) == expected
        for r in routed:
            r.finish()
        assert len(rep.outstanding.blocks) == 0
    with pytest.raises(KeyError):  # a hash that was never added cannot be dropped (the count stays exact)
        rep.outstanding.blocks.drop(["never"])


def test_pending_blocks_are_the_blocks_of_the_chains_in_flight():
    """PendingBlocks keeps the chains in flight as a tree (adding and dropping walk only a request's own blocks):
    after any sequence of adds and drops, in any order, its blocks are exactly those of the chains in flight, as a
    plain multiset of every block of every chain holds them, and nothing is left once all are dropped."""
    from collections import Counter

    from kvprefix.router.pending import PendingBlocks

    rng = random.Random(11)
    for _ in range(50):
        pending, reference, in_flight = PendingBlocks(), Counter(), []
        for _ in range(200):
            if in_flight and rng.random() < 0.45:
                chain = in_flight.pop(rng.randrange(len(in_flight)))
                pending.drop(chain)
                reference.subtract(chain)
            else:  # a path in a small tree of prompts: a block's hash names its whole prefix (chained)
                path = [rng.choice("abc") for _ in range(rng.randrange(8))]
                chain = ["/".join(path[: i + 1]) for i in range(len(path))]
                in_flight.append(chain)
                pending.add(chain)
                reference.update(chain)
            blocks = {h for h, n in reference.items() if n > 0}
            assert len(pending) == len(blocks) and all(h in pending for h in blocks)
        for chain in in_flight:
            pending.drop(chain)
        assert len(pending) == 0 and not pending._parent


def test_the_prefix_policy_decides_the_same_without_the_pending_blocks():
    """The ledger does not count a `prefix` router's requests' blocks as pending (the policy's own RoutedIndex
    remembers them; it never asks the view): the same choices, request for request, as with them counted."""

    def choices(count_blocks: bool) -> list[tuple[int, int]]:
        rng = random.Random(3)
        prompts = [[f"p{k}-{i}" for i in range(rng.randrange(1, 30))] for k in range(6)]
        view, policy = fleet(4), make_policy("prefix")
        in_flight, out = [], []
        for _ in range(400):
            prompt = rng.choice(prompts) + [f"q{rng.randrange(1000)}"]
            request = RouteRequest(prompt, None, num_blocks=len(prompt) + 1)
            decision = policy.choose(request, view)
            out.append(decision)
            in_flight.append(view.replicas[decision.replica].outstanding.add(
                request.block_hashes if count_blocks else (), request.num_blocks - decision.credited))
            while in_flight and rng.random() < 0.5:
                in_flight.pop(rng.randrange(len(in_flight))).finish()
            if rng.random() < 0.05:  # a replica reset through the router: it forgets, the pending blocks stay
                policy.forget(rng.randrange(4))
        return out

    counted = choices(True)
    assert choices(False) == counted
    assert len({d.replica for d in counted}) == 4 and any(d.credited for d in counted)


def test_the_ledger_counts_pending_blocks_only_for_a_policy_that_reads_the_cache():
    request = RouteRequest(["a", "b"], None, num_blocks=3)
    for name, pending in (("prefix", 0), ("kv-events", 2), ("round-robin", 0)):
        view = fleet(2)
        decision, routed = Ledger(make_policy(name)).route(request, view)
        out = view.replicas[decision.replica].outstanding
        assert (out.requests, out.queued_prefill_blocks, len(out.blocks)) == (1, 3, pending), name
        routed.finish()
        assert (out.requests, out.queued_prefill_blocks, len(out.blocks)) == (0, 0, 0)
