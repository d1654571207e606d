"""Every Python package folder is listed in pyproject.toml: a non-editable install (the
distribution-UCX build) takes only what is listed, and a missing subpackage breaks it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"transfer": "kvferry.transfer", "engine": "kvferry.engine", "cluster": "kvferry.cluster"}


def packages_on_disk() -> set[str]:
    found = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    return found


def test_every_package_folder_is_listed():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    assert packages_on_disk() <= listed, sorted(packages_on_disk() - listed)
    assert not packages_on_disk() <= listed - {"kvferry.engine.protocol"}, (
        "the check catches a subpackage left out"
    )


def test_the_minimum_python_is_the_one_the_tools_check_and_ci_runs():
    """requires-python, ruff's target and mypy's version name one minimum; the code may
    use what that version has (enum.StrEnum, TimeoutError from asyncio.wait_for), and the
    interpreter running the suite is at least it."""
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    minimum = project["project"]["requires-python"].removeprefix(">=")
    major, minor = (int(x) for x in minimum.split("."))
    assert project["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    assert project["tool"]["mypy"]["python_version"] == minimum
    assert sys.version_info[:2] >= (major, minor)
    readme = (ROOT / "README.md").read_text()
    assert f"Python {minimum}+" in readme
