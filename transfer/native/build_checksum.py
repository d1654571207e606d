"""cffi (API mode) builder for ``kvferry.transfer._checksum``: the page checksum of
``kvf_checksum.c`` (see ``kvf_checksum.h``), a byte function that the engine calls on CPU
pools (``kvferry.engine.integrity.page_checksums``).

A module of its own, apart from ``_ucp``: it links nothing but libc, so checksumming needs
neither UCX nor the UCX version checks of ``_native.py``, and its build cannot fail on a
UCX choice. ``kvf_checksum.c`` is compiled as its own translation unit; cffi's ``cdef``
gets the header's declarations between ``KVF_CDEF_BEGIN`` and ``KVF_CDEF_END``. cffi's API
mode releases the GIL around every call, so a checksum runs while other threads do.
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
CDEF_BEGIN, CDEF_END = "/* KVF_CDEF_BEGIN */", "/* KVF_CDEF_END */"


def cdef_declarations(header: str) -> str:
    """The part of kvf_checksum.h that cffi parses (plain C, no preprocessor lines)."""
    return header[header.index(CDEF_BEGIN) + len(CDEF_BEGIN) : header.index(CDEF_END)]


ffibuilder = FFI()
ffibuilder.cdef(cdef_declarations((HERE / "kvf_checksum.h").read_text()))
ffibuilder.set_source(
    "kvferry.transfer._checksum",
    '#include "kvf_checksum.h"\n',
    # relative: setuptools refuses absolute source paths (the build runs from the root)
    sources=[os.path.relpath(HERE / "kvf_checksum.c")],
    include_dirs=[str(HERE)],
    extra_compile_args=["-O3", "-std=gnu11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
