"""API keys the router presents to workers (vLLM ``--api-key``), as ``Authorization``.

Where a worker's key comes from, first match wins: its spec's ``api_key_file=PATH``;
the router's ``worker_api_key_file`` (e.g. a mounted Kubernetes Secret); the router's
``worker_api_key`` (best from the ``KVROUTE_WORKER_API_KEY`` env var). None of them: no
``Authorization`` header.

A key file is read at startup (a missing or unusable file is a configuration error
then) and re-read when it changes, checked at most every ``_RECHECK_S`` seconds, so a
rotated Secret is picked up without a restart.

Invariants: a key never appears in a log line, an error message or a ``repr``; a key
is printable ASCII without spaces (so the header line it makes is well formed).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
from aiohttp import ClientHandlerType, ClientMiddlewareType, ClientRequest, ClientResponse

from router.config import RouterConfig, WorkerSpec

log = logging.getLogger(__name__)

_RECHECK_S = 5.0
_MAX_KEY_CHARS = 4096


@dataclass(slots=True)
class _KeyFile:
    path: str
    line: bytes = b""  # b"Authorization: Bearer <key>\r\n"
    mtime_ns: int = -1
    checked_at: float = 0.0

    def __repr__(self) -> str:
        return f"_KeyFile({self.path!r})"


class WorkerCredentials:
    """Worker spec -> its ``Authorization`` header line (b"" when it has no key)."""

    def __init__(self, config: RouterConfig) -> None:
        self._default_line = b""
        if config.worker_api_key:
            self._default_line = _header_line(_checked(config.worker_api_key, "worker_api_key"))
        self._default_file = config.worker_api_key_file
        self._path_to_file: dict[str, _KeyFile] = {}
        for path in [config.worker_api_key_file, *(w.api_key_file for w in config.workers)]:
            if path:
                self._load(self._file(path), strict=True)

    def __repr__(self) -> str:
        return f"WorkerCredentials(files={sorted(self._path_to_file)})"

    def authorization_line(self, spec: WorkerSpec | None) -> bytes:
        """The header line for a request to this worker (b"": send none)."""
        path = (spec.api_key_file if spec is not None else None) or self._default_file
        if path is None:
            return self._default_line
        key_file = self._file(path)
        now = time.monotonic()
        if now - key_file.checked_at >= _RECHECK_S:
            self._load(key_file, strict=False)
        return key_file.line

    def client_middleware(
        self, worker_specs: Callable[[], Iterable[WorkerSpec]]
    ) -> ClientMiddlewareType:
        """An aiohttp client middleware that adds the key to the router's own requests to
        a worker (health, ``/v1/models``, metrics), unless they carry ``Authorization``."""

        async def add_worker_key(
            request: ClientRequest, handler: ClientHandlerType
        ) -> ClientResponse:
            if aiohttp.hdrs.AUTHORIZATION not in request.headers:
                origin = str(request.url.origin())
                spec = next((s for s in worker_specs() if s.url.startswith(origin)), None)
                if spec is not None:
                    line = self.authorization_line(spec)
                    if line:
                        value = line.decode().partition(": ")[2].rstrip()
                        request.headers[aiohttp.hdrs.AUTHORIZATION] = value
            return await handler(request)

        return add_worker_key

    # --- internal -----------------------------------------------------------------------

    def _file(self, path: str) -> _KeyFile:
        key_file = self._path_to_file.get(path)
        if key_file is None:
            key_file = self._path_to_file[path] = _KeyFile(path)
        return key_file

    def _load(self, key_file: _KeyFile, *, strict: bool) -> None:
        """(Re)read ``key_file`` if it changed; ``strict``: raise ``ValueError`` on a
        problem (startup), else keep the last key and log the problem (not the key)."""
        key_file.checked_at = time.monotonic()
        try:
            mtime_ns = os.stat(key_file.path).st_mtime_ns
            if mtime_ns == key_file.mtime_ns:
                return
            with open(key_file.path, encoding="ascii") as f:
                key = _checked(f.read(_MAX_KEY_CHARS + 1).strip(), key_file.path)
        except (OSError, ValueError) as exc:
            message = f"worker API key file {key_file.path}: {type(exc).__name__}"
            if strict:
                raise ValueError(message) from None
            log.warning("%s; keeping the last key", message)
            return
        key_file.mtime_ns = mtime_ns
        key_file.line = _header_line(key)


def _checked(key: str, source: str) -> str:
    if not key or len(key) > _MAX_KEY_CHARS or not all("!" <= c <= "~" for c in key):
        raise ValueError(f"the API key from {source} is empty or not printable ASCII")
    return key


def _header_line(key: str) -> bytes:
    return b"Authorization: Bearer %s\r\n" % key.encode("ascii")
