"""Which UCX the native binding is built against, and why (used by build_ucp.py).

``KVFERRY_UCX`` chooses:

- ``wheel``: the ``libucx`` wheel (``libucx-cu12``): shared memory and tcp, no verbs;
- ``system``: the UCX that ``pkg-config ucx`` finds (``PKG_CONFIG_PATH`` picks another),
  e.g. Debian's ``libucx-dev``, built with verbs for RDMA NICs;
- ``auto``: ``UCX_HOME``, else the ``pkg-config`` UCX when it is usable, else the wheel;
- a path: the UCX installed under that prefix (``include/``, ``lib/`` or ``lib64/``).

Unset: ``UCX_HOME`` when it is set, else the wheel (a system UCX that is merely installed
is reported, not used). A system UCX is checked before anything is compiled: its version
header must exist and say at least :data:`MIN_VERSION`, and ``libucp.so`` must be where
its library folder says; an explicit choice that fails the check is refused with a message
naming both versions and the other choices, and ``auto`` falls back to the wheel saying
why. Pure Python without cffi, so the tests can import it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MIN_VERSION = (1, 13)
CHOICES = "KVFERRY_UCX=wheel|system|auto|/prefix"
SYSTEM_INCLUDE_DIRS = ("/usr/include", "/usr/local/include")


class UcxChoiceError(RuntimeError):
    """The chosen UCX cannot be built against; the message says why and what else to try."""


@dataclass
class UcxBuild:
    """Where the headers and libraries are, the UCX API version, and why this one."""

    include_dirs: list[str]
    library_dirs: list[str]
    version: tuple[int, int]
    source: str  # e.g. "pkg-config ucx (/usr/include)"
    reason: str  # e.g. "KVFERRY_UCX=system"
    notes: list[str] = field(default_factory=list)

    @property
    def origin(self) -> str:
        """ "wheel" or "system": whether the runtime loads the wheel's libraries first."""
        return "wheel" if self.source.startswith("the libucx wheel") else "system"

    @property
    def version_text(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"

    def summary(self) -> str:
        """One line for the build log and for describe(): what, which version, why."""
        return (
            f"UCX {self.version_text} from {self.source}, chosen by {self.reason}; "
            f"choose another with {CHOICES}"
        )


def _text(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def header_version(include_dirs: list[str]) -> tuple[tuple[int, int], Path]:
    """(major, minor) from the first ``ucp/api/ucp_version.h`` among ``include_dirs``."""
    for folder in include_dirs:
        header = Path(folder) / "ucp" / "api" / "ucp_version.h"
        if header.is_file():
            text = header.read_text(errors="replace")
            major = re.search(r"#define\s+UCP_API_MAJOR\s+(\d+)", text)
            minor = re.search(r"#define\s+UCP_API_MINOR\s+(\d+)", text)
            if not (major and minor):
                raise UcxChoiceError(f"{header} defines no UCP_API_MAJOR/UCP_API_MINOR")
            return (int(major.group(1)), int(minor.group(1))), header
    raise UcxChoiceError(
        "no ucp/api/ucp_version.h under " + (", ".join(include_dirs) or "(no include folder)")
    )


def _check_usable(include_dirs: list[str], library_dirs: list[str], what: str) -> tuple[int, int]:
    """The UCX API version, or UcxChoiceError naming both versions / what is missing."""
    version, header = header_version(include_dirs)
    if version < MIN_VERSION:
        raise UcxChoiceError(
            f"{what} is UCX {_text(version)} ({header}), older than {_text(MIN_VERSION)}, "
            f"the oldest kvferry builds against"
        )
    if library_dirs and not any((Path(d) / "libucp.so").exists() for d in library_dirs):
        raise UcxChoiceError(
            f"{what}: no libucp.so in {', '.join(library_dirs)} (headers found at {header})"
        )
    return version


def from_prefix(prefix: str, reason: str) -> UcxBuild:
    root = Path(prefix).expanduser()
    if not root.is_dir():
        raise UcxChoiceError(f"{reason}: {root} is not a folder")
    lib = root / "lib64" if (root / "lib64" / "libucp.so").exists() else root / "lib"
    incs, libs = [str(root / "include")], [str(lib)]
    version = _check_usable(incs, libs, f"the UCX under {root}")
    return UcxBuild(incs, libs, version, f"{root}", reason)


def _pkg_config(env: dict[str, str], *args: str) -> str | None:
    tool = shutil.which("pkg-config", path=env.get("PATH", os.defpath))
    if tool is None:
        return None
    done = subprocess.run([tool, *args, "ucx"], capture_output=True, text=True, env=env)
    return done.stdout.strip() if done.returncode == 0 else None


def from_pkg_config(reason: str, env: dict[str, str]) -> UcxBuild:
    """The UCX ``pkg-config ucx`` finds under ``env`` (its PATH and PKG_CONFIG_PATH)."""
    cflags = _pkg_config(env, "--cflags-only-I")
    if cflags is None:
        where = env.get("PKG_CONFIG_PATH", "")
        found = shutil.which("pkg-config", path=env.get("PATH", os.defpath))
        raise UcxChoiceError(
            "pkg-config finds no ucx"
            + (f" (PKG_CONFIG_PATH={where})" if where else "")
            + ("" if found else ": pkg-config is not installed")
            + "; on Debian/Ubuntu install libucx-dev"
        )
    incs = [f[2:] for f in cflags.split() if f.startswith("-I")]
    libs = [f[2:] for f in (_pkg_config(env, "--libs-only-L") or "").split() if f.startswith("-L")]
    includedir = _pkg_config(env, "--variable=includedir")
    libdir = _pkg_config(env, "--variable=libdir")
    search = incs + ([includedir] if includedir else []) + list(SYSTEM_INCLUDE_DIRS)
    version = _check_usable(
        search,
        libs or ([libdir] if libdir else []),
        f"the pkg-config UCX {_pkg_config(env, '--modversion') or '?'}",
    )
    where = libdir or (libs[0] if libs else "the default library path")
    return UcxBuild(incs, libs, version, f"pkg-config ucx ({where})", reason)


def from_wheel(reason: str) -> UcxBuild:
    try:
        import libucx  # the libucx-cu12 wheel
    except ImportError as exc:
        raise UcxChoiceError(
            f"{reason}: the libucx wheel is not installed ({exc}); "
            "pip install libucx-cu12, or build against a system UCX "
            "(KVFERRY_UCX=system or a prefix)"
        ) from None
    root = Path(libucx.__file__).resolve().parent
    incs, libs = [str(root / "include")], [str(root / "lib")]
    version = _check_usable(incs, libs, "the libucx wheel")
    label = f"the libucx wheel {getattr(libucx, '__version__', '?')} ({root})"
    return UcxBuild(
        incs,
        libs,
        version,
        label,
        reason,
        [
            "the wheel has no verbs: --transports rdma needs a system UCX "
            "(KVFERRY_UCX=system or KVFERRY_UCX=/prefix)"
        ],
    )


def _system_note(env: dict[str, str]) -> str | None:
    """A word about a system UCX that is installed but not chosen, or None."""
    try:
        found = from_pkg_config("(not chosen)", env)
    except UcxChoiceError as exc:
        return None if "finds no ucx" in str(exc) else f"a system UCX is not usable: {exc}"
    return (
        f"a system UCX {found.version_text} is installed ({found.source}) but not "
        "used; KVFERRY_UCX=system builds against it (needed for --transports rdma)"
    )


def _refuse(choice: str, exc: UcxChoiceError) -> UcxChoiceError:
    return UcxChoiceError(
        f"{choice}: {exc}. Choose another UCX with {CHOICES} "
        f"(KVFERRY_UCX=wheel always works, without RDMA)"
    )


def locate(env: dict[str, str] | None = None) -> UcxBuild:
    """The UCX to build against, from ``KVFERRY_UCX`` / ``UCX_HOME`` (see the module
    docstring). Raises UcxChoiceError with the versions and the other choices."""
    env = dict(os.environ if env is None else env)
    choice = env.get("KVFERRY_UCX", "").strip()
    home = env.get("UCX_HOME", "").strip()
    if choice == "":
        if home:
            return _explicit(lambda: from_prefix(home, "UCX_HOME"), f"UCX_HOME={home}")
        build = from_wheel("default (KVFERRY_UCX unset)")
        note = _system_note(env)
        return _with_note(build, note)
    if choice == "wheel":
        return from_wheel("KVFERRY_UCX=wheel")
    if choice == "system":
        return _explicit(lambda: from_pkg_config("KVFERRY_UCX=system", env), "KVFERRY_UCX=system")
    if choice == "auto":
        return _auto(home, env)
    if choice.startswith(("/", ".", "~")):
        return _explicit(
            lambda: from_prefix(choice, f"KVFERRY_UCX={choice}"), f"KVFERRY_UCX={choice}"
        )
    raise UcxChoiceError(
        f"KVFERRY_UCX={choice!r} is not one of wheel, system, auto or a "
        "path (starting with / . or ~)"
    )


def _explicit(make: Callable[[], UcxBuild], choice: str) -> UcxBuild:
    try:
        return make()
    except UcxChoiceError as exc:
        raise _refuse(choice, exc) from None


def _with_note(build: UcxBuild, note: str | None) -> UcxBuild:
    if note:
        build.notes.insert(0, note)
    return build


def _auto(home: str, env: dict[str, str]) -> UcxBuild:
    attempts: list[tuple[str, Callable[[], UcxBuild]]] = []
    if home:
        attempts.append(("UCX_HOME", lambda: from_prefix(home, "KVFERRY_UCX=auto, UCX_HOME")))
    attempts.append(("pkg-config", lambda: from_pkg_config("KVFERRY_UCX=auto, pkg-config", env)))
    skipped: list[str] = []
    for label, make in attempts:
        try:
            return _with_note(make(), "; ".join(skipped) or None)
        except UcxChoiceError as exc:
            skipped.append(f"{label} skipped: {exc}")
    build = from_wheel("KVFERRY_UCX=auto, no usable system UCX")
    return _with_note(build, "; ".join(skipped))
