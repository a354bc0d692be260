"""Static checks of the Dockerfiles (no image can be built here): every COPY source exists,
the entrypoint and default arguments parse with the real CLI, and the user is not root."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from tests.charts.chart import IMAGES, parse_cli

ROOT = IMAGES.parents[1]
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))


def instructions(path: Path, name: str) -> list[str]:
    parser = DockerfileParser(path=str(path))
    return [i["value"] for i in parser.structure if i["instruction"] == name]


def test_there_is_a_router_and_a_worker_image() -> None:
    assert {p.name for p in DOCKERFILES} >= {"router.Dockerfile", "worker.Dockerfile"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_copy_source_exists_in_the_build_context(path: Path) -> None:
    copies = instructions(path, "COPY")
    assert copies
    for value in copies:
        *sources, _destination = shlex.split(value)
        for source in sources:
            assert not source.startswith("--"), f"{path.name}: COPY flags are not expected"
            assert (ROOT / source).exists(), f"{path.name}: COPY {source} is not in the repo"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_and_command_match_the_cli(path: Path) -> None:
    (entrypoint,) = instructions(path, "ENTRYPOINT")
    (command,) = instructions(path, "CMD")
    assert json.loads(entrypoint) == ["kvroute"]
    args = json.loads(command)
    if "--help" in args:  # the image's default prints the subcommand's help, and exits 0
        with pytest.raises(SystemExit) as exited:
            parse_cli(args)
        assert exited.value.code == 0
    else:
        parse_cli(args)  # SystemExit (argparse) on an unknown subcommand or option


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_runs_as_a_non_root_user(path: Path) -> None:
    users = instructions(path, "USER")
    assert users, f"{path.name} has no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
