"""pack: byte-balanced placement of items into shard files, aligned offsets, empty files dropped."""

from __future__ import annotations

import random

import pytest

from dcp_memstore.store.packing import ITEM_ALIGN, pack


def _check_layout(sizes, placements, file_sizes, align):
    """Items of one file never overlap, start aligned and lie inside the file's reported size."""
    assert len(placements) == len(sizes)
    by_bin: dict[int, list[tuple[int, int]]] = {}
    for size, p in zip(sizes, placements, strict=True):
        assert 0 <= p.bin < len(file_sizes)
        assert p.offset % align == 0
        assert p.offset + size <= file_sizes[p.bin]
        by_bin.setdefault(p.bin, []).append((p.offset, size))
    for ranges in by_bin.values():
        ranges.sort()
        for (o1, s1), (o2, _) in zip(ranges, ranges[1:], strict=False):
            assert o1 + s1 <= o2
    assert sorted(by_bin) == list(range(len(file_sizes)))  # every returned file holds data


def test_equal_items_are_spread_evenly():
    sizes = [1000] * 8
    placements, file_sizes = pack(sizes, 4)
    _check_layout(sizes, placements, file_sizes, ITEM_ALIGN)
    assert len(file_sizes) == 4
    assert len(set(file_sizes)) == 1
    assert [sum(p.bin == b for p in placements) for b in range(4)] == [2, 2, 2, 2]


def test_large_items_are_balanced_by_bytes_not_count():
    sizes = [4096, 1024, 1024, 1024, 1024]
    placements, file_sizes = pack(sizes, 2)
    _check_layout(sizes, placements, file_sizes, ITEM_ALIGN)
    assert sorted(file_sizes) == [4096, 4096]
    big = placements[0].bin
    assert all(p.bin != big for p in placements[1:])


def test_random_sizes_stay_within_one_item_of_balance():
    rng = random.Random(0)
    sizes = [rng.randint(1, 100_000) for _ in range(200)]
    placements, file_sizes = pack(sizes, 4)
    _check_layout(sizes, placements, file_sizes, ITEM_ALIGN)
    assert max(file_sizes) - min(file_sizes) <= max(sizes) + ITEM_ALIGN


def test_offsets_are_aligned_even_for_odd_sizes():
    sizes = [1, 3, 65, 127, 129, 7]
    placements, file_sizes = pack(sizes, 1)
    _check_layout(sizes, placements, file_sizes, ITEM_ALIGN)
    assert file_sizes == [sum((s + ITEM_ALIGN - 1) // ITEM_ALIGN * ITEM_ALIGN for s in sizes)]


def test_custom_alignment_is_honoured():
    sizes = [10, 20, 30, 40]
    placements, file_sizes = pack(sizes, 2, align=4096)
    _check_layout(sizes, placements, file_sizes, 4096)


def test_fewer_items_than_bins_drops_empty_files():
    placements, file_sizes = pack([500, 300], 4)
    assert len(file_sizes) == 2
    assert {p.bin for p in placements} == {0, 1}


def test_no_items_no_files():
    assert pack([], 4) == ([], [])


def test_zero_sized_items_still_get_a_file_slot():
    """An empty tensor (numel 0) must land in a real file, alone or next to others."""
    placements, file_sizes = pack([0, 0], 3)
    _check_layout([0, 0], placements, file_sizes, ITEM_ALIGN)
    assert file_sizes
    placements, file_sizes = pack([0, 100, 0], 3)
    _check_layout([0, 100, 0], placements, file_sizes, ITEM_ALIGN)


def test_bins_below_one_is_an_error():
    with pytest.raises(ValueError, match="bins"):
        pack([1], 0)
