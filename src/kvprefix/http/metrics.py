"""The ``GET /metrics`` answer of every front end: Prometheus text, under the admin rule (the numbers aggregate
every tenant's traffic, so with tenants only the admin key reads them)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from kvprefix.http.tenancy import Auth

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def metrics_response(auth: Auth, raw: Request, render: Callable[[], bytes]) -> Response:
    auth.check_admin(raw.headers.get("authorization"))
    return Response(render(), media_type=PROMETHEUS_TEXT)
