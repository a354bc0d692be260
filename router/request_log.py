"""One log line per request, and the per-request record the proxy's hooks fill.

``RequestRecord`` travels with the aiohttp request (``REQUEST_RECORD``) from the first
byte to the answer: the proxy sets the model and tenant once parsed, the times of
tokenization and admission, and every upstream ``Attempt``; at the end
``request_fields`` turns it into the line's fields:

    request_id, kind, tenant, model, worker, status, attempts, stream, prompt_tokens,
    cached_tokens, predicted_cached_tokens, ttft_s, duration_s

Never prompt text, nor any other body field: the log carries ids, names and numbers.
Lines go to the ``kvroute.requests`` logger at INFO: ``key=value`` text, or one JSON
object per line with ``log_format=json`` (``configure_logging``, which renders every
record of the process as JSON then, so the stream stays one JSON object per line).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from router.tracing import RequestTrace
    from router.upstream import Attempt

REQUEST_LOGGER = "kvroute.requests"
REQUEST_ID_HEADER = "x-request-id"
LOG_FORMATS = ("text", "json")
_MAX_CLIENT_ID_CHARS = 128
# NOTE: a process prefix and a counter, not uuid4 per request (a syscall for 16 random
# bytes): ids are unique per router process and cheap; the client's id wins when sent.
_ID_PREFIX = os.urandom(4).hex()
_ID_COUNTER = itertools.count(1)

log = logging.getLogger(REQUEST_LOGGER)


@dataclass(slots=True)
class RequestRecord:
    """What the router learnt about one request; filled by the proxy's hooks."""

    request_id: str
    kind: str
    started: float = field(default_factory=time.perf_counter)
    tenant: str | None = None
    model: str | None = None
    tokenize_ns: tuple[int, int] | None = None  # wall-clock ns (span times)
    admission_ns: tuple[int, int] | None = None
    attempts: list[Attempt] = field(default_factory=list)
    trace: RequestTrace | None = None

    @classmethod
    def start(cls, request: web.Request, kind: str) -> RequestRecord:
        return cls(request_id=request_id_of(request), kind=kind)

    def final_status(self, handler_status: int | None) -> int | None:
        """The status the client got: the last attempt's (it may end a stream with an
        error after a 200), else the handler's."""
        if self.attempts and self.attempts[-1].status is not None:
            return self.attempts[-1].status
        return handler_status


REQUEST_RECORD = web.RequestKey("kvroute_request_record", RequestRecord)


def request_id_of(request: web.Request) -> str:
    """The client's ``x-request-id`` (printable, bounded), else a new one."""
    sent = request.headers.get(REQUEST_ID_HEADER)
    if sent and len(sent) <= _MAX_CLIENT_ID_CHARS and sent.isprintable():
        return sent
    return f"{_ID_PREFIX}-{next(_ID_COUNTER)}"


def request_fields(record: RequestRecord, status: int | None) -> dict[str, Any]:
    """The log line's fields (see the module docstring); no prompt content."""
    attempt = record.attempts[-1] if record.attempts else None
    decision = attempt.decision if attempt is not None else None
    return {
        "request_id": record.request_id,
        "kind": record.kind,
        "tenant": record.tenant,
        "model": record.model,
        "worker": str(decision.worker_id) if decision is not None else None,
        "status": record.final_status(status),
        "attempts": len(record.attempts),
        "stream": attempt.stream if attempt is not None else None,
        "prompt_tokens": _prompt_tokens(attempt),
        "cached_tokens": attempt.cached_tokens if attempt is not None else None,
        "predicted_cached_tokens": decision.predicted_cached_tokens if decision else None,
        "ttft_s": _rounded(attempt.ttft_s if attempt is not None else None),
        "duration_s": _rounded(time.perf_counter() - record.started),
    }


def log_request(record: RequestRecord, status: int | None) -> None:
    """Write the request's line (INFO on ``kvroute.requests``), if that level is on."""
    if not log.isEnabledFor(logging.INFO):
        return
    fields = request_fields(record, status)
    log.info("request %s", _KeyValues(fields), extra={"kvroute": fields})


class _KeyValues:
    """``key=value ...`` of the fields, built only if a text formatter asks for it."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return " ".join(f"{key}={_text(value)}" for key, value in self.fields.items())


class JsonFormatter(logging.Formatter):
    """Every record as one JSON object: time, level, logger, message, and the
    structured fields of ``extra={"kvroute": {...}}`` at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "kvroute", None)
        if isinstance(fields, dict):
            data["message"] = "request"
            data.update(fields)
        else:
            data["message"] = record.getMessage()
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, separators=(",", ":"), default=str)


def configure_logging(level: str, log_format: str) -> None:
    """The process's logging: ``text`` (human lines) or ``json`` (one object a line)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _prompt_tokens(attempt: Attempt | None) -> int | None:
    if attempt is None:
        return None
    return attempt.prompt_tokens or attempt.decision.num_prompt_tokens


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    return json.dumps(text) if (" " in text or '"' in text or "=" in text) else text
