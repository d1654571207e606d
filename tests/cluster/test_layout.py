"""The package layout, read from the source with ``ast`` (nothing here imports the modules).

- The service does not import the harness: no module of ``kvferry.cluster`` outside
  ``cluster/harness/`` imports ``kvferry.cluster.harness`` (absolute, relative, or through
  ``importlib.import_module`` / ``__import__`` with a literal name).
- ``transfer/`` stands alone: nothing under it imports ``kvferry.engine`` or ``kvferry.cluster``.
- ``engine/`` does not reach up: nothing under it imports ``kvferry.cluster``.
- The protocol's core does no I/O: ``engine/protocol/`` imports only the standard
  library (none of its process, file, socket or clock modules) and ``kvferry.engine``.
- The vLLM connector is a host of the protocol, not a rank: ``cluster/vllm/`` imports no
  ``kvferry.cluster.runtime``.
- The service's ranks and router are hosted, never rewritten: no class under
  ``cluster/harness/`` or ``tests/`` subclasses ``DecodeRank``, ``PrefillRank``, ``Router``
  or the router's core (a simulator or a test supplies ports and data paths instead).

Each check also runs on a small synthetic tree holding one violating import of each kind,
which it must report (the broken mode).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Folder -> import name, as pyproject.toml's package-dir maps them.
PACKAGES = {
    "transfer": "kvferry.transfer",
    "engine": "kvferry.engine",
    "cluster": "kvferry.cluster",
}


def module_name(root: Path, path: Path) -> tuple[str, bool]:
    """The import name of ``path`` (a .py file under one of PACKAGES' folders) and
    whether it is a package's ``__init__``."""
    rel = path.relative_to(root)
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    is_pkg = parts[-1] == "__init__.py"
    parts = parts[:-1] if is_pkg else [*parts[:-1], parts[-1][:-3]]
    return ".".join(parts), is_pkg


def imported_modules(source: str, module: str, is_pkg: bool) -> list[tuple[int, str]]:
    """Every module a source file imports, as absolute names with line numbers. For
    ``from X import a`` both ``X`` and ``X.a`` are listed (``a`` may be a submodule)."""
    package = module if is_pkg else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if (
                name in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                out.append((node.lineno, node.args[0].value))
    return out


def violations(
    root: Path, folder: str, forbidden: tuple[str, ...], skip: tuple[str, ...] = ()
) -> list[str]:
    """``path:line imports name`` for each import under ``root/folder`` of a module in
    ``forbidden`` (or below one), leaving out files under the folders in ``skip``."""
    found = []
    for path in sorted((root / folder).rglob("*.py")):
        rel = path.relative_to(root)
        if any(rel.is_relative_to(s) for s in skip):
            continue
        module, is_pkg = module_name(root, path)
        for line, name in imported_modules(path.read_text(), module, is_pkg):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{rel}:{line} imports {name}")
    return found


def service_imports_harness(root: Path) -> list[str]:
    return violations(root, "cluster", ("kvferry.cluster.harness",), skip=("cluster/harness",))


def transfer_imports_above(root: Path) -> list[str]:
    return violations(root, "transfer", ("kvferry.engine", "kvferry.cluster"))


def engine_imports_cluster(root: Path) -> list[str]:
    return violations(root, "engine", ("kvferry.cluster",))


IO_MODULES = frozenset(
    {"os", "time", "socket", "select", "subprocess", "signal", "threading", "asyncio",
     "multiprocessing", "io", "pathlib", "shutil", "tempfile", "logging", "random"}
)  # fmt: skip


def protocol_core_imports(root: Path) -> list[str]:
    """Imports under ``engine/protocol/`` of anything but the standard library (less its
    I/O, clock and randomness modules) and ``kvferry.engine``."""
    import sys

    found = []
    for path in sorted((root / "engine" / "protocol").rglob("*.py")):
        rel = path.relative_to(root)
        module, is_pkg = module_name(root, path)
        for line, name in imported_modules(path.read_text(), module, is_pkg):
            top = name.split(".")[0]
            if name == "kvferry.engine" or name.startswith("kvferry.engine."):
                continue
            if (top in sys.stdlib_module_names and top not in IO_MODULES) or top == "__future__":
                continue
            found.append(f"{rel}:{line} imports {name}")
    return found


def connector_imports_runtime(root: Path) -> list[str]:
    return violations(root, "cluster/vllm", ("kvferry.cluster.runtime",))


SERVICE_CLASSES = frozenset({"DecodeRank", "PrefillRank", "Router", "RouterCore"})


def service_subclasses(root: Path) -> list[str]:
    """``path:line class X(Base)`` for each class under ``cluster/harness/`` or ``tests/``
    whose bases name one of the service's rank or router classes."""
    found = []
    for folder in ("cluster/harness", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef):
                    continue
                for base in node.bases:
                    name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                    if name in SERVICE_CLASSES:
                        rel = path.relative_to(root)
                        found.append(f"{rel}:{node.lineno} class {node.name}({name})")
    return found


def test_nothing_outside_the_service_subclasses_its_ranks_or_router():
    assert service_subclasses(ROOT) == []


def test_the_protocol_core_imports_only_the_standard_library_and_the_engine():
    assert protocol_core_imports(ROOT) == []


def test_the_vllm_connector_does_not_import_the_rank_runtime():
    assert connector_imports_runtime(ROOT) == []


def test_service_does_not_import_the_harness():
    assert (ROOT / "cluster" / "harness" / "__init__.py").is_file()
    assert service_imports_harness(ROOT) == []


def test_transfer_imports_neither_engine_nor_cluster():
    assert transfer_imports_above(ROOT) == []


def test_engine_does_not_import_cluster():
    assert engine_imports_cluster(ROOT) == []


# ------------------------------------------------------------------ broken mode
def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def tree(tmp_path):
    """A clean miniature of the layout: every check finds nothing in it."""
    for folder in (
        "transfer",
        "engine",
        "engine/protocol",
        "cluster",
        "cluster/harness",
        "cluster/vllm",
    ):
        write(tmp_path, f"{folder}/__init__.py", "")
    write(
        tmp_path,
        "engine/protocol/owner.py",
        "import enum\nfrom dataclasses import dataclass\nfrom .table import Move\n"
        "from kvferry.engine.allocator import PageAllocator\n",
    )
    write(tmp_path, "cluster/vllm/connector.py", "from kvferry.cluster.processes import DRAIN_S\n")
    write(tmp_path, "transfer/engine.py", "import os\nfrom .wire import pack\n")
    write(
        tmp_path,
        "engine/pool.py",
        "from kvferry.transfer import TransferEngine\nfrom ..transfer import wire\n",
    )
    write(
        tmp_path,
        "cluster/router.py",
        "from kvferry.engine.pool import KVPool\n"
        "from .messages import Hello\n"
        "cmd = ['-m', 'kvferry.cluster.harness.workload']\n",
    )
    write(
        tmp_path,
        "cluster/harness/soak.py",
        "from . import workload\n"
        "from ..router import latency_summary\n"
        "from kvferry.cluster.harness import netns\n",
    )
    assert service_imports_harness(tmp_path) == []
    assert transfer_imports_above(tmp_path) == []
    assert engine_imports_cluster(tmp_path) == []
    assert protocol_core_imports(tmp_path) == []
    assert connector_imports_runtime(tmp_path) == []
    assert service_subclasses(tmp_path) == []
    return tmp_path


@pytest.mark.parametrize(
    "rel,source",
    [
        ("cluster/cli.py", "from kvferry.cluster.harness.workload import main\n"),
        ("cluster/cli.py", "import kvferry.cluster.harness\n"),
        ("cluster/cli.py", "from kvferry.cluster import harness\n"),
        ("cluster/cli.py", "def f():\n    from .harness.workload import main\n"),
        ("cluster/cli.py", "from . import harness\n"),
        ("cluster/sub/__init__.py", "from ..harness import localcluster\n"),
        (
            "cluster/cli.py",
            "import importlib\nimportlib.import_module('kvferry.cluster.harness.soak')\n",
        ),
    ],
)
def test_broken_mode_service_importing_harness_is_reported(tree, rel, source):
    write(tree, rel, source)
    found = service_imports_harness(tree)
    assert found and all(f.startswith(rel) for f in found), found


@pytest.mark.parametrize(
    "source",
    [
        "from kvferry.engine.pool import KVPool\n",
        "import kvferry.cluster.router\n",
        "from ..engine import pool\n",
        "from .. import cluster\n",
    ],
)
def test_broken_mode_transfer_importing_above_is_reported(tree, source):
    write(tree, "transfer/batch.py", source)
    found = transfer_imports_above(tree)
    assert found and all(f.startswith("transfer/batch.py:1 ") for f in found), found


@pytest.mark.parametrize(
    "source",
    [
        "from kvferry.cluster.messages import Hello\n",
        "from ...cluster import router\n",
    ],
)
def test_broken_mode_engine_importing_cluster_is_reported(tree, source):
    write(tree, "engine/kernels/paged.py", source)
    found = engine_imports_cluster(tree)
    assert found and all(f.startswith("engine/kernels/paged.py:1 ") for f in found), found


@pytest.mark.parametrize(
    "source",
    [
        "import time\n",
        "import os.path\n",
        "from socket import socket\n",
        "import numpy as np\n",
        "from kvferry.transfer import TransferEngine\n",
        "from kvferry.cluster.runtime import RankRuntime\n",
        "from ... import cluster\n",
    ],
)
def test_broken_mode_protocol_core_doing_io_is_reported(tree, source):
    write(tree, "engine/protocol/driver.py", source)
    found = protocol_core_imports(tree)
    assert found and all(f.startswith("engine/protocol/driver.py:1 ") for f in found), found


@pytest.mark.parametrize(
    "source",
    [
        "from kvferry.cluster.runtime import DRAIN_S\n",
        "from ..runtime import process_gone\n",
        "import kvferry.cluster.runtime\n",
    ],
)
def test_broken_mode_connector_importing_the_runtime_is_reported(tree, source):
    write(tree, "cluster/vllm/connector.py", source)
    found = connector_imports_runtime(tree)
    assert found and all(f.startswith("cluster/vllm/connector.py:1 ") for f in found), found


@pytest.mark.parametrize(
    "rel,source",
    [
        ("cluster/harness/simulate/ranks.py", "class SimDecodeRank(DecodeRank):\n    pass\n"),
        (
            "cluster/harness/sim.py",
            "from kvferry.cluster import prefill\nclass W(prefill.PrefillRank): ...\n",
        ),
        ("tests/cluster/test_x.py", "class R(Router):\n    pass\n"),
        ("cluster/harness/simulate/router.py", "class SimRouter(object, RouterCore):\n    pass\n"),
    ],
)
def test_broken_mode_a_harness_subclassing_a_rank_is_reported(tree, rel, source):
    write(tree, rel, source)
    found = service_subclasses(tree)
    assert len(found) == 1 and found[0].startswith(rel), found
