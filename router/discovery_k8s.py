"""Workers from Kubernetes EndpointSlices, followed with a list + watch.

``KubernetesDiscovery.watch()`` yields the complete worker list on every change, like the
other discovery sources. A worker is one ready address of an EndpointSlice of the worker
Service (selected by ``label_selector``); the slice's named ports say where its engine
(``http``, or ``https`` for TLS) and its KV agent (``agent``) listen. (The engine's event
publisher, port ``kv-events``, is found from the engine's own ``/kv_event_sources`` when a
worker has no agent.)

Rules (pure, in ``workers_from_slice``):

- an endpoint joins when ``conditions.ready`` is not false and ``terminating`` is not
  true; a terminating or removed endpoint leaves (the fleet then drops its index blocks);
- its worker id is its Pod's name (``targetRef.name``), else its address;
- the slice's labels under ``kvroute.io/`` (model, GPU kind, ...) become the worker's
  labels; ``discovery.k8s.io/v1`` and ``v1beta1`` slices are read alike;
- ``kvroute.io/data-parallel-size: K`` makes each endpoint K routing targets, one per
  rank, followed on the engine's per-rank ZMQ sockets (the agent port is not used).

Resilience (``_SliceFollower``, run in one thread because the client is blocking):

- a watch that ends (server timeout) resumes from the last resourceVersion;
- ``410 Gone`` (the version was compacted away) relists;
- any other error (API server restarting, timeouts, 429 throttling) retries with
  exponential backoff up to ``max_backoff_s``; meanwhile the last list stands.

NOTE: the API server being away never empties the fleet: only a successful list or a
DELETED event removes workers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from router.config import WorkerSpec

log = logging.getLogger(__name__)

LABEL_PREFIX = "kvroute.io/"
# an engine with this many data-parallel ranks (vLLM --data-parallel-size): one routing
# target per rank, its events read from the engine's per-rank sockets (not an agent)
DATA_PARALLEL_SIZE_LABEL = LABEL_PREFIX + "data-parallel-size"
MAX_DATA_PARALLEL_SIZE = 64
PORT_HTTP = "http"
PORT_HTTPS = "https"  # an engine serving TLS names its port https instead
PORT_AGENT = "agent"
INITIAL_BACKOFF_S = 0.5  # after a failed call; doubles up to max_backoff_s


@dataclass(frozen=True, slots=True)
class KubernetesSettings:
    namespace: str
    label_selector: str
    api_version: str = "discovery.k8s.io/v1"
    kubeconfig: str | None = None  # None: the in-cluster service account
    watch_timeout_s: int = 60
    max_backoff_s: float = 30.0


def workers_from_slice(slice_object: Mapping[str, Any]) -> list[WorkerSpec]:
    """The routable workers of one EndpointSlice (a plain dict, as the API returns it)."""
    ports = {p.get("name"): p.get("port") for p in slice_object.get("ports") or []}
    scheme, http_port = "http", ports.get(PORT_HTTP)
    if not isinstance(http_port, int) and isinstance(ports.get(PORT_HTTPS), int):
        scheme, http_port = "https", ports[PORT_HTTPS]
    agent_port = ports.get(PORT_AGENT)
    if not isinstance(http_port, int):
        return []
    metadata = slice_object.get("metadata") or {}
    labels = tuple(
        sorted(
            (key.removeprefix(LABEL_PREFIX), str(value))
            for key, value in (metadata.get("labels") or {}).items()
            if key.startswith(LABEL_PREFIX)
        )
    )
    data_parallel_size = _data_parallel_size(metadata.get("labels") or {})
    if data_parallel_size > 1:
        agent_port = None  # its ranks are followed on the engine's own sockets
    workers = []
    for endpoint in slice_object.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        target = endpoint.get("targetRef") or {}
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            name = target.get("name") if len(endpoint["addresses"]) == 1 else None
            agent_url = f"http://{host}:{agent_port}" if isinstance(agent_port, int) else None
            workers.append(
                WorkerSpec(
                    url=f"{scheme}://{host}:{http_port}",
                    agent_url=agent_url,
                    worker_id=str(name or address),
                    labels=labels,
                    data_parallel_size=data_parallel_size,
                )
            )
    return workers


def _data_parallel_size(labels: Mapping[str, Any]) -> int:
    """The slice's ``kvroute.io/data-parallel-size`` (1 when absent or not a count)."""
    value = str(labels.get(DATA_PARALLEL_SIZE_LABEL, "1"))
    return int(value) if value.isdigit() and 1 <= int(value) <= MAX_DATA_PARALLEL_SIZE else 1


class SliceSet:
    """The slices seen so far: slice name -> its workers. ``workers()`` is their union,
    sorted by worker id, one spec per id (the first slice in name order wins)."""

    def __init__(self) -> None:
        self._name_to_workers: dict[str, list[WorkerSpec]] = {}

    def replace_all(self, slices: list[Mapping[str, Any]]) -> None:
        self._name_to_workers = {_name_of(s): workers_from_slice(s) for s in slices}

    def apply(self, event_type: str, slice_object: Mapping[str, Any]) -> None:
        if event_type == "DELETED":
            self._name_to_workers.pop(_name_of(slice_object), None)
        elif event_type in ("ADDED", "MODIFIED"):
            self._name_to_workers[_name_of(slice_object)] = workers_from_slice(slice_object)

    def workers(self) -> list[WorkerSpec]:
        id_to_spec: dict[str, WorkerSpec] = {}
        for name in sorted(self._name_to_workers):
            for spec in self._name_to_workers[name]:
                id_to_spec.setdefault(spec.worker_id, spec)
        return [id_to_spec[worker_id] for worker_id in sorted(id_to_spec)]


def _name_of(slice_object: Mapping[str, Any]) -> str:
    return str((slice_object.get("metadata") or {}).get("name", ""))


@dataclass(slots=True)
class FollowerStats:
    """Counts since start, written by the follower thread (single writer)."""

    lists: int = 0  # successful full lists (the first one, then each relist)
    expired: int = 0  # watches that ended in 410 Gone
    errors: int = 0  # failed calls, each followed by a backoff


class KubernetesDiscovery:
    """A ``Discovery`` over EndpointSlices; the blocking client runs in a daemon thread."""

    def __init__(self, settings: KubernetesSettings) -> None:
        self._settings = settings
        self.stats = FollowerStats()

    async def watch(self) -> AsyncIterator[list[WorkerSpec]]:
        loop = asyncio.get_running_loop()
        latest: list[list[WorkerSpec]] = []
        changed = asyncio.Event()

        def publish(workers: list[WorkerSpec]) -> None:
            # Only the newest list matters: the slot holds one, so memory stays bounded.
            def deliver() -> None:
                latest[:] = [workers]
                changed.set()

            loop.call_soon_threadsafe(deliver)

        stop = threading.Event()
        follower = _SliceFollower(self._settings, publish, stop, self.stats)
        thread = threading.Thread(target=follower.run, name="k8s-discovery", daemon=True)
        thread.start()
        last: list[WorkerSpec] | None = None
        try:
            while True:
                await changed.wait()
                changed.clear()
                workers = latest[0]
                if workers != last:
                    last = workers
                    yield workers
        finally:
            stop.set()


class _SliceFollower:
    """List, then watch from the list's resourceVersion; relist on 410; back off on errors."""

    def __init__(
        self,
        settings: KubernetesSettings,
        publish: Callable[[list[WorkerSpec]], None],
        stop: threading.Event,
        stats: FollowerStats,
    ) -> None:
        self._settings = settings
        self._publish = publish
        self._stop = stop
        self._stats = stats
        self._slices = SliceSet()
        self._version = ""  # the newest resourceVersion seen, where a resumed watch starts
        self._backoff_s = INITIAL_BACKOFF_S

    def run(self) -> None:
        """List once; then watch, resuming from the last seen resourceVersion after any
        failure (as client-go's reflector does); relist only when that version is gone."""
        resource = None
        version: str | None = None
        while not self._stop.is_set():
            try:
                if resource is None:
                    resource = self._resource()
                if version is None:
                    version = self._list(resource)
                    self._backoff_s = INITIAL_BACKOFF_S
                self._follow(resource, version)
            except _Gone:
                self._stats.expired += 1
                version = None
                log.info("EndpointSlice watch expired (410 Gone); relisting")
            except Exception as exc:  # any API failure: back off, keep the last list
                self._stats.errors += 1
                if version is not None:
                    version = self._version
                log.warning(
                    "Kubernetes discovery: %s; retrying in %.1f s", _short(exc), self._backoff_s
                )
                self._stop.wait(self._backoff_s)
                self._backoff_s = min(self._backoff_s * 2, self._settings.max_backoff_s)

    def _resource(self) -> Any:
        from kubernetes import config, dynamic
        from kubernetes.client import ApiClient

        # The kubernetes package has no type hints.
        if self._settings.kubeconfig:
            api_client = config.new_client_from_config(  # type: ignore[no-untyped-call]
                config_file=self._settings.kubeconfig
            )
        else:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            api_client = ApiClient()
        client = dynamic.DynamicClient(api_client)  # type: ignore[no-untyped-call]
        return client.resources.get(api_version=self._settings.api_version, kind="EndpointSlice")

    def _list(self, resource: Any) -> str:
        listing = resource.get(
            namespace=self._settings.namespace, label_selector=self._settings.label_selector
        ).to_dict()
        self._slices.replace_all(listing.get("items") or [])
        self._stats.lists += 1
        self._publish(self._slices.workers())
        self._version = str(listing["metadata"]["resourceVersion"])
        return self._version

    def _follow(self, resource: Any, version: str) -> None:
        """Watch until the stop flag; each server-side timeout resumes from ``version``."""
        from kubernetes.client.exceptions import ApiException

        while not self._stop.is_set():
            try:
                stream = resource.watch(
                    namespace=self._settings.namespace,
                    label_selector=self._settings.label_selector,
                    resource_version=version,
                    timeout=self._settings.watch_timeout_s,
                )
                for event in stream:
                    version = self._apply(event, version)
                    self._version = version
                    self._backoff_s = INITIAL_BACKOFF_S  # the server answers again
                    if self._stop.is_set():
                        return
            except ApiException as exc:
                if exc.status == 410:
                    raise _Gone from exc
                raise

    def _apply(self, event: Mapping[str, Any], version: str) -> str:
        raw = event.get("raw_object") or {}
        if event.get("type") == "ERROR":
            if raw.get("code") == 410:
                raise _Gone
            raise RuntimeError(f"watch error: {raw.get('message', raw)}")
        if event.get("type") == "BOOKMARK":
            return str((raw.get("metadata") or {}).get("resourceVersion", version))
        self._slices.apply(str(event.get("type")), raw)
        self._publish(self._slices.workers())
        return str((raw.get("metadata") or {}).get("resourceVersion", version))


class _Gone(Exception):
    """The watched resourceVersion is too old (410): list again."""


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 300 else text[:300] + "..."
