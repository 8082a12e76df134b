"""Plain ASGI middleware of the server: the API key and the body-size limit, and the error
object every status shares.

Plain ASGI rather than Starlette's @app.middleware("http") (BaseHTTPMiddleware): that relays
every chunk of a streamed response through a task and a memory stream of its own, a cost
paid per token per request.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

# What a request body may hold by default: a prompt of the longest contexts served (a
# million tokens is ~4 MB of text) with room to spare, and far below what would let one
# request grow the server by gigabytes.
MAX_BODY_BYTES = 8 * 1024 * 1024

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 499: "client_closed_request",
               500: "server_error", 503: "service_unavailable"}


def error_response(status: int, message: str, kind: str | None = None, param: str | None = None) -> JSONResponse:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    kind = kind or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


class ApiKeyMiddleware:
    """401 on /v1 routes without 'Authorization: Bearer <api_key>'."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if dict(scope["headers"]).get(b"authorization", b"") != self._expected:
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over max_body_bytes, before any of it is parsed or reaches the engine.

    A declared Content-Length is checked up front (the body is never read); a chunked body
    is read up to the limit and replayed to the app.
    """

    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self, size: str) -> JSONResponse:
        return error_response(413, f"the request body is {size}; this server accepts at most {self.max_body_bytes} "
                                   "bytes (serve --max-request-bytes)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await error_response(400, "Content-Length is not a number")(scope, receive, send)
            elif int(length) > self.max_body_bytes:
                await self._too_large(f"{int(length)} bytes")(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        if b"chunked" not in headers.get(b"transfer-encoding", b""):
            await self.app(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # a disconnect
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await self._too_large(f"over {self.max_body_bytes} bytes")(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
