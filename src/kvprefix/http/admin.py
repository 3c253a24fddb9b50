"""The answer to an admin call fanned out to every replica (`/reset_prefix_cache`, `/flush_cache`), the same from
`kvprefix route` and the Ray Serve ingress: each replica's status and answer side by side, 200 only if all
succeeded, else 502."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse


def replica_result(replica: str, status: int, body: bytes) -> dict:
    try:
        answer = json.loads(body)
    except ValueError:
        answer = body.decode("utf-8", "replace")
    return {"replica": replica, "status": status, "response": answer}


def replica_error(replica: str | None, exc: BaseException) -> dict:
    """The result of a replica the call did not reach, or that died under it."""
    return {"replica": replica, "status": None, "error": str(exc) or type(exc).__name__}


def fan_out_response(results: list[dict]) -> JSONResponse:
    ok = all(r["status"] == 200 for r in results)
    return JSONResponse({"success": ok, "replicas": results}, status_code=200 if ok else 502)
