"""SSD tier segments are preallocated (tiers/ssd.py, tiers/ssd_format.py
``preallocate``): a new segment's room is reserved on disk at once, and what
is not written is given back when the segment is sealed, when the tier
closes, and at the next open after a run that stopped without closing."""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np
import pytest

from tests.unit.tiers.test_ssd import KIB, MIB, NS, du_bytes, get, metas, put
from tests.conftest import chain
from tiers import ssd_format
from tiers.ssd import HEADER_BYTES, OsFileLayer, SsdTier
from tiers.ssd_format import preallocate

SEG = 1 * MIB


def allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def segs(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "seg-*.kvs")))


@pytest.fixture
def tdir(tmp_path: Any) -> str:
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not preallocate(fd, SEG):
            pytest.skip("this file system does not preallocate (fallocate KEEP_SIZE)")
        assert os.fstat(fd).st_size == 0 and allocated(str(probe)) >= SEG  # the room, not the size
    finally:
        os.close(fd)
    return str(tmp_path / "ssd")


def test_a_new_segment_has_its_room_and_sealing_gives_the_rest_back(tdir: str) -> None:
    size = 64 * KIB
    with SsdTier(tdir, 64 * MIB, segment_bytes=SEG) as t:
        owners = metas(NS, chain(b"pa", 20))
        locs, csums = put(t, owners[:2], size)
        (first,) = segs(tdir)
        assert os.path.getsize(first) == 2 * (HEADER_BYTES + size)
        assert allocated(first) >= SEG  # the whole segment's room, from its first write
        assert t.disk_bytes >= SEG
        more, mcs = put(t, owners[2:], size)  # 20 records do not fit one segment: it is sealed
        assert len(segs(tdir)) == 2
        n = os.path.getsize(first)
        assert n + HEADER_BYTES + size > SEG  # sealed because the next record did not fit
        assert allocated(first) < n + 64 * KIB  # ... and its unwritten room given back
        assert abs(t.disk_bytes - du_bytes(tdir)) <= 0.1 * du_bytes(tdir)  # the active room counted
        assert get(t, np.concatenate([locs, more]), owners, size, np.concatenate([csums, mcs]))[0].all()
    for p in segs(tdir):  # closing seals the active segment too
        assert allocated(p) < os.path.getsize(p) + 64 * KIB


def test_open_gives_back_the_room_a_stopped_run_left(tdir: str) -> None:
    size = 64 * KIB
    owners = metas(NS, chain(b"pb", 3))
    with SsdTier(tdir, 64 * MIB, segment_bytes=SEG) as t:
        locs, csums = put(t, owners, size)
    (seg,) = segs(tdir)
    fd = os.open(seg, os.O_RDWR)
    try:
        assert preallocate(fd, SEG)  # as a run killed while writing this segment leaves it
    finally:
        os.close(fd)
    assert allocated(seg) >= SEG
    with SsdTier(tdir, 64 * MIB, segment_bytes=SEG) as t:
        assert allocated(seg) < os.path.getsize(seg) + 64 * KIB
        assert os.path.getsize(seg) == 3 * (HEADER_BYTES + size)  # nothing written is touched
        assert get(t, locs, owners, size, csums)[0].all()


class NoRoom(OsFileLayer):
    """A file system (or a disk too full) that cannot preallocate."""

    def __init__(self) -> None:
        self.asked = 0

    def preallocate(self, fd: int, length: int) -> bool:  # type: ignore[override]
        self.asked += 1
        return False


def test_without_preallocation_segments_are_written_as_before(tdir: str) -> None:
    size = 64 * KIB
    fs = NoRoom()
    owners = metas(NS, chain(b"pc", 20))
    with SsdTier(tdir, 64 * MIB, segment_bytes=SEG, fs=fs) as t:
        locs, csums = put(t, owners, size)
        assert fs.asked == len(segs(tdir)) == 2
        for p in segs(tdir):
            assert allocated(p) < os.path.getsize(p) + 64 * KIB
        assert abs(t.disk_bytes - du_bytes(tdir)) <= 0.1 * du_bytes(tdir)
        assert get(t, locs, owners, size, csums)[0].all()


def test_a_preallocation_that_fails_part_way_keeps_no_room(tdir: str, monkeypatch: Any) -> None:
    """fallocate that runs out of space (ENOSPC) part way keeps the blocks
    it got on ext4 and XFS: ``preallocate`` gives them back when it says
    False, or they stay past the segment's end until it is removed."""
    real = ssd_format._fallocate
    assert real is not None

    def half(fd: int, mode: int, offset: int, length: int) -> int:
        real(fd, mode, offset, length // 2)
        return -1

    monkeypatch.setattr(ssd_format, "_fallocate", half)
    size = 64 * KIB
    owners = metas(NS, chain(b"ph", 20))
    with SsdTier(tdir, 64 * MIB, segment_bytes=SEG) as t:
        locs, csums = put(t, owners, size)  # two segments: the first sealed, the second closed
        assert get(t, locs, owners, size, csums)[0].all()
    for p in segs(tdir):
        assert allocated(p) < os.path.getsize(p) + 64 * KIB
