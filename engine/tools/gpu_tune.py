"""The decode kernel's tuning sweep on the device, in one call of a few minutes.

Every tuning of :func:`kvferry.engine.kernels.tuning.sweep` (or the ones named) is first
checked against the torch reference on ragged sequences, then timed (check off) on the
device table's cases against the copy measured in the same run: one JSON line per (case,
tuning). A tuning whose compile spills, or whose output is wrong, is reported and never
timed. Then the best tuning of each case, and the best single tuning over the goal cases
(the one whose worst loss against each case's best is smallest), which is timed again as
the main run times the default (check off and on, torch baselines), so its table and the
goals read the same way. The table ends with the ``KVFERRY_DECODE_TUNING`` value that
serves with the pick, and what to write into ``tuning.DEFAULT`` to make it the default.

Run as ``scripts/gpu-check.sh --tune [--tunings NAME,NAME]`` (a dry run on CPU:
``--tune --dry-run``, three tunings under the interpreter, small shapes).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable

import torch

from kvferry.engine.kernels import tuning as tunings_mod
from kvferry.engine.kernels.tuning import DEFAULT, DecodeTuning

from . import gpu_check as gc

GOAL_CASES = ((1, 131072), (16, 8192))
CASES = (*GOAL_CASES, (64, 2048))
SMALL_CASES = ((1, 512), (2, 256))
DRY_RUN_TUNINGS = ("n64-w4-s2-p4-m256", "n128-w4-s2-p4-m256", "n256-w8-s3-p1-m256")


def select(names: str | None) -> list[DecodeTuning]:
    """The tunings to sweep: those named (comma-separated), else the whole sweep (three on a
    dry run). ValueError names a tuning that does not parse."""
    if names:
        chosen = [DecodeTuning.parse(n) for n in names.split(",") if n.strip()]
    elif gc.SMALL:
        chosen = [DecodeTuning.parse(n) for n in DRY_RUN_TUNINGS]
    else:
        chosen = tunings_mod.sweep()
    return list(dict.fromkeys(chosen))


def check_point(tuning: DecodeTuning, gen: torch.Generator) -> bool:
    """``tuning`` against the reference on ragged sequences (empty, shorter than a step,
    not a multiple of ``block_n``, several splits long), page sizes 16 and 64, one split,
    seven and the heuristic's; then the registers and spills of what the JIT built, beside
    the sm_90 compile of the same variant (on the GPU). One check line each; False when
    any failed or the kernel spills."""
    from kvferry.engine.attention import paged_decode_attention as reference
    from kvferry.engine.kernels import aot, triton_decode

    ok_all = True
    top = 200 if gc.SMALL else 3000
    for page_size in (16, 64):
        lens = [top + 96, 0, 5, tuning.block_n * 3 + 7]
        kv, table, seq_lens, q = gc.random_case(
            gen, torch.bfloat16, 128, page_size, lens, kv_heads=2 if gc.SMALL else 8
        )
        want = reference(q, kv, 1, table, seq_lens)
        for splits in (1, 7, None):
            got = triton_decode.paged_decode_attention(
                q,
                kv,
                1,
                table,
                seq_lens,
                num_splits=splits,
                tuning=tuning,
                out=torch.full_like(q, float("nan")),
            )
            ok, err = gc.close_to_reference(got, want, torch.bfloat16, empty=(1,))
            gc.check(
                f"tuning {tuning.name} p{page_size} splits={splits or 'auto'}",
                ok,
                max_abs_err=err,
            )
            ok_all = ok_all and ok
    compiled = triton_decode.LAUNCHED.get("decode")
    spills = getattr(compiled, "n_spills", None)
    gc.emit(
        "jit",
        kernel="decode",
        tuning=tuning.name,
        registers=getattr(compiled, "n_regs", None),
        spills=spills,
        shared=getattr(getattr(compiled, "metadata", None), "shared", None),
    )
    if gc.DEV != "cpu":  # the interpreter compiles nothing
        gc.compare_registers(
            [(aot.Variant("decode", "bf16", 128, 4, False, tuning), compiled)], tuning
        )
    if spills:
        gc.emit("tune_skipped", tuning=tuning.name, reason=f"{spills} spilled registers")
        return False
    return ok_all


def time_case(
    batch: int,
    context: int,
    tunings: Iterable[DecodeTuning],
    copy_gbs: float,
    warmup: int,
    iters: int,
    deadline: float,
    gen: torch.Generator,
) -> dict[str, float]:
    """Seconds per pass of each tuning on one case (check off), each output compared with
    the reference first; one ``tune`` line per tuning."""
    from kvferry.engine.attention import paged_decode_attention as reference
    from kvferry.engine.kernels import triton_decode

    shape = gc.attention_shape()
    kv, table, seq_lens, q, io_bytes = gc.attention_inputs(batch, context, gen, shape)
    want = reference(q, kv, 1, table, seq_lens)
    out = torch.empty_like(q)
    case = f"{batch}x{context}"
    seconds: dict[str, float] = {}
    for tuning in tunings:
        if time.monotonic() > deadline:
            gc.emit("skipped", case=case, tuning=tuning.name, reason="time budget")
            continue
        got = triton_decode.paged_decode_attention(
            q, kv, 1, table, seq_lens, tuning=tuning, out=torch.full_like(q, float("nan"))
        )
        ok, err = gc.close_to_reference(got, want, shape[4])
        if not ok:
            gc.check(f"tuning {tuning.name} on {case}", False, max_abs_err=err)
            continue
        run = functools.partial(
            triton_decode.paged_decode_attention, q, kv, 1, table, seq_lens, tuning=tuning, out=out
        )
        t = gc.cuda_time(run, warmup, iters)
        seconds[tuning.name] = t
        gc.emit(
            "tune",
            case=case,
            tuning=tuning.name,
            splits=triton_decode.choose_splits(batch, shape[1], context, kv.device, tuning),
            max_abs_err=err,
            bytes=io_bytes,
            seconds=t,
            gb_s=io_bytes / t / 1e9,
            of_copy=io_bytes / t / 1e9 / copy_gbs,
        )
    return seconds


def best_overall(per_case: dict[str, dict[str, float]], goal_cases: list[str]) -> str | None:
    """The tuning timed in every goal case whose worst ratio to each case's best time is
    smallest (ties: the smaller sum of ratios); None when no tuning was timed in all."""
    cases = [c for c in goal_cases if per_case.get(c)]
    if not cases:
        return None
    common = set.intersection(*(set(per_case[c]) for c in cases))
    if not common:
        return None
    best = {c: min(per_case[c].values()) for c in cases}

    def loss(name: str) -> tuple[float, float, str]:
        ratios = [per_case[c][name] / best[c] for c in cases]
        return (max(ratios), sum(ratios), name)

    return min(common, key=loss)


def run(args) -> int:
    """The sweep (``gpu_check.main`` calls it for ``--tune``, after the device line)."""
    t0 = time.monotonic()
    deadline = t0 + max(args.budget - 60, args.budget / 2)  # the rest is the pick's timing
    try:
        tunings = select(args.tunings)
    except ValueError as error:
        gc.check("tunings parse", False, error=str(error))
        return 1
    gc.emit("tune_plan", tunings=len(tunings), default=DEFAULT.name)
    gen = torch.Generator(device=gc.DEV).manual_seed(args.seed)
    checked: dict[tuple[int, int, int], bool] = {}
    passed = []
    for tuning in tunings:
        if time.monotonic() > deadline:
            gc.emit("skipped", tuning=tuning.name, reason="time budget")
            continue
        key = tuning.compile_key
        if key not in checked:
            checked[key] = check_point(tuning, gen)
        if checked[key]:
            passed.append(tuning)
    gc.emit("phase", name="tuning checks", seconds=time.monotonic() - t0)
    copy_gbs = gc.copy_bandwidth(args.warmup, args.iters)
    cases = SMALL_CASES if gc.SMALL else CASES
    goal_cases = [f"{b}x{c}" for b, c in (SMALL_CASES if gc.SMALL else GOAL_CASES)]
    per_case: dict[str, dict[str, float]] = {}
    for batch, context in cases:
        case = f"{batch}x{context}"
        per_case[case] = time_case(
            batch, context, passed, copy_gbs, args.warmup, args.iters, deadline, gen
        )
        if per_case[case]:
            name = min(per_case[case].items(), key=lambda item: item[1])[0]
            default_t = per_case[case].get(DEFAULT.name)
            gc.emit(
                "tuned",
                case=case,
                best=name,
                seconds=per_case[case][name],
                default=DEFAULT.name,
                gain_over_default=(default_t / per_case[case][name]) if default_t else None,
            )
    overall = best_overall(per_case, goal_cases)
    gc.emit("phase", name="sweep", seconds=time.monotonic() - t0)
    if overall is None:
        gc.check("a tuning timed in every goal case", False)
    else:
        pick = DecodeTuning.parse(overall)
        gc.emit(
            "tuned",
            case="goal cases",
            best=overall,
            of_best={c: per_case[c][overall] / min(per_case[c].values()) for c in goal_cases},
            default=DEFAULT.name,
        )
        # the pick as the main run times the default: check off/on and the torch baselines
        gc.attention_cases(
            cases,
            copy_gbs,
            args.warmup,
            args.iters,
            t0 + args.budget,
            not (args.no_flex or gc.SMALL),
            pick,
        )
    gc.emit("phase", name="tune", seconds=time.monotonic() - t0)
    table(per_case)
    return 1 if gc.FAILED else 0


def table(per_case: dict[str, dict[str, float]]) -> None:
    """The sweep's top five per case, then the main table (the pick's rows and goals)."""
    print()
    for case, seconds in per_case.items():
        ranked = sorted(seconds.items(), key=lambda kv: kv[1])
        rows = {r["tuning"]: r for r in gc.RESULTS if r["kind"] == "tune" and r["case"] == case}
        print(f"{case}: {len(ranked)} tunings timed, best first")
        for name, _ in ranked[:5]:
            r = rows[name]
            mark = "  (default)" if name == DEFAULT.name else ""
            print(
                f"  {name:22} {r['gb_s']:8.0f} GB/s {r['of_copy']:6.2f} of copy "
                f"splits {r['splits']:>3}{mark}"
            )
        if DEFAULT.name in seconds and DEFAULT.name not in dict(ranked[:5]):
            r = rows[DEFAULT.name]
            place = [n for n, _ in ranked].index(DEFAULT.name) + 1
            print(
                f"  {DEFAULT.name:22} {r['gb_s']:8.0f} GB/s {r['of_copy']:6.2f} (default, #{place})"
            )
    pick = [r for r in gc.RESULTS if r["kind"] == "tuned" and r["case"] == "goal cases"]
    if pick:
        best = DecodeTuning.parse(pick[0]["best"])
        print(
            f"\nbest over the goal cases: {best.name}; to serve with it, "
            f"KVFERRY_DECODE_TUNING={best.name}; to make it the default, tuning.DEFAULT = "
            f"DecodeTuning(block_n={best.block_n}, num_warps={best.num_warps}, "
            f"num_stages={best.num_stages}, programs_per_sm={best.programs_per_sm}, "
            f"min_split_tokens={best.min_split_tokens})"
        )
    gc.table()
