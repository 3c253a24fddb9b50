"""The doctor's report as one self-contained HTML page: the ranked causes with their examples side by side, a bar
chart of the hit rate after each fix, and a histogram of where requests part from their nearest earlier one."""

from __future__ import annotations

from html import escape

from kvprefix.doctor.diagnosis import Diagnosis
from kvprefix.doctor.kinds import KINDS

_BAR_W, _BAR_H, _LABEL_W = 420, 22, 150
_HIST_W, _HIST_H, _BINS = 560, 160, 24
# After the page is laid out, a script checks every chart bar got a size and says so on <body>.
_CHECK = """<script>
const bars = [...document.querySelectorAll('svg rect.bar')];
document.body.dataset.rendered = bars.length && bars.every(b => b.getBBox().width > 0) ? 'ok' : 'broken';
</script>"""


def write_html(d: Diagnosis, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(d))


def render_html(d: Diagnosis) -> str:
    cap = "unbounded" if d.capacity_tokens is None else f"{d.capacity_tokens} tokens"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvprefix doctor: " + escape(d.log) + "</title>",
        "<style>body{font:14px system-ui,sans-serif;margin:2em;max-width:1100px}td,th{padding:4px 8px;"
        "text-align:left}pre{white-space:pre-wrap;background:#f6f6f6;padding:6px;margin:0}"
        ".pair{display:grid;grid-template-columns:1fr 1fr;gap:8px}mark{background:#ffd27a}</style></head><body>",
        f"<h1>kvprefix doctor: {escape(d.log)}</h1>",
        f"<p>{d.requests} requests, {d.prompt_tokens} prompt tokens, block size {d.block_size}, capacity "
        f"{escape(cap)}. <b>Hit rate now: {d.hit_rate:.1%}</b>.</p>",
        "<h2>Hit rate after each fix</h2>", _bars(d),
        "<h2>Causes</h2>", _table(d),
    ]
    for rank, c in enumerate(d.causes, start=1):
        parts.append(f"<h3 id='{escape(c.kind)}'>{rank}. {escape(c.kind)}</h3><p>{escape(KINDS[c.kind][0])}</p>")
        ex = c.example or {}
        if ex.get("detail"):
            parts.append(f"<p>{escape(ex['detail'])}</p>")
        if ex.get("this") is not None:
            where = escape(ex["field"] or "the template's own text")
            parts.append(f"<div class='pair'><div>line {ex['line']}, token {ex['token']}, {where}"
                         f"<pre>{_marked(ex['this'])}</pre></div><div>line {ex['other_line']}"
                         f"<pre>{_marked(ex['other'])}</pre></div></div>")
        if c.kind != "no-sharing":
            parts.append(f"<p><b>Fix:</b> {escape(c.fix)}</p>")
    parts += ["<h2>Where requests part from the nearest earlier one (first differing token)</h2>", _histogram(d),
              _CHECK, "</body></html>"]
    return "\n".join(parts)


def _marked(excerpt: str) -> str:
    return escape(excerpt).replace("«", "<mark>").replace("»", "</mark>")


def _table(d: Diagnosis) -> str:
    rows = ["<table><tr><th>kind</th><th>requests</th><th>tokens lost</th><th>hit rate after this fix</th></tr>"]
    for c in d.causes:
        after = "" if c.hit_rate_after is None else f"{d.hit_rate:.1%} → {c.hit_rate_after:.1%}"
        rows.append(f"<tr><td><a href='#{escape(c.kind)}'>{escape(c.kind)}</a></td><td>{c.requests}</td>"
                    f"<td>{c.tokens_lost}</td><td>{after}</td></tr>")
    return "".join(rows) + "</table>"


def _bars(d: Diagnosis) -> str:
    items = [("now", d.hit_rate)] + [(c.kind, c.hit_rate_after) for c in d.causes if c.hit_rate_after is not None]
    height = _BAR_H * len(items) + 10
    svg = [f"<svg width='{_LABEL_W + _BAR_W + 70}' height='{height}' role='img' aria-label='hit rate per fix'>"]
    for k, (label, rate) in enumerate(items):
        y = 5 + k * _BAR_H
        w = max(1.0, rate * _BAR_W)
        color = "#999" if label == "now" else "#3a7bd5"
        svg.append(f"<text x='0' y='{y + 15}'>{escape(label)}</text><rect class='bar' x='{_LABEL_W}' y='{y + 3}' "
                   f"width='{w:.1f}' height='{_BAR_H - 6}' fill='{color}'/><text x='{_LABEL_W + w + 6:.1f}' "
                   f"y='{y + 15}'>{rate:.1%}</text>")
    return "".join(svg) + "</svg>"


def _histogram(d: Diagnosis) -> str:
    positions = d.divergence_positions
    if not positions:
        return "<p>No request parts from an earlier one.</p>"
    top = max(positions) + 1
    width = max(1, -(-top // _BINS))
    counts = [0] * _BINS
    for p in positions:
        counts[min(p // width, _BINS - 1)] += 1
    most = max(counts)
    bw = _HIST_W / _BINS
    svg = [f"<svg width='{_HIST_W + 20}' height='{_HIST_H + 40}' role='img' aria-label='divergence positions'>"]
    for k, n in enumerate(counts):
        h = _HIST_H * n / most
        svg.append(f"<rect class='bar' x='{k * bw:.1f}' y='{_HIST_H - h:.1f}' width='{bw - 2:.1f}' "
                   f"height='{max(h, 0.5):.1f}' fill='#d5793a'><title>tokens {k * width}–{(k + 1) * width - 1}: "
                   f"{n} requests</title></rect>")
    svg.append(f"<text x='0' y='{_HIST_H + 18}'>token 0</text><text x='{_HIST_W - 90}' y='{_HIST_H + 18}'>"
               f"token {top}</text>")
    return "".join(svg) + "</svg>"
