"""What the doctor is asked (``Options``) and what it answers (``Diagnosis``: the hit rate now and the ranked
``Cause``s), as the reports print them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Options:
    block_size: int | None = None  # default: 16 for bodies, the log's own for a request log
    capacity_tokens: int | None = None  # per replica; None = unbounded
    progress: str = "off"  # "bar" (a terminal), "lines" (a line on stderr every progress_every_s seconds), "off"
    progress_every_s: float = 10.0


@dataclass
class Cause:
    kind: str
    requests: int
    tokens_lost: int
    example: dict[str, Any] | None
    fix: str
    hit_rate_after: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "requests": self.requests, "tokens_lost": self.tokens_lost,
                "example": self.example, "fix": self.fix, "hit_rate_after": self.hit_rate_after}


@dataclass
class Diagnosis:
    log: str
    requests: int
    block_size: int
    capacity_tokens: int | None
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    causes: list[Cause]
    divergence_positions: list[int] = field(default_factory=list)  # first differing token, per request

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "block_size": self.block_size, "hit_rate": self.hit_rate,
                "causes": [c.to_dict() for c in self.causes]}
