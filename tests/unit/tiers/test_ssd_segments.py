"""SSD tier (tiers/ssd.py): new segments, their names and their ids."""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

import numpy as np
import pytest

from kvstore.errors import Unavailable
from tests.conftest import chain, payload_for
from tests.unit.tiers.test_ssd import KIB, MIB, NS, get, metas, put, seg_files
from tests.unit.tiers.test_ssd_faults import NoUnlink
from tiers.ssd import OsFileLayer, SsdTier
from tiers.ssd_recover import SNAPSHOT_FILE


@pytest.fixture
def tdir(tmp_path: Any) -> str:
    return str(tmp_path / "ssd")


class DirSync(OsFileLayer):
    """The real OS; an fsync of a directory fails (EIO) while ``fail`` is
    set, and each segment write records whether the directory was synced
    since its segment was created."""

    def __init__(self) -> None:
        self.fail = False
        self.dir_syncs: list[bool] = []  # each directory fsync: did it succeed

    def fsync(self, fd: int) -> None:  # type: ignore[override]
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            self.dir_syncs.append(not self.fail)
            if self.fail:
                raise OSError(errno.EIO, "injected directory fsync failure")
        super().fsync(fd)


def test_a_failed_directory_fsync_fails_the_write_and_is_retried(tdir: str) -> None:
    """A new segment's name is fsynced into the directory before anything
    points into it. When that fsync fails the write fails (Unavailable,
    nothing indexed), and the next write does not append to that segment
    as if its name were durable: the directory is synced again first."""
    size = 64 * KIB
    fs = DirSync()
    owners = metas(NS, chain(b"ds", 4))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB, fs=fs) as t:
        fs.fail = True
        locs = t.allocate(size, 2)
        with pytest.raises(Unavailable):
            t.write(locs, [np.frombuffer(payload_for(o.ns_digest, o.key, size), np.uint8) for o in owners[:2]],
                    owners[:2])
        assert len(t.recover()) == 0 and t.garbage_bytes == 0
        assert seg_files(tdir) == []  # the segment whose name may not be durable is gone: nothing points in
        fs.fail = False
        done = len(fs.dir_syncs)
        t.free(locs)
        got, csums = put(t, owners, size)
        assert True in fs.dir_syncs[done:]  # synced (again) before these records counted as stored
        assert get(t, got, owners, size, csums)[0].all()
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        assert len(t.recover()) == 4


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


def test_a_failed_unlink_at_open_keeps_the_tier_and_its_blocks(tdir: str) -> None:
    """Open removes segments nothing points into; an unlink that fails
    there (EIO) made the whole open fail, so every stored block was lost
    to the daemon. The file now stays until a later reclaim removes it."""
    size = 64 * KIB
    owners = metas(NS, chain(b"uo", 20))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        locs, _ = put(t, owners, size)  # 15 records a segment: two segments
        t.free(locs[15:])  # the second segment holds only garbage
    assert len(seg_files(tdir)) == 2
    fs = NoUnlink()
    fs.fail = True
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB, fs=fs) as t:
        got = t.recover()
        assert len(got) == 15
        more, csums = put(t, metas(NS, chain(b"uo2", 20)), size)
        assert get(t, more, metas(NS, chain(b"uo2", 20)), size, csums)[0].all()
        fs.fail = False
        t.reclaim()
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        assert len(t.recover()) == 35


@pytest.mark.parametrize("kind", ["directory", "eio"])
def test_a_leftover_tmp_that_cannot_be_removed_keeps_the_tier(tdir: str, kind: str) -> None:
    """Open removes leftover ``.tmp`` files (a small file's rewrite that
    stopped before its rename); one whose unlink fails (EIO, or an entry
    unlink cannot remove) made the whole open fail, so every stored block
    was lost to the daemon. It is now left (logged) and the tier opens."""
    size = 64 * KIB
    owners = metas(NS, chain(b"tm", 10))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        locs, csums = put(t, owners, size)
    tmp = os.path.join(tdir, "namespaces.tmp")
    fs = NoUnlink()
    if kind == "directory":
        os.mkdir(tmp)
    else:
        with open(tmp, "wb") as f:
            f.write(b"half a rewrite")
        fs.fail = True
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB, fs=fs) as t:
        assert len(t.recover()) == 10
        assert get(t, locs, owners, size, csums)[0].all()
    assert os.path.exists(tmp)  # left for a later open
    if kind == "eio":
        with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:  # unlink works again: it goes
            assert len(t.recover()) == 10
        assert not os.path.exists(tmp)


def test_blocks_at_far_ids_are_renumbered_not_lost_at_a_restart(tdir: str, monkeypatch: Any) -> None:
    """Ids are reused lowest-freed-last, so a tier that once held many
    blocks and kept a few (a shrink, a namespace removed) can keep them at
    ids past max(4 x entries, DENSE_IDS). Open dropped those intact blocks
    only for their id; it now gives them free ids below the bound, in the
    index too, so they survive this restart and the next."""
    import tiers.ssd as ssd_mod

    monkeypatch.setattr(ssd_mod, "DENSE_IDS", 16)  # (2^20 blocks, at tiny size)
    size = 4 * KIB
    owners = metas(NS, chain(b"far", 100))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        locs, csums = put(t, owners, size)
        assert sorted(locs.tolist()) == list(range(100))
        t.free(locs[:90])  # ten left, at ids 90..99: past max(4 x 10, 16)
    os.remove(os.path.join(tdir, SNAPSHOT_FILE))  # the first open reads RocksDB (as after a crash), the next a snapshot
    for _ in range(2):
        with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
            rec = t.recover()
            assert t.dropped_count == 0 and len(rec) == 10
            got = {r[1].key: (r[0], r[3]) for r in rec}
            assert all(loc < 40 for loc, _ in got.values())  # (the table sized by the entries, not the old ids)
            new = np.array([got[o.key][0] for o in owners[90:]])
            assert get(t, new, owners[90:], size, np.array([got[o.key][1] for o in owners[90:]], np.uint64))[0].all()
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:  # a write after: no id given twice
        t.recover()
        more, mcs = put(t, metas(NS, chain(b"far2", 20)), size)
        assert not set(more.tolist()) & set(new.tolist())
        assert get(t, new, owners[90:], size, csums[90:])[0].all()
        assert get(t, more, metas(NS, chain(b"far2", 20)), size, mcs)[0].all()
