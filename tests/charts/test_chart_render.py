"""The Helm chart: lint, render (default and CPU values), Kubernetes schemas 1.30+, the
values schema, and the container commands against the real CLI."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import ENV_PREFIX, OPTIONS, load_config
from tests.charts.chart import CHART, find, parse_cli, render, values_file

VALUES = {"default": {}, "cpu": values_file("values-cpu.yaml")}
# Objects of CRDs that no built-in schema knows.
CUSTOM_KINDS = {"ServiceMonitor"}


def test_chart_lints_without_errors() -> None:
    import helm_python

    result = helm_python.lint(str(CHART))
    assert result["errors"] == []
    assert all(m["severity"] < 3 for m in result["messages"]), result["messages"]


@pytest.mark.parametrize("name", sorted(VALUES))
@pytest.mark.parametrize("kube_version", ["1.30", "1.33"])
def test_every_rendered_object_is_valid_kubernetes(name: str, kube_version: str) -> None:
    import kubernetes_validate

    values = {
        **VALUES[name],
        "router": {**VALUES[name].get("router", {}), "autoscaling": {"enabled": True}},
    }
    values["serviceMonitor"] = {"enabled": True}
    objects = render(values)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Role", "RoleBinding",
            "ServiceAccount", "NetworkPolicy", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "ServiceMonitor"} <= kinds  # fmt: skip
    for obj in objects:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, kube_version, strict=True)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"router": {"replicas": "two"}}, "/router/replicas"),
        ({"router": {"policy": "fastest"}}, "/router/policy"),
        ({"worker": {"blockSize": 0}}, "/worker/blockSize"),
        ({"worker": {"ports": {"http": 70000}}}, "/worker/ports/http"),
        ({"discovery": {"endpointSliceApi": "v2"}}, "/discovery/endpointSliceApi"),
        ({"workers": {}}, "workers"),
    ],
)
def test_a_wrong_value_fails_at_install_time(values: dict[str, Any], where: str) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmValuesError, match=where):
        render(values)


@pytest.mark.parametrize("name", sorted(VALUES))
def test_the_router_config_loads_and_points_at_the_worker_service(name: str) -> None:
    objects = render(VALUES[name])
    config_map = find(objects, "ConfigMap", "-router")
    config_path = _write(config_map["data"]["router.yaml"])
    config = load_config(None, {}, config_path)
    worker_service = find(objects, "Service", "-workers")
    assert config.k8s_label_selector == (
        f"kubernetes.io/service-name={worker_service['metadata']['name']}"
    )
    assert config.host == "0.0.0.0"  # in a pod the router serves the pod's address
    deployment = find(objects, "Deployment", "-router")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert parse_cli(container["args"]).config == "/etc/kvroute/router.yaml"
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("name", sorted(VALUES))
def test_the_worker_containers_parse_with_the_real_cli(name: str) -> None:
    objects = render(VALUES[name])
    pod = find(objects, "StatefulSet", "-worker")["spec"]["template"]["spec"]
    engine, agent = pod["containers"]
    engine_args = parse_cli(engine["args"])
    assert engine_args.engine == "vllm" and engine_args.no_agent
    assert engine_args.block_size == VALUES[name].get("worker", {}).get("blockSize", 16)
    agent_args = parse_cli(agent["args"])
    assert agent_args.zmq_endpoint.startswith("tcp://127.0.0.1:")  # the pod's loopback only
    service = find(objects, "Service", "-workers")
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "agent"}
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["PYTHONHASHSEED"] == "0"


def test_only_routers_reach_the_workers() -> None:
    objects = render({})
    policy = find(objects, "NetworkPolicy")
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    role = find(objects, "Role")
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["get", "list", "watch"]}
    ]  # fmt: skip


def test_secrets_are_referenced_never_inlined() -> None:
    secrets = {
        "agentTokenSecret": "agent",
        "apiKeysSecret": "keys",
        "tenantSecret": "tenant",
        "adminTokenSecret": "admin",
        "workerApiKeySecret": "worker-key",
    }
    objects = render({"secrets": secrets})
    assert not [o for o in objects if o["kind"] == "Secret"]
    router = find(objects, "Deployment", "-router")["spec"]["template"]["spec"]
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for e in router["containers"][0]["env"]
        if "valueFrom" in e
    }
    assert refs == {"agent", "tenant", "admin", "worker-key"}
    assert {"secret": {"secretName": "keys"}, "name": "api-keys"} in router["volumes"]
    # every variable the router gets is one of its options (a misspelt one is ignored,
    # and with it, say, client authentication)
    known = {ENV_PREFIX + opt.name.upper() for opt in OPTIONS}
    names = [e["name"] for e in router["containers"][0]["env"]]
    assert [n for n in names if n.startswith(ENV_PREFIX) and n not in known] == []
    mounts = {m["name"]: m["mountPath"] for m in router["containers"][0]["volumeMounts"]}
    tenants = next(e for e in router["containers"][0]["env"] if e["name"].endswith("TENANTS_FILE"))
    assert tenants["value"] == mounts["api-keys"]  # the mounted Secret: a file per tenant


def _write(text: str) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        handle.write(text)
    return handle.name
