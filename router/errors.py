"""OpenAI-format errors: ``{"error": {"message", "type", "param", "code"}}``.

Every error the router answers goes through here, so clients (the ``openai`` package
among them) always get a body they can parse. Handlers raise ``ApiError``; the
middleware turns it, aiohttp's own HTTP errors (404 route, 405, 413 body too large)
and any unexpected exception into that JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

log = logging.getLogger(__name__)

# HTTP status -> OpenAI error "type"
_TYPE_OF_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    """An error answered to the client with ``status`` and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_OF_STATUS.get(status, "api_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, param=self.param, code=self.code)

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=_encoder.encode(self.body()),
            content_type="application/json",
            headers=self.headers,
        )


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def sse_error_event(
    message: str, error_type: str = "upstream_error", code: str | None = None
) -> bytes:
    """An SSE event carrying an error; the ``openai`` client raises ``APIError`` on it."""
    return b"data: " + _encoder.encode(error_body(message, error_type, code=code)) + b"\n\n"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or is not served by any worker.",
        param="model",
        code="model_not_found",
    )


def overloaded(retry_after_s: float) -> ApiError:
    seconds = max(1, round(retry_after_s))
    return ApiError(
        429,
        "All workers are at capacity and the router queue is full; retry later.",
        code="overloaded",
        headers={"Retry-After": str(seconds)},
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render every failure as OpenAI error JSON; never let a traceback reach a client."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text or exc.reason
        if exc.status == 413:
            message = f"Request body too large: {exc.text or exc.reason}"
        return ApiError(exc.status, message, headers=_passthrough_headers(exc)).response()
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "Internal router error.").response()


def _passthrough_headers(exc: web.HTTPException) -> dict[str, str]:
    return {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
