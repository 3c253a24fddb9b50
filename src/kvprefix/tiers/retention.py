"""What a request may ask of the tiers below the pool, and for how long (docs/tiers.md#retention).

``None`` (the default): the blocks a request computes are written to the tier and evicted in LRU order.
``"in_memory"`` (OpenAI's ``prompt_cache_retention``): they stay in the pool, never written below it.
``"5m"``, ``"1h"`` (a text part's ``cache_control.ttl``), ``"24h"`` (``prompt_cache_retention``): written and kept
at least that long: LRU eviction passes over an unexpired retained object, within a per-tenant byte budget.
"""

from __future__ import annotations

IN_MEMORY = "in_memory"
DURATIONS = {"5m": 300.0, "1h": 3600.0, "24h": 86400.0}  # retention -> seconds kept at least
RETENTIONS = (IN_MEMORY, *DURATIONS)


def check_retention(value: str | None, name: str = "kv_retention") -> str | None:
    """``value`` if it is a retention (or None); ValueError naming ``name`` otherwise."""
    if value is not None and value not in RETENTIONS:
        raise ValueError(f"{name} must be one of {', '.join(repr(r) for r in RETENTIONS)}, got {value!r}")
    return value


def retained_seconds(value: str | None) -> float | None:
    """How long blocks of this retention are kept at least; None for the default and in_memory."""
    return DURATIONS.get(value) if value is not None else None


def longest(values) -> str | None:
    """The retention that keeps blocks longest among ``values`` (None when none asks for a duration)."""
    timed = [v for v in values if v in DURATIONS]
    return max(timed, key=DURATIONS.__getitem__) if timed else None
