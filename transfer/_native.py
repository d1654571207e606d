"""Loads the native UCX binding ``kvferry.transfer._ucp``.

The module is linked against UCX with an rpath; when it was built against the
``libucx`` wheel inside an isolated build environment that rpath no longer exists, so the
wheel's libraries are loaded first with ``libucx.load_library()`` (the dynamic loader then
resolves ``libucp.so.0`` by soname).
"""
from __future__ import annotations

try:
    from ._ucp import ffi, lib
except ImportError as first_error:
    try:
        import libucx
    except ImportError:
        raise first_error from None
    libucx.load_library()
    from ._ucp import ffi, lib

__all__ = ["ffi", "lib"]
