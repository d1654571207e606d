"""Builds the native UCX binding ``kvferry.transfer._ucp`` (cffi, API mode) at install
time, for both editable and normal installs; everything else lives in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["transfer/native/build_ucp.py:ffibuilder"])
