"""OpenAI-style errors: every failure a client can cause becomes ``{"error": {...}}`` with a 4xx status."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    """An error with the HTTP status and the OpenAI error fields (``type``, ``param``, ``code``)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc(loc: tuple) -> str:
    # pydantic puts union members ("str", "list[int]") in the location, FastAPI the source ("query"); keep only
    # field names and indices.
    if loc and loc[0] in ("query", "body", "path", "header"):
        loc = loc[1:]
    return ".".join(
        str(p) for p in loc if isinstance(p, int) or (p not in _TYPE_TAGS and not any(c in p for c in "[]-"))
    )


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """Turns the first pydantic error into a message that names the bad field and what is accepted."""
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else list(exc.errors())
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"malformed JSON in request body: {first['msg'].removeprefix('Invalid JSON: ')}")
    if first["type"] == "model_type" or (first["type"] == "model_attributes_type" and not first["loc"]):
        return bad_request("request body must be a JSON object")
    field = _loc(first["loc"])
    if first["type"] == "extra_forbidden":
        return bad_request(f"unrecognized request argument supplied: {field}", param=field)
    if first["type"] == "missing":
        return bad_request(f"missing required parameter: '{field}'", param=field)
    # Union types give one error per member; listing the expected types names what is accepted. pydantic's error
    # type follows each message as pydantic (and so vLLM) writes it, e.g. [type=greater_than_equal], which vLLM's
    # own tests match on; our own validators' "value_error" says nothing and is left out.
    same_field = [e for e in errors if _loc(e["loc"]) == field]
    msgs = sorted({e["msg"].removeprefix("Value error, ") + ("" if e["type"] == "value_error" else f" [type={e['type']}]")
                   for e in same_field})
    return bad_request(f"invalid value for '{field}': {'; or '.join(msgs)}", param=field)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _query_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths (404) and wrong methods (405) in the same shape as every other error.
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=type_, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error").response()
