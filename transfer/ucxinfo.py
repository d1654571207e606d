"""What the UCX under this build offers: versions (built against, running), optional
features compiled out, the transport components and RDMA devices below ucp, and the
refusal of ``transports="rdma"`` when verbs or a device is missing.

``python -m kvferry.transfer [--transports rdma]`` prints it as JSON (exit status 2
when ``--transports rdma`` would be refused, with the reason).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from ._native import ffi, lib
from .errors import RdmaUnavailableError, status_name

# Optional features of the native layer: the UCX release that brought each, and what a
# build without it does instead.
FEATURES = {
    "ep_transports": (
        (1, 14),
        "per-endpoint transport query (ucp_ep_query with "
        "UCP_EP_ATTR_FIELD_TRANSPORTS); an endpoint's transports are "
        "read from ucp_ep_print_info instead",
    ),
}
# uct components whose memory domains are RDMA devices (verbs; "mlx5" in newer UCX).
RDMA_COMPONENTS = ("ib", "mlx5")
RDMA_TLS = ("rc", "ud", "dc")
_LANE = re.compile(r"lane\[\d+\]:\s+\d+:([\w-]+)/(\S+?)\.\d+\s")


def _text(ptr: Any) -> str:
    """A NUL-terminated C string (a cffi ``char *``) as text."""
    text: bytes = ffi.string(ptr)
    return text.decode(errors="replace")


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """``built`` (the headers' UCP API major.minor) and ``running`` (the library's)."""
    vals = [ffi.new("unsigned *") for _ in range(5)]
    lib.kvf_ucx_versions(*vals)
    bmaj, bmin, rmaj, rmin, rrel = (int(v[0]) for v in vals)
    return {"built": f"{bmaj}.{bmin}", "running": f"{rmaj}.{rmin}.{rrel}"}


def unavailable_features() -> list[str]:
    """A sentence per optional feature this build lacks (empty on a recent UCX)."""
    have = set(filter(None, _text(lib.kvf_features()).split(",")))
    return [
        f"{what}: needs UCX >= {v[0]}.{v[1]}, built against {versions()['built']}"
        for name, (v, what) in FEATURES.items()
        if name not in have
    ]


def has_feature(name: str) -> bool:
    return name in _text(lib.kvf_features()).split(",")


@dataclass
class Inventory:
    """The uct components and their memory domains; for RDMA components also each
    domain's transport resources ("rc_verbs/mlx5_0:1", ...)."""

    components: dict[str, list[str]] = field(default_factory=dict)
    resources: dict[str, list[str]] = field(default_factory=dict)  # "ib/mlx5_0" -> [...]

    @classmethod
    def parse(cls, text: str) -> Inventory:
        inv = cls()
        for line in text.splitlines():
            parts = line.split("\t")
            if len(parts) == 2:
                inv.components[parts[0]] = parts[1].split()
            elif len(parts) == 3:
                inv.resources[f"{parts[0]}/{parts[1]}"] = parts[2].split()
        return inv

    def has_verbs(self) -> bool:
        return any(c in self.components for c in RDMA_COMPONENTS)

    def rdma_devices(self) -> list[str]:
        """The RDMA memory domains (e.g. "mlx5_0")."""
        return [md for c in RDMA_COMPONENTS for md in self.components.get(c, [])]

    def rdma_transports(self) -> list[str]:
        """rc/ud/dc resources as "tl/device:port"."""
        return [
            r
            for rs in self.resources.values()
            for r in rs
            if r.split("/")[0].split("_")[0] in RDMA_TLS
        ]


@functools.lru_cache(maxsize=1)
def inventory() -> Inventory:
    """This UCX's components (opens the RDMA devices, once per process)."""
    buf = ffi.new("char[]", 1 << 16)
    st = lib.kvf_uct_inventory(",".join(RDMA_COMPONENTS).encode(), buf, len(buf))
    if st != 0:
        raise RdmaUnavailableError(
            f"listing UCX's transport components failed: {status_name(int(st))}", "components"
        )
    return Inventory.parse(_text(buf))


def iface_option(component: str, tl: str, name: str) -> tuple[int, str]:
    """(status, value) of a transport's option as this UCX would read it now: the
    environment, else UCX's default. Status 0, or -12 (no such option/component here),
    -14 (the component has no device)."""
    buf = ffi.new("char[256]")
    st = lib.kvf_uct_iface_option(component.encode(), tl.encode(), name.encode(), buf, 256)
    return int(st), _text(buf)


def ucx_label() -> str:
    return (
        f"UCX {versions()['running']} at {_text(lib.kvf_library_path()) or '?'} "
        f"({_text(lib.kvf_ucx_source()).split(';')[0]})"
    )


def _net_devices(env: dict[str, str]) -> list[str] | None:
    value = env.get("UCX_NET_DEVICES", "").strip()
    return None if value in ("", "all") else [d for d in value.split(",") if d]


def rdma_refusal(inv: Inventory, label: str, env: dict[str, str]) -> tuple[str, str] | None:
    """(what is missing, message) when ``transports="rdma"`` cannot run, else None."""
    fix = (
        "build kvferry against a UCX with verbs: KVFERRY_UCX=system (or =/prefix) "
        "pip install -e . (README, section RDMA)"
    )
    if not inv.has_verbs():
        found = ", ".join(inv.components) or "none"
        return "verbs", (
            f"--transports rdma needs a UCX built with verbs, but {label} has "
            f"no verbs transport component ({' or '.join(RDMA_COMPONENTS)}; "
            f"its components: {found}); {fix}"
        )
    devices = inv.rdma_devices()
    if not devices:
        return "device", (
            f"--transports rdma: no RDMA device: {label} has verbs but its "
            f"verbs components list no device (check ibv_devices, "
            f"/sys/class/infiniband, the NIC driver and rdma-core's "
            f"providers)"
        )
    transports = inv.rdma_transports()
    if not transports:
        return "transport", (
            f"--transports rdma: the RDMA devices {', '.join(devices)} offer "
            f"no rc, ud or dc transport under {label}"
        )
    wanted = _net_devices(env)
    if wanted is not None:
        usable = [t for t in transports if t.split("/", 1)[1] in wanted]
        if not usable:
            return "device", (
                f"--transports rdma: UCX_NET_DEVICES={','.join(wanted)} names "
                f"none of the RDMA devices ({', '.join(transports)})"
            )
    return None


def check_rdma(env: dict[str, str] | None = None) -> dict[str, list[str]]:
    """The RDMA devices and transports, or RdmaUnavailableError naming what is missing."""
    inv = inventory()
    refused = rdma_refusal(inv, ucx_label(), dict(os.environ if env is None else env))
    if refused is not None:
        missing, message = refused
        raise RdmaUnavailableError(message, missing)
    return {"devices": inv.rdma_devices(), "transports": inv.rdma_transports()}


def lanes_from_print_info(text: str) -> str:
    """ "tl/dev,..." from ucp_ep_print_info's lane lines (first appearance order)."""
    seen: list[str] = []
    for tl, dev in _LANE.findall(text):
        if f"{tl}/{dev}" not in seen:
            seen.append(f"{tl}/{dev}")
    return ",".join(seen)


def lane_transports(lanes: str) -> set[str]:
    """The transport names in an endpoint's lanes ``"tl/dev,..."`` (as
    :func:`endpoint_transports` gives them): ``{"posix", "cma", ...}``."""
    return {lane.split("/", 1)[0].strip() for lane in lanes.split(",") if lane.strip()}


def endpoint_transports(ep: Any) -> tuple[str, str]:
    """(transports "tl/dev,...", how they were read) of a ucp endpoint."""
    buf = ffi.new("char[]", 1 << 14)
    if lib.kvf_ep_transports(ep, buf, len(buf)) == 0:
        return _text(buf), "ucp_ep_query"
    if lib.kvf_ep_print_info(ep, buf, len(buf)) == 0:
        return lanes_from_print_info(_text(buf)), "ucp_ep_print_info"
    return "", "unavailable"


def report(transports: str | None = None) -> dict[str, Any]:
    """Everything above as one dict (the CLI's output)."""
    inv = inventory()
    out = {
        "ucx": ucx_label(),
        "build": _text(lib.kvf_ucx_source()),
        **versions(),
        "unavailable": unavailable_features(),
        "components": inv.components,
        "verbs": inv.has_verbs(),
        "rdma_devices": inv.rdma_devices(),
        "rdma_transports": inv.rdma_transports(),
    }
    if transports == "rdma":
        refused = rdma_refusal(inv, ucx_label(), dict(os.environ))
        out["rdma_refused"] = None if refused is None else refused[1]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", choices=["shm", "tcp", "rdma"], default=None)
    args = p.parse_args(argv)
    out = report(args.transports)
    print(json.dumps(out, indent=2))
    return 2 if out.get("rdma_refused") else 0


if __name__ == "__main__":
    sys.exit(main())
