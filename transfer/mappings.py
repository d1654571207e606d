"""What this process has mapped, from ``/proc/self/maps``: the bound a direct write into a
peer's shared-memory segment must stay within.

UCX maps a peer's shared-memory segment into this process when its rkey is unpacked, and
``ucp_rkey_ptr`` turns the descriptor's base into an address here without checking the
descriptor's length against the mapping. Writes on the direct path are stores at that
address, so a descriptor that claims more than was mapped (a peer's bug, or a lie) would
have them land in whatever this process mapped next: another peer's pool.
"""

from __future__ import annotations

MAPS = "/proc/self/maps"


def mapped_span(address: int, maps: str = MAPS) -> tuple[int, int] | None:
    """``[start, end)`` of the mapping of this process that holds ``address``, joined with
    the mappings right after it of the same object (a mapping split by its protections),
    or None when nothing is mapped there (or the maps cannot be read)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    spans: list[tuple[int, int, tuple[str, ...]]] = []  # start, end, (dev, inode, path)
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        start, _, end = fields[0].partition("-")
        spans.append((int(start, 16), int(end, 16), tuple(fields[3:])))
    for i, (lo, hi, obj) in enumerate(spans):
        if lo <= address < hi:
            for next_lo, next_hi, next_obj in spans[i + 1 :]:
                if next_lo != hi or next_obj != obj or obj[1] == "0":  # inode 0: anonymous
                    break
                hi = next_hi
            return lo, hi
    return None
