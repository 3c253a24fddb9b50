"""Example text for the causes the replays find (which request lost most, and to which earlier one), and the fix
text each cause prints."""

from __future__ import annotations

from array import array

from kvprefix.doctor.chains import Variant
from kvprefix.doctor.kinds import KINDS
from kvprefix.doctor.observe import Observation

_WHAT = {
    "eviction": "was cached by line {o}, then evicted before this request came",
    "routing": "was cached on replica {r} (line {o}); this request went to replica {me}",
    "concurrency": "was still being computed for line {o} when this request arrived",
    "namespace": "has the same tokens as line {o}, in another namespace ({why})",
    "short-prefix": "shares fewer tokens than one block with earlier requests",
}


def fix_text(obs: Observation, kind: str) -> str:
    fix = KINDS[kind][1]
    sites = obs.findings.volatile_sites() if kind == "volatile-prefix" else None
    if sites:
        site = sites.most_common(1)[0][0]
        before, after = site.before.rsplit("\n", 1)[-1][-16:], site.after.split("\n", 1)[0][:16]  # its line
        where = f"the span after {before!r}" if before else f"the span before {after!r}" if after else "all of it"
        more = len(sites) - 1
        return (f"{fix}: in {site.field or 'the template text'}, {where}"
                + (f" (and {more} more place{'s' if more > 1 else ''})" if more else ""))
    if kind == "namespace" and any(adapter for _, adapter in obs.requests.space_names):
        return f"{fix}; adapters never share KV: send a shared prefix to one model (or adapter)"
    return fix


def replay_example(obs: Observation, kind: str, variant: Variant, gains: list[int], now: array,
                   detail: str) -> dict:
    """The request that gained most, and the earlier request that first had its first lost block."""
    req = obs.requests
    i = max(range(len(gains)), key=gains.__getitem__)
    chain = variant.tree.chain(variant.leaves[i])
    first_lost = now[i] // variant.block_size
    other = variant.tree.first_request[chain[first_lost]] if first_lost < len(chain) else -1
    other_line = req.lines[other] if other >= 0 and other != i else None
    what = _WHAT[kind].format(o=other_line, r=req.replica[other] if other >= 0 else "?", me=req.replica[i],
                              why=_namespace_difference(obs, i, other) if kind == "namespace" else "")
    text = f"line {req.lines[i]}: {gains[i]} prompt tokens from token {now[i]} on {what}"
    return {"line": req.lines[i], "other_line": other_line, "token": now[i], "field": None,
            "detail": f"{text}; {detail}" if detail else text, "this": None, "other": None}


def _namespace_difference(obs: Observation, i: int, other: int) -> str:
    req = obs.requests
    if other < 0 or not req.space_of:
        return "tenant, cache salt or adapter"
    names = list(req.space_names)
    (salt, adapter), (other_salt, other_adapter) = names[req.space_of[i]], names[req.space_of[other]]
    whats = [] if salt == other_salt else ["another tenant or cache salt"]
    if adapter != other_adapter:
        whats.append(f"model {adapter or req.adapters.base_model!r} vs {other_adapter or req.adapters.base_model!r}")
    return ", ".join(whats) or "tenant, cache salt or adapter"


def unique_example(obs: Observation, unique: list[int], ideal: Variant) -> dict:
    lines = obs.requests.lines
    i = max(range(len(unique)), key=unique.__getitem__)
    return {"line": lines[i], "other_line": None, "token": ideal.tokens[i] - unique[i], "field": None,
            "detail": f"line {lines[i]}: {unique[i]} of {ideal.tokens[i]} prompt tokens appear in no "
                      f"earlier request, even with every fix", "this": None, "other": None}
