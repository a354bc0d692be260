"""Router config: flags > env > file > defaults; worker specs; --help explains each option."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from router.config import OPTIONS, RouterConfig, WorkerSpec, configure_parser, load_config


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(argv)


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    config_file = tmp_path / "router.yaml"
    config_file.write_text(
        "port: 9001\npolicy: least_load\nqueue_size: 7\nidle-timeout-s: 3.5\n"
        "workers:\n  - url: http://127.0.0.1:1\n    agent_url: http://127.0.0.1:2\n"
    )
    env = {"KVROUTE_POLICY": "random", "KVROUTE_QUEUE_SIZE": "8", "KVROUTE_METRICS_NEED_ADMIN": "1"}
    args = _parse(["--config", str(config_file), "--queue-size", "9"])
    config = load_config(args, env)
    assert config.port == 9001  # file
    assert config.policy == "random"  # env beats file
    assert config.queue_size == 9  # flag beats env
    assert config.idle_timeout_s == 3.5  # file key with dashes
    assert config.metrics_need_admin is True
    assert config.first_byte_timeout_s == RouterConfig().first_byte_timeout_s  # default
    assert config.workers == [WorkerSpec("http://127.0.0.1:1", agent_url="http://127.0.0.1:2")]


def test_toml_file_and_repeated_worker_flags(tmp_path: Path) -> None:
    config_file = tmp_path / "router.toml"
    config_file.write_text('policy = "session"\n[policy_params]\nvirtual_nodes = 64\n')
    args = _parse(
        [
            "--config",
            str(config_file),
            "--worker",
            "http://a:1,agent=http://a:2,max_concurrency=4",
            "--worker",
            "http://b:1/,id=b",
            "--tokenizers",
            "m=/tmp/tok",
        ]
    )
    config = load_config(args, {})
    assert config.policy == "session"
    assert config.policy_params == {"virtual_nodes": 64}
    assert config.workers == [
        WorkerSpec("http://a:1", agent_url="http://a:2", max_concurrency=4),
        WorkerSpec("http://b:1", worker_id="b"),
    ]
    assert config.tokenizers == {"m": "/tmp/tok"}


def test_env_workers_are_semicolon_separated() -> None:
    config = load_config(None, {"KVROUTE_WORKERS": "http://a:1,agent=http://a:2;http://b:1"})
    assert [w.url for w in config.workers] == ["http://a:1", "http://b:1"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVROUTE_PORT": "eighty"}, "port"),
        ({"KVROUTE_WORKERS": "ftp://x"}, "workers"),
        ({"KVROUTE_WORKERS": "http://x,colour=red"}, "workers"),
        ({"KVROUTE_POLICY_PARAMS": "[1]"}, "policy_params"),
    ],
)
def test_bad_values_name_the_option(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, env)


def test_unknown_file_key_is_rejected(tmp_path: Path) -> None:
    config_file = tmp_path / "router.yaml"
    config_file.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="prot"):
        load_config(None, {}, config_file)


def test_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    with pytest.raises(SystemExit):
        main(["router", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for opt in OPTIONS:
        assert f"KVROUTE_{opt.name.upper()}" in text
        assert " ".join(opt.help.split("{")[0].split())[:20] in text


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVROUTE_METRICS_NEED_ADMIN": "maybe"}, "metrics_need_admin"),
        ({"KVROUTE_QUEUE_SIZE": "-1"}, "queue_size"),
        ({"KVROUTE_CONNECT_TIMEOUT_S": "0"}, "connect_timeout_s"),
        ({"KVROUTE_PORT": "80.5"}, "port"),
        ({"KVROUTE_POLICY": "fastest"}, "fastest"),
        ({"KVROUTE_POLICY_PARAMS": '{"no_such_param": 1}'}, "no_such_param"),
    ],
)
def test_invalid_values_are_rejected_not_defaulted(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, env)


@pytest.mark.parametrize(("text", "expected"), [("yes", True), ("OFF", False), ("1", True)])
def test_booleans_accept_the_usual_spellings(text: str, expected: bool) -> None:
    assert load_config(None, {"KVROUTE_METRICS_NEED_ADMIN": text}).metrics_need_admin is expected


def test_every_field_is_an_option_with_help() -> None:
    """One declaration: each RouterConfig field yields exactly one documented option."""
    assert [opt.name for opt in OPTIONS] == [f.name for f in fields(RouterConfig)]
    assert all(opt.help for opt in OPTIONS)


def test_policy_help_lists_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main
    from router.scheduling.registry import POLICIES

    with pytest.raises(SystemExit):
        main(["router", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "scheduling policy: " + ", ".join(POLICIES) in text
