"""Transfer benchmark: two processes on this host, one JSON line per result.

Workloads (per transport, shm and tcp): 256 x 256 KiB and 4096 x 16 KiB scattered writes
(64 MiB per batch; gbps is the median over --batches batches after a warm-up that touches
every page set once), and 8 x 16 KiB write + notice latency: p50/p99 of the time from
posting the write to the notice being delivered to the target's handler (both processes
read the same CLOCK_MONOTONIC). Each page's first and last 8 bytes carry the round number;
after taking its timestamp the target checks (``checked``) either every byte of the 8 pages
(``byte-exact``: as a reader of KV pages does, which leaves their lines in its cache, so
the next write to those pages first takes them back) or only the two stamps of each page
(``stamps``: how transfer benchmarks usually time a write, the pages' bytes left alone).
The run fails on any mismatch. Both ways of posting are timed (``api``): ``write`` then
``notify``, and one ``write(..., notice=)``. ``copy`` says how the direct path copied.
In the same run: a memcpy of the same pages into pre-faulted memory (the ceiling), the
idle target's CPU use, and the CPU cost of one write + notice + delivery measured in one
process (two engines, no wake-ups: the software cost alone).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time

import msgpack
import numpy as np

from kvferry.transfer import Peer, SegmentDescriptor, TransferConfig, TransferEngine
from kvferry.transfer._native import COPY_FLAG_STREAMING, ffi, lib

MiB = 1 << 20


def emit(**rec) -> None:
    print(json.dumps(rec), flush=True)


def source_pattern(nbytes: int) -> np.ndarray:
    """The initiator's source bytes (the target recomputes them to check pages)."""
    cycle = np.arange(251, dtype=np.uint8)
    return np.tile(cycle, nbytes // 251 + 1)[:nbytes].copy()


def scattered(n: int, page: int, src_len: int, dst_len: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty((n, 3), dtype=np.int64)
    out[:, 0] = rng.permutation(src_len // page)[:n] * page
    out[:, 1] = rng.permutation(dst_len // page)[:n] * page
    out[:, 2] = page
    return out


# --------------------------------------------------------------------------- target
def run_target(args) -> int:
    eng = TransferEngine(
        TransferConfig(
            transports=args.transport,
            name="bench-target",
            spin_us=args.spin_us,
            busy_poll_us=args.busy_poll_us,
        )
    )
    if args.dest == "allocate":
        seg = eng.allocate(args.size)
    else:
        buf = np.ones(args.size, dtype=np.uint8)
        seg = eng.register(buf)
    view = seg.as_numpy()
    view[:] = 0
    pattern = source_pattern(args.src_size)
    state = {"exit": False}
    peers: dict[bytes, Peer] = {}

    def handle(sender: bytes, payload: bytes) -> None:
        t = time.monotonic_ns()  # delivery: the latency ends here
        cmd = msgpack.unpackb(payload)
        if cmd["op"] == "exit":
            state["exit"] = True
            return
        bad = 0
        stamp = np.frombuffer(int(cmd.get("i", 0)).to_bytes(8, "little"), np.uint8)
        every_byte = cmd.get("check") == "byte-exact"
        for lo, ro, ln in cmd.get("pages", ()):
            ok = (
                np.array_equal(view[ro : ro + 8], stamp)
                and np.array_equal(view[ro + ln - 8 : ro + ln], stamp)
                and (
                    not every_byte
                    or np.array_equal(view[ro + 8 : ro + ln - 8], pattern[lo + 8 : lo + ln - 8])
                )
            )
            bad += not ok
        peer = peers.get(sender) or peers.setdefault(sender, eng.connect(sender))
        eng.send(peer, msgpack.packb({"t": t, "i": cmd.get("i", 0), "bad": bad}))

    eng.set_message_handler(handle)
    print(
        json.dumps(
            {
                "address": eng.address.hex(),
                "segment": seg.descriptor().pack().hex(),
                "describe": eng.describe(),
            }
        ),
        flush=True,
    )
    deadline = time.monotonic() + args.lifetime
    parent = os.getppid()
    while not state["exit"] and time.monotonic() < deadline and os.getppid() == parent:
        eng.progress(0.05)
    eng.shutdown()
    return 0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------ initiator
class Bench:
    def __init__(self, args, transport: str, dest: str):
        self.args, self.transport, self.dest = args, transport, dest
        cmd = [
            sys.executable,
            "-m",
            "kvferry.cluster.harness.bench_transfer",
            "--role",
            "target",
            "--transport",
            transport,
            "--dest",
            dest,
            "--size",
            str(args.dst_mib * MiB),
            "--spin-us",
            str(args.spin_us),
            "--busy-poll-us",
            str(args.busy_poll_us),
            "--src-size",
            str(args.src_mib * MiB),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        if not ready:
            self.proc.kill()
            raise TimeoutError("target did not start within 60 s")
        hello = json.loads(self.proc.stdout.readline())
        self.eng = TransferEngine(
            TransferConfig(
                transports=transport,
                name="bench-initiator",
                spin_us=args.spin_us,
                busy_poll_us=args.busy_poll_us,
            )
        )
        self.replies: list = []
        self.eng.set_message_handler(lambda s, p: self.replies.append(msgpack.unpackb(p)))
        self.peer = self.eng.connect(bytes.fromhex(hello["address"]), name="bench-target")
        self.rseg = self.eng.open_segment(
            self.peer, SegmentDescriptor.unpack(bytes.fromhex(hello["segment"]))
        )
        self.src_buf = source_pattern(args.src_mib * MiB)
        self.src = self.eng.register(self.src_buf)
        self.path = "direct" if self.rseg.direct is not None else "ucp_put"
        self.transports_used = self.eng.describe()["peers"]["bench-target"]["transports"]

    def base(self, copied_bytes: int | None = None, **rec) -> dict:
        """Keys shared by this bench's lines; ``copied_bytes`` (a batch's size) adds
        which copy the direct path used for it."""
        copy = (
            {"copy": "streaming" if self.eng.copies_streaming(copied_bytes) else "memcpy"}
            if self.path == "direct" and copied_bytes is not None
            else {}
        )
        return {
            "engine": "kvferry",
            "transport": self.transport,
            "dest": self.dest,
            "path": self.path,
            **copy,
            "ucx_transports": self.transports_used,
            **rec,
        }

    def throughput(self, npages: int, page: int) -> None:
        times = []
        pages = [
            scattered(npages, page, self.src.length, self.rseg.length, seed=s) for s in range(4)
        ]
        warmup = max(self.args.warmup, len(pages))  # first touch of every page set
        for i in range(warmup + self.args.batches):
            t0 = time.perf_counter()
            self.eng.write(self.peer, self.src, self.rseg, pages[i % 4]).wait(60.0)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
        nbytes = npages * page
        rates = sorted(nbytes / t / 1e9 for t in times)
        emit(
            **self.base(
                nbytes,
                op="write",
                pages=npages,
                page_bytes=page,
                batch_bytes=nbytes,
                gbps=round(statistics.median(rates), 3),
                gbps_min=round(rates[0], 3),
                gbps_max=round(rates[-1], 3),
                batches=len(times),
            )
        )

    def latency(self, fused: bool, check: str, npages: int = 8, page: int = 16 << 10) -> None:
        """Write npages, notify; the target timestamps delivery, then checks the pages
        (``check``: byte-exact or stamps). ``fused``: one ``write(..., notice=)`` call,
        else ``write`` then ``notify``."""
        lat = []
        sets = [
            scattered(npages, page, self.src.length, self.rseg.length, seed=s) for s in range(16)
        ]
        n_total = self.args.latency_warmup + self.args.latency_iters
        for i in range(n_total):
            pages = sets[i % len(sets)]
            stamp = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            for lo, _, ln in pages:
                self.src_buf[lo : lo + 8] = stamp
                self.src_buf[lo + ln - 8 : lo + ln] = stamp
            payload = msgpack.packb({"op": "lat", "i": i, "pages": pages.tolist(), "check": check})
            n = len(self.replies)
            t0 = time.monotonic_ns()
            if fused:
                self.eng.write(self.peer, self.src, self.rseg, pages, notice=payload)
            else:
                self.eng.write(self.peer, self.src, self.rseg, pages)
                self.eng.notify(self.peer, payload)
            deadline = time.monotonic() + 10
            while len(self.replies) <= n:
                if time.monotonic() > deadline:
                    raise TimeoutError("latency reply missing")
                self.eng.progress(0.01)
            reply = self.replies[n]
            if reply["i"] != i or reply["bad"]:
                raise RuntimeError(
                    f"round {i}: {reply['bad']} of {npages} pages differ at "
                    f"the target (reply for round {reply['i']})"
                )
            if i >= self.args.latency_warmup:
                lat.append((reply["t"] - t0) / 1e3)
        for lo in np.unique(np.concatenate([p[:, 0] for p in sets])):  # plain pattern again
            for at in (lo, lo + page - 8):
                self.src_buf[at : at + 8] = (np.arange(at, at + 8) % 251).astype(np.uint8)
        lat.sort()
        emit(
            **self.base(
                npages * page,
                op="write+notify",
                api=API[fused],
                pages=npages,
                page_bytes=page,
                p50_us=round(lat[len(lat) // 2], 1),
                p99_us=round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
                iters=len(lat),
                checked=check,
                busy_poll_us=self.args.busy_poll_us,
                gbps=round(npages * page / (lat[len(lat) // 2] * 1e3), 3),
            )
        )

    def idle_cpu(self, seconds: float = 1.0) -> None:
        c0, t0 = cpu_seconds(self.proc.pid), time.monotonic()
        time.sleep(seconds)
        pct = 100 * (cpu_seconds(self.proc.pid) - c0) / (time.monotonic() - t0)
        emit(**self.base(op="idle_target_cpu", cpu_pct=round(pct, 1)))

    def close(self) -> None:
        try:
            self.eng.send(self.peer, msgpack.packb({"op": "exit"})).wait(5)
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
        self.eng.shutdown()


API = {True: "write(notice=)", False: "write,notify"}


def cpu_per_op(args, transport: str, fused: bool, npages: int = 8, page: int = 16 << 10) -> None:
    """Software cost of write + notice + delivery: two engines in this process, the target
    drained right after each notice, so no wake-up or scheduling is counted."""
    a = TransferEngine(TransferConfig(transports=transport, name="cpu-initiator"))
    b = TransferEngine(TransferConfig(transports=transport, name="cpu-target"))
    try:
        dst = b.allocate(16 * MiB)
        dst.as_numpy()[:] = 0
        src = a.register(source_pattern(16 * MiB))
        peer = a.connect(b.address, name="cpu-target")
        rseg = a.open_segment(peer, dst.descriptor())
        got: list = []
        b.set_message_handler(lambda sender, payload: got.append(payload))
        sets = [scattered(npages, page, src.length, rseg.length, seed=s) for s in range(16)]
        payload = msgpack.packb({"op": "lat", "i": 0})
        iters = args.cpu_iters
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(iters):
            if fused:
                a.write(peer, src, rseg, sets[i % 16], notice=payload)
            else:
                a.write(peer, src, rseg, sets[i % 16])
                a.notify(peer, payload)
            deadline = time.monotonic() + 10
            while not got:
                b.progress(0)
                a.progress(0)
                if time.monotonic() > deadline:
                    raise TimeoutError("in-process notice missing")
            got.pop()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        emit(
            engine="kvferry",
            transport=transport,
            op="write+notify cpu",
            api=API[fused],
            pages=npages,
            page_bytes=page,
            cpu_us=round(cpu / iters * 1e6, 2),
            wall_us=round(wall / iters * 1e6, 2),
            iters=iters,
            path="direct" if rseg.direct is not None else "ucp_put",
        )
    finally:
        a.shutdown()
        b.shutdown()


def memcpy_ceiling(args, npages: int, page: int) -> None:
    """The same scattered pages copied between pre-faulted buffers in this process: plain
    memcpy (the ceiling the goals are stated against) and streaming stores (the copy the
    engine's direct path uses)."""
    src = np.full(args.src_mib * MiB, 0x5A, dtype=np.uint8)
    dst = np.zeros(args.dst_mib * MiB, dtype=np.uint8)
    dst[:] = 1  # pre-fault
    for streaming in (False, True):
        times = []
        for i in range(args.warmup + args.batches):
            pages = scattered(npages, page, src.size, dst.size, seed=i % 4)
            t0 = time.perf_counter()
            lib.kvf_memcpy_pages(
                ffi.cast("char *", dst.ctypes.data),
                ffi.cast("char *", src.ctypes.data),
                ffi.cast("int64_t *", pages.ctypes.data),
                npages,
                COPY_FLAG_STREAMING if streaming else 0,
            )
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times.append(dt)
        rates = sorted(npages * page / t / 1e9 for t in times)
        emit(
            engine="memcpy",
            transport="local",
            op="memcpy",
            pages=npages,
            page_bytes=page,
            copy="streaming" if streaming else "memcpy",
            gbps=round(statistics.median(rates), 3),
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["initiator", "target"], default="initiator")
    ap.add_argument("--transport", default="shm", help="target role: shm or tcp")
    ap.add_argument("--transports", default="shm,tcp", help="initiator: which to run")
    ap.add_argument("--dest", default="allocate", choices=["allocate", "register"])
    ap.add_argument(
        "--dests",
        default="allocate,register",
        help="initiator: destination kinds on shm (tcp uses allocate)",
    )
    ap.add_argument("--size", type=int, default=256 * MiB)
    ap.add_argument("--src-mib", type=int, default=256)
    ap.add_argument("--dst-mib", type=int, default=256)
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--latency-iters", type=int, default=400)
    ap.add_argument("--latency-warmup", type=int, default=50)
    ap.add_argument("--spin-us", type=int, default=100)
    ap.add_argument(
        "--busy-poll-us",
        type=int,
        default=TransferConfig.busy_poll_us,
        help="busy-poll window after the last activity (0: sleep at once)",
    )
    ap.add_argument("--cpu-iters", type=int, default=5000)
    ap.add_argument("--src-size", type=int, default=256 * MiB, help="target role")
    ap.add_argument("--lifetime", type=float, default=900.0)
    args = ap.parse_args(argv)
    if args.role == "target":
        return run_target(args)
    workloads = [(256, 256 << 10), (4096, 16 << 10)]
    emit(
        engine="host",
        op="load",
        cpus=os.cpu_count(),
        loadavg=[round(x, 2) for x in os.getloadavg()],
    )  # context for noisy figures
    for npages, page in workloads:
        memcpy_ceiling(args, npages, page)
    for transport in args.transports.split(","):
        for fused in (False, True):
            cpu_per_op(args, transport, fused)
    for transport in args.transports.split(","):
        dests = args.dests.split(",") if transport == "shm" else ["allocate"]
        for dest in dests:
            b = Bench(args, transport, dest)
            try:
                for npages, page in workloads:
                    b.throughput(npages, page)
                for check in ("byte-exact", "stamps"):
                    for fused in (False, True):
                        b.latency(fused, check)
                b.idle_cpu()
            finally:
                b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
