"""The rendered chart against a real API server (1.20): server-side dry-run of every object
whose API 1.20 serves, and the rendered router config discovering the rendered worker
Service's EndpointSlices."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from router.config import load_config
from router.discovery import discovery_from_config
from tests.charts.chart import find, render
from tests.k8s.apiserver import ApiServer
from tests.k8s.cluster import API_VERSION, Cluster
from tests.polling import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

# APIs newer than 1.20 (policy/v1 since 1.21, autoscaling/v2 since 1.23) and CRDs.
NOT_IN_1_20 = {("policy/v1", "PodDisruptionBudget"), ("autoscaling/v2", "HorizontalPodAutoscaler")}
ON_1_20 = {"discovery": {"endpointSliceApi": API_VERSION}}


def test_server_side_dry_run_accepts_the_rendered_chart(apiserver: ApiServer) -> None:
    cluster = Cluster(apiserver.kubeconfig, "dryrun")
    objects = render(ON_1_20, namespace="dryrun")
    checked = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in NOT_IN_1_20:
            continue
        resource = cluster.client.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        resource.create(body=obj, namespace="dryrun", dry_run="All")
        checked.append(obj["kind"])
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "Role",
            "RoleBinding", "ServiceAccount"} <= set(checked)  # fmt: skip


def test_the_rendered_router_config_discovers_the_rendered_worker_slices(
    apiserver: ApiServer, tmp_path: Path
) -> None:
    objects = render(ON_1_20, namespace="chartns")
    service = find(objects, "Service", "-workers")
    cluster = Cluster(apiserver.kubeconfig, "chartns", service=service["metadata"]["name"])
    services = cluster.client.resources.get(api_version="v1", kind="Service")
    services.create(body=service, namespace="chartns")
    # What the EndpointSlice controller would write for two ready worker pods.
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    ready = {"10.8.0.1": {"ready": True}, "10.8.0.2": {"ready": True}}
    cluster.put_slice("workers-abc", ready, labels=service["metadata"]["labels"], ports=ports)
    router_yaml = tmp_path / "router.yaml"
    router_yaml.write_text(find(objects, "ConfigMap", "-router")["data"]["router.yaml"])
    env = {"KVROUTE_K8S_KUBECONFIG": str(apiserver.kubeconfig), "KVROUTE_K8S_NAMESPACE": "chartns"}
    config = load_config(None, env, router_yaml)
    seen: list[list[Any]] = []

    async def follow() -> None:
        async def collect() -> None:
            async for workers in discovery_from_config(config).watch():
                seen.append(workers)

        task = asyncio.create_task(collect())
        try:
            await wait_until(lambda: bool(seen) and len(seen[-1]) == 2, 20, "two workers")
        finally:
            task.cancel()

    asyncio.run(follow())
    assert [w.url for w in seen[-1]] == [f"http://10.8.0.{i}:{ports['http']}" for i in (1, 2)]
    assert [w.agent_url for w in seen[-1]] == [
        f"http://10.8.0.{i}:{ports['agent']}" for i in (1, 2)
    ]
    assert ("gpu-kind", "H100") in seen[-1][0].labels
