"""What keeps the server safe by default: loopback binding, the optional API key (constant-time
check) and the body size limit, applied before FastAPI parses anything."""

from __future__ import annotations

import hmac
import ipaddress

OPEN_PATHS = frozenset({"/health"})
"""Paths served without the API key (liveness checks)."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_warning(host: str, api_key: str | None) -> str | None:
    """The warning to print when ``host`` is reachable from other machines, else None."""
    if is_loopback(host):
        return None
    tail = "" if api_key else "; no --api-key is set, so anyone who can reach it can use it"
    return f"serving on {host}, not loopback: other machines can reach this server{tail}"


def key_matches(header: bytes | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (constant-time
    comparison, so that the time taken does not tell how much of a guess was right)."""
    expected = b"Bearer " + api_key.encode()
    return hmac.compare_digest(header or b"", expected)


class Guard:
    """ASGI middleware: 401 without the API key (when set; ``OPEN_PATHS`` excepted), 413 for a body
    over ``max_body_bytes`` (by Content-Length or as it arrives)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope.get("path") not in OPEN_PATHS and not key_matches(
                headers.get(b"authorization"), self.api_key):
            await _reply(send, 401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                         "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _reply(send, 413, self._too_large(), "request_too_large")
            return
        if scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        body, more, total = [], True, 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                await _reply(send, 413, self._too_large(), "request_too_large")
                return
            body.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(body), receive), send)

    def _too_large(self) -> str:
        return f"the request body is larger than the limit of {self.max_body_bytes} bytes (--max-body-bytes)"


def _replay(body: bytes, receive):
    """A ``receive`` that gives ``body`` once, then what the connection says (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(send, status: int, message: str, code: str, extra_headers=()) -> None:
    # imported here: .errors imports FastAPI, which ``edgesync serve`` imports while its workers
    # load, after ``bind_warning``
    from edgesync_engines.server.errors import error_bytes

    body = error_bytes(status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body})
