"""``tests.engines.VllmServer`` leaves nothing behind: its ipc:// sockets live in a
private folder (``VLLM_RPC_BASE_PATH``) that ``stop()`` removes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.engines import STARTUP_TIMEOUT_S, VllmServer


@pytest.mark.vllm
@pytest.mark.slow
def test_stopped_server_leaves_no_ipc_sockets(tmp_path: Path) -> None:
    server = VllmServer(tmp_path / "vllm.log", omp_threads_bind="1")
    try:
        server.start()
        ipc_dir = server.ipc_dir
        assert ipc_dir is not None and server.environment()["VLLM_RPC_BASE_PATH"] == str(ipc_dir)
        server.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        sockets = [path for path in ipc_dir.iterdir() if path.is_socket()]
        assert sockets, "vLLM put its ipc:// sockets elsewhere"
    finally:
        server.stop()
    assert server.ipc_dir is None
    assert not ipc_dir.exists()
    assert not any(path.exists() for path in sockets)
