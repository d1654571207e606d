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

KV-shaped rows (``op: kv-burst``), the method of the kv-transfer suites: a burst of 1-64
requests, each one write of its own layer-major descriptor list (for every layer, K then
V, every block of a seeded random block table, source and destination pools laid out
``[layers, 2, blocks, block_bytes]`` as a paged KV cache is), the same total bytes at every
burst size; beside them a one-descriptor ``bulk`` write of those bytes, the wire's ceiling
in this run, and each row's ``ceiling_ratio`` against it.

Every throughput row (scattered, kv-burst, bulk) checks its bytes at the target: the
destination is cleared after the warm-up, the timed batches run, then the target compares
every byte each descriptor wrote with the source pattern (``verified``); a mismatch fails
the run.

Placement (``--placement``, in every line): ``split`` (the default with two or more CPUs)
runs the initiator on one CPU and the target on another, as a writer and its owner run on
hosts of their own; ``any`` leaves them to the scheduler, which over loopback tcp often
keeps both on one CPU (a sender's wake-up pulls its receiver over), cutting that run's
tcp figures to a third at random; ``shared`` puts both on one CPU on purpose.
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
VERIFY_RUNS = 8192  # descriptors per verify request (192 KiB, under the message limit)


def placement_cpus(placement: str) -> tuple[set[int], set[int]] | None:
    """(initiator CPUs, target CPUs) for ``placement``, or None to leave both as they are.
    ``split`` needs two CPUs this process may use; with fewer it runs as ``any``."""
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "split" and len(cpus) >= 2:
        return {cpus[0]}, {cpus[1]}
    if placement == "shared":
        return {cpus[0]}, {cpus[0]}
    return None


def placement_name(pinned: tuple[set[int], set[int]] | None) -> str:
    """What :func:`placement_cpus` gave, named as ``--placement`` names it."""
    if pinned is None:
        return "any"
    return "shared" if pinned[0] == pinned[1] else "split"


def tcp_congestion_control() -> str | None:
    """The congestion control this network namespace gives new tcp connections (None where
    unreadable): over loopback under ``bbr`` a connection's segments arrive out of order
    and are sent again, and the tcp rows swing with it (transfer/README.md, "Benchmark")."""
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return None


def emit(**rec) -> None:
    print(json.dumps(rec), flush=True)


def source_pattern(nbytes: int) -> np.ndarray:
    """The initiator's source bytes (the target recomputes them to check pages)."""
    cycle = np.arange(251, dtype=np.uint8)
    return np.tile(cycle, nbytes // 251 + 1)[:nbytes].copy()


def scattered(
    n: int, page: int, src_len: int, dst_len: int, seed: int, part: tuple[int, int] = (0, 1)
) -> np.ndarray:
    """``n`` random (source, destination) pages; ``part=(k, of)``: the destinations are
    the k-th of ``of`` disjoint slices of one permutation (shared by every k), so that the
    sets of a byte-checked row never write each other's pages."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, 3), dtype=np.int64)
    out[:, 0] = rng.permutation(src_len // page)[:n] * page
    k, of = part
    dst = np.random.default_rng(10_000 + of).permutation(dst_len // page)
    out[:, 1] = (
        dst[k * n : (k + 1) * n] * page if of > 1 else rng.permutation(dst_len // page)[:n] * page
    )
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
        if cmd["op"] == "zero":
            view[:] = 0
        elif cmd["op"] == "verify":
            runs = np.frombuffer(cmd["runs"], dtype="<i8").reshape(-1, 3)
            bad = sum(
                not np.array_equal(view[ro : ro + ln], pattern[lo : lo + ln])
                for lo, ro, ln in runs.tolist()
            )
            peer = peers.get(sender) or peers.setdefault(sender, eng.connect(sender))
            eng.send(peer, msgpack.packb({"op": "verified", "bad": bad, "runs": len(runs)}))
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


def kv_descriptors(
    requests: int,
    blocks: int,
    layers: int,
    block: int,
    src_blocks: int,
    dst_blocks: int,
    seed: int,
) -> list[np.ndarray]:
    """One ``[layers * 2 * blocks, 3]`` descriptor list per request, layer-major (layer,
    then K/V, then block), over pools laid out ``[layers, 2, pool blocks, block]``: each
    request's source and destination block tables drawn from a seeded generator, no block
    shared between the burst's requests."""
    rng = np.random.default_rng(seed)
    src = rng.permutation(src_blocks)[: requests * blocks].reshape(requests, blocks)
    dst = rng.permutation(dst_blocks)[: requests * blocks].reshape(requests, blocks)
    plane = np.arange(layers * 2, dtype=np.int64)[:, None]  # (layer, kv) planes
    out = []
    for r in range(requests):
        lo = ((plane * src_blocks + src[r][None, :]) * block).reshape(-1)
        ro = ((plane * dst_blocks + dst[r][None, :]) * block).reshape(-1)
        out.append(np.stack([lo, ro, np.full_like(lo, block)], axis=1))
    return out


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------ initiator
class Bench:
    def __init__(
        self,
        args,
        transport: str,
        dest: str,
        cross_memory: bool = True,
        pinned: tuple[set[int], set[int]] | None = None,
    ):
        """``pinned``: (this process's CPUs, the target's), from :func:`placement_cpus`
        (None: both left as they are), named in every line."""
        self.args, self.transport, self.dest = args, transport, dest
        self.placement = placement_name(pinned)
        cmd = [
            sys.executable,
            "-m",
            "kvferry.transfer.tools.bench_transfer",
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
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            preexec_fn=None if pinned is None else lambda: os.sched_setaffinity(0, pinned[1]),
        )
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
                cross_memory_copy=cross_memory,
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
        self.path = self.rseg.path
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
            "placement": self.placement,
            "transport": self.transport,
            "dest": self.dest,
            "path": self.path,
            **copy,
            "ucx_transports": self.transports_used,
            **rec,
        }

    def _ask(self, obj: dict, timeout_s: float = 60.0) -> dict:
        """Send a command to the target (after every earlier write: ``notify``) and wait
        for its reply."""
        n = len(self.replies)
        self.eng.notify(self.peer, msgpack.packb(obj)).wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        while len(self.replies) <= n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply to {obj['op']} within {timeout_s:.0f} s")
            self.eng.progress(0.01)
        return self.replies[n]

    def _timed(self, sets: list[list[np.ndarray]]) -> list[float]:
        """Seconds per timed round; a round posts each descriptor list of one set (one
        write per list, all in flight together) and waits for all. The warm-up touches
        every set once; then the target is cleared, the timed rounds run, and the target
        checks every byte of every set (RuntimeError on any mismatch)."""
        warmup = max(self.args.warmup, len(sets))
        for i in range(warmup):
            for b in [
                self.eng.write(self.peer, self.src, self.rseg, d) for d in sets[i % len(sets)]
            ]:
                b.wait(60.0)
        self._ask({"op": "zero"})
        times = []
        for i in range(max(self.args.batches, len(sets))):
            t0 = time.perf_counter()
            batches = [
                self.eng.write(self.peer, self.src, self.rseg, d) for d in sets[i % len(sets)]
            ]
            for b in batches:
                b.wait(60.0)
            times.append(time.perf_counter() - t0)
        runs = np.ascontiguousarray(np.concatenate([d for s in sets for d in s]), dtype="<i8")
        bad = 0
        for lo in range(0, len(runs), VERIFY_RUNS):  # each ask under the message limit
            bad += self._ask({"op": "verify", "runs": runs[lo : lo + VERIFY_RUNS].tobytes()})["bad"]
        if bad:
            raise RuntimeError(
                f"{bad} of {len(runs)} descriptors differ at the target "
                f"({self.transport}, {self.dest})"
            )
        return times

    def _rates(self, nbytes: int, times: list[float]) -> dict:
        rates = sorted(nbytes / t / 1e9 for t in times)
        return dict(
            gbps=round(statistics.median(rates), 3),
            gbps_min=round(rates[0], 3),
            gbps_max=round(rates[-1], 3),
            batches=len(times),
            verified="byte-exact",
        )

    def throughput(self, npages: int, page: int) -> None:
        nsets = max(1, min(4, self.rseg.length // (npages * page)))  # disjoint targets
        pages = [
            [scattered(npages, page, self.src.length, self.rseg.length, seed=s, part=(s, nsets))]
            for s in range(nsets)
        ]
        nbytes = npages * page
        times = self._timed(pages)
        emit(
            **self.base(
                nbytes,
                op="write",
                pages=npages,
                page_bytes=page,
                batch_bytes=nbytes,
                **self._rates(nbytes, times),
            )
        )

    def bulk(self, nbytes: int) -> float:
        """One descriptor of ``nbytes``: the wire's ceiling for these bytes in this run."""
        sets = [[np.array([[s * nbytes, s * nbytes, nbytes]], dtype=np.int64)] for s in range(2)]
        rates = self._rates(nbytes, self._timed(sets))
        emit(**self.base(nbytes, op="bulk", descriptors=1, batch_bytes=nbytes, **rates))
        return rates["gbps"]

    def kv_burst(self, requests: int, layers: int, block: int, total: int, ceiling: float) -> None:
        """A burst of ``requests`` requests of ``total`` bytes in all, each written as one
        layer-major descriptor list over its seeded random block tables."""
        per_req = total // (requests * layers * 2 * block)
        src_blocks = self.src.length // (layers * 2 * block)
        dst_blocks = self.rseg.length // (layers * 2 * block)
        both = kv_descriptors(2 * requests, per_req, layers, block, src_blocks, dst_blocks, seed=7)
        sets = [both[:requests], both[requests:]]  # no destination block in both
        nbytes = requests * per_req * layers * 2 * block
        rates = self._rates(nbytes, self._timed(sets))
        emit(
            **self.base(
                block * per_req * layers * 2,
                op="kv-burst",
                requests=requests,
                layers=layers,
                blocks_per_request=per_req,
                descriptors=requests * per_req * layers * 2,
                block_bytes=block,
                batch_bytes=nbytes,
                **rates,
                ceiling_ratio=round(rates["gbps"] / ceiling, 3) if ceiling else None,
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


def raw_write_seconds(
    nbytes: int, run_bytes: int, transport: str = "shm", rounds: int = 3
) -> float:
    """Median seconds of one write of ``nbytes`` in runs of ``run_bytes`` (a prompt's pages,
    in order) from this process's engine into another process's: the transfer engine's
    writes with no protocol and no checks, to read a served request's transfer against.
    The bytes are checked at the target after the timed rounds (RuntimeError if any
    differ)."""
    mib = -(-nbytes // MiB)
    args = argparse.Namespace(
        dst_mib=mib,
        src_mib=mib,
        spin_us=100,
        busy_poll_us=TransferConfig.busy_poll_us,
        warmup=1,
        batches=rounds,
    )
    bench = Bench(args, transport, "allocate")
    try:
        count = nbytes // run_bytes
        offsets = np.arange(count, dtype=np.int64) * run_bytes
        runs = np.stack([offsets, offsets, np.full(count, run_bytes, dtype=np.int64)], axis=1)
        return statistics.median(bench._timed([[runs]]))
    finally:
        bench.close()


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


def _on_off_list(text: str) -> list[str]:
    """``--cross-memory``: "on", "off" or a comma list of them, in the order to run."""
    values = [v.strip() for v in text.split(",")]
    bad = [v for v in values if v not in ("on", "off")]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected on, off or on,off (got {bad})")
    return values


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
    ap.add_argument(
        "--cross-memory",
        default="on",
        type=_on_off_list,
        help="initiator: into registered memory on shm, the kernel's cross-memory copy "
        "(on), UCX's puts (off), or both in turn (on,off)",
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
    ap.add_argument("--kv-mib", type=int, default=64, help="bytes of each kv-burst and bulk row")
    ap.add_argument("--kv-layers", type=int, default=8, help="layers of the kv-burst rows")
    ap.add_argument("--kv-block-kib", type=int, default=16, help="block bytes of kv-burst rows")
    ap.add_argument(
        "--placement",
        default="split",
        choices=["split", "any", "shared"],
        help="initiator: each process on a CPU of its own (split), where the scheduler "
        "puts them (any), or both on one CPU (shared)",
    )
    ap.add_argument("--src-size", type=int, default=256 * MiB, help="target role")
    ap.add_argument("--lifetime", type=float, default=900.0)
    args = ap.parse_args(argv)
    if args.role == "target":
        return run_target(args)
    pinned = placement_cpus(args.placement)
    if pinned is not None:
        os.sched_setaffinity(0, pinned[0])  # the target gets its own at its start
    workloads = [(256, 256 << 10), (4096, 16 << 10)]
    emit(
        engine="host",
        op="load",
        cpus=os.cpu_count(),
        placement=placement_name(pinned),
        tcp_congestion_control=tcp_congestion_control(),
        loadavg=[round(x, 2) for x in os.getloadavg()],
    )  # context for noisy figures
    for npages, page in workloads:
        memcpy_ceiling(args, npages, page)
    for transport in args.transports.split(","):
        for fused in (False, True):
            cpu_per_op(args, transport, fused)
    for transport in args.transports.split(","):
        dests = args.dests.split(",") if transport == "shm" else ["allocate"]
        kinds = [
            (dest, cross == "on")
            for dest in dests
            for cross in (args.cross_memory if dest == "register" else ["on"])
        ]
        for dest, cross_memory in kinds:
            b = Bench(args, transport, dest, cross_memory, pinned=pinned)
            try:
                for npages, page in workloads:
                    b.throughput(npages, page)
                total = args.kv_mib * MiB
                ceiling = b.bulk(total)
                for requests in (1, 4, 16, 64):
                    b.kv_burst(requests, args.kv_layers, args.kv_block_kib << 10, total, ceiling)
                for check in ("byte-exact", "stamps"):
                    for fused in (False, True):
                        b.latency(fused, check)
                b.idle_cpu()
            finally:
                b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
