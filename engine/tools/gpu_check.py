"""The device run of the engine's GPU kernels, in one call of a few minutes: build (JIT),
check against the torch references, time; JSON lines first, a table last.

Checks (fresh random inputs, every output poisoned with NaN before each run): decode
attention against ``kvferry.engine.attention.paged_decode_attention`` for fp16/bf16, head
dims 64/128, page sizes 16/32/64, one split and several, empty sequences; a pool past 2^31
elements; the ownership check's flags against its torch reference for every mismatch kind,
and a clean run bit-identical with the check on and off; checksums equal to
``kvferry.engine.integrity.page_checksums``; the registers and spills of the kernels the JIT
built (beside the sm_90 compile's on CPU, ``python -m kvferry.engine.kernels.aot``).

Timings (CUDA events, median after warm-up): a device-to-device copy (the roofline: bytes
read + written per second); decode attention on batch x context 1x131072, 16x8192, 64x2048,
32 query heads, 8 KV heads, head dim 128, page size 16, bf16, check off and on, in GB/s of
KV + Q + O bytes; the torch baselines on the same cases (gather into dense KV +
``scaled_dot_product_attention``; FlexAttention on the gathered KV where this torch has
it), whose GB/s count the same bytes; checksums over a whole pool in GB/s read; the
staging gather of a TP 1 -> 2 fan-out (``kvferry.transfer.copy_tensor_runs``: one decode
worker's half of every token's row of a token-major pool, blocks in a random order, a
batch of 8 MiB at a time as the vLLM connector stages it, index building on the host
included), checked against torch indexing, in GB/s read + written.

GPU page transfer: two processes on one GPU, a CUDA pool each (one plain allocation),
256 pages of 2 MiB scattered into the target's pool through kvferry's transfer engine
over UCX (cuda_ipc), each batch flushed and noticed, GB/s (read + written, as the copy)
as a fraction of the copy; the bytes checked at the target after (page checksums). When
UCX's CUDA transports cannot run, the exact error goes into a JSON line and the pages
move through CUDA IPC memory handles (CuPy's runtime API), flushed (stream synchronised)
and noticed through the engine the same way. A dry run moves host memory through the UCX
path. Needs kvferry's native module (``transfer/_ucp.abi3.so``) and its libucx wheel.

Run as ``python -m kvferry.engine.tools.gpu_check`` (``scripts/gpu-check.sh``).

Exit status: 0 when every check passed, 1 when one failed, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvferry.engine.kernels.tuning import DEFAULT as DEFAULT_TUNING
from kvferry.engine.kernels.tuning import DecodeTuning
from kvferry.engine.kernels.tuning import active as active_tuning

if TYPE_CHECKING:
    from kvferry.transfer import TransferConfig

DEV = "cuda"  # "cpu" in a dry run (--dry-run: the interpreter, small shapes, wall-clock timings)
SMALL = False
RESULTS: list[dict] = []
FAILED: list[str] = []


def emit(kind: str, **fields) -> dict:
    row = {"kind": kind, **fields}
    RESULTS.append(row)
    print(json.dumps(row, default=str), flush=True)
    return row


def check(name: str, ok: bool, **fields) -> None:
    emit("check", name=name, ok=bool(ok), **fields)
    if not ok:
        FAILED.append(name)


def cuda_time(fn: Callable[[], object], warmup: int, iters: int, repeat: int = 10) -> float:
    """Median seconds of one ``fn``: on CUDA by events around ``repeat`` calls captured in
    one CUDA graph (see :func:`graphed`), after ``warmup`` runs; on CPU (a dry run) one
    call by the wall clock."""
    if DEV == "cpu":
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    times, _ = cuda_time_interleaved({"fn": fn}, warmup, iters, repeat)
    return times["fn"]


def as_graph(fn: Callable[[], object], repeat: int) -> Callable[[], object]:
    """``repeat`` calls of ``fn`` captured in one CUDA graph, replayed as one call: the GPU's
    time alone, not the host's launches (a split launch's host work, its partials'
    allocations and the combine kernel's launch, can take as long as the kernel, and a
    timing of eager calls then measures the host). Raises what the capture raised."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # allocations and compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    return graph.replay


def graphed(name: str, fn: Callable[[], object], repeat: int) -> tuple[Callable[[], object], int]:
    """What a sample calls and how often: the graph of ``repeat`` calls once, or, where the
    capture fails (a host sync inside ``fn``), ``fn`` itself ``repeat`` times, said in a
    ``timing`` row."""
    try:
        return as_graph(fn, repeat), 1
    except Exception as error:
        torch.cuda.synchronize()
        emit("timing", name=name, graph=False, reason=f"{type(error).__name__}: {error}"[:300])
        return fn, repeat


def cuda_time_interleaved(
    fns: dict[str, Callable[[], object]],
    warmup: int,
    iters: int,
    repeat: int = 10,
    graph: bool = True,
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median seconds of each ``fn``, timed in turns: each round times every function once
    (``repeat`` calls in one CUDA graph, by CUDA events; see :func:`graphed`; eager calls
    without ``graph``, for work that syncs the host or runs long enough), in an order
    that rotates, so a drift of the clocks or of a neighbour's load falls on all of them
    alike. Also returns the rounds' samples, for ratios taken round by round."""
    names = list(fns)
    if DEV == "cpu":
        return {n: cuda_time(fns[n], warmup, iters, repeat) for n in names}, {}
    runs: dict[str, tuple[Callable[[], object], int]] = {}
    for name in names:
        for _ in range(warmup):
            fns[name]()
        runs[name] = graphed(name, fns[name], repeat) if graph else (fns[name], repeat)
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for i in range(iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fn, calls = runs[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / 1e3 / repeat)
    return {n: statistics.median(v) for n, v in samples.items()}, samples


def paired_cost(samples: dict[str, list[float]], name: str, base: str) -> float | None:
    """The median over rounds of ``name``'s time over ``base``'s in the same round, less 1."""
    if not samples:
        return None
    return statistics.median(a / b for a, b in zip(samples[name], samples[base], strict=True)) - 1


# --- inputs ----------------------------------------------------------------------------
def random_case(
    gen: torch.Generator,
    dtype,
    head_dim,
    page_size,
    seq_lens,
    kv_heads=8,
    group=4,
    layers=2,
    spare=5,
):
    """Pool ``[pages, layers, 2, kv_heads, page_size, head_dim]`` on the GPU, shuffled table
    ``[batch, width]`` int32 (padding -1), q ``[batch, q_heads, head_dim]``."""
    width = max(1, max(-(-n // page_size) for n in seq_lens))
    pages = width * len(seq_lens) + spare
    kv = torch.randn(pages, layers, 2, kv_heads, page_size, head_dim, generator=gen, device=DEV).to(
        dtype
    )
    perm = torch.randperm(pages, generator=gen, device=DEV).to(torch.int32)
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32, device=DEV)
    for b, n in enumerate(seq_lens):
        used = -(-n // page_size)
        table[b, :used] = perm[b * width : b * width + used]
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen, device=DEV).to(dtype)
    return kv, table, torch.tensor(seq_lens, dtype=torch.int32, device=DEV), q


def stamp_all(kv, table, seq_lens, page_size):
    """A canary table and ownership expectations under which every page read is clean."""
    from kvferry.engine.kernels import PageOwnership

    batch, width = table.shape
    canaries = torch.full((kv.shape[0], 3), -1, dtype=torch.int64, device=DEV)
    gens = torch.zeros(batch, width, dtype=torch.int64, device=DEV)
    rids = torch.arange(batch, dtype=torch.int64, device=DEV) * 7919 + 13
    lens = seq_lens.tolist()
    for b in range(batch):
        used = -(-lens[b] // page_size)
        if used:
            pages = table[b, :used].long()
            gens[b, :used] = torch.arange(used, device=DEV) + 100 * b
            canaries[pages, 0] = rids[b]
            canaries[pages, 1] = gens[b, :used]
            canaries[pages, 2] = torch.arange(used, device=DEV)
    return canaries, rids, gens, lambda: PageOwnership.create(canaries, rids, gens)


# --- checks ----------------------------------------------------------------------------
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # the kernel's output against fp32


def close_to_reference(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, empty: tuple[int, ...] = ()
) -> tuple[bool, float]:
    """Whether a kernel output (poisoned with NaN before the run) is fully written and
    within ``TOLERANCE`` of the reference, with zeros for the ``empty`` sequences; and its
    largest absolute error."""
    err = (got.float() - want.float()).abs().max().item()
    tol = TOLERANCE[dtype]
    ok = bool(torch.isfinite(got).all()) and all(bool((got[b] == 0).all()) for b in empty)
    return ok and bool(torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)), err


def correctness(seed: int) -> None:
    from kvferry.engine.attention import paged_decode_attention as reference
    from kvferry.engine.integrity import page_checksums as checksum_reference
    from kvferry.engine.kernels import check_ownership_reference, triton_checksum, triton_decode
    from kvferry.engine.kernels import ownership as own_mod

    gen = torch.Generator(device=DEV).manual_seed(seed)
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128):
            for page_size in (16, 32, 64):
                if SMALL and (dtype, head_dim) not in ((torch.bfloat16, 128), (torch.float16, 64)):
                    continue
                top = 200 if SMALL else 3000
                lens = [
                    int(torch.randint(1, top, (1,), generator=gen, device=DEV)),
                    0,
                    top + 96,
                    77,
                ]
                kv, table, seq_lens, q = random_case(
                    gen, dtype, head_dim, page_size, lens, kv_heads=2 if SMALL else 8
                )
                want = reference(q, kv, 1, table, seq_lens)
                for splits in (1, 7, None):
                    out = torch.full_like(q, float("nan"))
                    got = triton_decode.paged_decode_attention(
                        q, kv, 1, table, seq_lens, num_splits=splits, out=out
                    )
                    ok, err = close_to_reference(got, want, dtype, empty=(1,))
                    name = f"decode {str(dtype)[6:]} d{head_dim} p{page_size}"
                    check(
                        f"{name} splits={splits or 'auto'}",
                        ok,
                        max_abs_err=err,
                    )
                _, _, _, fresh = stamp_all(kv, table, seq_lens, page_size)
                own = fresh()
                checked = triton_decode.paged_decode_attention(
                    q,
                    kv,
                    1,
                    table,
                    seq_lens,
                    num_splits=5,
                    ownership=own,
                    out=torch.full_like(q, float("nan")),
                )
                plain = triton_decode.paged_decode_attention(
                    q, kv, 1, table, seq_lens, num_splits=5, out=torch.full_like(q, float("nan"))
                )
                check(
                    f"check on == off bit for bit {str(dtype)[6:]} d{head_dim} p{page_size}",
                    torch.equal(checked, plain) and own.failures() == [],
                )

    # every mismatch kind, kernel flags against the torch reference
    kv, table, seq_lens, q = random_case(
        gen, torch.bfloat16, 128, 16, [300, 200, 0, 513], kv_heads=1 if SMALL else 8
    )
    canaries, _, _, fresh = stamp_all(kv, table, seq_lens, 16)
    base_table, base_canaries = table.clone(), canaries.clone()
    kinds = {
        "foreign": lambda t, c: c.__setitem__((int(t[0, 3]), 0), 999),
        "stale": lambda t, c: c.__setitem__((int(t[1, 2]), 1), -5),
        "swapped": lambda t, c: t[3].__setitem__(slice(4, 6), t[3, 4:6].flip(0).clone()),
        "out_of_pool": lambda t, c: t[0].__setitem__(5, kv.shape[0] + 11),
        "negative": lambda t, c: t[1].__setitem__(0, -3),
        "beyond_table": lambda t, c: seq_lens.__setitem__(2, t.shape[1] * 16 + 1),
    }
    for name, corrupt in kinds.items():
        table.copy_(base_table)
        canaries.copy_(base_canaries)
        lens_saved = seq_lens.clone()
        corrupt(table, canaries)
        own, ref = fresh(), fresh()
        out = triton_decode.paged_decode_attention(
            q, kv, 0, table, seq_lens, num_splits=3, ownership=own
        )
        check_ownership_reference(table, seq_lens, 16, kv.shape[0], ref)
        got, want = own.failures(), ref.failures()
        check(
            f"ownership {name}",
            got == want and len(got) == 1,
            kernel=got,
            reference=want,
            kinds=own_mod.describe_kinds(got[0][1]) if got else "none",
            finite=bool(torch.isfinite(out).all()),
        )
        seq_lens.copy_(lens_saved)

    # a pool whose offsets pass 2^31 elements
    if SMALL:
        emit("skipped", name="pool past 2^31", reason="dry run (the interpreter tests cover it)")
    else:
        pool_past_2_31(gen, reference, triton_decode)
    checksums(gen, checksum_reference, triton_checksum)
    for kind, compiled in list(triton_decode.LAUNCHED.items()) + list(
        triton_checksum.LAUNCHED.items()
    ):
        emit(
            "jit",
            kernel=kind,
            registers=getattr(compiled, "n_regs", None),
            spills=getattr(compiled, "n_spills", None),
            shared=getattr(getattr(compiled, "metadata", None), "shared", None),
        )


def registers_against_aot(gen: torch.Generator, tuning: DecodeTuning = DEFAULT_TUNING) -> None:
    """The registers and spills the GPU's JIT gave each kernel, beside the sm_90 compile of
    the same variant on this machine (``kvferry.engine.kernels.aot``: the signature and
    16-byte divisibility the CPU-side compile assumes): one ``registers`` line each,
    ``equal`` when the counts agree, so the CPU-side figures in engine/GPU.md are checked
    where they matter: the decode kernel (bf16, head dim 128, group 4) at ``tuning`` with
    the check off and on, the combine and the checksum kernels."""
    if DEV == "cpu":
        emit(
            "skipped",
            name="registers against the sm_90 compile",
            reason="dry run: the interpreter compiles nothing",
        )
        return
    from kvferry.engine.kernels import aot, triton_checksum, triton_decode

    kv, table, seq_lens, q = random_case(gen, torch.bfloat16, 128, 16, [700, 300])
    _, _, _, fresh = stamp_all(kv, table, seq_lens, 16)
    launched: list[tuple[Any, Any]] = []
    for check_on in (False, True):
        triton_decode.paged_decode_attention(
            q,
            kv,
            1,
            table,
            seq_lens,
            num_splits=3,
            tuning=tuning,
            ownership=fresh() if check_on else None,
        )
        variant = aot.Variant("decode", "bf16", 128, 4, check_on, tuning)
        launched.append((variant, triton_decode.LAUNCHED["decode"]))
    launched.append((aot.Variant("combine", "bf16", 128), triton_decode.LAUNCHED["combine"]))
    triton_checksum.page_checksums(kv, torch.arange(kv.shape[0], device=DEV))
    launched.append((aot.Variant("checksum", "pairs"), triton_checksum.LAUNCHED["checksum"]))
    compare_registers(launched, tuning)


def compare_registers(launched: list[tuple[Any, Any]], tuning: DecodeTuning) -> None:
    """Each (aot variant, compiled kernel the JIT gave) compiled again for sm_90 here, one
    ``registers`` line each."""
    from kvferry.engine.kernels import aot

    for variant, compiled in launched:
        jit, jit_spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
        try:
            report = aot.compile_variant(variant, budget=255)
        except Exception as error:
            emit(
                "registers",
                variant=variant.name,
                jit=jit,
                error=f"{type(error).__name__}: {error}"[:300],
            )
            continue
        emit(
            "registers",
            variant=variant.name,
            tuning=tuning.name,
            jit=jit,
            aot=report.registers,
            jit_spills=jit_spills,
            aot_spill_ops=report.spill_ops,
            aot_from=report.sass_from,
            equal=jit == report.registers,
        )


def pool_past_2_31(gen, reference, triton_decode) -> None:
    per_page = 16 * 128 * 8 * 2
    pages = (1 << 31) // per_page + 64
    big = torch.empty(pages, 1, 2, 8, 16, 128, dtype=torch.bfloat16, device=DEV)
    table = torch.tensor(
        [[pages - 1, 3, pages - 40], [pages - 2, 17, pages - 64]], dtype=torch.int32, device=DEV
    )
    big[table.long().flatten()] = torch.randn(6, 1, 2, 8, 16, 128, generator=gen, device=DEV).to(
        torch.bfloat16
    )
    seq_lens = torch.tensor([40, 48], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 32, 128, generator=gen, device=DEV).to(torch.bfloat16)
    got = triton_decode.paged_decode_attention(
        q, big, 0, table, seq_lens, num_splits=2, out=torch.full_like(q, float("nan"))
    )
    ok, err = close_to_reference(got, reference(q, big, 0, table, seq_lens), torch.bfloat16)
    check("pool past 2^31 elements", ok, elements=big.numel(), max_abs_err=err)
    del big


def checksums(gen, checksum_reference, triton_checksum) -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kv = torch.randn(30 if SMALL else 300, 2, 2, 8, 16, 128, generator=gen, device=DEV).to(
            dtype
        )
        kv.view(torch.uint8)[7] = 0xFF
        pages = torch.randperm(kv.shape[0], generator=gen, device=DEV)[: kv.shape[0] * 2 // 3]
        check(
            f"checksum {str(dtype)[6:]}",
            torch.equal(triton_checksum.page_checksums(kv, pages), checksum_reference(kv, pages)),
        )
    odd = torch.randint(0, 256, (50, 3, 7), generator=gen, device=DEV, dtype=torch.uint8)
    check(
        "checksum odd page bytes",
        torch.equal(
            triton_checksum.page_checksums(odd, [4, 0, 2]), checksum_reference(odd, [4, 0, 2])
        ),
    )


# --- timings ---------------------------------------------------------------------------
def copy_bandwidth(warmup: int, iters: int) -> float:
    src = torch.empty((1 << 20) if SMALL else (2 << 30), dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), warmup, iters)
    gbs = 2 * src.numel() / t / 1e9
    emit("copy", bytes=2 * src.numel(), seconds=t, gb_s=gbs)
    return gbs


def attention_shape() -> tuple[int, int, int, int, torch.dtype]:
    """(q heads, kv heads, head dim, page size, dtype) of the timed cases."""
    return (8, 2, 128, 16, torch.bfloat16) if SMALL else (32, 8, 128, 16, torch.bfloat16)


def attention_inputs(
    batch: int, context: int, gen: torch.Generator, shape: tuple[int, int, int, int, torch.dtype]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A timed case's inputs: pool ``[pages, 2, 2, kv_heads, page_size, head_dim]`` (layer 1
    is read), a shuffled full table ``[batch, context / page_size]`` int32, every sequence
    ``context`` long, q ``[batch, q_heads, head_dim]``; and the bytes a pass moves (the K/V
    read, q read and the output written)."""
    q_heads, kv_heads, head_dim, page_size, dtype = shape
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq + 16
    kv = torch.empty(
        num_pages, 2, 2, kv_heads, page_size, head_dim, dtype=dtype, device=DEV
    ).normal_()
    table = (
        torch.randperm(num_pages, generator=gen, device=DEV)[: batch * pages_per_seq]
        .view(batch, pages_per_seq)
        .to(torch.int32)
    )
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, q_heads, head_dim, generator=gen, device=DEV).to(dtype)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * kv.element_size()
    return kv, table, seq_lens, q, kv_bytes + 2 * q.numel() * q.element_size()


def attention_cases(
    cases,
    copy_gbs: float,
    warmup: int,
    iters: int,
    deadline: float,
    flex: bool,
    tuning: DecodeTuning = DEFAULT_TUNING,
) -> None:
    shape = attention_shape()
    gen = torch.Generator(device=DEV).manual_seed(7)
    flex_fn: Callable[..., Any] | None = None
    if flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex_fn = torch.compile(flex_attention, dynamic=False)
        except Exception as error:  # this torch has none
            emit(
                "baseline", name="flex", available=False, reason=f"{type(error).__name__}: {error}"
            )
    for batch, context in cases:
        if time.monotonic() > deadline:
            emit("skipped", case=f"{batch}x{context}", reason="time budget")
            continue
        flex_fn = attention_case(
            batch, context, copy_gbs, warmup, iters, deadline, flex_fn, gen, shape, tuning
        )


def attention_case(
    batch: int,
    context: int,
    copy_gbs: float,
    warmup: int,
    iters: int,
    deadline: float,
    flex_fn: Callable[..., Any] | None,
    gen: torch.Generator,
    shape: tuple[int, int, int, int, torch.dtype],
    tuning: DecodeTuning = DEFAULT_TUNING,
) -> Callable[..., Any] | None:
    """One batch x context case: the kernel (at ``tuning``) with the check off and on, the
    torch baselines; returns the FlexAttention function for the next case (None once it
    failed or its compile took too long)."""
    from kvferry.engine.kernels import triton_decode

    kv_heads, page_size = shape[1], shape[3]
    kv, table, seq_lens, q, io_bytes = attention_inputs(batch, context, gen, shape)
    out = torch.empty_like(q)
    _, _, _, fresh = stamp_all(kv, table, seq_lens, page_size)
    own = fresh()
    head_dim = q.shape[2]
    splits = triton_decode.choose_splits(batch, kv_heads, context, kv.device, tuning)
    variants: dict[str, Callable[[], object]] = {
        "triton": lambda: triton_decode.paged_decode_attention(
            q, kv, 1, table, seq_lens, out=out, tuning=tuning
        ),
        "triton+check": lambda: triton_decode.paged_decode_attention(
            q, kv, 1, table, seq_lens, out=out, ownership=own, tuning=tuning
        ),
        # kernel v1's placement of the check (inside the loop), for comparison
        "triton+check tiles": lambda: triton_decode.paged_decode_attention(
            q,
            kv,
            1,
            table,
            seq_lens,
            out=out,
            ownership=own,
            tuning=tuning,
            check_placement="tiles",
        ),
    }
    results, samples = cuda_time_interleaved(variants, warmup, iters)
    for name, t in results.items():
        emit(
            "attention",
            case=f"{batch}x{context}",
            impl=name,
            splits=splits,
            tuning=tuning.name,
            bytes=io_bytes,
            seconds=t,
            gb_s=io_bytes / t / 1e9,
            of_copy=io_bytes / t / 1e9 / copy_gbs,
        )
    check(f"clean timing run {batch}x{context} raised no flag", own.failures() == [])

    def gathered():
        idx = table.long()
        k = kv[:, 1, 0][idx].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, context, head_dim)
        v = kv[:, 1, 1][idx].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, context, head_dim)
        return k, v

    def sdpa():
        k, v = gathered()
        return torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None, :], k, v, enable_gqa=True
        )

    try:
        t = cuda_time(sdpa, warmup, iters)
        results["torch"] = t
        emit(
            "attention",
            case=f"{batch}x{context}",
            impl="torch gather+sdpa",
            bytes=io_bytes,
            seconds=t,
            gb_s=io_bytes / t / 1e9,
            of_copy=io_bytes / t / 1e9 / copy_gbs,
        )
    except Exception as error:
        emit(
            "baseline",
            name="sdpa",
            case=f"{batch}x{context}",
            available=False,
            reason=f"{type(error).__name__}: {error}"[:300],
        )
    if flex_fn is not None and time.monotonic() < deadline - 60:

        def flex_run():
            k, v = gathered()
            return flex_fn(q[:, :, None, :], k, v, enable_gqa=True)

        try:
            compile_start = time.monotonic()
            flex_run()  # compiles for this shape
            if time.monotonic() - compile_start > 40:
                emit(
                    "baseline",
                    name="flex",
                    note="compile took over 40 s: later cases skip FlexAttention",
                )
                flex_budget_spent = True
            else:
                flex_budget_spent = False
            t = cuda_time(flex_run, max(warmup, 2), iters)
            results["flex"] = t
            emit(
                "attention",
                case=f"{batch}x{context}",
                impl="torch gather+flex",
                bytes=io_bytes,
                seconds=t,
                gb_s=io_bytes / t / 1e9,
                of_copy=io_bytes / t / 1e9 / copy_gbs,
            )
            if flex_budget_spent:
                flex_fn = None
        except Exception as error:
            emit(
                "baseline",
                name="flex",
                case=f"{batch}x{context}",
                available=False,
                reason=f"{type(error).__name__}: {error}"[:300],
            )
            flex_fn = None
    torch_best = min([results[k] for k in ("torch", "flex") if k in results], default=None)
    emit(
        "summary",
        case=f"{batch}x{context}",
        check_cost=results["triton+check"] / results["triton"] - 1,
        check_cost_tiles=results["triton+check tiles"] / results["triton"] - 1,
        check_cost_paired=paired_cost(samples, "triton+check", "triton"),
        check_cost_tiles_paired=paired_cost(samples, "triton+check tiles", "triton"),
        vs_torch=(torch_best / results["triton"]) if torch_best else None,
    )
    return flex_fn


# The checksum kernel's launches timed beside its default (words a step, steps a
# program, warps): each must give the default's values; the best is for the next default.
CHECKSUM_OTHER_LAUNCHES: tuple[tuple[int, int, int], ...] = (
    (2048, 16, 8),
    (1024, 64, 4),
    (4096, 8, 8),
    (512, 32, 4),
)


def checksum_bandwidth(copy_gbs: float, warmup: int, iters: int) -> None:
    from kvferry.engine.kernels import triton_checksum

    kv = torch.empty(
        16 if SMALL else 16384, 2, 2, 8, 16, 128, dtype=torch.bfloat16, device=DEV
    ).normal_()  # 2 GiB
    pages = torch.arange(kv.shape[0], device=DEV)
    nbytes = kv.numel() * kv.element_size()
    default = (triton_checksum.BLOCK, triton_checksum.CHUNK_STEPS, triton_checksum.NUM_WARPS)
    others = CHECKSUM_OTHER_LAUNCHES[:1] if SMALL else CHECKSUM_OTHER_LAUNCHES
    launches = (default, *others)
    want = triton_checksum.page_checksums(kv, pages)
    fns: dict[str, Callable[[], object]] = {}
    for block, steps, warps in launches:
        name = f"b{block}-s{steps}-w{warps}"

        def run(block: int = block, steps: int = steps, warps: int = warps) -> torch.Tensor:
            return triton_checksum.page_checksums(
                kv, pages, block=block, steps=steps, num_warps=warps
            )

        check(f"checksum launch {name} equals the default's", torch.equal(run(), want))
        fns[name] = run
    # eager: its bounds check syncs the host, and a launch takes over half a millisecond
    times, _ = cuda_time_interleaved(fns, warmup, iters, graph=False)
    for i, (name, t) in enumerate(times.items()):
        emit(
            "checksum" if i == 0 else "checksum_launch",
            launch=name,
            bytes=nbytes,
            seconds=t,
            gb_s=nbytes / t / 1e9,
            of_copy=nbytes / t / 1e9 / copy_gbs,
        )


def relayout_bandwidth(copy_gbs: float, warmup: int, iters: int) -> None:
    """Pages landed heads-major turned into a token-major pool (what an owner of another
    layout does after its checks, :meth:`~kvferry.engine.pool.KVPool.relayout`): checked
    against the writer's pages through the model's view, then timed (read + written, as
    the copy counts) beside the copy."""
    from kvferry.engine.pool import KVPool, PoolConfig
    from kvferry.engine.reshard import Order

    shape = (2, 8, 128, 16, 16 if SMALL else 8192)  # layers, heads, dim, page, pages: 1 GiB
    writer = KVPool(PoolConfig(*shape, dtype=torch.bfloat16, device=DEV, order=Order.HND))
    owner = KVPool(PoolConfig(*shape, dtype=torch.bfloat16, device=DEV, order=Order.NHD))
    writer.kv.normal_()
    owner.storage.view(-1).copy_(writer.storage.view(-1))  # landed byte for byte
    pages = torch.randperm(owner.num_pages, device=DEV)[: owner.num_pages // 2]
    owner.relayout(pages, Order.HND)
    check(
        "relayout turns landed pages into the pool's order",
        torch.equal(owner.kv[pages], writer.kv[pages]),
    )
    nbytes = 2 * len(pages) * owner.page_bytes
    times, _ = cuda_time_interleaved(
        {"relayout": lambda: owner.relayout(pages, Order.HND)}, warmup, iters, graph=False
    )
    t = times["relayout"]
    emit(
        "relayout",
        bytes=nbytes,
        seconds=t,
        gb_s=nbytes / t / 1e9,
        of_copy=nbytes / t / 1e9 / copy_gbs,
    )


def staging_gather_bandwidth(copy_gbs: float, warmup: int, iters: int) -> None:
    """The vLLM connector's staging gather on the device (what a fan-out's writer does
    before each batch goes on the wire): from a token-major layer span ``[blocks, 16
    tokens, 8 heads, 128]`` bf16, the first 4 heads of every token (1 KiB of every 2 KiB)
    of blocks in a random order, into contiguous staging, one batch of 8 MiB per call
    with its indices built on the host as the connector builds them. Checked against
    torch indexing, then timed (read + written, as the copy counts) beside the copy."""
    import numpy as np

    from kvferry.transfer.local_copy import copy_tensor_runs, copy_unit, copy_word

    tokens, heads, dim, share = 16, 8, 128, 4
    blocks = 64 if SMALL else 65536  # 2 GiB of K
    block_bytes, piece = tokens * heads * dim * 2, share * dim * 2
    batch_blocks = (8 << 20) // (tokens * piece)
    pool = torch.empty(blocks * block_bytes, dtype=torch.uint8, device=DEV).random_()
    order = np.random.default_rng(0).permutation(blocks)[: min(blocks, batch_blocks)]
    src_at = (order[:, None] * block_bytes + np.arange(tokens) * (heads * dim * 2)).reshape(-1)
    runs = np.stack(
        [src_at, np.arange(len(src_at)) * piece, np.full(len(src_at), piece)], axis=1
    ).astype(np.int64)
    staging = torch.empty(len(runs) * piece, dtype=torch.uint8, device=DEV)
    moved = copy_tensor_runs(staging, pool, runs)
    spans = pool.view(torch.bfloat16).view(blocks, tokens, heads, dim)
    want = spans[torch.from_numpy(order).to(DEV), :, :share].contiguous().view(torch.uint8)
    check("staging gather of a fan-out's rows", torch.equal(staging, want.reshape(-1)))
    times, _ = cuda_time_interleaved(  # eager: the host builds each batch's indices
        {"gather": lambda: copy_tensor_runs(staging, pool, runs)}, warmup, iters, graph=False
    )
    t = times["gather"]
    emit(
        "staging_gather",
        bytes=2 * moved,
        seconds=t,
        gb_s=2 * moved / t / 1e9,
        of_copy=2 * moved / t / 1e9 / copy_gbs,
        pieces=len(runs),
        piece_bytes=piece,
        unit=copy_unit(runs),
        word=copy_word(copy_unit(runs), staging, pool),
    )


# --- GPU page transfer -------------------------------------------------------------
def _pool_buffer(nbytes: int, device: str) -> torch.Tensor:
    """A pool's bytes: on CUDA one plain allocation (kvferry.engine.pool), zeroed."""
    if device == "cuda":
        from kvferry.engine.pool import plain_cuda_allocation

        return plain_cuda_allocation((nbytes,), torch.uint8, device, zero=True)[0]
    return torch.zeros(nbytes, dtype=torch.uint8)


def _page_sums(buf: torch.Tensor, page_bytes: int, pages: list[int]) -> list[int]:
    from kvferry.engine.kernels import page_checksums

    sums: list[int] = page_checksums(buf.view(-1, page_bytes), pages).tolist()
    return sums


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(
            f"transfer target printed nothing within {timeout_s} s (rc {proc.poll()})"
        )
    row: dict[str, Any] = json.loads(line)
    return row


def _engine_config(name: str, cuda: bool, config: dict[str, Any]) -> TransferConfig:
    """Either side's engine settings: shared memory, CUDA memory when ``cuda``, then the
    attempt's own ``config`` fields over them."""
    from kvferry.transfer import TransferConfig

    memory_types = ("host", "cuda") if cuda else ("host",)
    return TransferConfig(
        **{"transports": "shm", "memory_types": memory_types, **config}, name=name
    )


def transfer_target(spec: dict[str, Any]) -> int:
    """The target process of the page transfer: a pool of its own (CUDA, or host in a dry
    run), registered with its transfer engine (``mode="ucx"``) or exported as a CUDA IPC
    memory handle (``mode="cuda-ipc"``); prints its hello line, counts notices, checks the
    final notice's checksums against the bytes that landed, prints the result, and keeps
    its memory until the initiator closes stdin."""
    from kvferry.transfer import TransferEngine

    device, mode, page_bytes = spec["device"], spec["mode"], spec["page_bytes"]
    buf = _pool_buffer(spec["pages"] * page_bytes, device)
    cuda_ucx = device == "cuda" and mode == "ucx"
    hello: dict[str, Any] = {}
    try:
        eng = TransferEngine(_engine_config("gpu-check-target", cuda_ucx, spec["config"]))
        hello["address"] = eng.address.hex()
        if mode == "ucx":
            hello["segment"] = eng.register(buf).descriptor().pack().hex()
        else:
            cupy = importlib.import_module("cupy")  # the device machine's; never needed on CPU

            handle = cupy.cuda.runtime.ipcGetMemHandle(buf.data_ptr())
            hello["ipc"] = bytes(handle).hex()
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps(hello), flush=True)
    state: dict[str, Any] = {"notices": 0, "result": None}

    def on_message(sender: bytes, payload: bytes) -> None:
        state["notices"] += 1
        msg = json.loads(payload)
        if "sums" in msg:
            got = _page_sums(buf, page_bytes, msg["pages"])
            bad = [p for p, a, b in zip(msg["pages"], got, msg["sums"], strict=True) if a != b]
            state["result"] = {"notices": state["notices"], "ok": not bad, "bad_pages": bad[:8]}

    eng.set_message_handler(on_message)
    deadline = time.monotonic() + spec["timeout_s"]
    while state["result"] is None and time.monotonic() < deadline:
        eng.progress(0.01)
    print(json.dumps(state["result"] or {"error": "no final notice", **state}), flush=True)
    sys.stdin.read()  # the initiator is done with the memory
    eng.shutdown()
    return 0


def _transfer_run(
    mode: str,
    copy_gbs: float,
    warmup: int,
    iters: int,
    sizes: tuple[int, int],
    config: dict[str, Any],
) -> None:
    """One page-transfer measurement: a target process, this process the writer; pages
    scattered over the target's pool, each iteration flushed and noticed; bytes checked
    at the target after. ``config``: TransferConfig fields for both engines."""
    from kvferry.transfer import SegmentDescriptor, TransferEngine

    pages, page_bytes = sizes
    nbytes = pages * page_bytes
    device = "cuda" if DEV == "cuda" else "cpu"
    spec = {
        "device": device,
        "mode": mode,
        "pages": pages,
        "page_bytes": page_bytes,
        "config": config,
        "timeout_s": 35.0,
    }
    cmd = [sys.executable, "-m", "kvferry.engine.tools.gpu_check", "--transfer-target"]
    proc = subprocess.Popen(
        [*cmd, json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    eng = None
    try:
        hello = _read_line(proc, 60.0)
        if "error" in hello:
            raise RuntimeError(f"the target process: {hello['error']}")
        cuda_ucx = device == "cuda" and mode == "ucx"
        eng = TransferEngine(_engine_config("gpu-check-writer", cuda_ucx, config))
        src = _pool_buffer(nbytes, device)
        src.random_(0, 256)
        peer = eng.connect(bytes.fromhex(hello["address"]), name="gpu-check-target")
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(5)).tolist()
        notice = json.dumps({"step": 1}).encode()
        if mode == "ucx":
            seg = eng.register(src)
            rseg = eng.open_segment(peer, SegmentDescriptor.unpack(bytes.fromhex(hello["segment"])))
            page_list = [[i * page_bytes, perm[i] * page_bytes, page_bytes] for i in range(pages)]

            def once() -> None:
                batch = eng.write(peer, seg, rseg, page_list, notice=notice)
                eng.wait(batch, 60.0)
                if batch.error is not None:
                    raise batch.error

        else:
            cupy = importlib.import_module("cupy")  # the device machine's; never needed on CPU

            ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(hello["ipc"]))
            memory = cupy.cuda.UnownedMemory(ptr, nbytes, None)
            array = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))
            # rows of 8-byte words: the index copy moves one element per thread
            dst = torch.as_tensor(array, device="cuda").view(torch.int64).view(pages, -1)
            rows = src.view(torch.int64).view(pages, -1)
            index = torch.tensor(perm, device="cuda")
            stream = torch.cuda.Stream()

            def once() -> None:
                stream.wait_stream(torch.cuda.current_stream())  # the producer
                with torch.cuda.stream(stream):
                    dst.index_copy_(0, index, rows)
                stream.synchronize()  # the flush: every page landed
                batch = eng.notify(peer, notice)
                eng.wait(batch, 60.0)
                if batch.error is not None:
                    raise batch.error

        times = []
        for n in range(warmup + iters):
            t0 = time.perf_counter()
            once()
            if n >= warmup:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        sums = _page_sums(src, page_bytes, list(range(pages)))
        final = json.dumps({"sums": sums, "pages": perm}).encode()
        eng.wait(eng.notify(peer, final), 60.0)
        result = _read_line(proc, 120.0)
        check(
            f"page transfer {mode}: every page's bytes equal at the target",
            bool(result.get("ok")),
            bad_pages=result.get("bad_pages"),
            target_error=result.get("error"),
        )
        check(
            f"page transfer {mode}: every notice delivered",
            result.get("notices") == warmup + iters + 1,
            notices=result.get("notices"),
        )
        desc = eng.describe()
        emit(
            "transfer",
            path=mode,
            bytes=nbytes,
            pages=pages,
            page_bytes=page_bytes,
            seconds=t,
            gb_s=nbytes / t / 1e9,
            of_copy=2 * nbytes / t / 1e9 / copy_gbs,  # read + written, as the copy counts
            transports=desc["peers"].get("gpu-check-target", {}).get("transports"),
            memory_types=desc["memory_types"],
            ucx=desc["ucx_version"],
        )
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if eng is not None:
            eng.shutdown()


# Each attempt runs in a writer process of its own, so that a crash inside UCX or the CUDA
# driver (a signal, not an exception) is a failed attempt with its stderr, not the end of
# the run; the first crash is run once more under a debugger for its native stack. The
# UCX attempts after the first tell the crash's place apart: the same transfer waiting by
# busy polling alone (never arming the worker's event fd), then without cuda_ipc (device
# memory staged by cuda_copy). The CUDA IPC path (CuPy) runs last in every case.
TRANSFER_ATTEMPTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("ucx", "ucx", {}),
    ("ucx, busy polling", "ucx", {"spin_us": 600_000_000}),
    ("ucx, no cuda_ipc", "ucx", {"transports": "sm,self,cuda_copy"}),
    ("cuda-ipc", "cuda-ipc", {}),
)
WRITER_TIMEOUT_S = 45.0
DEBUG_TIMEOUT_S = 120.0


def page_transfer(copy_gbs: float, warmup: int, iters: int) -> None:
    """GPU page transfer between two processes on one GPU through kvferry's transfer
    engine over UCX (cuda_ipc), then through CUDA IPC memory handles (CuPy's runtime API),
    flushed and noticed the same way; a UCX attempt that fails records its exact error and
    the next one runs. A dry run moves host memory through the UCX path."""
    sizes = (64, 64 << 10) if SMALL else (256, 2 << 20)  # 2 MiB: a page of 32 layers
    attempts = TRANSFER_ATTEMPTS if DEV == "cuda" else TRANSFER_ATTEMPTS[:1]
    moved, ucx_done, debugged = False, False, False
    for label, mode, config in attempts:
        if mode == "ucx" and ucx_done:
            continue
        spec = {
            "mode": mode,
            "copy_gbs": copy_gbs,
            "warmup": warmup,
            "iters": iters,
            "sizes": list(sizes),
            "dry": DEV != "cuda",
            "config": config,
            "label": label,
        }
        error, crashed = _writer_process(spec)
        if error is None:
            moved = True
            ucx_done |= mode == "ucx"
            continue
        emit("transfer", path=label, ok=False, error=error)
        if crashed and not debugged:
            debugged = True
            native_stack(spec)
    check("page transfer: a path moved the pages", moved)


def _writer_process(spec: dict[str, Any]) -> tuple[str | None, bool]:
    """Run one attempt in a writer process; its rows join this run's. Returns (None when
    it measured the transfer, else what went wrong: the exit signal and the end of its
    stderr; whether it died of a signal)."""
    import signal
    import tempfile

    cmd = [sys.executable, "-m", "kvferry.engine.tools.gpu_check", "--transfer-writer"]
    with tempfile.TemporaryFile("w+") as errfile:
        proc = subprocess.Popen(
            [*cmd, json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=errfile,
            text=True,
            start_new_session=True,  # the target it starts goes with it on a timeout
        )
        try:
            out, _ = proc.communicate(timeout=WRITER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        try:  # a target left behind by a writer that crashed
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        errfile.seek(0)
        stderr = errfile.read()
    if stderr:
        sys.stderr.write(stderr)
    measured = False
    for line in out.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        kind = row.pop("kind", None)
        if kind == "check":
            check(row.pop("name"), row.pop("ok"), **row)
        elif kind is not None:
            if kind == "transfer":
                measured |= "gb_s" in row
                row["path"] = spec["label"]
            emit(kind, **row)
    if measured:
        return None, False
    rc = proc.returncode
    crashed = rc is not None and rc < 0
    how = f"signal {signal.Signals(-rc).name}" if crashed else f"exit {rc}"
    tail = " | ".join(stderr.strip().splitlines()[-12:])
    return f"writer process ended with {how} before a measurement: {tail[-1500:]}", crashed


def native_stack(spec: dict[str, Any]) -> None:
    """The attempt once more under a debugger (cuda-gdb or gdb, whichever is there): the
    native stack of the thread that crashed, as a ``native_stack`` row."""
    import shutil

    debugger = shutil.which("cuda-gdb") or shutil.which("gdb")
    if debugger is None:
        emit("native_stack", path=spec["label"], available=False, reason="no gdb or cuda-gdb")
        return
    cmd = [
        debugger,
        "-q",
        "-batch",
        "-ex",
        "set pagination off",
        "-ex",
        "handle SIGPIPE SIGUSR1 SIGUSR2 SIG32 SIG33 SIG34 SIG35 SIG36 nostop noprint pass",
        "-ex",
        "run",
        "-ex",
        "bt 40",
        "--args",
        sys.executable,
        "-m",
        "kvferry.engine.tools.gpu_check",
        "--transfer-writer",
        json.dumps(spec),
    ]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=DEBUG_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
        text = done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        parts = [
            p.decode(errors="replace") if isinstance(p, bytes) else p or ""
            for p in (exc.stdout, exc.stderr)
        ]
        text = "".join(parts) + f"\n(debugger stopped at {DEBUG_TIMEOUT_S} s)"
    frames = [ln for ln in text.splitlines() if ln.startswith("#") or "signal" in ln.lower()]
    emit("native_stack", path=spec["label"], debugger=debugger, frames=frames[:60])
    for line in frames[:60]:
        print(f"  {line[:200]}", file=sys.stderr)


def transfer_writer(spec: dict[str, Any]) -> int:
    """The writer process of one attempt (see :func:`page_transfer`)."""
    global DEV, SMALL
    if spec["dry"]:
        DEV, SMALL = "cpu", True
    try:
        _transfer_run(
            spec["mode"],
            spec["copy_gbs"],
            spec["warmup"],
            spec["iters"],
            tuple(spec["sizes"]),
            spec["config"],
        )
    except Exception as exc:
        print(f"gpu-check writer: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


# --- report --------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def goals(say: Callable[[str], None]) -> None:
    """The issue's goals for the device table, each met or not (timings never fail the run)."""
    att = {(r["case"], r["impl"]): r for r in RESULTS if r["kind"] == "attention"}
    summ = {r["case"]: r for r in RESULTS if r["kind"] == "summary"}
    for case in ("1x131072", "16x8192"):
        if (case, "triton") in att:
            frac = att[(case, "triton")]["of_copy"]
            say(f"goal {case}: attention >= 0.80 of copy: {frac:.2f} {_met(frac >= 0.8)}")
            vs = summ[case]["vs_torch"]
            if vs is not None:
                say(f"goal {case}: >= 2x the torch baseline: {vs:.2f}x {_met(vs >= 2)}")
    for case, r in summ.items():
        cost = r["check_cost_paired"] if r.get("check_cost_paired") is not None else r["check_cost"]
        say(f"goal {case}: ownership check costs <= 3 %: {100 * cost:+.1f} % {_met(cost <= 0.03)}")
    for r in RESULTS:
        if r["kind"] == "checksum":
            frac = r["of_copy"]
            say(f"goal checksum >= 0.80 of copy: {frac:.2f} {_met(frac >= 0.8)}")
        elif r["kind"] == "transfer" and "of_copy" in r:
            frac = r["of_copy"]
            say(f"goal page transfer ({r['path']}) >= 0.60 of copy: {frac:.2f} {_met(frac >= 0.6)}")


def _row(what: str, r: dict[str, Any] | None = None, note: str = "") -> None:
    if r is None:
        print(f"{what:34} {'':>8} {'':>8} {'':>9}  {note}")
    else:
        ms = r["seconds"] * 1e3
        print(f"{what:34} {r['gb_s']:8.0f} {r.get('of_copy', 1):8.2f} {ms:9.3f}  {note}")


def table() -> None:
    print()
    print(f"{'what':34} {'GB/s':>8} {'of copy':>8} {'ms':>9}  note")
    for r in RESULTS:
        if r["kind"] == "copy":
            _row("device-to-device copy", r, "read + written")
        elif r["kind"] == "attention":
            _row(f"{r['case']} {r['impl']}", r, f"splits {r['splits']}" if "splits" in r else "")
        elif r["kind"] == "summary":
            vs = f"{r['vs_torch']:.2f}x the best torch baseline" if r["vs_torch"] else "no baseline"
            _row(
                f"{r['case']} summary",
                None,
                f"check costs {100 * r['check_cost']:+.1f} % "
                f"(in the loop: {100 * r['check_cost_tiles']:+.1f} %; round by round "
                f"{_pct(r.get('check_cost_paired'))} / {_pct(r.get('check_cost_tiles_paired'))})"
                f", {vs}",
            )
        elif r["kind"] == "checksum":
            _row("checksum, whole pool", r, r.get("launch", ""))
        elif r["kind"] == "relayout":
            _row("relayout (landed HND -> NHD pool)", r)
        elif r["kind"] == "staging_gather":
            _row("staging gather (fan-out, 8 MiB)", r, f"{r['pieces']} x {r['piece_bytes']} B")
        elif r["kind"] == "checksum_launch":
            _row("checksum, another launch", r, r["launch"])
        elif r["kind"] == "transfer" and "gb_s" in r:
            _row(
                f"page transfer {r['path']}", r, f"{r['pages']} x {r['page_bytes']} B, 2 processes"
            )
        elif r["kind"] == "transfer":
            _row(f"page transfer {r['path']}", None, f"failed: {r['error'][:120]}")
    for r in RESULTS:
        if r["kind"] == "jit":
            at = f" {r['tuning']}" if "tuning" in r else ""
            _row(
                f"JIT {r['kernel']}{at}", None, f"registers {r['registers']}, spills {r['spills']}"
            )
        elif r["kind"] == "registers" and "aot" in r:
            same = "equal" if r["equal"] else "DIFFER"
            _row(
                f"registers {r['variant']}",
                None,
                f"JIT {r['jit']} (spills {r['jit_spills']}), sm_90 compile {r['aot']}: {same}",
            )
        elif r["kind"] == "registers":
            _row(f"registers {r['variant']}", None, f"JIT {r['jit']}; compile failed: {r['error']}")
    goals(print)
    checks = [r for r in RESULTS if r["kind"] == "check"]
    print(
        f"checks: {sum(r['ok'] for r in checks)} passed, {len(FAILED)} failed"
        + (f" ({', '.join(FAILED)})" if FAILED else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget",
        type=float,
        default=240.0,
        help="seconds after which timings are skipped (default 240)",
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--no-flex",
        action="store_true",
        help="skip the FlexAttention baseline (it compiles on first use)",
    )
    parser.add_argument("--checks-only", action="store_true", help="correctness only, no timings")
    parser.add_argument(
        "--no-transfer", action="store_true", help="skip the GPU page transfer between processes"
    )
    parser.add_argument(
        "--tuning",
        help="the decode kernel's tuning for the timings: block_n, warps, stages, programs "
        f"per SM, min split tokens (default: $KVFERRY_DECODE_TUNING, else {DEFAULT_TUNING.name})",
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="instead of the main run: the tuning sweep (each tuning checked, then timed on "
        "the goal cases; the best timed as the main run times the default)",
    )
    parser.add_argument(
        "--tunings", help="with --tune: only these tunings, comma-separated (default: the sweep)"
    )
    parser.add_argument("--transfer-target", help=argparse.SUPPRESS)  # the target process
    parser.add_argument("--transfer-writer", help=argparse.SUPPRESS)  # one attempt's writer
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU: the script's own logic on CPU under the interpreter, small shapes",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=int(time.time()) % 100_000,
        help="inputs' seed (default: fresh each run)",
    )
    args = parser.parse_args(argv)
    try:
        tuning = DecodeTuning.parse(args.tuning) if args.tuning else active_tuning()
    except ValueError as error:
        parser.error(str(error))
    t0 = time.monotonic()
    global DEV, SMALL
    faulthandler.enable()  # a crash in native code prints where Python was
    if args.transfer_target:
        return transfer_target(json.loads(args.transfer_target))
    if args.transfer_writer:
        return transfer_writer(json.loads(args.transfer_writer))
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        DEV, SMALL = "cpu", True
    elif not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device visible (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}); this check runs only on a GPU machine",
            file=sys.stderr,
        )
        return 2
    import triton

    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        emit(
            "device",
            name=props.name,
            sms=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            torch=torch.__version__,
            cuda=torch.version.cuda,
            triton=triton.__version__,
            seed=args.seed,
        )
    else:
        emit(
            "device",
            name="cpu (dry run under the Triton interpreter)",
            torch=torch.__version__,
            triton=triton.__version__,
            seed=args.seed,
        )
    if args.tune:
        from . import gpu_tune

        return gpu_tune.run(args)
    correctness(args.seed)
    registers_against_aot(torch.Generator(device=DEV).manual_seed(args.seed), tuning)
    emit("phase", name="checks", seconds=time.monotonic() - t0)
    if not args.checks_only:
        copy_gbs = copy_bandwidth(args.warmup, args.iters)
        cases = [(1, 512), (2, 256)] if SMALL else [(1, 131072), (16, 8192), (64, 2048)]
        attention_cases(
            cases,
            copy_gbs,
            args.warmup,
            args.iters,
            t0 + args.budget,
            not (args.no_flex or SMALL),
            tuning,
        )
        if time.monotonic() < t0 + args.budget:
            checksum_bandwidth(copy_gbs, args.warmup, args.iters)
        if time.monotonic() < t0 + args.budget:
            relayout_bandwidth(copy_gbs, args.warmup, args.iters)
        if time.monotonic() < t0 + args.budget:
            staging_gather_bandwidth(copy_gbs, args.warmup, args.iters)
        if args.no_transfer:
            emit("skipped", name="page transfer", reason="--no-transfer")
        elif time.monotonic() < t0 + args.budget:
            page_transfer(copy_gbs, args.warmup, args.iters)
        else:
            emit("skipped", name="page transfer", reason="time budget")
        emit("phase", name="timings", seconds=time.monotonic() - t0)
    table()
    return 1 if FAILED else 0


if __name__ == "__main__":
    # through the imported module, so that gpu_tune shares its globals (device, results)
    from kvferry.engine.tools import gpu_check

    sys.exit(gpu_check.main())
