"""Kubernetes discovery against a real kube-apiserver (1.20, EndpointSlices v1beta1).

The tests create, change and delete EndpointSlices as the EndpointSlice controller would,
and check that ``KubernetesDiscovery`` follows within a deadline, also across an API
server restart (the last list stands meanwhile) and a watch expiry (410 Gone: relist).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from router.config import WorkerSpec
from router.discovery_k8s import KubernetesDiscovery, KubernetesSettings
from tests.k8s.apiserver import ApiServer, ApiServerUnavailable, ensure_kube_apiserver
from tests.polling import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

API_VERSION = "discovery.k8s.io/v1beta1"  # what 1.20 serves
SELECTOR = "kubernetes.io/service-name=kvroute-workers"


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    try:
        binary = ensure_kube_apiserver()
    except ApiServerUnavailable as exc:
        pytest.skip(str(exc))
    server = ApiServer(binary, tmp_path_factory.mktemp("apiserver"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Cluster:
    """Writes objects through the real client, as a controller would."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        from kubernetes import config, dynamic

        self.namespace = namespace
        client = dynamic.DynamicClient(config.new_client_from_config(config_file=str(kubeconfig)))
        self.slices = client.resources.get(api_version=API_VERSION, kind="EndpointSlice")
        self.config_maps = client.resources.get(api_version="v1", kind="ConfigMap")
        namespaces = client.resources.get(api_version="v1", kind="Namespace")
        namespaces.create(body={"metadata": {"name": namespace}})

    def put_slice(self, name: str, addresses: dict[str, dict[str, bool]]) -> None:
        body = {
            "apiVersion": API_VERSION,
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/service-name": "kvroute-workers",
                    "kvroute.io/model": "m",
                },
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000}, {"name": "agent", "port": 8100}],
            "endpoints": [
                {
                    "addresses": [ip],
                    "conditions": conditions,
                    "targetRef": {"kind": "Pod", "name": f"pod-{ip}"},
                }
                for ip, conditions in addresses.items()
            ],
        }
        try:
            self.slices.replace(body=body, namespace=self.namespace, name=name)
        except Exception:  # not there yet
            self.slices.create(body=body, namespace=self.namespace)

    def delete_slice(self, name: str) -> None:
        self.slices.delete(namespace=self.namespace, name=name)

    def churn(self, num_objects: int) -> None:
        """Writes that the discovery's selector does not see: they move etcd's revision."""
        for i in range(num_objects):
            self.config_maps.create(
                body={"metadata": {"name": f"churn-{i}"}, "data": {"i": str(i)}},
                namespace=self.namespace,
            )


class Follower:
    """Runs ``KubernetesDiscovery.watch()`` and keeps every list it yields."""

    def __init__(self, discovery: KubernetesDiscovery) -> None:
        self.discovery = discovery
        self.lists: list[list[WorkerSpec]] = []

    @property
    def ids(self) -> list[str]:
        return [w.worker_id for w in self.lists[-1]] if self.lists else []

    async def run(self) -> None:
        async for workers in self.discovery.watch():
            self.lists.append(workers)


@contextlib.asynccontextmanager
async def following(server: ApiServer, namespace: str) -> AsyncIterator[Follower]:
    settings = KubernetesSettings(
        namespace=namespace,
        label_selector=SELECTOR,
        api_version=API_VERSION,
        kubeconfig=str(server.kubeconfig),
        watch_timeout_s=5,
        max_backoff_s=1.0,
    )
    follower = Follower(KubernetesDiscovery(settings))
    task = asyncio.create_task(follower.run())
    try:
        yield follower
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


def test_fleet_follows_slices_created_changed_and_deleted(apiserver: ApiServer) -> None:
    async def scenario() -> None:
        cluster = await in_thread(Cluster, apiserver.kubeconfig, "follow")
        async with following(apiserver, "follow") as follower:
            await wait_until(lambda: follower.lists == [[]], 20, "the first (empty) list")
            await in_thread(cluster.put_slice, "a", {"10.9.0.1": {"ready": True}})
            await wait_until(lambda: follower.ids == ["pod-10.9.0.1"], 10, "one worker")
            ready2 = {"10.9.0.1": {"ready": True}, "10.9.0.2": {"ready": True}}
            await in_thread(cluster.put_slice, "a", ready2)
            await wait_until(lambda: len(follower.ids) == 2, 10, "two workers")
            assert follower.lists[-1][0].labels == (("model", "m"),)
            await in_thread(
                cluster.put_slice,
                "a",
                {"10.9.0.1": {"ready": True}, "10.9.0.2": {"ready": True, "terminating": True}},
            )
            await wait_until(lambda: follower.ids == ["pod-10.9.0.1"], 10, "terminating leaves")
            await in_thread(cluster.delete_slice, "a")
            await wait_until(lambda: follower.ids == [], 10, "deleted slice leaves")

    asyncio.run(scenario())


def test_an_api_server_restart_keeps_the_fleet_and_the_watch_resumes(apiserver: ApiServer) -> None:
    async def scenario() -> None:
        cluster = await in_thread(Cluster, apiserver.kubeconfig, "restart")
        await in_thread(cluster.put_slice, "a", {"10.9.1.1": {"ready": True}})
        async with following(apiserver, "restart") as follower:
            await wait_until(lambda: follower.ids == ["pod-10.9.1.1"], 20, "the worker")
            num_lists = len(follower.lists)
            await in_thread(apiserver.stop_apiserver)
            errors_before = follower.discovery.stats.errors
            await wait_until(
                lambda: follower.discovery.stats.errors > errors_before, 20, "a failed call"
            )
            assert len(follower.lists) == num_lists  # nothing yielded, the fleet stands
            await in_thread(apiserver.start_apiserver)
            await in_thread(cluster.put_slice, "a", {"10.9.1.2": {"ready": True}})
            await wait_until(lambda: follower.ids == ["pod-10.9.1.2"], 30, "change after restart")
            assert all(follower.lists), "the fleet was never emptied"

    asyncio.run(scenario())


def test_an_expired_watch_relists(apiserver: ApiServer) -> None:
    async def scenario() -> None:
        cluster = await in_thread(Cluster, apiserver.kubeconfig, "expiry")
        await in_thread(cluster.put_slice, "a", {"10.9.2.1": {"ready": True}})
        async with following(apiserver, "expiry") as follower:
            await wait_until(lambda: follower.ids == ["pod-10.9.2.1"], 20, "the worker")
            lists_before = follower.discovery.stats.lists
            # The follower's resourceVersion is its slice's; unseen writes move etcd on,
            # compaction drops the history, and after a restart the resumed watch is 410.
            await in_thread(cluster.churn, 20)
            await in_thread(apiserver.compact_etcd)
            await in_thread(apiserver.stop_apiserver)
            await in_thread(apiserver.start_apiserver)
            await wait_until(lambda: follower.discovery.stats.expired >= 1, 30, "a 410")
            await wait_until(lambda: follower.discovery.stats.lists > lists_before, 30, "a relist")
            await in_thread(cluster.put_slice, "a", {"10.9.2.2": {"ready": True}})
            await wait_until(lambda: follower.ids == ["pod-10.9.2.2"], 20, "change after relist")

    asyncio.run(scenario())
