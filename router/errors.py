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
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
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
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_OF_STATUS.get(status, "api_error")
        self.headers = headers or {}
        self.close_connection = close_connection  # the request was not read whole

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, param=self.param, code=self.code)

    def response(self) -> web.Response:
        response = web.Response(
            status=self.status,
            body=_encoder.encode(self.body()),
            content_type="application/json",
            headers=self.headers,
        )
        if self.close_connection:
            response.force_close()
        return response


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


def overloaded(retry_after_s: float, *, timed_out: bool = False) -> ApiError:
    seconds = max(1, round(retry_after_s))
    reason = "no worker freed up in time" if timed_out else "the router queue is full"
    return ApiError(
        429,
        f"All workers serving this model are at capacity and {reason}; retry later.",
        code="overloaded",
        headers={"Retry-After": str(seconds)},
    )


def request_timeout(what: str, timeout_s: float) -> ApiError:
    """The client did not send ``what`` within ``timeout_s``; the connection closes."""
    return ApiError(
        408,
        f"The request {what} did not arrive within {timeout_s:g} s.",
        code="request_timeout",
        close_connection=True,
    )


def protocol_error_response(status: int, exc: BaseException | None) -> web.Response:
    """The answer to a request aiohttp's HTTP parser refused (bad head, oversize
    header, unsupported encoding), in OpenAI JSON; the connection closes.

    NOTE: the parser's own message is not echoed: it may quote the client's bytes.
    """
    kind = type(exc).__name__ if exc is not None else "BadHttpMessage"
    if status >= 500:
        message = "Internal router error."
    elif kind == "LineTooLong":
        message = "A request line or header is too long."
    elif kind == "ContentEncodingError":
        message = "The request body's Content-Encoding is not supported or does not decode."
    else:
        message = f"The HTTP request could not be parsed ({kind})."
    return ApiError(status, message, code="bad_http_request", close_connection=True).response()


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
