"""Package hygiene: import boundaries, self-contained docs, and the ``kvroute`` command line."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from router import cli

REPO = Path(__file__).resolve().parent.parent
# A Markdown file named anywhere in the repository must ship with it; so must a folder
# beside the checkout (a path that climbs out of it). Files the tools write are no
# citations.
CITED_MARKDOWN = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
SIBLING_FOLDER = re.compile(r"(?<![\w/.])\.\./[A-Za-z][\w.-]*")
WRITTEN_BY_THE_TOOLS = {"report.md"}  # loadtest.report's output, in the user's --out


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (``from . import x`` resolved as ``.``)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("package", ["router", "kvindex"])
def test_package_does_not_import_worker(package: str) -> None:
    offenders = {
        str(path.relative_to(REPO)): sorted(m for m in modules if m.split(".")[0] == "worker")
        for path in sorted((REPO / package).rglob("*.py"))
        if (modules := imported_modules(path))
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def test_import_scan_sees_nested_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from worker.models import model_dir\n    import worker.sim\n")
    assert imported_modules(source) == {"worker.models", "worker.sim"}


def tracked_files() -> list[str]:
    result = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                            check=False)  # fmt: skip
    if result.returncode != 0:
        pytest.skip("not a git checkout")
    return [name for name in result.stdout.decode().split("\0") if name]


def outside_citations(text: str, shipped_markdown: set[str]) -> list[str]:
    """Markdown names not in the repository, and paths into folders beside it."""
    missing = [
        name
        for name in CITED_MARKDOWN.findall(text)
        if name not in shipped_markdown and name not in WRITTEN_BY_THE_TOOLS
    ]
    return sorted({*missing, *SIBLING_FOLDER.findall(text)})


def test_outside_citations_are_found() -> None:
    # built from pieces, so that this file does not cite them itself
    notes, beside = "NOTES" + ".md", "../" + "elsewhere"
    text = f"see {notes} and {beside}/x; README.md, /v1/../v1/models, ln -s ../.. x"
    assert outside_citations(text, {"README.md"}) == [beside, notes]


def test_no_tracked_file_cites_documents_outside_the_repo() -> None:
    names = tracked_files()
    shipped_markdown = {Path(name).name for name in names if name.endswith(".md")}
    offenders = []
    for name in names:
        path = REPO / name
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        offenders += [f"{name}: {c}" for c in outside_citations(text, shipped_markdown)]
    assert offenders == []


def test_every_package_has_a_readme() -> None:
    packages = ["kvindex", "router", "router/scheduling", "worker", "worker/agent",
                "worker/sim", "loadtest", "tests"]  # fmt: skip
    assert [p for p in packages if not (REPO / p / "README.md").is_file()] == []


def test_license_is_the_declared_apache_2() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert 'license = { text = "Apache-2.0" }' in (REPO / "pyproject.toml").read_text()


# --- the kvroute command line -----------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("kvroute ") and out != "kvroute "


def test_unknown_subcommand_names_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["rooter"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'rooter'" in err
    assert all(name in err for name in cli.SUBCOMMANDS)


def test_unknown_subcommand_exit_status_from_the_shell() -> None:
    result = subprocess.run([sys.executable, "-m", "router.cli", "nope"], capture_output=True,
                            text=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 2 and "valid subcommands" in result.stderr


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_every_option_shows_its_default(name: str) -> None:
    parser = cli.build_parser(name)
    options = [a for a in parser._actions if a.option_strings and a.nargs != 0]  # not flags
    rendered = "".join(parser.format_help().split())  # wrapping moves spaces: drop them
    for action in options:
        help_text = action.help or ""
        assert "default" in help_text or "required" in help_text, action.option_strings
        shown = "".join((help_text % {**vars(action), "prog": parser.prog}).split())
        assert shown in rendered, action.option_strings  # argparse printed it


def test_option_without_help_text_shows_its_default() -> None:
    text = " ".join(cli.build_parser("demo").format_help().split())
    assert "--workers WORKERS (default: 4)" in text


def test_defaults_formatter() -> None:
    parser = argparse.ArgumentParser(formatter_class=cli.DefaultsHelpFormatter)
    parser.add_argument("--port", type=int, default=8000, help="port")
    parser.add_argument("--name", default=None, help="a name")
    parser.add_argument("--host", default="x", help="host (default: --bind)")
    parser.add_argument("--fast", action="store_true", help="go fast")
    parser.add_argument("--model", required=True, help="model")
    text = " ".join(parser.format_help().split())
    assert "port (default: 8000)" in text and "a name (default: none)" in text
    assert "host (default: --bind) " in text and "go fast " in text and "model (required)" in text


# --- matplotlib is the `loadtest` extra ----------------------------------------------------

WITHOUT_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; "  # import fails


def test_router_and_worker_import_without_matplotlib() -> None:
    code = WITHOUT_MATPLOTLIB + "import router.app, router.server_cli, worker.cli, loadtest.up"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_load_test_tools_name_the_extra_when_matplotlib_is_missing() -> None:
    code = WITHOUT_MATPLOTLIB + "from router.cli import main; sys.exit(main(['loadtest']))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "kvroute loadtest: the load-test reports plot with matplotlib, an optional extra that "
        "is not installed: pip install 'kvroute[loadtest]'"
    ]


def test_declared_dependencies() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].lower() for dep in project["dependencies"]}
    assert "pyyaml" in names and "matplotlib" not in names
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["loadtest"])


def test_kvindex_stays_pure() -> None:
    forbidden = {"router", "worker", "loadtest", "asyncio", "aiohttp", "zmq", "socket",
                 "subprocess", "threading"}  # fmt: skip
    offenders = {}
    for path in sorted((REPO / "kvindex").rglob("*.py")):
        if bad := sorted(m for m in imported_modules(path) if m.split(".")[0] in forbidden):
            offenders[str(path.relative_to(REPO))] = bad
    assert offenders == {}
