"""Ahead-of-time compile of every kernel variant for sm_90 (Hopper), on a machine without a
GPU, and the checks on the result: no spills, registers within budget, 16-byte global
loads for K/V (and the checksum's words), tensor-core MMA for the attention dots.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` runs Triton's whole
pipeline to a cubin without a device; ``cuobjdump`` from the Triton wheel gives the
resource usage (registers, stack, local memory) and the SASS. Without a cuobjdump the
loads and MMAs are read from the PTX instead and registers and spills go unchecked
(``sass_from: "ptx"``). The signatures carry the
16-byte divisibility the JIT infers for the pool's usual layout (pointers 16-byte
aligned; q, pool and output strides multiples of 16 elements; ``split_len`` a multiple of
64), so vector widths are those of a real launch. Whether the GPU JIT's register counts
equal these is for the device run to confirm (``scripts/gpu-check.sh`` prints both).

Run: ``python -m kvferry.engine.kernels.aot [--jobs N] [--json]``: one JSON object per
variant, a table, exit 1 on any violation. ``--sweep`` compiles the decode kernel (bf16,
head dim 128, group 4, check off and on) at every (block_n, warps, stages) point of
:func:`.tuning.compile_points` instead, with the programs each leaves resident per SM;
there only spills and failed compiles are violations, since the register budget is the
default launch's. Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .tuning import DEFAULT, DecodeTuning, compile_points

# Registers per thread: 4 warps at <= 128 keep 4 programs (16 warps) resident per SM.
REGISTER_BUDGET = {"decode": 128, "combine": 96, "checksum": 64}
TARGET = ("cuda", 90, 32)
NUM_WARPS = 4  # the combine and checksum kernels'; the decode kernel's come from its tuning
NUM_STAGES = 2
_DT = {"bf16": "*bf16", "fp16": "*fp16"}
# sm_90 per SM: 64K registers (allocated per warp in 256s), 228 KiB shared memory (1 KiB
# of it reserved per block), 64 warps, 32 blocks.
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_BLOCKS = 65536, 233472, 64, 32


@dataclass(frozen=True)
class Variant:
    kernel: str  # decode | combine | checksum
    dtype: str = "bf16"
    head_dim: int = 128
    group: int = 4
    check: bool = False
    tuning: DecodeTuning = DEFAULT  # the decode kernel's block_n, warps and stages

    @property
    def name(self) -> str:
        if self.kernel == "decode":
            check = "check" if self.check else "nocheck"
            key = self.tuning.compile_key
            at = "" if key == DEFAULT.compile_key else "@n{}-w{}-s{}".format(*key)
            return f"decode-{self.dtype}-d{self.head_dim}-g{self.group}-{check}{at}"
        if self.kernel == "combine":
            return f"combine-{self.dtype}-d{self.head_dim}"
        return f"checksum-{self.dtype}"


def variants() -> list[Variant]:
    """Every variant a launch can pick for the supported shapes: the attention's
    constexprs are dtype, head dim and the check (page size and split count are runtime
    arguments); GQA group 4 (32/8 heads, the device table's), and group 8 at head dim 128
    (other groups up to 16 share the 16-row query tile)."""
    out = [
        Variant("decode", dt, d, 4, check)
        for dt in ("bf16", "fp16")
        for d in (64, 128)
        for check in (False, True)
    ]
    out += [Variant("decode", "bf16", 128, 8, check) for check in (False, True)]
    out += [Variant("combine", dt, d) for dt in ("bf16", "fp16") for d in (64, 128)]
    # pairs: pages of whole aligned 32-bit pairs of words (every pool of the table);
    # words: 16-bit words one by one (a page of 2 mod 4 bytes)
    out += [Variant("checksum", mode) for mode in ("pairs", "words")]
    return out


def sweep_variants() -> list[Variant]:
    """The decode kernel of the device table's shape (bf16, head dim 128, group 4), check
    off and on, at every compile point of the tuning sweep."""
    return [
        Variant("decode", "bf16", 128, 4, check, point)
        for point in compile_points()
        for check in (False, True)
    ]


def resident_programs(registers: int, shared: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps an sm_90 SM holds at once with these registers per
    thread and bytes of shared memory per program."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = SM_REGISTERS // (per_warp * num_warps)
    by_shared = SM_SHARED // (max(shared, 0) + 1024)
    return int(min(by_regs, by_shared, SM_WARPS // num_warps, SM_BLOCKS))


@dataclass
class Report:
    variant: str
    triton: str
    registers: int = -1
    stack: int = -1
    local: int = -1
    shared: int = -1
    loads_128: int = 0
    mma: int = 0
    spill_ops: int = 0
    num_warps: int = NUM_WARPS
    resident: int = -1  # programs per SM, from registers and shared memory (-1: unknown)
    seconds: float = 0.0
    # "ptx" where no cuobjdump is found: loads and MMA from PTX, registers unknown (-1)
    sass_from: str = "cuobjdump"
    violations: list[str] = field(default_factory=list)


def _source(v: Variant, divisibility: bool = True) -> Any:
    """The ASTSource of a variant: kernel, signature with divisibility (unless told not
    to: the check that 16-byte loads are found then fails), constexprs."""
    import triton.language as tl
    from triton.compiler import ASTSource

    from . import triton_checksum, triton_decode

    if v.kernel == "decode":
        fn = triton_decode._decode_split_kernel
        dt = _DT[v.dtype]
        aligned = {
            "q_ptr",
            "stride_qb",
            "stride_qh",
            "k_ptr",
            "v_ptr",
            "stride_page",
            "stride_head",
            "stride_slot",
            "table_ptr",
            "seq_ptr",
            "out_ptr",
            "stride_ob",
            "stride_oh",
            "part_ptr",
            "ml_ptr",
            "split_len",
            "canary_ptr",
            "rid_ptr",
            "gen_ptr",
            "err_ptr",
            "first_ptr",
        }
        part_t = "*fp32"
        sig = {
            "q_ptr": dt,
            "stride_qb": "i32",
            "stride_qh": "i32",
            "k_ptr": dt,
            "v_ptr": dt,
            "stride_page": "i32",
            "stride_head": "i32",
            "stride_slot": "i32",
            "table_ptr": "*i32",
            "stride_tb": "i32",
            "seq_ptr": "*i32",
            "num_pages": "i32",
            "width": "i32",
            "page_shift": "i32",
            "out_ptr": dt,
            "stride_ob": "i32",
            "stride_oh": "i32",
            "part_ptr": part_t,
            "ml_ptr": part_t,
            "num_splits": "i32",
            "split_len": "i32",
            "canary_ptr": "*i64" if v.check else "*i32",
            "rid_ptr": "*i64" if v.check else "*i32",
            "gen_ptr": "*i64" if v.check else "*i32",
            "stride_gb": "i32",
            "err_ptr": "*i32",
            "first_ptr": "*i32",
            "qk_scale": "fp32",
        }
        consts = {
            "GROUP": v.group,
            "G_PAD": triton_decode.group_pad(v.group),
            "HEAD_DIM": v.head_dim,
            "BLOCK": v.tuning.block_n,
            "CHECK": v.check,
            "UPCAST": False,
            "CHECK_TILES": False,
        }
    elif v.kernel == "combine":
        fn = triton_decode._combine_kernel
        sig = {
            "part_ptr": "*fp32",
            "ml_ptr": "*fp32",
            "out_ptr": _DT[v.dtype],
            "stride_ob": "i32",
            "stride_oh": "i32",
            "seq_ptr": "*i32",
            "num_splits": "i32",
            "split_len": "i32",
            "max_tokens": "i32",
        }
        aligned = {
            "part_ptr",
            "ml_ptr",
            "out_ptr",
            "stride_ob",
            "stride_oh",
            "seq_ptr",
            "split_len",
        }
        consts = {"HEAD_DIM": v.head_dim, "SPLITS": triton_decode.COMBINE_BLOCK}
    else:
        fn = triton_checksum._checksum_kernel
        pairs = v.dtype == "pairs"
        sig = {
            "words_ptr": "*i32" if pairs else "*i16",
            "stride_page": "i32",
            "pages_ptr": "*i64",
            "part_ptr": "*i64",
            "words_per_page": "i32",
            "chunks": "i32",
        }
        aligned = {"words_ptr", "stride_page", "pages_ptr", "part_ptr", "words_per_page"}
        consts = {
            "BLOCK": triton_checksum.BLOCK,
            "STEPS": triton_checksum.CHUNK_STEPS,
            "BYTES": False,
            "COMPOSE": False,
            "PAIRS": pairs,
            "ACC": tl.int32,  # the default steps (CHUNK_STEPS <= MAX_INT32_STEPS)
        }
    for name in consts:
        sig[name] = "constexpr"
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned} if divisibility else {}
    return ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)


def cuobjdump() -> str | None:
    """The cuobjdump shipped in the Triton wheel (or on PATH), if any."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else shutil.which("cuobjdump")


_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_LOAD128 = re.compile(r"\b(LDG\.E[.A-Z0-9_]*\.128|LDGSTS\.E[.A-Z0-9_]*\.128)\b")
_MMA = re.compile(r"\b(HMMA|HGMMA)\.")
_SPILL = re.compile(r"\b(STL|LDL)\b")


def compile_variant(v: Variant, budget: int | None = None, divisibility: bool = True) -> Report:
    """Compile one variant for sm_90 and check it against the register budget (its
    kernel's, unless ``budget`` is given)."""
    import triton
    from triton.backends.compiler import GPUTarget

    report = Report(v.name, triton.__version__)
    warps, stages = (
        (v.tuning.num_warps, v.tuning.num_stages)
        if v.kernel == "decode"
        else (NUM_WARPS, NUM_STAGES)
    )
    report.num_warps = warps
    t0 = time.perf_counter()
    compiled = triton.compile(
        _source(v, divisibility),
        target=GPUTarget(*TARGET),
        options={"num_warps": warps, "num_stages": stages},
    )
    report.seconds = round(time.perf_counter() - t0, 2)
    report.shared = int(getattr(compiled.metadata, "shared", -1))
    tool = cuobjdump()
    if tool is None:
        report.sass_from = "ptx"
        ptx = compiled.asm["ptx"]
        report.loads_128 = len(
            re.findall(
                r"(ld\.global[.a-z0-9]*\.v4\.b32|cp\.async\.c[ag]\.shared\.global[^;]*,\s*(?:16|0x10)\s*[,;])",
                ptx,
            )
        )
        report.mma = len(re.findall(r"\bmma\.sync|wgmma\.", ptx))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(tmp, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(compiled.asm["cubin"])
            res = subprocess.run(
                [tool, "-res-usage", cubin], capture_output=True, text=True, check=True
            ).stdout
            sass = subprocess.run(
                [tool, "-sass", cubin], capture_output=True, text=True, check=True
            ).stdout
        m = _RES.search(res)
        if m is None:
            raise RuntimeError(f"no resource usage in cuobjdump output: {res!r}")
        report.registers, report.stack, _, report.local = (int(x) for x in m.groups())
        report.loads_128 = len(_LOAD128.findall(sass))
        report.mma = len(_MMA.findall(sass))
        report.spill_ops = len(_SPILL.findall(sass))
        report.resident = resident_programs(report.registers, report.shared, warps)
        budget = REGISTER_BUDGET[v.kernel] if budget is None else budget
        if report.registers > budget:
            report.violations.append(f"{report.registers} registers > budget {budget}")
        if report.stack or report.local or report.spill_ops:
            report.violations.append(
                f"spills: stack {report.stack}, local {report.local}, {report.spill_ops} STL/LDL"
            )
    if report.loads_128 < 2 if v.kernel == "decode" else report.loads_128 < 1:
        report.violations.append(f"only {report.loads_128} 16-byte global loads")
    if v.kernel == "decode" and report.mma < 2:
        report.violations.append(f"only {report.mma} tensor-core MMA instructions")
    return report


def _compile_safe(job: tuple[Variant, int | None, bool]) -> Report:
    v = job[0]
    try:
        return compile_variant(*job)
    except Exception as error:  # report every variant, fail at the end
        import triton

        return Report(
            v.name,
            triton.__version__,
            violations=[f"compile failed: {type(error).__name__}: {str(error)[-400:]}"],
        )


def run(
    selected: list[Variant], jobs: int, budget: int | None = None, divisibility: bool = True
) -> list[Report]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter cannot compile kernels")
    work = [(v, budget, divisibility) for v in selected]
    if jobs <= 1:
        return [_compile_safe(job) for job in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_safe, work))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--only", default="", help="substring of the variant names to compile")
    parser.add_argument("--json", action="store_true", help="JSON lines only, no table")
    parser.add_argument(
        "--register-budget", type=int, help="one budget for every kernel (shows the check can fail)"
    )
    parser.add_argument(
        "--no-divisibility",
        action="store_true",
        help="drop the 16-byte divisibility hints (shows the load check can fail)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="the decode kernel at every tuning compile point (registers, spills, resident "
        "programs per SM) instead of the default variants",
    )
    parser.add_argument(
        "--tuning",
        help="the decode variants at this tuning (e.g. n128-w8-s3-p2-m256), registers "
        "reported against 255 per thread unless --register-budget is given",
    )
    args = parser.parse_args(argv)
    if args.tuning:
        try:
            at = DecodeTuning.parse(args.tuning)
        except ValueError as error:
            parser.error(str(error))
        pool = [replace(v, tuning=at) for v in variants() if v.kernel == "decode"]
    else:
        pool = sweep_variants() if args.sweep else variants()
    selected = [v for v in pool if args.only in v.name]
    if not selected:
        parser.error(f"no variant matches {args.only!r}")
    budget = args.register_budget
    if (args.sweep or args.tuning) and budget is None:
        budget = 255  # every register a thread may have: the sweep reports, resident decides
    t0 = time.perf_counter()
    reports = run(selected, args.jobs, budget, not args.no_divisibility)
    for r in reports:
        print(json.dumps(asdict(r)), flush=True)
    if not args.json:
        print(
            f"\n{'variant':56} {'regs':>4} {'spill':>5} {'ld128':>5} {'mma':>4} {'smem':>6}"
            f" {'res':>3}  verdict"
        )
        for r in reports:
            verdict = "ok" if not r.violations else "; ".join(r.violations)
            print(
                f"{r.variant:56} {r.registers:>4} {r.stack + r.local:>5} {r.loads_128:>5} "
                f"{r.mma:>4} {r.shared:>6} {r.resident:>3}  {verdict}"
            )
        failing = sum(bool(r.violations) for r in reports)
        print(f"{len(reports)} variants, {failing} failing, {time.perf_counter() - t0:.1f} s")
    return 1 if any(r.violations for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
