"""Loads the native UCX binding ``kvferry.transfer._ucp``.

The module is linked against UCX with an rpath. When it was built against the ``libucx``
wheel (its file says ``kvferry-ucx-origin=wheel``), the wheel's libraries are loaded first
with ``libucx.load_library()``: a build isolated by pip leaves an rpath that no longer
exists, and the dynamic loader would then resolve ``libucp.so.0`` to a system UCX if one is
installed. A UCX older than the one the module was built against is refused here, with
both versions.
"""
from __future__ import annotations

import importlib.util

ORIGIN_WHEEL = b"kvferry-ucx-origin=wheel"


def _built_against_wheel() -> bool:
    spec = importlib.util.find_spec(f"{__package__}._ucp")
    if spec is None or not spec.origin:
        return False
    with open(spec.origin, "rb") as f:
        return ORIGIN_WHEEL in f.read()


def _load_wheel() -> bool:
    try:
        import libucx
    except ImportError:
        return False
    libucx.load_library()
    return True


if _built_against_wheel():
    _load_wheel()
try:
    from ._ucp import ffi, lib
except ImportError as first_error:
    if not _load_wheel():
        raise first_error from None
    from ._ucp import ffi, lib


def _check_versions() -> None:
    v = [ffi.new("unsigned *") for _ in range(5)]
    lib.kvf_ucx_versions(*v)
    built, running = (int(v[0][0]), int(v[1][0])), (int(v[2][0]), int(v[3][0]))
    if running < built:
        raise ImportError(
            f"kvferry's UCX binding was built against UCX {built[0]}.{built[1]} "
            f"({ffi.string(lib.kvf_ucx_source()).decode()}) but loaded UCX "
            f"{ffi.string(lib.kvf_version_string()).decode()} from "
            f"{ffi.string(lib.kvf_library_path()).decode()}: rebuild it against that UCX "
            "(KVFERRY_UCX=system or a prefix) or fix LD_LIBRARY_PATH")


_check_versions()

__all__ = ["ffi", "lib"]
