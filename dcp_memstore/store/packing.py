"""Placing items into per-thread shard files: balanced by bytes, each item aligned."""

from __future__ import annotations

from dataclasses import dataclass

ITEM_ALIGN = 64  # cache line; also a multiple of every dtype's size, so views need no copy


@dataclass(frozen=True)
class Placement:
    bin: int
    offset: int


def pack(sizes: list[int], bins: int, align: int = ITEM_ALIGN) -> tuple[list[Placement], list[int]]:
    """Assign items of ``sizes`` bytes to at most ``bins`` files, largest first to the least-filled file.

    Returns each item's placement (in input order) and each used file's size in bytes. Empty files are
    dropped and the remaining bins renumbered, so every returned bin holds data.
    """
    if bins < 1:
        raise ValueError("bins must be >= 1")
    fill = [0] * bins
    placed: list[Placement | None] = [None] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        b = min(range(bins), key=fill.__getitem__)
        placed[i] = Placement(b, fill[b])
        fill[b] += max(1, (sizes[i] + align - 1) // align) * align  # an empty item still gets a file
    used = [b for b in range(bins) if fill[b] > 0]
    renumber = {b: n for n, b in enumerate(used)}
    return [Placement(renumber[p.bin], p.offset) for p in placed], [fill[b] for b in used]
