"""Turns replay summaries into a text table, a JSON document and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from kvprefix.sim.metrics import HIT_RATE_DEFINITIONS, ReplaySummary

_COLUMNS = (
    ("routing", "routing", "{}"),
    ("replicas", "repl", "{}"),
    ("capacity_tokens", "capacity/replica", "{:,}"),
    ("token_hit_rate", "hit(tok)", "{:.4f}"),
    ("block_hit_rate", "hit(blk)", "{:.4f}"),
    ("request_hit_rate", "hit(req)", "{:.4f}"),
    ("prefill_tokens_with_cache", "prefill w/ cache", "{:,}"),
    ("prefill_tokens_without_cache", "w/o cache", "{:,}"),
    ("evictions", "evictions", "{:,}"),
    ("load_imbalance", "imbalance", "{:.2f}"),
    ("ttft_gain", "TTFT gain", "{:.1%}"),
    ("waited", "waited", "{:,}"),
    ("mean_wait_s", "wait(s)", "{:.2f}"),
    ("rejected", "rejected", "{:,}"),
)
# With tiers (--disk-capacity, --shared-capacity), after the capacity: hit rate per tier (their sum = hit(tok)).
_POOL_COLUMN = (("pool_token_hit_rate", "hit(pool)", "{:.4f}"),)
_DISK_COLUMNS = (
    ("disk_capacity_bytes", "disk/replica", "{:,}"),
    ("disk_token_hit_rate", "hit(disk)", "{:.4f}"),
    ("disk_evictions", "disk evictions", "{:,}"),
)
_SHARED_COLUMNS = (
    ("shared_capacity_bytes", "shared", "{:,}"),
    ("shared_token_hit_rate", "hit(shared)", "{:.4f}"),
    ("shared_evictions", "shared evictions", "{:,}"),
)


def format_table(summaries: list[ReplaySummary]) -> str:
    disk = any(s.disk_capacity_bytes is not None for s in summaries)
    shared = any(s.shared_capacity_bytes is not None for s in summaries)
    tiers = (*(_POOL_COLUMN if disk or shared else ()), *(_DISK_COLUMNS if disk else ()),
             *(_SHARED_COLUMNS if shared else ()))
    columns = (*_COLUMNS[:4], *tiers, *_COLUMNS[4:])
    rows = [[head for _, head, _ in columns]]
    for s in summaries:
        row = []
        for key, _, fmt in columns:
            value = getattr(s, key)
            row.append("unbounded" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if summaries:
        s = summaries[0]
        lines += [
            "",
            f"trace {s.trace}: {s.requests:,} requests, {s.block_refs:,} block refs, block size {s.block_size}, "
            f"mode {s.mode}; TTFT gain = prefill time saved at {s.prefill_tps:,.0f} tokens/s",
        ]
        lines += [f"{key.split('_')[0]:>6}: {text}" for key, text in HIT_RATE_DEFINITIONS.items()]
    return "\n".join(lines)


def write_json(summaries: list[ReplaySummary], path: str | Path) -> None:
    doc = {"hit_rate_definitions": HIT_RATE_DEFINITIONS, "runs": [s.to_dict() for s in summaries]}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def plot_hit_rate(summaries: list[ReplaySummary], path: str | Path, title: str | None = None) -> None:
    """Token-weighted hit rate vs capacity per replica (log scale), one line per routing and replica count.
    Unbounded runs have no x position; they are drawn as dotted horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in tests
    import matplotlib.pyplot as plt

    lines: dict[str, list[ReplaySummary]] = {}
    for s in summaries:
        label = s.routing if s.replicas == 1 else f"{s.routing} x{s.replicas}"
        lines.setdefault(label, []).append(s)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for label, runs in lines.items():
        bounded = sorted((s for s in runs if s.capacity_tokens is not None), key=lambda s: s.capacity_tokens)
        if bounded:
            ax.plot([s.capacity_tokens for s in bounded], [s.token_hit_rate for s in bounded], marker="o", label=label)
            if any(s.disk_capacity_bytes is not None or s.shared_capacity_bytes is not None for s in bounded):
                # the pool's share: the rest is the tiers'
                ax.plot([s.capacity_tokens for s in bounded], [s.pool_token_hit_rate for s in bounded], marker=".",
                        linestyle="--", label=f"{label}, pool only")
        for s in runs:
            if s.capacity_tokens is None:
                ax.axhline(s.token_hit_rate, linestyle=":", color="grey", label=f"{label}, unbounded")
    if any(s.capacity_tokens is not None for s in summaries):
        ax.set_xscale("log")
    ax.set_xlabel("cache capacity per replica (tokens)")
    ax.set_ylabel("hit rate (token-weighted)")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title or (summaries[0].trace if summaries else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
