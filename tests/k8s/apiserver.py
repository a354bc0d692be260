"""A real Kubernetes API server on loopback for tests: etcd + kube-apiserver 1.20.2.

``ensure_kube_apiserver()`` returns the binary, building it once per machine
(``build_kube_apiserver.sh``, about 10 minutes on 2 cores, cached outside the repo).
``ApiServer`` starts etcd and the API server on free loopback ports with a static admin
token, writes a kubeconfig for clients, and can restart the API server on the same port
(etcd keeps the state) or compact etcd (so old resourceVersions answer 410 Gone).

There is no controller manager, scheduler or kubelet: tests create EndpointSlices
themselves, as the EndpointSlice controller would.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent
ADMIN_TOKEN = "kvroute-test-admin-token"


class ApiServerUnavailable(RuntimeError):
    """The binary could not be built here (not root, no apt): tests skip."""


def ensure_kube_apiserver() -> Path:
    cached = os.environ.get("KVROUTE_KUBE_APISERVER")
    if cached and Path(cached).is_file():
        return Path(cached)
    if shutil.which("etcd") is None and os.geteuid() != 0:
        raise ApiServerUnavailable("etcd is missing and apt-get needs root")
    done = subprocess.run(
        ["bash", str(HERE / "build_kube_apiserver.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"building kube-apiserver failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ApiServer:
    """etcd + kube-apiserver under ``workdir``; ``stop()`` ends both."""

    def __init__(self, binary: Path, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.etcd_port = free_port()
        self._etcd_peer_port = free_port()
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []
        self.kubeconfig = workdir / "kubeconfig.yaml"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        self._write_credentials()
        self._etcd = self._spawn(
            "etcd",
            [
                "etcd", "--data-dir", str(self.workdir / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{self._etcd_peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self._etcd_peer_port}",
                "--initial-cluster", f"default=http://127.0.0.1:{self._etcd_peer_port}",
            ],
        )  # fmt: skip
        self.start_apiserver(timeout_s)

    def start_apiserver(self, timeout_s: float = 60.0) -> None:
        w = self.workdir
        self._apiserver = self._spawn(
            "kube-apiserver",
            [
                str(self.binary),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--tls-cert-file={w / 'serving.crt'}",
                f"--tls-private-key-file={w / 'serving.key'}",
                f"--token-auth-file={w / 'tokens.csv'}", "--authorization-mode=RBAC",
                f"--service-account-key-file={w / 'sa.pub'}",
                f"--service-account-signing-key-file={w / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--disable-admission-plugins=ServiceAccount",
                # 1.20 keeps conditions.terminating only behind this (alpha) gate.
                "--feature-gates=EndpointSliceTerminatingCondition=true",
            ],
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self._apiserver.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kube-apiserver did not start:\n{self.log_tail()}")
            time.sleep(0.2)

    def stop_apiserver(self) -> None:
        if self._apiserver is not None:
            self._apiserver.terminate()
            try:
                self._apiserver.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._apiserver.kill()
                self._apiserver.wait()
            self._apiserver = None

    def stop(self) -> None:
        self.stop_apiserver()
        if self._etcd is not None:
            self._etcd.terminate()
            try:
                self._etcd.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._etcd.kill()
                self._etcd.wait()
        for log in self._logs:
            log.close()

    def ready(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.workdir / "serving.crt"))
        request = urllib.request.Request(
            self.url + "/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2, context=context) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def compact_etcd(self) -> int:
        """Compact etcd at its current revision; returns that revision."""
        endpoint = f"http://127.0.0.1:{self.etcd_port}"
        env = {**os.environ, "ETCDCTL_API": "3"}
        status = subprocess.run(
            ["etcdctl", "--endpoints", endpoint, "endpoint", "status", "-w", "json"],
            env=env, check=True, capture_output=True, text=True,
        )  # fmt: skip
        revision = int(json.loads(status.stdout)[0]["Status"]["header"]["revision"])
        subprocess.run(
            ["etcdctl", "--endpoints", endpoint, "compact", str(revision)],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
        return revision

    def log_tail(self, num_chars: int = 3000) -> str:
        path = self.workdir / "kube-apiserver.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def _write_credentials(self) -> None:
        w = self.workdir
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=kube-apiserver", "-addext", "subjectAltName=IP:127.0.0.1",
             "-keyout", str(w / "serving.key"), "-out", str(w / "serving.crt")],
            check=True, capture_output=True,
        )  # fmt: skip
        (w / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin,"system:masters"\n')
        subprocess.run(
            ["openssl", "genrsa", "-out", str(w / "sa.key"), "2048"],
            check=True, capture_output=True,
        )  # fmt: skip
        subprocess.run(
            ["openssl", "rsa", "-in", str(w / "sa.key"), "-pubout", "-out", str(w / "sa.pub")],
            check=True, capture_output=True,
        )  # fmt: skip
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: test\n  cluster:\n    server: {self.url}\n"
            f"    certificate-authority: {w / 'serving.crt'}\n"
            f"users:\n- name: admin\n  user:\n    token: {ADMIN_TOKEN}\n"
            "contexts:\n- name: test\n  context:\n    cluster: test\n    user: admin\n"
            "current-context: test\n"
        )

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        self._logs.append(log)
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
