"""cffi (API mode) builder for ``kvferry.transfer._ucp``, the native layer over UCX ucp.

Which UCX is used is decided by ``ucx_locate.py`` (``KVFERRY_UCX=wheel|system|auto|/prefix``;
unset: ``UCX_HOME`` if set, else the ``libucx`` wheel) and printed, with the reason and how
to choose another; a UCX that cannot be used (too old, headers or ``libucp.so`` missing) is
refused before anything is compiled, with both versions in the message.

The module is linked with an rpath to the chosen lib folder, so it finds ``libucp.so.0``
without ``LD_LIBRARY_PATH``; the runtime also calls ``libucx.load_library()`` first when
the wheel is the source (the ``kvferry-ucx-origin=`` mark of ``kvf_ucx_origin``, which
``_native.py`` reads from the file before loading it): a build isolated by pip links to a
wheel that is gone afterwards, and the loader would otherwise take whatever
``libucp.so.0`` the system has. The choice is recorded in the module (``kvf_ucx_source``)
and reported by ``describe()``.

``kvf_ucp.c`` is compiled as its own translation unit (it includes ``kvf_ucp.h``); the
cffi module's source only includes the header and defines the two build records above.
cffi's ``cdef`` gets the header's declarations between its ``KVF_CDEF_BEGIN`` and
``KVF_CDEF_END`` markers, with ``ucs_status_t`` declared as an integer type whose size
cffi takes from UCX's header (it is a packed enum).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from cffi import FFI

HERE = Path(__file__).resolve().parent


def _locator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvferry_ucx_locate", HERE / "ucx_locate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


def choose_ucx() -> Any:
    """The UcxBuild to compile against (typed Any: ucx_locate is loaded from its file, not
    imported); exits with the locator's message when none fits."""
    locator = _locator()
    try:
        build = locator.locate()
    except locator.UcxChoiceError as exc:
        sys.exit(f"kvferry: cannot build the UCX binding: {exc}")
    print(f"kvferry: building against {build.summary()}", file=sys.stderr)
    for note in build.notes:
        print(f"kvferry: note: {note}", file=sys.stderr)
    return build


UCX = choose_ucx()
ORIGIN_MARK = "kvferry-ucx-origin="
CDEF_BEGIN, CDEF_END = "/* KVF_CDEF_BEGIN */", "/* KVF_CDEF_END */"


def cdef_declarations(header: str) -> str:
    """The part of kvf_ucp.h that cffi parses (plain C, no preprocessor lines)."""
    begin, end = header.index(CDEF_BEGIN) + len(CDEF_BEGIN), header.index(CDEF_END)
    return "typedef int... ucs_status_t;\n" + header[begin:end]


ffibuilder = FFI()
ffibuilder.cdef(cdef_declarations((HERE / "kvf_ucp.h").read_text()))
ffibuilder.cdef("const char *kvf_ucx_source(void);\nextern const char kvf_ucx_origin[];")
ffibuilder.set_source(
    "kvferry.transfer._ucp",
    '#include "kvf_ucp.h"\n'
    "const char *kvf_ucx_source(void) { return "
    + json.dumps(UCX.summary())
    + "; }\n"
    # Read from the file by _native.py before loading: a wheel build loads the wheel first.
    + "const char kvf_ucx_origin[] = "
    + json.dumps(ORIGIN_MARK + UCX.origin)
    + ";\n",
    # relative: setuptools refuses absolute source paths (the build runs from the root)
    sources=[os.path.relpath(HERE / "kvf_ucp.c")],
    include_dirs=[str(HERE), *UCX.include_dirs],
    library_dirs=UCX.library_dirs,
    runtime_library_dirs=UCX.library_dirs,
    libraries=["ucp", "uct", "ucs"],
    extra_compile_args=["-O3", "-std=gnu11", "-Wno-sign-compare"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
