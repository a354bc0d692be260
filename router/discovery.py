"""Where workers come from: a static list or a file, behind one ``Discovery`` interface.

A discovery source yields the *complete* current worker list every time it changes; the
fleet diffs it against what it has (add new, drop gone). Kubernetes EndpointSlices plug
in behind the same interface (``router.discovery_k8s``, chosen by ``--k8s-label-selector``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from router.config import RouterConfig, WorkerSpec, parse_workers

log = logging.getLogger(__name__)


class Discovery(Protocol):
    """A source of worker lists. ``watch()`` yields the full list on each change."""

    def watch(self) -> AsyncIterator[list[WorkerSpec]]: ...


class StaticDiscovery:
    """A fixed list (``--worker`` flags): yields once, then stays quiet."""

    def __init__(self, workers: Sequence[WorkerSpec]) -> None:
        self._workers = list(workers)

    async def watch(self) -> AsyncIterator[list[WorkerSpec]]:
        yield list(self._workers)
        await asyncio.Event().wait()  # never changes; cancelled at shutdown


class FileDiscovery:
    """A YAML/JSON file holding a list of workers (or ``{workers: [...]}``), polled.

    NOTE: polling the mtime (every ``interval_s``) is portable and cheap; a file that
    fails to parse keeps the last good list (logged), so a half-written file never
    empties the fleet.
    """

    def __init__(self, path: Path, interval_s: float, extra: Sequence[WorkerSpec] = ()) -> None:
        self._path = path
        self._interval_s = interval_s
        self._extra = list(extra)

    async def watch(self) -> AsyncIterator[list[WorkerSpec]]:
        last_stamp: tuple[int, int] | None = None
        last_list: list[WorkerSpec] | None = None
        while True:
            stamp = self._stamp()
            if stamp != last_stamp:
                last_stamp = stamp
                workers = self._read()
                if workers is not None and workers != last_list:
                    last_list = workers
                    yield self._extra + workers
            await asyncio.sleep(self._interval_s)

    def _stamp(self) -> tuple[int, int]:
        try:
            st = self._path.stat()
        except OSError:
            return (-1, -1)
        return (st.st_mtime_ns, st.st_size)

    def _read(self) -> list[WorkerSpec] | None:
        try:
            return read_workers_file(self._path)
        except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as exc:
            log.warning("workers file %s unreadable, keeping the last list: %s", self._path, exc)
            return None


def read_workers_file(path: Path) -> list[WorkerSpec]:
    text = path.read_text()
    data: Any = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if isinstance(data, dict):
        data = data.get("workers", [])
    if data is None:
        return []
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of workers")
    return parse_workers(data)


def discovery_from_config(config: RouterConfig) -> Discovery:
    if config.k8s_label_selector:
        from router.discovery_k8s import KubernetesDiscovery, KubernetesSettings

        return KubernetesDiscovery(
            KubernetesSettings(
                namespace=config.k8s_namespace or _pod_namespace(),
                label_selector=config.k8s_label_selector,
                api_version=config.k8s_endpointslice_api,
                kubeconfig=config.k8s_kubeconfig,
            )
        )
    if config.workers_file:
        return FileDiscovery(
            Path(config.workers_file), config.discovery_interval_s, extra=config.workers
        )
    return StaticDiscovery(config.workers)


_POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _pod_namespace() -> str:
    """The namespace the router's pod runs in (its service account says), else default."""
    try:
        return _POD_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"
