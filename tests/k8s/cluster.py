"""Test-side Kubernetes helpers: write objects as controllers would, follow discovery."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from router.config import WorkerSpec
from router.discovery_k8s import KubernetesDiscovery, KubernetesSettings
from tests.k8s.apiserver import ApiServer

API_VERSION = "discovery.k8s.io/v1beta1"  # what 1.20 serves
SELECTOR = "kubernetes.io/service-name=kvroute-workers"


class Cluster:
    """Writes objects through the real client, as a controller would."""

    def __init__(self, kubeconfig: Path, namespace: str, service: str = "kvroute-workers") -> None:
        from kubernetes import config, dynamic

        self.namespace = namespace
        self.service = service
        client = dynamic.DynamicClient(config.new_client_from_config(config_file=str(kubeconfig)))
        self.client = client
        self.slices = client.resources.get(api_version=API_VERSION, kind="EndpointSlice")
        self.config_maps = client.resources.get(api_version="v1", kind="ConfigMap")
        namespaces = client.resources.get(api_version="v1", kind="Namespace")
        namespaces.create(body={"metadata": {"name": namespace}})

    def put_slice(
        self,
        name: str,
        addresses: dict[str, dict[str, bool]],
        *,
        labels: dict[str, str] | None = None,
        ports: dict[str, int] | None = None,
    ) -> None:
        """Create or replace slice ``name`` of the service, as the controller would: the
        Service's labels (``labels``), its named ports, one endpoint per address."""
        ports = ports or {"http": 8000, "agent": 8100}
        body = {
            "apiVersion": API_VERSION,
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "labels": {
                    **(labels if labels is not None else {"kvroute.io/model": "m"}),
                    "kubernetes.io/service-name": self.service,
                },
            },
            "addressType": "IPv4",
            "ports": [{"name": k, "port": v, "protocol": "TCP"} for k, v in ports.items()],
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
async def following(
    server: ApiServer, namespace: str, selector: str = SELECTOR
) -> AsyncIterator[Follower]:
    settings = KubernetesSettings(
        namespace=namespace,
        label_selector=selector,
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
