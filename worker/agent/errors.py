"""Errors the agent returns, in OpenAI's error JSON (``{"error": {...}}``)."""

from __future__ import annotations

import json

from aiohttp import web

_EXCEPTION_BY_STATUS: dict[int, type[web.HTTPException]] = {
    400: web.HTTPBadRequest,
    401: web.HTTPUnauthorized,
    404: web.HTTPNotFound,
    503: web.HTTPServiceUnavailable,
}


def openai_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> web.HTTPException:
    """An HTTP exception whose body is ``{"error": {"message", "type", "param", "code"}}``."""
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": param,
            "code": code,
        }
    }
    exception_class = _EXCEPTION_BY_STATUS.get(status, web.HTTPInternalServerError)
    return exception_class(text=json.dumps(body), content_type="application/json")
