"""SSD tier (tiers/ssd.py): new segments, their names and their ids."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.conftest import chain
from tests.unit.tiers.test_ssd import KIB, MIB, NS, get, metas, put, seg_files
from tiers.ssd import SsdTier
from tiers.ssd_recover import SNAPSHOT_FILE


@pytest.fixture
def tdir(tmp_path: Any) -> str:
    return str(tmp_path / "ssd")


def test_a_damaged_segment_name_below_2_32_does_not_use_up_the_segment_ids(tdir: str) -> None:
    """A segment file renamed by damage to ``seg-004294967295.kvs`` (the
    last id below 2^32) holds nothing the index points at: it is not what
    the next segment's id is counted from (the ids would be used up, and
    every later write refused)."""
    size = 64 * KIB
    owners = metas(NS, chain(b"dn", 40))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        put(t, owners[:20], size)  # 15 records a segment: two segments
    segs = seg_files(tdir)
    assert len(segs) == 2
    os.rename(segs[1], os.path.join(tdir, "seg-004294967295.kvs"))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        assert len(t.recover()) == 15  # the renamed segment's five are misses
        more, csums = put(t, owners[20:], size)  # needs new segments
        assert get(t, more, owners[20:], size, csums)[0].all()
    assert all(int(os.path.basename(p)[4:16]) < 100 for p in seg_files(tdir))


def test_a_rebuilt_index_naming_the_last_segment_id_still_writes(tdir: str) -> None:
    """The same damaged name when the index is rebuilt from the segments:
    its records are found under that id, so it stays; new segments take
    ids no file uses, not ids past 2^32 - 1 (no write would succeed)."""
    size = 64 * KIB
    owners = metas(NS, chain(b"dr", 40))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        put(t, owners[:20], size)
    segs = seg_files(tdir)
    os.rename(segs[1], os.path.join(tdir, "seg-004294967295.kvs"))
    os.unlink(os.path.join(tdir, SNAPSHOT_FILE))
    with open(os.path.join(tdir, "index", "CURRENT"), "wb") as f:
        f.write(b"damaged\n")  # unreadable: rebuilt from the segment headers
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        assert t.index_rebuilds == 1 and len(t.recover()) == 20
        more, csums = put(t, owners[20:], size)
        assert get(t, more, owners[20:], size, csums)[0].all()
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        assert len(t.recover()) == 40
