"""Header checks before any route: the Host and Origin that browsers send, and a single Authorization header.

Without keys, any web page can send requests to a server on 127.0.0.1 (cross-site POSTs; DNS rebinding lets it read
answers too). Browsers always send the Host they believe they talk to and an Origin on cross-site POSTs; curl and
SDKs send no Origin. So a foreign Host or a cross-site Origin gets 403; ``GET /health`` and ``/ping`` are exempt, so
probes reach them by any address. docs/security.md.
"""

from __future__ import annotations

import functools
import ipaddress
from urllib.parse import urlsplit

from kvprefix.http.errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@functools.lru_cache(maxsize=256)  # a client sends the same Host on every request: parsed once
def _hostname(netloc: str) -> str | None:
    """The host of ``host[:port]``, lower case, IPv6 without brackets; None when it is not a host."""
    try:
        return urlsplit("//" + netloc).hostname or None
    except ValueError:
        return None


def allowed_hosts(option: str | None, bind_host: str) -> frozenset[str] | None:
    """The Host names to serve (any port), from ``--allowed-hosts`` (comma-separated, ``*``); None means any. By
    default the loopback names (and the bound address) when bound to loopback, else any (names it cannot know)."""
    if option is None:
        loopback = bind_host == "localhost" or _is_loopback_ip(bind_host)
        return LOOPBACK_NAMES | {bind_host.lower()} if loopback else None
    names = [name.strip() for name in option.split(",") if name.strip()]
    if "*" in names:
        return None
    hosts = {name if _is_ip(name) else _hostname(name) for name in names}  # a bare IPv6 address has colons
    if not hosts or None in hosts:
        raise ValueError(f"--allowed-hosts {option!r}: give host names or addresses separated by commas, or *")
    return frozenset(hosts)  # type: ignore[arg-type]


def _is_loopback_ip(host: str) -> bool:
    return _is_ip(host) and ipaddress.ip_address(host).is_loopback


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class BrowserGuard:
    """ASGI middleware: refuses requests from a browser that the server's user did not mean to send."""

    def __init__(self, app, allowed_hosts: frozenset[str] | None):
        self.app = app
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope, receive, send) -> None:
        error = self._check(scope) if scope["type"] == "http" else None
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, scope) -> APIError | None:
        headers = [(k, v.decode("latin-1")) for k, v in scope["headers"] if k in (b"host", b"origin",
                                                                                    b"authorization")]
        if sum(k == b"authorization" for k, _ in headers) > 1:
            # Two keys: whichever one a proxy checked, the server might use the other.
            return APIError(400, "send one Authorization header, not several", type="authentication_error")
        if scope["method"] == "GET" and scope["path"] in ("/health", "/ping"):
            return None
        hosts = [v for k, v in headers if k == b"host"]
        for host in hosts:
            if self.allowed_hosts is not None and _hostname(host) not in self.allowed_hosts:
                return APIError(403, f"Host {host!r} is not a name of this server (a guard against DNS "
                                "rebinding); to serve it, start the server with --allowed-hosts",
                                type="permission_error")
        for origin in (v for k, v in headers if k == b"origin"):
            if not self._same_site(origin, hosts):
                return APIError(403, f"cross-site request from Origin {origin!r} refused (browsers on other sites "
                                "may not use this server); to allow it, start the server with --allowed-hosts",
                                type="permission_error")
        return None

    def _same_site(self, origin: str, hosts: list[str]) -> bool:
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False  # "null" (a sandboxed page, a file) or garbage
        if self.allowed_hosts is not None:
            return parts.hostname in self.allowed_hosts
        return any(parts.netloc.lower() == host.lower() for host in hosts)  # any Host: same origin only
