"""A fleet of child processes (simulated workers with agents, one router) under steady load.

For the tests that look at the fleet from outside, as an operator would: the dashboard
in a real browser, a real Prometheus server scraping every ``/metrics``. The load is a
few client threads sending completions (streaming and not) over a handful of prompt
families that share long prefixes, so the router sees cache hits, misses and both kinds
of TTFT. ``LoadThreads.stop()`` joins them; counts are read under a lock.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from loadtest.fleet import Fleet, FleetConfig

MODEL = "kvroute-tiny"
FAMILIES = [
    "".join(f"family {f} rule {i}: answer briefly and cite the manual. " for i in range(40))
    for f in range(4)
]


@dataclass
class LoadThreads:
    url: str
    num_threads: int = 3
    stop_event: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: dict[int, int] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for n in range(self.num_threads):
            thread = threading.Thread(target=self._loop, args=(n,), name=f"load-{n}", daemon=True)
            self.threads.append(thread)
            thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def num_answered(self, status: int = 200) -> int:
        with self.lock:
            return self.statuses.get(status, 0)

    def _loop(self, n: int) -> None:
        i = 0
        while not self.stop_event.is_set():
            i += 1
            family = FAMILIES[(n + i) % len(FAMILIES)]
            body = {
                "model": MODEL,
                "prompt": f"{family} question {n}-{i}",
                "max_tokens": 8,
                "stream": i % 2 == 0,
            }
            status = self._post(body)
            with self.lock:
                self.statuses[status] = self.statuses.get(status, 0) + 1

    def _post(self, body: dict[str, object]) -> int:
        request = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                response.read()
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return 0


@contextlib.contextmanager
def loaded_fleet(
    num_workers: int = 2, router_args: list[str] | None = None
) -> Iterator[tuple[Fleet, LoadThreads]]:
    """Workers and router started and ready, load running; everything stopped after."""
    config = FleetConfig(
        num_workers=num_workers,
        engine="sim",
        num_gpu_blocks=4096,
        worker_args=["--speedup", "4"],
        router_args=["--health-interval-s", "0.5", *(router_args or [])],
        startup_timeout_s=90,
    )
    with Fleet(config) as fleet:
        fleet.start_workers()
        url = fleet.start_router("cache_aware")
        load = LoadThreads(url)
        load.start()
        try:
            yield fleet, load
        finally:
            load.stop()


def wait_until_sync(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms (blocking) until true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
