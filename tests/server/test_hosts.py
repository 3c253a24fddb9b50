"""Browsers cannot drive a keyless server on 127.0.0.1: a Host that is not the server's (DNS rebinding) or a
cross-site Origin gets 403, while curl and SDKs (no Origin) are served; one Authorization header at most."""

from __future__ import annotations

import httpx
import pytest
from support.servers import Server, start_server, stop_server

OK_C = {"model": "default-model-v1", "prompt": "hello", "max_tokens": 1}


def _get(server: Server, **headers: str) -> httpx.Response:
    return server.get("/v1/models", headers=headers, timeout=10)


@pytest.mark.parametrize("host", ["localhost", "localhost:1234", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST"])
def test_loopback_names_are_served(server: Server, host: str) -> None:
    assert _get(server, host=host).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::2]"])
def test_rebound_host_is_refused(server: Server, host: str) -> None:
    r = _get(server, host=host)
    assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"], r.text
    assert server.post("/flush_cache", headers={"host": host}).status_code == 403


@pytest.mark.parametrize("origin", ["http://evil.example", "https://localhost.evil.example", "null"])
def test_cross_site_origin_is_refused(server: Server, origin: str) -> None:
    for r in (server.post("/flush_cache", headers={"origin": origin}),
              server.post("/v1/completions", OK_C, headers={"origin": origin})):
        assert r.status_code == 403 and "Origin" in r.json()["error"]["message"], r.text


def test_same_site_origin_and_no_origin_are_served(server: Server) -> None:
    for headers in ({}, {"origin": "http://localhost:3000"}, {"origin": server.url}):
        assert server.post("/v1/completions", OK_C, headers=headers).status_code == 200


def test_more_than_one_authorization_header_is_refused(server: Server, tenant_server: Server) -> None:
    two = [("authorization", "Bearer key-alice"), ("authorization", "Bearer key-bob")]
    for s in (server, tenant_server):
        r = s.get("/v1/models", headers=two, timeout=10)
        assert r.status_code == 400 and "Authorization" in r.json()["error"]["message"], r.text


def test_startup_warns_that_admin_endpoints_are_open(server: Server, tenant_server: Server) -> None:
    assert "admin endpoints" in server.log_path.read_text()
    assert "admin endpoints" not in tenant_server.log_path.read_text()


@pytest.mark.slow
def test_allowed_hosts_option(server_tmp) -> None:
    s = start_server(server_tmp, "--num-gpu-blocks", "64", "--allowed-hosts", "api.example, [::1]")
    try:
        assert _get(s).status_code == 403  # 127.0.0.1 is no longer in the list
        assert _get(s, host="api.example:8000").status_code == 200
        assert _get(s, host="[::1]").status_code == 200
        assert s.post("/v1/completions", OK_C, headers={"host": "api.example",
                                                        "origin": "https://api.example"}).status_code == 200
    finally:
        stop_server(s)
