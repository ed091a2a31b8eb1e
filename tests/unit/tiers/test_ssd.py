"""SSD tier (tiers/ssd.py): layout, crash ordering, corruption, reclaim, restart."""

from __future__ import annotations

import errno
import glob
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
from typing import Any, Sequence

import numpy as np
import pytest
import xxhash

from kvstore.errors import CapacityError, InvalidArgument, Unavailable
from tests.conftest import chain, payload_for
from tiers.base import BlockMeta, TierKind
from tiers.ssd import HEADER_BYTES, OsFileLayer, SsdTier
from tiers.ssd_table import ROW

NS = b"\x11" * 16
NS2 = b"\x22" * 16
KIB = 1 << 10
MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def metas(ns: bytes, keys: Sequence[bytes], first_parent: bytes = b"") -> list[BlockMeta]:
    parents = [first_parent] + list(keys[:-1])
    return [BlockMeta(ns, k, p) for k, p in zip(keys, parents)]


def put(t: SsdTier, owners: Sequence[BlockMeta], size: int) -> tuple[np.ndarray, np.ndarray]:
    locs = t.allocate(size, len(owners))
    assert locs.size == len(owners)
    payloads = [np.frombuffer(payload_for(o.ns_digest, o.key, size), np.uint8) for o in owners]
    return locs, t.write(locs, payloads, owners)


def get(t: SsdTier, locs: np.ndarray, owners: Sequence[BlockMeta], size: int,
        csums: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    outs = [np.zeros(size, np.uint8) for _ in owners]
    ok = t.read_into(locs, np.full(len(owners), size), csums, outs, owners)
    for good, o, out in zip(ok, owners, outs):
        if good:  # never wrong bytes
            assert out.tobytes() == payload_for(o.ns_digest, o.key, size)
    return ok, outs


def du_bytes(path: str) -> int:
    out = subprocess.run(["du", "-s", "-B1", path], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def seg_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "seg-*.kvs")))


class FaultyFs(OsFileLayer):
    """The real OS, with a switch that makes writes/syncs fail."""

    def __init__(self) -> None:
        self.fail_write: int | None = None
        self.fail_sync: int | None = None
        self.writes = 0

    def pwritev(self, fd: int, bufs: Sequence[Any], offset: int) -> int:  # type: ignore[override]
        self.writes += 1
        if self.fail_write is not None:
            # a partial write first, as a real full disk does
            n = os.pwritev(fd, [memoryview(bufs[0])[:100]], offset)
            if n:
                raise OSError(self.fail_write, os.strerror(self.fail_write))
        return super().pwritev(fd, bufs, offset)

    def fdatasync(self, fd: int) -> None:  # type: ignore[override]
        if self.fail_sync is not None:
            raise OSError(self.fail_sync, os.strerror(self.fail_sync))
        super().fdatasync(fd)


@pytest.fixture
def tdir(tmp_path: Any) -> str:
    return str(tmp_path / "ssd")


def test_round_trip_and_checksums(tdir: str) -> None:
    with SsdTier(tdir, 16 * MIB, segment_bytes=256 * KIB) as t:
        assert t.kind is TierKind.SSD
        owners = metas(NS, chain(b"a", 12))
        locs, csums = put(t, owners, 40 * KIB)  # spans several segments
        for o, c in zip(owners, csums):
            assert int(c) == xxhash.xxh3_64_intdigest(payload_for(NS, o.key, 40 * KIB))
        ok, _ = get(t, locs, owners, 40 * KIB, csums)
        assert ok.all()
        # out of order, and a payload smaller than its allocation
        ok, _ = get(t, locs[::-1], owners[::-1], 40 * KIB, csums[::-1])
        assert ok.all()
        small = t.allocate(40 * KIB, 1)
        c = t.write(small, [b"xyz"], [BlockMeta(NS, b"k" * 16)])
        out = bytearray(3)
        assert t.read_into(small, np.array([3]), c, [out], [BlockMeta(NS, b"k" * 16)]).all()
        assert bytes(out) == b"xyz"
        assert t.used_bytes == 13 * (HEADER_BYTES + 40 * KIB)
        assert t.corrupt_count == 0


def test_bad_arguments(tdir: str) -> None:
    with SsdTier(tdir, MIB) as t:
        with pytest.raises(InvalidArgument):
            t.footprint(0)
        with pytest.raises(InvalidArgument):
            t.footprint(2 * MIB)
        loc = t.allocate(100, 1)
        with pytest.raises(InvalidArgument):
            t.write(loc, [b"x" * 100], None)  # owners required
        with pytest.raises(InvalidArgument):
            t.write(loc, [b"x" * 101], [BlockMeta(NS, b"k" * 16)])  # bigger than allocated
        with pytest.raises(InvalidArgument):
            t.write(np.array([99]), [b"x"], [BlockMeta(NS, b"k" * 16)])  # never allocated
        with pytest.raises(InvalidArgument):
            t.write(loc, [b"x"], [BlockMeta(NS[:8], b"k" * 16)])
        # unknown / free / unwritten locations are plain misses
        ok = t.read_into(np.array([loc[0], 12345, -1]), np.array([1, 1, 1]), np.zeros(3, np.uint64),
                         [bytearray(1)] * 3, None)
        assert not ok.any() and t.corrupt_count == 0


def test_identity_mismatch_is_a_miss(tdir: str) -> None:
    with SsdTier(tdir, 8 * MIB) as t:
        owners = metas(NS, chain(b"id", 4))
        locs, csums = put(t, owners, 8 * KIB)
        wrong_ns = [BlockMeta(NS2, o.key, o.parent) for o in owners[:1]]
        ok, outs = get(t, locs[:1], wrong_ns, 8 * KIB, csums[:1])
        assert not ok.any() and not outs[0].any()
        wrong_key = [BlockMeta(NS, owners[2].key, owners[1].key)]
        assert not get(t, locs[1:2], wrong_key, 8 * KIB, csums[1:2])[0].any()
        bad_sum = csums[3:4] ^ np.uint64(1)
        assert not get(t, locs[3:4], owners[3:4], 8 * KIB, bad_sum)[0].any()
        assert t.corrupt_count == 3
        # the tier forgot those locations; the untouched one still reads
        assert list(get(t, locs, owners, 8 * KIB, csums)[0]) == [False, False, True, False]
        t.free(locs)
        assert t.used_bytes == 0


def test_byte_flips_while_closed_are_misses(tdir: str) -> None:
    size = 16 * KIB
    owners = metas(NS, chain(b"flip", 24))
    with SsdTier(tdir, 8 * MIB) as t:
        locs, csums = put(t, owners, size)
    (seg,) = seg_files(tdir)
    rec = HEADER_BYTES + size
    victims = {3: HEADER_BYTES + 5000, 7: 20, 11: rec - 1, 19: 40}  # payload, header, last byte, key
    with open(seg, "r+b") as f:
        for i, at in victims.items():
            f.seek(i * rec + at)
            b = f.read(1)
            f.seek(i * rec + at)
            f.write(bytes([b[0] ^ 0x40]))
    with SsdTier(tdir, 8 * MIB) as t:
        assert len(t.recover()) == 24  # the index is intact: found, then refused on read
        ok, _ = get(t, locs, owners, size, csums)
        assert sorted(np.flatnonzero(~ok).tolist()) == sorted(victims)
        assert t.corrupt_count == len(victims)
        assert not get(t, locs, owners, size, csums)[0][list(victims)].any()


def test_torn_tail_drops_only_those_blocks(tdir: str) -> None:
    size = 32 * KIB
    a, b = metas(NS, chain(b"t", 10)[:5]), metas(NS, chain(b"t", 10)[5:])
    with SsdTier(tdir, 8 * MIB) as t:
        la, ca = put(t, a, size)
        put(t, b, size)
    (seg,) = seg_files(tdir)
    full = os.path.getsize(seg)
    os.truncate(seg, full - 3 * (HEADER_BYTES + size) + 100)  # last two records gone, one torn
    with SsdTier(tdir, 8 * MIB) as t:
        found = {m.key for _, m, _, _ in t.recover()}
        assert found == {m.key for m in a} | {m.key for m in b[:2]}
        assert t.dropped_count == 3
        assert get(t, la, a, size, ca)[0].all()
    with SsdTier(tdir, 8 * MIB) as t:  # the dropped entries are gone for good
        assert t.dropped_count == 0 and len(t.recover()) == 7


def test_free_and_reclaim_shrink_disk(tdir: str) -> None:
    size = 64 * KIB
    with SsdTier(tdir, 64 * MIB, segment_bytes=512 * KIB, auto_reclaim=False) as t:
        owners = metas(NS, chain(b"gc", 96))
        locs, csums = put(t, owners, size)
        before = t.disk_bytes
        assert abs(before - du_bytes(tdir)) <= 0.1 * du_bytes(tdir)
        keep = np.arange(96) % 4 == 0
        t.free(locs[~keep])
        assert t.used_bytes == 24 * (HEADER_BYTES + size)
        assert t.disk_bytes == before  # nothing reclaimed yet: free only drops the index entry
        assert t.garbage_bytes == 72 * (HEADER_BYTES + size)
        freed = t.reclaim()
        assert freed >= 70 * (HEADER_BYTES + size)
        assert t.garbage_bytes == 0 and t.reclaim() == 0
        seg_total = sum(os.path.getsize(p) for p in seg_files(tdir))
        assert seg_total == t.used_bytes
        du = du_bytes(tdir)
        assert abs(t.disk_bytes - du) <= 0.1 * du
        assert du < before / 2
        kept = [o for o, k in zip(owners, keep) if k]
        assert get(t, locs[keep], kept, size, csums[keep])[0].all()
    with SsdTier(tdir, 64 * MIB) as t:  # and the moved blocks are where the index says
        assert {m.key for _, m, _, _ in t.recover()} == {o.key for o in kept}


def test_reclaim_is_bounded_and_automatic(tdir: str) -> None:
    size = 64 * KIB
    with SsdTier(tdir, 64 * MIB, segment_bytes=256 * KIB, auto_reclaim=False) as t:
        owners = metas(NS, chain(b"b", 64))
        locs, _ = put(t, owners, size)
        t.free(locs[np.arange(64) % 2 == 1])
        segs = len(seg_files(tdir))
        t.reclaim(max_bytes=1)  # one segment's live data at most
        assert len(seg_files(tdir)) >= segs - 2
        t.reclaim()
        assert t.garbage_bytes == 0
    with SsdTier(tdir + "2", 16 * MIB, segment_bytes=256 * KIB) as t:  # auto: garbage stays bounded
        for r in range(40):
            owners = metas(NS, chain(str(r).encode(), 8))
            locs, _ = put(t, owners, size)
            t.free(locs[:6])
        assert t.garbage_bytes <= 2 * max(256 * KIB, t.capacity_bytes // 10) + 8 * (HEADER_BYTES + size)


def test_capacity_budget(tdir: str) -> None:
    size = 64 * KIB
    with SsdTier(tdir, MIB) as t:
        locs = t.allocate(size, 100)
        assert locs.size == MIB // (HEADER_BYTES + size) == 15
        assert t.allocate(size, 1).size == 0
        assert t.used_bytes <= t.capacity_bytes
        with pytest.raises(CapacityError):
            t.resize(t.used_bytes - 1)
        t.free(locs[:5])
        t.free(locs[:5])  # already free: ignored
        again = t.allocate(size, 10)
        assert again.size == 5 and set(again.tolist()) == set(locs[:5].tolist())
        t.resize(2 * MIB)
        assert t.allocate(size, 100).size == 2 * MIB // (HEADER_BYTES + size) - 15


def test_enospc_via_file_layer(tdir: str) -> None:
    fs = FaultyFs()
    size = 32 * KIB
    with SsdTier(tdir, 16 * MIB, segment_bytes=MIB, fs=fs) as t:
        a = metas(NS, chain(b"e", 12)[:6])
        b = metas(NS, chain(b"e", 12)[6:])
        la, ca = put(t, a, size)
        fs.fail_write = errno.ENOSPC
        lb = t.allocate(size, len(b))
        payloads = [payload_for(NS, o.key, size) for o in b]
        with pytest.raises(CapacityError):
            t.write(lb, payloads, b)
        assert get(t, la, a, size, ca)[0].all()  # reads keep working
        assert not get(t, lb, b, size, np.zeros(6, np.uint64))[0].any()
        fs.fail_write = None
        fs.fail_sync = errno.EIO
        with pytest.raises(Unavailable):
            t.write(lb, payloads, b)
        fs.fail_sync = errno.ENOSPC
        with pytest.raises(CapacityError):
            t.write(lb, payloads, b)
        assert len(t.recover()) == 6  # nothing of the failed batches is in the index
        fs.fail_sync = None  # space is back
        cb = t.write(lb, payloads, b)
        assert get(t, lb, b, size, cb)[0].all() and get(t, la, a, size, ca)[0].all()
    with SsdTier(tdir, 16 * MIB) as t:
        assert len(t.recover()) == 12
        assert t.disk_bytes < 2 * t.used_bytes + MIB


def test_reopen_recovers_parents_first(tdir: str) -> None:
    size = 4 * KIB
    c1 = metas(NS, chain(b"c1", 30))
    c2 = metas(NS, chain(b"c2", 10), first_parent=c1[9].key)  # branches off c1
    c3 = metas(NS2, chain(b"c1", 5))  # same keys, other namespace
    written: dict[tuple[bytes, bytes], int] = {}
    where: dict[bytes, int] = {}
    with SsdTier(tdir, 8 * MIB) as t:
        t.put_namespace(NS, b'{"tenant":"t"}')
        t.put_namespace(NS2, b'{"tenant":"u"}')
        for group in (c3, c2[::-1], c1[::-1]):  # leaf-first, as demotion does
            for i in range(0, len(group), 7):
                locs, cs = put(t, group[i:i + 7], size)
                for loc, o, c in zip(locs.tolist(), group[i:i + 7], cs.tolist()):
                    written[(o.ns_digest, o.key)] = c
                    where[o.key] = loc
        t.free(np.array([where[c1[-1].key]]))  # one leaf goes away
    with SsdTier(tdir, 8 * MIB) as t:
        rec = t.recover()
        assert len(rec) == 44
        present = {(m.ns_digest, m.key) for _, m, _, _ in rec}
        seen: set[tuple[bytes, bytes]] = set()
        for loc, m, sz, c in rec:
            if m.parent and (m.ns_digest, m.parent) in present:
                assert (m.ns_digest, m.parent) in seen, "child before its parent"
            seen.add((m.ns_digest, m.key))
            assert sz == size and c == written[(m.ns_digest, m.key)]
        locs = np.array([r[0] for r in rec])
        owners = [r[1] for r in rec]
        assert get(t, locs, owners, size, np.array([r[3] for r in rec], np.uint64))[0].all()
        assert t.namespaces() == {NS: b'{"tenant":"t"}', NS2: b'{"tenant":"u"}'}
        # new writes after a restart get fresh locations and survive another one
        more = metas(NS, chain(b"more", 3))
        put(t, more, size)
    with SsdTier(tdir, 8 * MIB) as t:
        assert len(t.recover()) == 47


def test_unknown_schema_and_foreign_dirs_refused(tdir: str, tmp_path: Any) -> None:
    with SsdTier(tdir, MIB):
        pass
    with open(os.path.join(tdir, "SCHEMA"), "w") as f:
        f.write("kvstore-ssd-tier\nschema 99\n")
    with pytest.raises(InvalidArgument, match="schema 99"):
        SsdTier(tdir, MIB)
    with open(os.path.join(tdir, "SCHEMA"), "w") as f:
        f.write("something else\n")
    with pytest.raises(InvalidArgument, match="not a kvstore SSD schema"):
        SsdTier(tdir, MIB)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.bin").write_bytes(b"x")
    with pytest.raises(InvalidArgument, match="no SCHEMA marker"):
        SsdTier(str(foreign), MIB)
    assert os.listdir(foreign) == ["data.bin"]


def test_modes_and_single_owner(tdir: str) -> None:
    with SsdTier(tdir, MIB) as t:
        put(t, metas(NS, chain(b"m", 2)), 100)
        t.put_namespace(NS, b"{}")
        assert stat.S_IMODE(os.stat(tdir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.join(tdir, "index")).st_mode) == 0o700
        for name in os.listdir(tdir):
            p = os.path.join(tdir, name)
            if os.path.isfile(p):
                assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, name
        with pytest.raises(Unavailable, match="in use"):
            SsdTier(tdir, MIB)
    for p in glob.glob(os.path.join(tdir, "index", "*")):  # RocksDB's own files, after close
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p


def test_corrupt_index_is_rebuilt_from_segments(tdir: str) -> None:
    size = 8 * KIB
    owners = metas(NS, chain(b"ix", 20))
    with SsdTier(tdir, 8 * MIB) as t:
        locs, csums = put(t, owners, size)
        t.put_namespace(NS, b"{}")
    for p in glob.glob(os.path.join(tdir, "index", "*")):
        if os.path.basename(p).startswith(("MANIFEST", "CURRENT")):
            with open(p, "r+b") as f:
                f.write(b"\xff" * 8)
    with SsdTier(tdir, 8 * MIB) as t:
        assert t.index_rebuilds == 1
        rec = t.recover()
        assert {m.key for _, m, _, _ in rec} == {o.key for o in owners}
        ok, _ = get(t, np.array([r[0] for r in rec]), [r[1] for r in rec], size,
                    np.array([r[3] for r in rec], np.uint64))
        assert ok.all()
        assert t.namespaces() == {NS: b"{}"}


def test_random_byte_flips_in_index_never_give_wrong_bytes(tdir: str) -> None:
    size = 4 * KIB
    owners = metas(NS, chain(b"rf", 50))
    with SsdTier(tdir, 8 * MIB) as t:
        put(t, owners, size)
    rng = random.Random(7)
    files = [p for p in glob.glob(os.path.join(tdir, "index", "*")) if os.path.getsize(p) > 0]
    for p in files:
        data = bytearray(open(p, "rb").read())
        for _ in range(5):
            data[rng.randrange(len(data))] ^= 0xFF
        open(p, "wb").write(bytes(data))
    with SsdTier(tdir, 8 * MIB) as t:
        rec = t.recover()
        by_key = {o.key: o for o in owners}
        for loc, m, sz, c in rec:
            o = by_key.get(m.key)
            if o is None:
                continue
            out = np.zeros(size, np.uint8)
            if t.read_into(np.array([loc]), np.array([sz]), np.array([c], np.uint64), [out], [o])[0]:
                assert out.tobytes() == payload_for(NS, o.key, size)


def test_model_based_random_operations(tdir: str) -> None:
    """Random allocate/write/overwrite/free/read/reclaim/reopen against a dict model."""
    rng = random.Random(3)
    model: dict[int, tuple[BlockMeta, int, int]] = {}  # loc -> (meta, size, checksum)
    allocated: dict[int, int] = {}  # loc -> allocated size
    t = SsdTier(tdir, 4 * MIB, segment_bytes=128 * KIB, gc_garbage_ratio=0.3)
    try:
        for step in range(300):
            op = rng.random()
            if op < 0.35:
                size = rng.choice([1000, 5000, 20000])
                locs = t.allocate(size, rng.randint(1, 6))
                allocated.update((loc, size) for loc in locs.tolist())
                owners = [BlockMeta(NS, os.urandom(16)) for _ in locs]
                cs = t.write(locs, [payload_for(NS, o.key, size) for o in owners], owners)
                for loc, o, c in zip(locs.tolist(), owners, cs.tolist()):
                    model[loc] = (o, size, c)
            elif op < 0.45 and model:
                loc = rng.choice(sorted(model))
                o = BlockMeta(NS, os.urandom(16))
                size = model[loc][1]
                c = t.write(np.array([loc]), [payload_for(NS, o.key, size)], [o])
                model[loc] = (o, size, int(c[0]))
            elif op < 0.7 and allocated:
                gone = rng.sample(sorted(allocated), min(len(allocated), rng.randint(1, 8)))
                t.free(np.array(gone))
                for loc in gone:
                    allocated.pop(loc, None)
                    model.pop(loc, None)
            elif op < 0.85 and model:
                for loc in rng.sample(sorted(model), min(len(model), 6)):
                    o, size, c = model[loc]
                    out = np.zeros(size, np.uint8)
                    assert t.read_into(np.array([loc]), np.array([size]), np.array([c], np.uint64), [out], [o])[0]
                    assert out.tobytes() == payload_for(NS, o.key, size)
            elif op < 0.93:
                t.reclaim(rng.choice([None, 64 * KIB]))
            else:
                t.close()
                t = SsdTier(tdir, 4 * MIB, segment_bytes=128 * KIB, gc_garbage_ratio=0.3)
                assert {loc: (m.key, s, c) for loc, m, s, c in t.recover()} == \
                    {loc: (m.key, s, c) for loc, (m, s, c) in model.items()}
                allocated = {loc: s for loc, (_, s, _) in model.items()}
            assert t.used_bytes == sum(HEADER_BYTES + s for s in allocated.values())
        assert t.corrupt_count == 0 and t.dropped_count == 0
        live = sum(HEADER_BYTES + s for _, s, _ in model.values())
        assert t.garbage_bytes + live == sum(os.path.getsize(p) for p in seg_files(tdir))
    finally:
        t.close()


_WRITER = textwrap.dedent("""
    import sys, os
    sys.path.insert(0, {root!r})
    import numpy as np
    from tests.conftest import payload_for
    from tiers.base import BlockMeta
    from tiers.ssd import SsdTier
    t = SsdTier({path!r}, 64 << 20, segment_bytes=1 << 20)
    i = 0
    print("ready", flush=True)
    while True:
        n = 1 + i % 5
        size = 4096 * (1 + i % 7)
        owners = [BlockMeta({ns!r}, os.urandom(16)) for _ in range(n)]
        locs = t.allocate(size, n)
        if locs.size < n:
            t.free(np.array([r[0] for r in t.recover()[:20]]))
            t.reclaim(1 << 20)
            continue
        t.write(locs, [payload_for({ns!r}, o.key, size) for o in owners], owners)
        if i % 3 == 0:
            t.free(locs[:1])
        i += 1
""")


def test_sigkill_during_writes_leaves_whole_blocks(tdir: str) -> None:
    rounds = int(os.environ.get("KVSTORE_SSD_KILL_ROUNDS", "6"))
    rng = random.Random(11)
    script = _WRITER.format(root=ROOT, path=tdir, ns=NS)
    for _ in range(rounds):
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        try:
            p.wait(timeout=rng.uniform(0.05, 0.6))
            pytest.fail("writer exited early")
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
        with SsdTier(tdir, 64 << 20, segment_bytes=1 << 20) as t:
            rec = t.recover()
            for loc, m, size, c in rec:
                out = np.zeros(size, np.uint8)
                assert t.read_into(np.array([loc]), np.array([size]), np.array([c], np.uint64), [out], [m])[0]
                assert out.tobytes() == payload_for(NS, m.key, size)
            assert t.corrupt_count == 0


def test_ids_stay_under_the_limit_the_index_keeps(tdir: str, monkeypatch: Any) -> None:
    """The index keeps a DRAM block's SSD copy's id in 32 bits: the tier
    never hands out an id at or past ``ID_LIMIT`` (it is full there, reusing
    freed ids); a recovered entry past it gets a free id below it while
    there is one, else it is dropped (a miss, never a wrong id)."""
    import tiers.ssd as ssd_mod

    size = 4 * KIB
    owners = metas(NS, chain(b"lim", 12))
    with SsdTier(tdir, 8 * MIB) as t:
        locs, _ = put(t, owners[:10], size)
        assert sorted(locs.tolist()) == list(range(10))
        monkeypatch.setattr(ssd_mod, "ID_LIMIT", 12)
        more = t.allocate(size, 5)
        assert sorted(more.tolist()) == [10, 11]  # full at the limit, though bytes are left
        t.free(more)
        t.free(locs[:1])
        again = t.allocate(size, 5)
        assert sorted(again.tolist()) == [0, 10, 11] and again.max() < 12
        t.free(again)
    monkeypatch.setattr(ssd_mod, "ID_LIMIT", 6)
    with SsdTier(tdir, 8 * MIB) as t:
        rec = t.recover()
        assert sorted(r[0] for r in rec) == [0, 1, 2, 3, 4, 5]  # 1..9 were live: one moved to the free 0
        assert t.dropped_count == 3
        assert get(t, np.array([r[0] for r in rec]), [r[1] for r in rec], size,
                   np.array([r[3] for r in rec], np.uint64))[0].all()


def test_the_location_table_grows_in_place(tdir: str) -> None:
    """The per-location table (a 70-byte row per id) costs the rows used,
    not its doubling capacity, and keeps them when it grows."""
    size = 4 * KIB
    owners = metas(NS, chain(b"grow", 3000))
    assert ROW.itemsize == 70
    with SsdTier(tdir, 64 * MIB) as t:
        base = t.table.nbytes
        assert base <= 1024 * 70 + 4096  # the first 1,024 rows, not a reservation
        got = [put(t, owners[i:i + 100], size) for i in range(0, 3000, 100)]  # grown to 4,096 rows
        assert t.table.nbytes <= 3000 * 70 + 2 * 4096 < 4096 * 70  # the 3,000 rows used, not 4,096
        locs, cs = np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])
        assert get(t, locs, owners, size, cs)[0].all()


def test_the_location_table_without_a_range_is_copied(tdir: str, monkeypatch: Any) -> None:
    import tiers.ssd_table as table_mod

    monkeypatch.setattr(table_mod.Reserved, "make", classmethod(lambda cls, dtype, rows: None))
    size = 4 * KIB
    owners = metas(NS, chain(b"copy", 1500))
    with SsdTier(tdir, 64 * MIB) as t:
        got = [put(t, owners[i:i + 500], size) for i in range(0, 1500, 500)]
        assert t.table.range is None and t.table.rows.nbytes == 2048 * 70
        assert t.table.nbytes == t.table.rows.nbytes + t.table.digests.table.nbytes  # (one namespace: 256 B)
        locs, cs = np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])
        assert get(t, locs, owners, size, cs)[0].all()
    with SsdTier(tdir, 64 * MIB) as t:
        assert len(t.recover()) == 1500


def test_a_namespaces_file_of_another_version_is_refused_not_overwritten(tdir: str) -> None:
    """A namespaces file a newer kvstore wrote (version 2) is never read as
    empty and then rewritten: that would lose every namespace it holds."""
    with SsdTier(tdir, MIB) as t:
        t.put_namespace(NS, b"{}")
    path = os.path.join(tdir, "namespaces")
    with open(path, "r+b") as f:
        f.seek(4)
        f.write((2).to_bytes(4, "little"))
    before = open(path, "rb").read()
    with pytest.raises(InvalidArgument, match="version 2"):
        with SsdTier(tdir, MIB) as t:
            t.put_namespace(b"other-namespace-", b"{}")
    assert open(path, "rb").read() == before
