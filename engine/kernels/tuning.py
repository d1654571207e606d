"""The decode kernel's launch parameters: one record, its name, and the sweep the device
run times.

A :class:`DecodeTuning` holds what a launch chooses beyond the shapes: positions per step
(``block_n``, a tile of ``[block_n, head_dim]`` K and V per step), warps per program,
software-pipeline stages, and the split heuristic (programs per SM to aim for, and the
fewest positions a split may hold). Its name, ``n64-w4-s2-p4-m256``, is how the sm_90
compile, the device run and an operator's ``--tuning`` spell it; :meth:`DecodeTuning.parse`
reads it back. ``DEFAULT`` is what every launch uses unless told otherwise; an operator
tells otherwise with ``KVFERRY_DECODE_TUNING=<name>`` (:func:`active`), e.g. with the pick
``scripts/gpu-check.sh --tune`` printed for their GPU.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

BLOCK_NS = (64, 128, 256)  # multiples of every page size (16/32/64): a step never straddles
WARPS = (2, 4, 8)
STAGES = (1, 2, 3, 4)
SWEEP_STAGES = (1, 2, 3)  # 4 compiles to what 3 does for this loop (sm_90, same registers/smem)
MAX_ROWS_PER_WARP = 32  # block_n / num_warps past this spills on sm_90 at head dim 128
# 3: one split at 64 x 2048 with 8 KV heads (512 programs on 132 SMs), where 4 made a
# second split that cost 11 % on an H200, and still several at long single prompts
PROGRAMS_PER_SM = (1, 2, 3, 4, 8)
MAX_SPLITS = 128  # the combine kernel's partials per (batch, head), [B, QH, S, D] fp32
_NAME = re.compile(r"^n(\d+)-w(\d+)-s(\d+)-p(\d+)-m(\d+)$")


@dataclass(frozen=True)
class DecodeTuning:
    """Launch parameters of the split-KV decode kernel (the combine kernel's are fixed)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2
    min_split_tokens: int = 256

    def __post_init__(self) -> None:
        if self.block_n not in BLOCK_NS:
            raise ValueError(
                f"block_n {self.block_n} not in {BLOCK_NS} (a multiple of every page size)"
            )
        if self.num_warps not in WARPS:
            raise ValueError(f"num_warps {self.num_warps} not in {WARPS}")
        if self.num_stages not in STAGES:
            raise ValueError(f"num_stages {self.num_stages} not in {STAGES}")
        if self.programs_per_sm not in PROGRAMS_PER_SM:
            raise ValueError(f"programs_per_sm {self.programs_per_sm} not in {PROGRAMS_PER_SM}")
        if self.min_split_tokens < self.block_n or self.min_split_tokens % self.block_n:
            raise ValueError(
                f"min_split_tokens {self.min_split_tokens} must be a positive multiple of "
                f"block_n {self.block_n}"
            )

    @property
    def name(self) -> str:
        return (
            f"n{self.block_n}-w{self.num_warps}-s{self.num_stages}"
            f"-p{self.programs_per_sm}-m{self.min_split_tokens}"
        )

    @property
    def compile_key(self) -> tuple[int, int, int]:
        """What a compiled variant depends on; the split heuristic is chosen at launch."""
        return (self.block_n, self.num_warps, self.num_stages)

    @classmethod
    def parse(cls, name: str) -> DecodeTuning:
        """The tuning a name spells (``n128-w8-s3-p2-m256``); ValueError says what is wrong."""
        m = _NAME.match(name.strip())
        if m is None:
            raise ValueError(
                f"tuning {name!r} is not of the form n<block_n>-w<warps>-s<stages>"
                f"-p<programs per SM>-m<min split tokens>, e.g. {DEFAULT.name}"
            )
        block_n, warps, stages, per_sm, min_split = (int(x) for x in m.groups())
        return cls(block_n, warps, stages, per_sm, min_split)

    def splits(self, batch: int, kv_heads: int, max_tokens: int, sms: int) -> int:
        """Splits of the sequence so that about ``programs_per_sm`` programs run per SM,
        each split keeping at least ``min_split_tokens`` positions, at most ``MAX_SPLITS``."""
        programs = max(1, batch * kv_heads)
        want = -(-self.programs_per_sm * sms // programs)
        cap = max(1, max_tokens // self.min_split_tokens)
        return int(max(1, min(want, cap, MAX_SPLITS)))


# The device's pick (engine/GPU.md, "On the H200"): kernel v1's tile, warps and stages aiming
# for 4 programs per SM instead of 2. On an H200 it read 0.91 of copy at 1 x 131072 (0.75
# at 2 programs per SM), 0.90 at 16 x 8192 (0.86-0.89) and 0.82-0.83 at 64 x 2048 (0.92-
# 0.94, where it splits in two what one split covers), in two runs; the sweep's best over
# the two goal cases (n128-w4-s3-p2-m256) was within 2 % there and lower at 64 x 2048.
DEFAULT = DecodeTuning(programs_per_sm=4)
ENV = "KVFERRY_DECODE_TUNING"


@functools.lru_cache(maxsize=8)
def _parsed(name: str) -> DecodeTuning:
    return DecodeTuning.parse(name)


def active(environ: Mapping[str, str] | None = None) -> DecodeTuning:
    """The tuning launches use: ``KVFERRY_DECODE_TUNING`` when set, else ``DEFAULT``.
    ValueError names the variable and what is wrong with its value."""
    name = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not name:
        return DEFAULT
    try:
        return _parsed(name)
    except ValueError as error:
        raise ValueError(f"{ENV}={name!r}: {error}") from None


def compile_points() -> list[DecodeTuning]:
    """The (block_n, warps, stages) points the sweep compiles, with the default split
    heuristic: every one whose K/V tile rows per warp stay within ``MAX_ROWS_PER_WARP``.
    The sm_90 compile (``python -m kvferry.engine.kernels.aot --sweep``; ``--tuning`` for a
    point past the rule) found none within it spilling, and every point past it spilling
    with the check on under Triton 3.6 (under 3.9 all but block_n 256 on 4 warps at 2
    stages)."""
    return [
        DecodeTuning(block_n=n, num_warps=w, num_stages=s, min_split_tokens=max(256, n))
        for n in BLOCK_NS
        for w in WARPS
        for s in SWEEP_STAGES
        if n <= MAX_ROWS_PER_WARP * w
    ]


def sweep(points: list[DecodeTuning] | None = None) -> list[DecodeTuning]:
    """The sweep the device run times: each compile point (``points``, else every one)
    with every programs-per-SM target; the default first, each tuning once."""
    out = [DEFAULT]
    for point in compile_points() if points is None else points:
        for per_sm in PROGRAMS_PER_SM:
            t = replace(point, programs_per_sm=per_sm)
            if t not in out:
                out.append(t)
    return out
