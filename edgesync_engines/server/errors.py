"""Errors in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` with their HTTP
status (400, 401, 404, 413, 500, 503)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "dict", "list", "none"})
"""pydantic's tags for the plain-type branches of a union in an error's location."""

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}
"""The OpenAI error ``type`` of each status."""


MAX_SHOWN = 300
"""Characters of an error's message (and ``param``) sent back: it may repeat a huge client value."""


def _cut(text: str | None) -> str | None:
    """``text`` of at most :data:`MAX_SHOWN` characters, cut in the middle: a message names the
    field first and gives the reason last, the client's value between them."""
    if text is None or len(text) <= MAX_SHOWN:
        return text
    head = MAX_SHOWN // 2
    return text[:head] + "..." + text[len(text) - (MAX_SHOWN - head - 3):]


class APIError(Exception):
    """An error answered as the OpenAI error body with HTTP status ``status`` (its message and
    ``param`` cut to :data:`MAX_SHOWN` characters)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = _cut(message)
        self.code = code
        self.param = _cut(param)
        self.err_type = err_type or TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        """The JSON body ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a response."""
        return JSONResponse(self.body(), status_code=self.status)


def error_bytes(status: int, message: str, code: str | None = None) -> bytes:
    """The JSON body of an error, encoded (for the ASGI middleware, which answers before FastAPI)."""
    return json.dumps(APIError(status, message, code).body()).encode()


def _is_type_tag(part: str) -> bool:
    """Whether a pydantic error location part names a union branch's type (``str``, ``int``,
    ``list[str]``, ``function-after[...]``) rather than a field."""
    return part in TYPE_TAGS or (part.endswith("]") and "[" in part)


def _validation_error(exc: RequestValidationError, content_type: str) -> APIError:
    """A pydantic validation failure as one 400: the first problem, naming its field ("param:
    message", without the "Value error, " pydantic puts before a validator's own message)."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return APIError(400, f"the body is not valid JSON: {detail}", code="invalid_json")
    # a union (str | list) reports one error per branch, its location ending in the branch's type
    # tag ("str", "list[str]"): name the field, not the branch (a field named "stream" is a field)
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(str(p))]
    param = ".".join(loc) or None
    if param is None and first.get("type") == "missing":
        return APIError(400, "the body is empty: send a JSON object", code="invalid_json")
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        # FastAPI reads a body of another Content-Type as a string: say what it must be instead
        sent_as = "" if "json" in content_type.lower() else ", sent as Content-Type: application/json"
        return APIError(400, f"the body must be a JSON object{sent_as}", code="invalid_json")
    msg = "a required field is missing" if first.get("type") == "missing" else first.get("msg", "invalid value")
    if first.get("type") == "value_error":  # a validator's ValueError: pydantic prefixes its message
        msg = msg.removeprefix("Value error, ")
    return APIError(400, f"{param or 'body'}: {msg}", code="invalid_value", param=param)


def install_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc, request.headers.get("content-type", "")).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI's own, when decoding the body failed short of a JSON error
            # json.loads refuses integers of over sys.get_int_max_str_digits() (4,300) digits too
            return APIError(400, "the body could not be decoded as JSON (not UTF-8, nested too deep, or an "
                                 "integer of too many digits)", code="invalid_json").response()
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                            str(exc.detail))
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return APIError(500, f"the server failed: {type(exc).__name__}").response()
