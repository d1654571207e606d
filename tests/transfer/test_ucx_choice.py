"""Which UCX the binding builds against (transfer/native/ucx_locate.py): the choice and its
reason are explicit, and a UCX that cannot be used is refused before anything compiles,
with both versions and the other choices in the message."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

LOCATOR = Path(__file__).resolve().parents[2] / "transfer" / "native" / "ucx_locate.py"


@pytest.fixture(scope="module")
def locator():
    spec = importlib.util.spec_from_file_location("kvferry_ucx_locate_test", LOCATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def fake_ucx(root: Path, major: int, minor: int, with_lib: bool = True) -> Path:
    header = root / "include" / "ucp" / "api" / "ucp_version.h"
    header.parent.mkdir(parents=True)
    header.write_text(f"#define UCP_API_MAJOR    {major}\n#define UCP_API_MINOR    {minor}\n")
    (root / "lib").mkdir()
    if with_lib:
        (root / "lib" / "libucp.so").write_text("")
    return root


def test_prefix_too_old_is_refused_with_both_versions(locator, tmp_path):
    root = fake_ucx(tmp_path / "ucx", 1, 12)
    with pytest.raises(locator.UcxChoiceError) as err:
        locator.locate({"KVFERRY_UCX": str(root)})
    text = str(err.value)
    assert "1.12" in text and "1.13" in text and str(root) in text
    assert "KVFERRY_UCX=wheel" in text


def test_prefix_without_libucp_is_refused(locator, tmp_path):
    root = fake_ucx(tmp_path / "ucx", 1, 15, with_lib=False)
    with pytest.raises(locator.UcxChoiceError, match=r"no libucp\.so"):
        locator.locate({"KVFERRY_UCX": str(root)})


def test_usable_prefix_is_chosen_and_says_why(locator, tmp_path):
    root = fake_ucx(tmp_path / "ucx", 1, 13)
    build = locator.locate({"KVFERRY_UCX": str(root)})
    assert build.version == (1, 13)
    assert build.include_dirs == [str(root / "include")]
    assert f"KVFERRY_UCX={root}" in build.summary() and "UCX 1.13" in build.summary()
    assert "KVFERRY_UCX=wheel|system" in build.summary()


def test_ucx_home_is_honoured_when_nothing_else_is_said(locator, tmp_path):
    root = fake_ucx(tmp_path / "home", 1, 20)
    build = locator.locate({"UCX_HOME": str(root)})
    assert build.version == (1, 20) and "UCX_HOME" in build.reason


def test_default_is_the_wheel(locator):
    pytest.importorskip("libucx")
    build = locator.locate({"PATH": "/nonexistent"})  # no pkg-config: nothing else seen
    assert "wheel" in build.source and "default" in build.reason
    assert build.version >= locator.MIN_VERSION


def test_auto_falls_back_to_the_wheel_saying_why(locator, tmp_path):
    pytest.importorskip("libucx")
    root = fake_ucx(tmp_path / "old", 1, 9)
    build = locator.locate({"KVFERRY_UCX": "auto", "UCX_HOME": str(root), "PATH": "/nonexistent"})
    assert "wheel" in build.source
    assert any("1.9" in n and "1.13" in n for n in build.notes), build.notes


def test_system_without_pkg_config_ucx_is_refused(locator):
    with pytest.raises(locator.UcxChoiceError) as err:
        locator.locate({"KVFERRY_UCX": "system", "PATH": "/nonexistent"})
    assert "KVFERRY_UCX=system" in str(err.value) and "pkg-config" in str(err.value)


def test_unknown_choice_is_refused(locator):
    with pytest.raises(locator.UcxChoiceError, match="not one of wheel, system, auto"):
        locator.locate({"KVFERRY_UCX": "verbs"})


def test_the_build_in_use_reports_its_choice():
    from kvferry.transfer import ucxinfo

    report = ucxinfo.report()
    assert "chosen by" in report["build"] and "KVFERRY_UCX=" in report["build"]
    built = tuple(int(x) for x in report["built"].split("."))
    assert built >= (1, 13)
    assert report["running"].startswith(report["built"] + ".") or built <= tuple(
        int(x) for x in report["running"].split(".")[:2]
    )


def test_system_choice_takes_the_pkg_config_ucx(locator):
    import os
    import shutil
    import subprocess

    if (
        shutil.which("pkg-config") is None
        or subprocess.run(["pkg-config", "--exists", "ucx"]).returncode != 0
    ):
        pytest.skip("no system UCX (pkg-config ucx)")
    env = dict(os.environ, KVFERRY_UCX="system")
    version = subprocess.run(
        ["pkg-config", "--modversion", "ucx"], capture_output=True, text=True
    ).stdout.strip()
    build = locator.locate(env)
    assert version.startswith(build.version_text) and "pkg-config" in build.source
    default = locator.locate({k: v for k, v in env.items() if k not in ("KVFERRY_UCX", "UCX_HOME")})
    assert "wheel" in default.source
    assert any(
        "KVFERRY_UCX=system" in n and version.startswith(build.version_text) for n in default.notes
    ), default.notes


def test_the_loaded_ucx_is_the_one_built_against():
    """A wheel build must not pick up a system libucp.so.0 (its rpath is gone after pip's
    isolated build), nor a system build the wheel's."""
    from kvferry.transfer import ucxinfo

    report = ucxinfo.report()
    from_wheel = "libucx wheel" in report["build"]
    assert ("/libucx/" in report["ucx"]) == from_wheel, report["ucx"]
    assert report["running"].startswith(report["built"] + "."), report
