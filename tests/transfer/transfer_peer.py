"""A real second process for the transfer tests and the benchmark.

Roles:
  target     creates an engine and a segment, prints one JSON line
             {"address": hex, "segment": hex, "pid": n}, then serves commands that arrive
             as messages (msgpack maps) until "exit", its deadline, or its parent's death.
  initiator  connects to a target (--address/--segment hex), runs write+notify rounds
             and prints one JSON line with the outcome (used across network namespaces).

Commands (payload of send/notify, msgpack map):
  {"op": "check", "round": k, "seed": s, "src_len": n, "pages": [[l, r, len], ...]}
      compare every written page with the initiator's pattern; reply
      {"round": k, "ok": bool, "bad_pages": [...]}.
  {"op": "fill", "seed": s}   fill the segment with pattern(s, 0); reply {"ok": true}.
  {"op": "ping"}              reply {"ok": true}.
  {"op": "sum"}               reply {"sum": n}: the segment's bytes added up.
  {"op": "big", "n": n}       reply {"big": n bytes}: a message of many fragments.
  {"op": "exit"}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import msgpack
import numpy as np

from kvferry.transfer import SegmentDescriptor, TransferConfig, TransferEngine


def pattern(seed: int, round_: int, nbytes: int) -> np.ndarray:
    """The bytes an initiator writes in round ``round_``: deterministic, distinct per round."""
    return np.random.default_rng([seed, round_]).integers(0, 256, nbytes, dtype=np.uint8)


def scattered_pages(n: int, page: int, src_len: int, dst_len: int, seed: int) -> np.ndarray:
    """n non-overlapping pages at shuffled slots on both sides: [n, 3] int64."""
    rng = np.random.default_rng(seed)
    src_slots = rng.permutation(src_len // page)[:n]
    dst_slots = rng.permutation(dst_len // page)[:n]
    out = np.empty((n, 3), dtype=np.int64)
    out[:, 0] = src_slots * page
    out[:, 1] = dst_slots * page
    out[:, 2] = page
    return out


def check_pages(dst: np.ndarray, src: np.ndarray, pages) -> list[int]:
    bad = []
    for i, (lo, ro, ln) in enumerate(pages):
        if not np.array_equal(dst[ro : ro + ln], src[lo : lo + ln]):
            bad.append(i)
    return bad


def run_target(args: argparse.Namespace) -> int:
    eng = TransferEngine(TransferConfig(transports=args.transports, name=args.name))
    if args.mode == "allocate":
        seg = eng.allocate(args.size)
    else:
        buf = np.zeros(args.size, dtype=np.uint8)
        seg = eng.register(buf)
    view = seg.as_numpy()
    state = {"exit": False}

    def reply(sender: bytes, obj: dict) -> None:
        peer = eng.connect(sender)
        eng.send(peer, msgpack.packb(obj)).wait(5.0)

    def handle(sender: bytes, payload: bytes) -> None:
        cmd = msgpack.unpackb(payload)
        op = cmd.get("op")
        if op == "check":
            src = pattern(cmd["seed"], cmd["round"], cmd["src_len"])
            bad = check_pages(view, src, cmd["pages"])
            reply(sender, {"round": cmd["round"], "ok": not bad, "bad_pages": bad[:16]})
        elif op == "fill":
            view[:] = pattern(cmd["seed"], 0, view.size)
            reply(sender, {"ok": True})
        elif op == "sum":
            reply(sender, {"sum": int(view.sum(dtype=np.uint64))})
        elif op == "ping":
            reply(sender, {"ok": True, "malformed": eng.counters.malformed_messages})
        elif op == "big":
            reply(sender, {"big": bytes(cmd["n"])})
        elif op == "exit":
            state["exit"] = True

    eng.set_message_handler(handle)
    print(
        json.dumps(
            {
                "address": eng.address.hex(),
                "segment": seg.descriptor().pack().hex(),
                "pid": os.getpid(),
                "describe": eng.describe(),
            }
        ),
        flush=True,
    )
    parent = os.getppid()
    deadline = time.monotonic() + args.lifetime
    while not state["exit"] and time.monotonic() < deadline and os.getppid() == parent:
        eng.progress(0.05)
    eng.shutdown()
    return 0


def run_initiator(args: argparse.Namespace) -> int:
    eng = TransferEngine(TransferConfig(transports=args.transports, name=args.name))
    peer = eng.connect(bytes.fromhex(args.address), name="target")
    rseg = eng.open_segment(peer, SegmentDescriptor.unpack(bytes.fromhex(args.segment)))
    src_len = args.pages * args.page_bytes * 2
    src = eng.register(np.zeros(src_len, dtype=np.uint8))
    replies: list[dict] = []
    eng.set_message_handler(lambda s, p: replies.append(msgpack.unpackb(p)))
    failures = []
    for k in range(args.rounds):
        src.as_numpy()[:] = pattern(7, k, src_len)
        pages = scattered_pages(args.pages, args.page_bytes, src_len, rseg.length, seed=k)
        eng.write(peer, src, rseg, pages).wait(10.0)
        eng.notify(
            peer,
            msgpack.packb(
                {"op": "check", "round": k, "seed": 7, "src_len": src_len, "pages": pages.tolist()}
            ),
        ).wait(10.0)
        deadline = time.monotonic() + 10.0
        while len(replies) <= k and time.monotonic() < deadline:
            eng.progress(0.05)
        if len(replies) <= k or not replies[k]["ok"]:
            failures.append(k)
            break
    eng.send(peer, msgpack.packb({"op": "exit"})).wait(5.0)
    print(
        json.dumps(
            {"rounds": args.rounds, "failures": failures, "transports": eng.describe()["peers"]}
        ),
        flush=True,
    )
    eng.shutdown()
    return 0 if not failures else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=["target", "initiator"])
    ap.add_argument("--transports", default="shm")
    ap.add_argument("--name", default="peer")
    ap.add_argument("--size", type=int, default=16 << 20)
    ap.add_argument("--mode", choices=["allocate", "register"], default="allocate")
    ap.add_argument("--lifetime", type=float, default=120.0)
    ap.add_argument("--address", default="")
    ap.add_argument("--segment", default="")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-bytes", type=int, default=16 << 10)
    args = ap.parse_args(argv)
    return run_target(args) if args.role == "target" else run_initiator(args)


if __name__ == "__main__":
    sys.exit(main())
