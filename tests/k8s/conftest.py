"""The real API server, shared by the Kubernetes tests of one session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.k8s.apiserver import ApiServer, ApiServerUnavailable, ensure_kube_apiserver


@pytest.fixture(scope="session")
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
