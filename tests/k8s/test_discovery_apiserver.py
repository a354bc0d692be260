"""Kubernetes discovery against a real kube-apiserver (1.20, EndpointSlices v1beta1).

The tests create, change and delete EndpointSlices as the EndpointSlice controller would,
and check that ``KubernetesDiscovery`` follows within a deadline, also across an API
server restart (the last list stands meanwhile) and a watch expiry (410 Gone: relist).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.k8s.apiserver import ApiServer
from tests.k8s.cluster import Cluster, following, in_thread
from tests.polling import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


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
