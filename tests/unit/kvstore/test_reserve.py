"""Columns grown in place (kvstore/reserve.py): what the kernel backs is
what is counted, and a longer view is the same memory."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

import kvstore.reserve as reserve
from kvstore.reserve import PAGE, Reserved, resident


def test_only_written_pages_count_and_views_share_memory() -> None:
    r = Reserved.make("i8", 1 << 22)  # 32 MiB of address space
    assert r is not None
    assert resident([r]) == 0
    small = r.view(100)
    small[:] = -1
    assert resident([r]) == PAGE
    big = r.view(1 << 20)  # longer: the same memory, nothing copied or backed
    assert np.shares_memory(small, big) and big[:100].tolist() == [-1] * 100
    assert resident([r]) == PAGE  # nothing copied or backed by the longer view
    assert not big[100:].any()  # (reading maps the zero page, which mincore counts: never fewer than RSS)
    big[:] = 7
    assert small[0] == 7
    assert (1 << 20) * 8 <= resident([r]) <= (1 << 20) * 8 + PAGE
    other = Reserved.make("u1", 10)
    assert other is not None and resident([r, other]) == resident([r])


def test_without_mincore_every_page_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    r = Reserved.make("u4", 5000)
    assert r is not None
    monkeypatch.setattr(reserve, "MINCORE", None)
    assert resident([r]) == -(-5000 * 4 // PAGE) * PAGE  # an upper bound, never fewer than backed


def test_no_range_where_none_can_be_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kw: object) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(reserve.mmap, "mmap", refuse)
    assert Reserved.make("i8", 1 << 20) is None
