"""The doctor's report as terminal text: the hit rate now, then each cause ranked, with its example and what the
hit rate would be with only that cause fixed."""

from __future__ import annotations

from kvprefix.doctor.diagnosis import Diagnosis
from kvprefix.doctor.kinds import KINDS


def format_report(d: Diagnosis) -> str:
    cap = "unbounded" if d.capacity_tokens is None else f"{d.capacity_tokens} tokens"
    out = [
        f"kvprefix doctor: {d.log}: {d.requests} requests, {d.prompt_tokens} prompt tokens, block size "
        f"{d.block_size}, capacity {cap}",
        f"hit rate now: {d.hit_rate:.1%} ({d.cached_tokens} tokens cached, {d.prompt_tokens - d.cached_tokens} "
        f"prefilled)",
    ]
    if not any(c.kind != "no-sharing" for c in d.causes):
        out.append("no fixable cause: every request shares what it can with the requests before it")
    for rank, c in enumerate(d.causes, start=1):
        out.append("")
        share = c.tokens_lost / d.prompt_tokens if d.prompt_tokens else 0.0
        head = f"{rank}. {c.kind}: {c.requests} requests, {c.tokens_lost} tokens ({share:.1%} of all prompt tokens)"
        if c.hit_rate_after is not None:
            head += f", hit rate {d.hit_rate:.1%} -> {c.hit_rate_after:.1%} after this fix"
        out.append(head)
        out.append(f"   {KINDS[c.kind][0]}")
        ex = c.example or {}
        if ex.get("detail"):
            out.append(f"   {ex['detail']}")
        if ex.get("this") is not None:
            where = ex["field"] or "the template's own text"
            out.append(f"   line {ex['line']:>6} at token {ex['token']} ({where}): {ex['this']}")
            out.append(f"   line {ex['other_line']:>6} at token {ex['token']} ({where}): {ex['other']}")
        if c.kind != "no-sharing":
            out.append(f"   fix: {c.fix}")
    return "\n".join(out)
