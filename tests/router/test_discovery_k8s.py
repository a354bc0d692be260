"""EndpointSlice -> workers, the pure part of Kubernetes discovery (v1 and v1beta1 shapes)."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import WorkerSpec
from router.discovery_k8s import SliceSet, workers_from_slice


def slice_of(
    name: str,
    endpoints: list[dict[str, Any]],
    *,
    ports: dict[str, int] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    ports = {"http": 8000, "agent": 8100, "kv-events": 5557} if ports is None else ports
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "addressType": "IPv4",
        "ports": [{"name": k, "port": v, "protocol": "TCP"} for k, v in ports.items()],
        "endpoints": endpoints,
    }


def endpoint(address: str, pod: str | None = None, **conditions: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"addresses": [address], "conditions": conditions}
    if pod is not None:
        result["targetRef"] = {"kind": "Pod", "name": pod}
    return result


def test_ready_endpoints_become_workers_named_by_their_pod() -> None:
    workers = workers_from_slice(
        slice_of(
            "s1",
            [endpoint("10.1.0.5", "worker-0", ready=True), endpoint("10.1.0.6", ready=True)],
            labels={"kvroute.io/model": "llama", "kvroute.io/gpu-kind": "H100", "app": "x"},
        )
    )
    labels = (("gpu-kind", "H100"), ("model", "llama"))
    assert workers == [
        WorkerSpec("http://10.1.0.5:8000", "http://10.1.0.5:8100", "worker-0", labels=labels),
        WorkerSpec("http://10.1.0.6:8000", "http://10.1.0.6:8100", "10.1.0.6", labels=labels),
    ]


@pytest.mark.parametrize(
    "conditions",
    [{"ready": False}, {"ready": True, "terminating": True}, {"terminating": True}],
)
def test_unready_or_terminating_endpoints_leave(conditions: dict[str, bool]) -> None:
    assert workers_from_slice(slice_of("s", [endpoint("10.0.0.1", "p", **conditions)])) == []


def test_unknown_readiness_counts_as_ready_as_the_api_documents() -> None:
    (worker,) = workers_from_slice(slice_of("s", [endpoint("10.0.0.1", "p")]))
    assert worker.worker_id == "p"


def test_ports_decide_engine_agent_and_scheme() -> None:
    no_agent = workers_from_slice(slice_of("s", [endpoint("10.0.0.1")], ports={"http": 80}))
    assert no_agent[0].agent_url is None
    tls = workers_from_slice(slice_of("s", [endpoint("10.0.0.1")], ports={"https": 8443}))
    assert tls[0].url == "https://10.0.0.1:8443"
    assert workers_from_slice(slice_of("s", [endpoint("10.0.0.1")], ports={"metrics": 9})) == []


def test_ipv6_addresses_are_bracketed() -> None:
    (worker,) = workers_from_slice(slice_of("s", [endpoint("fd00::5", "p")]))
    assert worker.url == "http://[fd00::5]:8000"


def test_slice_set_follows_added_modified_deleted() -> None:
    slices = SliceSet()
    slices.replace_all([slice_of("a", [endpoint("10.0.0.1", "p1")])])
    slices.apply("ADDED", slice_of("b", [endpoint("10.0.0.2", "p2")]))
    assert [w.worker_id for w in slices.workers()] == ["p1", "p2"]
    slices.apply("MODIFIED", slice_of("a", [endpoint("10.0.0.1", "p1", terminating=True)]))
    assert [w.worker_id for w in slices.workers()] == ["p2"]
    slices.apply("DELETED", slice_of("b", []))
    assert slices.workers() == []


def test_one_worker_in_two_slices_is_listed_once() -> None:
    slices = SliceSet()
    slices.replace_all(
        [slice_of("a", [endpoint("10.0.0.1", "p1")]), slice_of("b", [endpoint("10.0.0.1", "p1")])]
    )
    assert len(slices.workers()) == 1
