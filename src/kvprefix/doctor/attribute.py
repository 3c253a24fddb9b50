"""Pass 3, attribute: replays the log as it is and each counterfactual (a fix's variant, or a setting with that
cause removed: unbounded capacity, one replica, no waiting, one namespace) and credits each cause with the
prompt tokens its counterfactual serves from the cache that the log as it is does not."""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterator

from kvprefix.doctor.chains import Variant
from kvprefix.doctor.diagnosis import Cause, Diagnosis
from kvprefix.doctor.examples import fix_text, replay_example, unique_example
from kvprefix.doctor.kinds import KINDS
from kvprefix.doctor.observe import Observation, Requests
from kvprefix.doctor.replaying import Replayer, Setting, Timing
from kvprefix.sim.replay import DEFAULT_KV_BYTES_PER_TOKEN
from kvprefix.tiers.sizes import format_size

_MAX_CAPACITY_STEPS = 16
_FIRST_DISK_BYTES = 64 * 2**20  # the disk sizes tried: 64 MiB, doubling (as many steps as for the capacity)
Replay = Callable[[Variant, Setting], array]


def replay_order(requests: Requests) -> tuple[bool, list[int], list[list[int]]]:
    """Whether every request has an arrival time; the requests in arrival order (else log order); and that
    order split by replica."""
    n = len(requests.lines)
    timed = all(t is not None for t in requests.arrival)
    order = sorted(range(n), key=requests.arrival.__getitem__) if timed else list(range(n))
    by_replica: dict[str, list[int]] = {}
    for i in order:
        by_replica.setdefault(requests.replica[i], []).append(i)
    return timed, order, list(by_replica.values())


def attribute(path: str, obs: Observation, fixed: dict[str, Variant], capacity_tokens: int | None) -> Diagnosis:
    """The diagnosis: the hit rate now and the causes, ranked by the tokens they lose."""
    bs, n = obs.variants.block_size, len(obs.requests.lines)
    timed, order, groups = replay_order(obs.requests)
    timing = Timing(obs.requests.arrival, obs.requests.prefill) if timed else Timing(None, None)
    cap_blocks = None if capacity_tokens is None else capacity_tokens // bs
    setting = Setting(cap_blocks, len(groups) > 1, timed)
    replay = Replayer(order, groups, timing, bs).cached_tokens
    base = obs.variants["as is"]
    now = replay(base, setting)
    total = sum(base.tokens)
    causes = [c for c in _causes(obs, fixed, replay, setting, now) if c is not None]
    causes.sort(key=lambda c: -c.tokens_lost)
    shared = obs.variants.get("one namespace")
    ideal = fixed.get("all fixed") or (shared if shared is not None and len(shared) == n else base)
    best = replay(ideal, Setting(None, False, False))
    unique = [t - c for t, c in zip(ideal.tokens, best, strict=True)]
    if any(u > 0 for u in unique):
        causes.append(Cause("no-sharing", sum(1 for u in unique if u > 0), int(sum(unique)),
                            unique_example(obs, unique, ideal), KINDS["no-sharing"][1], None))
    return Diagnosis(os.path.basename(path), n, bs, capacity_tokens, int(total), int(sum(now)),
                     _ratio(sum(now), total), causes, obs.findings.positions)


def _causes(obs: Observation, fixed: dict[str, Variant], replay: Replay, setting: Setting,
            now: array) -> Iterator[Cause | None]:
    """Each counterfactual's cause (None: it wins less than a block), in the order ties rank."""
    base, timed, cap_blocks = obs.variants["as is"], setting.in_flight, setting.capacity_blocks
    for kind in ("volatile-prefix", "reordered", "template-drift"):
        if kind in fixed:
            d = obs.findings.examples.get(kind)
            yield _cause(obs, kind, fixed[kind], replay(fixed[kind], setting), now,
                         example=None if d is None else d.to_dict())
    if "short-prefix" in fixed:
        v = fixed["short-prefix"]
        yield _cause(obs, "short-prefix", v, replay(v, setting), now, only_unhit=True,
                     detail=f"at {v.block_size}-token blocks")
    if cap_blocks is not None:
        after = replay(base, Setting(None, setting.per_replica, timed))
        yield _cause(obs, "eviction", base, after, now, detail=_capacity_needed(base, replay, setting, after))
    if setting.per_replica:
        yield _cause(obs, "routing", base, replay(base, Setting(cap_blocks, False, timed)), now)
    if timed:
        yield _cause(obs, "concurrency", base, replay(base, Setting(cap_blocks, setting.per_replica, False)), now)
    shared = obs.variants.get("one namespace")
    if len(obs.requests.namespaces) > 1 and shared is not None and len(shared) == len(base):
        yield _cause(obs, "namespace", shared, replay(shared, setting), now)
    elif obs.requests.miss_reasons["different_salt"]:
        yield Cause("namespace", obs.requests.miss_reasons["different_salt"], 0, None, fix_text(obs, "namespace"),
                    None)


def _cause(obs: Observation, kind: str, variant: Variant, after: array, now: array, only_unhit: bool = False,
           example: dict | None = None, detail: str = "") -> Cause | None:
    gains = [a - b for a, b in zip(after, now, strict=True)]
    if only_unhit:  # requests that hit nothing now, or none of their content (short-prefix)
        short = obs.findings.short
        gains = [g if now[i] == 0 or i in short else 0 for i, g in enumerate(gains)]
    lost = sum(gains) if not only_unhit else sum(g for g in gains if g > 0)
    affected = sum(1 for g in gains if g > 0)
    if lost < obs.variants.block_size or affected == 0:  # less than one block in the whole log is noise
        return None
    if example is None:
        example = replay_example(obs, kind, variant, gains, now, detail)
    return Cause(kind, affected, int(lost), example, fix_text(obs, kind), _ratio(sum(after), sum(variant.tokens)))


def _capacity_needed(base: Variant, replay: Replay, setting: Setting, unbounded: array) -> str:
    """The smallest capacity (doubling from --capacity) at which nothing evicted is lost, and the smallest disk
    tier below the present pool (``kvprefix serve --kv-disk-size``, doubling from 64 MiB) that keeps the same."""
    goal = sum(unbounded)
    blocks, found = setting.capacity_blocks, []
    for _ in range(_MAX_CAPACITY_STEPS):
        blocks *= 2
        if blocks >= base.distinct_blocks + base.max_blocks or sum(
                replay(base, Setting(blocks, setting.per_replica, setting.in_flight))) >= goal:
            found.append(f"a capacity of {blocks * base.block_size} tokens per replica keeps it")
            break
    disk = _FIRST_DISK_BYTES
    everything = (base.distinct_blocks + base.max_blocks) * base.block_size * DEFAULT_KV_BYTES_PER_TOKEN
    for _ in range(_MAX_CAPACITY_STEPS):
        if disk >= everything or sum(replay(base, Setting(setting.capacity_blocks, setting.per_replica,
                                                          setting.in_flight, disk))) >= goal:
            found.append(f"{'so does' if found else 'keeps it:'} a disk tier of {format_size(disk)} below the pool "
                         f"(kvprefix serve --kv-disk "
                         f"--kv-disk-size {format_size(disk)}, at the default model's "
                         f"{DEFAULT_KV_BYTES_PER_TOKEN:,} bytes of KV per token)")
            break
        disk *= 2
    return "; ".join(found)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
