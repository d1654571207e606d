"""Builds the native modules (cffi, API mode) at install time, for both editable and
normal installs: ``kvferry.transfer._ucp``, the UCX binding; ``kvferry.transfer._checksum``,
the CPU page checksum; and ``kvferry.transfer._turn``, the CPU turn of pages between
layouts (these two link no UCX); everything else lives in pyproject.toml."""

from setuptools import setup

setup(
    cffi_modules=[
        "transfer/native/build_ucp.py:ffibuilder",
        "transfer/native/build_checksum.py:ffibuilder",
        "transfer/native/build_turn.py:ffibuilder",
    ]
)
