"""Page checksum benchmark on the CPU: one JSON line per (pool size, page size).

Per result, on a bf16 pool of random values (``--pool-mib``) cut into pages
(``--page-kib``), all its pages listed in a random order: ``memcpy_gbps``, a torch
``copy_`` of the same bytes into pre-faulted memory (the ceiling: it reads every byte once,
as the checksum does, and writes them too); ``native_gbps``, the native checksum
(``kvferry.engine.integrity.page_checksums_native``, what decode runs on CPU pools);
``reference_gbps``, the torch reference (``page_checksums_reference``) over the first
``--reference-mib`` of those pages only (it runs near 100 MB/s); ``native_over_memcpy``,
the goal being at least 0.5; and ``agree``, whether native and reference gave the same
values on the pages both checksummed. Each figure is the median of ``--reps`` timed runs
after one warm-up. torch runs on ``--threads`` threads (default 1: the native checksum is
single-threaded). A first line gives the host's load, context for noisy figures.

Then one line per (pool size, run size) for region checksums (``op: regions``, see
:mod:`kvferry.engine.run_checksum`: what a writer and an owner of a reshaped transfer
check): the pool cut into runs of ``--run-kib`` read in a random order, regions of
``--region-kib`` in the destination; ``regions_gbps`` (native run sums and their
combination) beside ``memcpy_gbps``, and ``agree`` (native and torch run sums on the first
``--reference-mib``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvferry.engine.integrity import (
    native_supports,
    page_checksums_native,
    page_checksums_reference,
)
from kvferry.engine.run_checksum import (
    region_checksums,
    run_checksums_native,
    run_checksums_reference,
)

MiB = 1 << 20


def emit(**rec) -> None:
    print(json.dumps(rec), flush=True)


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: faults, caches, lazy imports
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_one(pool_mib: int, page_kib: int, reps: int, reference_mib: int, seed: int) -> None:
    page_bytes = page_kib << 10
    num_pages = (pool_mib * MiB) // page_bytes
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_pages, page_bytes // 2, generator=gen).to(torch.bfloat16)
    assert native_supports(kv), "the native checksum module is not built"
    pages = torch.randperm(num_pages, generator=gen)
    nbytes = num_pages * page_bytes
    dst = torch.zeros_like(kv)  # zeros_like writes it: pre-faulted

    memcpy = median_seconds(lambda: dst.copy_(kv), reps)
    native = median_seconds(lambda: page_checksums_native(kv, pages), reps)
    ref_pages = pages[: max(1, (reference_mib * MiB) // page_bytes)]
    ref_bytes = ref_pages.numel() * page_bytes
    reference = median_seconds(lambda: page_checksums_reference(kv, ref_pages), max(1, reps // 2))
    agree = torch.equal(
        page_checksums_native(kv, ref_pages), page_checksums_reference(kv, ref_pages)
    )
    emit(
        bench="checksum",
        pool_mib=pool_mib,
        page_kib=page_kib,
        pages=num_pages,
        dtype="bfloat16",
        memcpy_gbps=round(nbytes / memcpy / 1e9, 3),
        native_gbps=round(nbytes / native / 1e9, 3),
        reference_gbps=round(ref_bytes / reference / 1e9, 3),
        reference_mib=ref_bytes // MiB,
        native_over_memcpy=round(memcpy / native, 3),
        agree=agree,
        reps=reps,
        torch_threads=torch.get_num_threads(),
    )


def run_regions(
    pool_mib: int, run_kib: int, region_kib: int, reps: int, reference_mib: int, seed: int
) -> None:
    run_bytes, nbytes = run_kib << 10, pool_mib * MiB
    n = nbytes // run_bytes
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(nbytes // 2, generator=gen).to(torch.bfloat16)
    dst = torch.zeros_like(kv)
    order = torch.randperm(n, generator=gen).numpy().astype(np.int64)
    runs = np.stack(
        [order * run_bytes, np.arange(n, dtype=np.int64) * run_bytes, np.full(n, run_bytes)],
        axis=1,
    )
    region_bytes = max(run_bytes, region_kib << 10)
    memcpy = median_seconds(lambda: dst.copy_(kv), reps)
    regions = median_seconds(lambda: region_checksums(kv, runs, region_bytes, 2, read=0), reps)
    some = runs[: max(1, (reference_mib * MiB) // run_bytes)]
    agree = bool(
        (
            run_checksums_native(kv, some[:, 0], some[:, 2], 2)
            == run_checksums_reference(kv, some[:, 0], some[:, 2], 2)
        ).all()
    )
    emit(
        bench="checksum",
        op="regions",
        pool_mib=pool_mib,
        run_kib=run_kib,
        region_kib=region_bytes >> 10,
        runs=n,
        memcpy_gbps=round(nbytes / memcpy / 1e9, 3),
        regions_gbps=round(nbytes / regions / 1e9, 3),
        regions_over_memcpy=round(memcpy / regions, 3),
        agree=agree,
        reps=reps,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--pool-mib", default="64,256", help="pool sizes, comma-separated")
    ap.add_argument("--page-kib", default="16,256", help="page sizes, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per figure (median)")
    ap.add_argument(
        "--reference-mib", type=int, default=16, help="bytes the torch reference checksums"
    )
    ap.add_argument("--run-kib", default="2,16", help="region rows: run sizes, comma-separated")
    ap.add_argument("--region-kib", type=int, default=256, help="region rows: region size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (copy_, reference)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    emit(
        bench="checksum",
        op="load",
        cpus=os.cpu_count(),
        loadavg=[round(x, 2) for x in os.getloadavg()],
    )
    for pool_mib in (int(x) for x in args.pool_mib.split(",")):
        for page_kib in (int(x) for x in args.page_kib.split(",")):
            run_one(pool_mib, page_kib, args.reps, args.reference_mib, args.seed)
    for pool_mib in (int(x) for x in args.pool_mib.split(",")):
        for run_kib in (int(x) for x in args.run_kib.split(",")):
            run_regions(
                pool_mib, run_kib, args.region_kib, args.reps, args.reference_mib, args.seed
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
