"""kvstore.fs_room: the one answer to "how many bytes may still be written
on the file system at this path" (the DRAM and SSD start checks, resizes,
the slab's growth)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from kvstore.fs_room import free_bytes

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("kvstore", "tiers", "transport", "admission", "engine_adapter", "router")


def test_free_bytes_counts_what_an_unprivileged_writer_may_take(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Any) -> None:
    class Vfs:
        f_bavail, f_bfree, f_frsize, f_bsize = 3, 100, 8192, 4096  # root's reserve and f_bsize do not count

    seen: list[str] = []
    monkeypatch.setattr(os, "statvfs", lambda p: seen.append(str(p)) or Vfs())
    assert free_bytes(tmp_path) == 3 * 8192
    assert seen == [str(tmp_path)]


def test_free_bytes_of_a_real_path() -> None:
    st = os.statvfs(ROOT)
    assert free_bytes(str(ROOT)) >= 0 and free_bytes(str(ROOT)) % st.f_frsize == 0


def test_the_product_asks_the_file_system_for_room_only_through_it() -> None:
    """One formula: a second copy (f_bfree, f_bsize) would let a start check
    and a resize disagree on the same disk."""
    own = ROOT / "kvstore" / "fs_room.py"
    found = [f"{p.relative_to(ROOT)}:{n}"
             for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py")) if p != own
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bstatvfs\b", line)]
    assert found == []
