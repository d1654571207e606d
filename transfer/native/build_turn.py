"""cffi (API mode) builder for ``kvferry.transfer._turn``: the in-place turn of KV rows
of ``kvf_turn.c`` (see ``kvf_turn.h``), a byte function that the engine calls on CPU
pools and vLLM caches whose pages landed in the other order
(``kvferry.engine.pool.turn_rows``).

A module of its own, like ``_checksum``: it links nothing but libc. cffi's API mode
releases the GIL around every call.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # setuptools runs this file by path, not as a module
from build_checksum import cdef_declarations  # type: ignore[import-not-found]  # noqa: E402

ffibuilder = FFI()
ffibuilder.cdef(cdef_declarations((HERE / "kvf_turn.h").read_text()))
ffibuilder.set_source(
    "kvferry.transfer._turn",
    '#include "kvf_turn.h"\n',
    # relative: setuptools refuses absolute source paths (the build runs from the root)
    sources=[os.path.relpath(HERE / "kvf_turn.c")],
    include_dirs=[str(HERE)],
    extra_compile_args=["-O3", "-std=gnu11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
