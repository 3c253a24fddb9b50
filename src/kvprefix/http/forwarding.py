"""The request headers every front end passes on to a replica: the caller's key (the replica checks it again and
names the tenant by it), the body's type, what the caller accepts, and its session key (``x-session-id``, which
the session policy routes by). One list for the relay, the router's admin fan-out and the Ray ingress."""

from __future__ import annotations

from collections.abc import Mapping

FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-session-id")
FORWARD_RAW_HEADERS = frozenset(name.encode() for name in FORWARD_HEADERS)  # as an ASGI scope spells them


def forwarded(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The forwarded headers among ``headers`` (a Starlette ``Headers`` or any case-insensitive mapping)."""
    return [(name, headers[name]) for name in FORWARD_HEADERS if name in headers]
