"""SSD tier (tiers/ssd.py) under disk faults: a fault is a miss for the
blocks it touches, never an error for the caller, and the intact blocks
beside it stay stored."""

from __future__ import annotations

import errno
import glob
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any, Sequence

import numpy as np
import pytest
import rocksdict

from tests.conftest import chain
from tests.unit.tiers.test_ssd import KIB, MIB, NS, ROOT, get, metas, put
from tiers import ssd_dir
from tiers.ssd import HEADER_BYTES, OsFileLayer, SsdTier
from tiers.ssd_format import VALUE, Segment
from tiers.ssd_recover import SNAPSHOT_FILE


@pytest.fixture
def tdir(tmp_path: Any) -> str:
    return str(tmp_path / "ssd")


class BadSector(OsFileLayer):
    """The real OS, but a read covering byte ``bad`` fails with EIO."""

    def __init__(self) -> None:
        self.bad: int | None = None

    def preadv(self, fd: int, bufs: Sequence[Any], offset: int) -> int:  # type: ignore[override]
        n = sum(memoryview(b).nbytes for b in bufs)
        if self.bad is not None and offset <= self.bad < offset + n:
            raise OSError(errno.EIO, "bad sector")
        return super().preadv(fd, bufs, offset)


def test_a_read_error_in_one_record_keeps_its_neighbours(tdir: str) -> None:
    size = 4 * KIB
    fs = BadSector()
    owners = metas(NS, chain(b"bs", 4))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB, fs=fs) as t:
        locs, csums = put(t, owners, size)  # back to back: one preadv reads them all
        fs.bad = 2 * (HEADER_BYTES + size) + 100  # inside the third record's payload
        ok, _ = get(t, locs, owners, size, csums)
        assert ok.tolist() == [True, True, False, True]
        assert t.corrupt_count == 1
        fs.bad = None
        ok, _ = get(t, locs, owners, size, csums)
        assert ok.tolist() == [True, True, False, True]  # the intact ones are still stored


class NoUnlink(OsFileLayer):
    """The real OS, but unlinking a file fails (EIO) while ``fail`` is set."""

    def __init__(self) -> None:
        self.fail = False

    def unlink(self, path: str) -> None:  # type: ignore[override]
        if self.fail:
            raise OSError(errno.EIO, "unlink failed")
        super().unlink(path)


def test_a_failed_unlink_stops_reclaim_without_an_error(tdir: str) -> None:
    size = 64 * KIB
    fs = NoUnlink()
    owners = metas(NS, chain(b"ul", 40))
    with SsdTier(tdir, 8 * MIB, segment_bytes=MIB, fs=fs) as t:
        locs, csums = put(t, owners[:30], size)
        t.free(locs[:20])
        fs.fail = True
        assert t.reclaim() <= 0  # the live records moved; the old segment could not go
        more, mcs = put(t, owners[30:], size)  # garbage over the limit: reclaims by itself, fails again
        assert get(t, locs[20:], owners[20:30], size, csums[20:])[0].all()
        assert get(t, more, owners[30:], size, mcs)[0].all()
        fs.fail = False
        assert t.reclaim() > 0  # a later pass removes it
        assert t.garbage_bytes < MIB
    with SsdTier(tdir, 8 * MIB, segment_bytes=MIB) as t:
        assert len(t.recover()) == 20


_OPEN_LIMITED = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, {root!r})
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a dense map of the ids named would not fit
    from tiers.ssd import SsdTier
    from tiers.base import BlockMeta
    with SsdTier({path!r}, 16 << 20, segment_bytes=1 << 20) as t:
        n = len(t.recover())
        loc = t.allocate(10, 1)
        t.write(loc, [b"x" * 10], [BlockMeta({ns!r}, b"z" * 16)])
        print(n, t.dropped_count)
""")


def test_a_damaged_segment_name_costs_only_its_blocks(tdir: str) -> None:
    """A segment file whose name (a flipped digit) gives a huge id: open
    neither sizes anything by that id nor stops writing; the blocks that
    segment held are misses (their index entries name the old id)."""
    size = 64 * KIB
    owners = metas(NS, chain(b"sn", 40))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        put(t, owners, size)  # 15 records a segment: three segments
    segs = sorted(glob.glob(os.path.join(tdir, "seg-*.kvs")))
    assert len(segs) == 3
    os.rename(segs[1], os.path.join(tdir, "seg-004000000002.kvs"))  # below 2^32
    os.rename(segs[2], os.path.join(tdir, "seg-800000000003.kvs"))  # past any id the tier writes
    script = _OPEN_LIMITED.format(root=ROOT, path=tdir, ns=NS)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["15", "25"]
    assert not glob.glob(os.path.join(tdir, "seg-8*.kvs"))  # nothing points into it: removed


def stored_index(tdir: str, owners, size: int):
    """Blocks ``owners`` of ``size`` bytes written and the tier closed, its
    snapshot removed (an open reads the index itself), and that RocksDB
    index opened raw to be damaged: (db, locations, checksums)."""
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        locs, csums = put(t, owners, size)
    os.unlink(os.path.join(tdir, SNAPSHOT_FILE))
    return rocksdict.Rdict(os.path.join(tdir, "index"), rocksdict.Options(raw_mode=True)), locs, csums

@pytest.mark.parametrize("bad_size", [0, (1 << 64) - 8, 1 << 63])
def test_an_index_entry_with_an_impossible_size_is_dropped(tdir: str, bad_size: int) -> None:
    """An index entry's size is bounded as the unsigned number it is (a
    size of 2^63 or more must not pass the bound as a negative one)."""
    size = 4 * KIB
    owners = metas(NS, chain(b"sz", 3))
    db, locs, csums = stored_index(tdir, owners, size)
    key = b"b" + int(locs[1]).to_bytes(8, "big")
    v = np.frombuffer(db[key], dtype=VALUE).copy()
    v["ident"]["size"] = bad_size
    db[key] = v.tobytes()
    db.close()
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        assert t.dropped_count == 1
        assert sorted((loc, sz) for loc, _, sz, _ in t.recover()) == [(int(locs[0]), size), (int(locs[2]), size)]
        assert t.used_bytes == 2 * (HEADER_BYTES + size)


def test_disk_figures_read_while_a_write_adds_a_segment(tdir: str) -> None:
    """Stats read ``disk_bytes``/``garbage_bytes`` on the event loop while
    the disk worker writes (kvstore/core/ssd_io.py): a segment added
    meanwhile must not break the figure."""
    size = 64 * KIB
    owners = metas(NS, chain(b"dr", 30))
    reading, added = threading.Event(), threading.Event()
    main = threading.get_ident()

    class Paused(Segment):  # its size read by the stats thread waits for the writer, once
        __slots__ = ()

        @property  # type: ignore[override]
        def size(self) -> int:
            if threading.get_ident() == main and not reading.is_set():
                reading.set()
                added.wait(60)
            return int(Segment.size.__get__(self))  # type: ignore[attr-defined]

        @size.setter
        def size(self, v: int) -> None:
            Segment.size.__set__(self, v)  # type: ignore[attr-defined]

    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        put(t, owners[:20], size)  # two segments, the first sealed
        first = min(t._segs)
        old = t._segs[first]
        t._segs[first] = Paused(old.id, old.size, old.live)

        def writer() -> None:
            reading.wait(60)
            try:
                put(t, owners[20:], size)  # a third segment
            finally:
                added.set()

        for figure in ("garbage_bytes", "disk_bytes"):
            reading.clear()
            added.clear()
            th = threading.Thread(target=writer)
            th.start()
            try:
                assert getattr(t, figure) >= 0
            finally:
                th.join(60)
            owners = owners[:20] + metas(NS, chain(figure.encode(), 10))


def vanishing_scandir(tdir: str, nbytes: int) -> Any:
    """An ``os.scandir`` that lists, in the tier's index directory, a file
    that is gone by the time the caller looks at it (as RocksDB's own
    threads delete obsolete files)."""
    doomed = os.path.join(tdir, "index", "OLD.log")
    real = os.scandir

    def scandir(path: str) -> Any:
        if os.path.basename(path) == "index":
            with open(doomed, "wb") as f:
                f.write(b"x" * nbytes)
            entries = list(real(path))
            os.unlink(doomed)
            return iter(entries)
        return real(path)

    return scandir

def test_disk_bytes_when_a_file_goes_while_it_is_counted(tdir: str, monkeypatch: Any) -> None:
    """RocksDB's own threads delete index files at any time: one listed and
    gone before it is measured is not counted, not an error."""
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        put(t, metas(NS, chain(b"gf", 2)), 4 * KIB)
        monkeypatch.setattr(ssd_dir.os, "scandir", vanishing_scandir(tdir, 8192))
        try:
            assert t.disk_bytes > 0
        finally:
            monkeypatch.undo()


def test_an_index_file_gone_while_open_makes_it_private_is_no_rebuild(tdir: str, monkeypatch: Any) -> None:
    """Open makes the index's files 0600 right after RocksDB opens, while
    its threads may delete obsolete ones: a file gone is not an unreadable
    index (which would rebuild it from every segment header)."""
    owners = metas(NS, chain(b"pi", 4))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        put(t, owners, 4 * KIB)
    monkeypatch.setattr(ssd_dir.os, "scandir", vanishing_scandir(tdir, 1))
    try:
        t = SsdTier(tdir, 16 * MIB, segment_bytes=MIB)
    finally:
        monkeypatch.undo()
    with t:
        assert t.index_rebuilds == 0
        assert len(t.recover()) == 4


def test_an_index_that_cannot_be_made_private_is_closed_before_the_rebuild(tdir: str, monkeypatch: Any) -> None:
    """Open makes the index private right after RocksDB opens it: when
    that fails (EPERM, EROFS), the handle is closed, so the rebuild that
    follows can open the index again (RocksDB's lock is per process)."""
    owners = metas(NS, chain(b"pv", 4))
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        put(t, owners, 4 * KIB)
    os.unlink(os.path.join(tdir, SNAPSHOT_FILE))
    real, failed = os.chmod, []

    def chmod(path: str, mode: int) -> None:
        if os.path.basename(path) == "index" and not failed:
            failed.append(path)
            raise OSError(errno.EPERM, "operation not permitted", path)
        real(path, mode)

    monkeypatch.setattr(ssd_dir.os, "chmod", chmod)
    try:
        t = SsdTier(tdir, 16 * MIB, segment_bytes=MIB)
    finally:
        monkeypatch.undo()
    with t:
        assert failed and t.index_rebuilds == 1
        assert len(t.recover()) == 4


def test_a_failed_open_closes_its_index(tdir: str, monkeypatch: Any) -> None:
    """An open that fails after the index is open (here: loading it) lets
    go of it: the next open of the directory works."""
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        put(t, metas(NS, chain(b"fo", 3)), 4 * KIB)

    def load(self: SsdTier, locs: Any, vals: Any) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(SsdTier, "_load", load)
    with pytest.raises(OSError) as failed:  # (its traceback keeps the failed tier alive)
        SsdTier(tdir, 16 * MIB, segment_bytes=MIB)
    monkeypatch.undo()
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        assert failed.value.errno == errno.EIO
        assert t.index_rebuilds == 0 and len(t.recover()) == 3


def test_an_index_entry_with_a_huge_id_costs_only_its_block(tdir: str) -> None:
    """A damaged index key naming an id near ID_LIMIT: open sizes nothing
    by that id (no table, count or free list up to it); the entry, intact
    but for its id, gets a free id (its block is kept) and the tier keeps
    working."""
    size = 4 * KIB
    owners = metas(NS, chain(b"hi", 3))
    db, locs, csums = stored_index(tdir, owners, size)
    key = b"b" + int(locs[1]).to_bytes(8, "big")
    value = db[key]
    del db[key]
    db[b"b" + ((1 << 31) - 2).to_bytes(8, "big")] = value
    db.close()
    script = _OPEN_LIMITED.format(root=ROOT, path=tdir, ns=NS)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["3", "0"]
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB) as t:
        got = {m.key: loc for loc, m, *_ in t.recover()}
        assert [got[o.key] for o in owners] == [int(x) for x in locs]  # the free id below the bound: its own
        assert get(t, locs, owners, size, csums)[0].all()
