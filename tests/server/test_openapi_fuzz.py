"""Schemathesis against the served /openapi.json: schema-driven request bodies for the two generation endpoints,
sent to the real server. No case may get a 5xx, and no block may stay referenced afterwards.

Cases are drawn from schemathesis's hypothesis strategies inside a plain hypothesis test (its pytest plugin does
not support this pytest version)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.servers import Server

MAX_NEW_TOKENS = 8  # the schema allows long generations; keep each case short
PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="session")
def api_schema(server_process: Server):
    return schemathesis.openapi.from_url(server_process.url + "/openapi.json")


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_schema_driven_no_5xx(server_process: Server, api_schema, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(PATHS))
    case = data.draw(api_schema[path]["POST"].as_strategy())
    if isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens") if path.endswith("chat/completions") else ("max_tokens",):
            value = case.body.get(key)
            if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > MAX_NEW_TOKENS):
                case.body[key] = MAX_NEW_TOKENS
    response = case.call(base_url=server_process.url, timeout=120)
    assert response.status_code < 500, (case.body, response.text)


@pytest.mark.slow  # the check of the fuzz above, on its `kvprefix serve` process (schemathesis calls a URL)
def test_no_leak_after_schema_fuzz(server_process: Server) -> None:
    server_process.wait_idle()

