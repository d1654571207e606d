"""cffi (API mode) builder for ``kvferry.transfer._ucp``, the native layer over UCX ucp.

Which UCX is used, in this order:

1. ``UCX_HOME``: a system install (``$UCX_HOME/include``, ``$UCX_HOME/lib``), e.g. one
   built with verbs/rdmacm for RDMA NICs;
2. ``pkg-config ucx``;
3. the ``libucx`` wheel (``libucx-cu12``): shared memory and tcp only, no RDMA.

The module is linked with an rpath to the chosen lib folder, so it finds ``libucp.so.0``
without ``LD_LIBRARY_PATH``; the runtime also calls ``libucx.load_library()`` first when
the wheel is the source. The chosen folder is recorded in ``UCX_BUILD_INFO``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent


def _from_home(home: str) -> tuple[list[str], list[str], str]:
    root = Path(home)
    lib = root / "lib64" if (root / "lib64" / "libucp.so").exists() else root / "lib"
    return [str(root / "include")], [str(lib)], f"UCX_HOME={root}"


def _from_pkg_config() -> tuple[list[str], list[str], str] | None:
    if shutil.which("pkg-config") is None:
        return None
    try:
        cflags = subprocess.run(["pkg-config", "--cflags-only-I", "ucx"], check=True,
                                capture_output=True, text=True).stdout.split()
        libs = subprocess.run(["pkg-config", "--libs-only-L", "ucx"], check=True,
                              capture_output=True, text=True).stdout.split()
    except subprocess.CalledProcessError:
        return None
    incs = [f[2:] for f in cflags if f.startswith("-I")]
    libdirs = [f[2:] for f in libs if f.startswith("-L")]
    return incs, libdirs, "pkg-config ucx"


def _from_wheel() -> tuple[list[str], list[str], str]:
    import libucx  # the libucx-cu12 wheel

    root = Path(libucx.__file__).resolve().parent
    version = getattr(libucx, "__version__", "?")
    return [str(root / "include")], [str(root / "lib")], f"libucx wheel {version}"


def locate_ucx() -> tuple[list[str], list[str], str]:
    home = os.environ.get("UCX_HOME")
    if home:
        return _from_home(home)
    found = _from_pkg_config()
    if found is not None:
        return found
    return _from_wheel()


INCLUDE_DIRS, LIBRARY_DIRS, UCX_SOURCE = locate_ucx()
DECLARATIONS = (HERE / "kvf_ucp.h").read_text()

ffibuilder = FFI()
ffibuilder.cdef(DECLARATIONS)
ffibuilder.cdef("const char *kvf_ucx_source(void);")
ffibuilder.set_source(
    "kvferry.transfer._ucp",
    "#include <stdint.h>\n#include <stddef.h>\n"
    + DECLARATIONS
    + "\nconst char *kvf_ucx_source(void) { return " + json.dumps(UCX_SOURCE) + "; }\n"
    + (HERE / "kvf_ucp.c").read_text(),
    include_dirs=INCLUDE_DIRS,
    library_dirs=LIBRARY_DIRS,
    runtime_library_dirs=LIBRARY_DIRS,
    libraries=["ucp", "ucs"],
    extra_compile_args=["-O3", "-std=gnu11", "-Wno-sign-compare"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
