"""A real Prometheus server (the system's ``prometheus`` binary) for tests, on loopback.

``PrometheusServer`` writes a config that scrapes the given targets every second and
evaluates the chart's rules, starts the server with its TSDB in a temp folder, waits
until ``/-/ready`` answers, and stops it (SIGTERM, then SIGKILL) on exit. ``query``
runs an instant PromQL query through the HTTP API.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.fleet import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
RULES_DIR = Path(__file__).resolve().parents[2] / "charts" / "kvroute" / "prometheus"


class PrometheusServer:
    def __init__(self, folder: Path, jobs: dict[str, list[str]]) -> None:
        """``jobs``: job name -> ``host:port`` targets."""
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        scrape_configs = [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES_DIR / "rules.yml")],
            "scrape_configs": scrape_configs,
        }
        # NOTE: JSON is YAML; no YAML writer needed.
        (folder / "prometheus.yml").write_text(json.dumps(config))
        self._log = (folder / "prometheus.log").open("wb")
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PrometheusServer:
        self._process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.folder / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not self._ready():
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("prometheus did not start:\n" + self.log_tail())
            time.sleep(0.1)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
        self._log.close()

    def log_tail(self, num_chars: int = 3000) -> str:
        return (self.folder / "prometheus.log").read_text(errors="replace")[-num_chars:]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The result vector of an instant query (empty when no data)."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise AssertionError(f"query {promql!r} failed: {body}")
        return list(body["data"]["result"])

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False
