"""The shared index (kvstore.daemon.shared_index writes it, kvstore.wire.shared_index reads it): a
client's lookup from shared memory answers exactly what the store's lookup answers, through growth,
rehashes and removals; a lookup that races a change, or reads torn rows, is refused, never wrong
or a crash; files are private and go away."""

from __future__ import annotations

import os
import stat
import threading

import numpy as np
import pytest

from kvstore.core.index import SHARED_COLUMNS, BlockIndex, BlockState
from kvstore.core.ssd_io import StoreLock
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.daemon.shared_index import SharedIndex, sweep_stale
from kvstore.keys import Namespace, block_keys
from kvstore.wire import shared_index as wire
from kvstore.wire.shared_index import SharedIndexReader
from tiers.base import TierKind

pytestmark = pytest.mark.skipif(wire.load_native() is None, reason="kvstore._native is not built")

NS = Namespace(tenant="t", model_id="m", block_size=16)


@pytest.fixture
def shared():
    store = TieredStore(StoreConfig(dram_bytes=64 << 20))
    lock = StoreLock()
    si = SharedIndex(store, lock)
    si.start()
    reader = SharedIndexReader(si.path)
    yield store, lock, si, reader
    reader.close()
    si.close()
    store.close()


def _put(store: TieredStore, lock: StoreLock, keys: list[bytes], parent: bytes | None = None) -> None:
    v = np.zeros(4096, np.uint8)
    with lock:
        assert all(s.name == "OK" for s in store.put(NS, keys, [v] * len(keys), parent=parent).statuses)


def _both(store: TieredStore, lock: StoreLock, reader: SharedIndexReader, keys: list[bytes]) -> tuple:
    with lock:
        nid = store.namespace_id(NS, create=False)
        want = store.peek(NS, keys)
    got = reader.lookup(nid, b"".join(keys))
    assert got is not None
    return (want.hit_blocks, bytes((want.tier_codes + 1).astype(np.uint8))), got


def test_layout_matches_the_index():
    assert wire.COMMITTED_STATE == int(BlockState.COMMITTED)
    assert wire.DRAM_TIER == int(TierKind.DRAM)
    assert tuple(n for n, _ in wire.ARRAYS[1:]) == SHARED_COLUMNS
    cols = {name: np.dtype(dt) for name, dt, *_ in BlockIndex.COLUMNS}
    assert [np.dtype(dt) for _, dt in wire.ARRAYS[1:]] == [cols[n] for n in SHARED_COLUMNS]


def test_reader_answers_like_the_store_through_growth_rehash_and_removal(shared):
    store, lock, si, reader = shared
    gen0 = int(si.hdr[1])
    chain = block_keys(NS, np.arange(16 * 3000, dtype=np.uint32))  # past the first 1,024 rows: the columns grow
    for a in range(0, len(chain), 500):
        _put(store, lock, chain[a : a + 500], parent=chain[a - 1] if a else None)
    assert int(si.hdr[1]) > gen0  # the arrays moved to new files, named under new generations
    other = block_keys(NS, np.arange(16 * 4, dtype=np.uint32) + 7)
    for probe in (chain, chain[:1], chain[:1700] + other, other, [], chain[2999:]):
        want, got = _both(store, lock, reader, probe)
        assert got == want
    assert _both(store, lock, reader, chain)[1][0] == 3000
    with lock:
        store.remove(NS, chain[2000:2001])  # the block and what hangs below it
    assert _both(store, lock, reader, chain)[1][0] == 2000
    # only the current generation's files exist (replaced ones were unlinked)
    mine = [n for n in os.listdir(wire.SHM_DIR) if n.startswith(si.prefix)]
    assert len(mine) == 1 + len(wire.ARRAYS)
    for n in mine:
        st = os.stat(os.path.join(wire.SHM_DIR, n))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()


def test_a_lookup_while_the_daemon_holds_the_lock_is_refused(shared):
    store, lock, si, reader = shared
    keys = block_keys(NS, np.arange(16 * 4, dtype=np.uint32))
    _put(store, lock, keys)
    with lock:
        nid = store.namespace_id(NS, create=False)
    held, go = threading.Event(), threading.Event()

    def writer() -> None:
        with lock:
            held.set()
            go.wait(10)

    t = threading.Thread(target=writer)
    t.start()
    held.wait(10)
    try:
        assert int(si.hdr[0]) & 1  # odd: a change may be under way
        assert reader.lookup(nid, b"".join(keys)) is None
    finally:
        go.set()
        t.join()
    assert reader.lookup(nid, b"".join(keys)) == (4, bytes([2]) * 4)


def test_torn_rows_are_refused_not_followed():
    native = wire.load_native()
    hdr = np.zeros(8, np.uint64)
    k0 = np.arange(16, dtype=np.uint64)
    table = np.full(32, -1, np.int32)
    table[:] = 1 << 20  # every slot names a row far past the columns
    cols = (k0, k0.copy(), np.zeros(16, np.uint32), np.full(16, 2, np.uint8), np.ones(16, np.uint8))
    assert native.shared_lookup(hdr, 0, table, *cols, b"k" * 32, 0, 2) is None
    table[:] = -1
    assert native.shared_lookup(hdr, 0, table, *cols, b"k" * 32, 0, 2) == (0, b"")
    hdr[0] = 3  # odd sequence
    assert native.shared_lookup(hdr, 0, table, *cols, b"k" * 16, 0, 2) is None
    hdr[0] = 4
    assert native.shared_lookup(hdr, 1, table, *cols, b"k" * 16, 0, 2) is None  # another generation
    with pytest.raises(ValueError):
        native.shared_lookup(hdr, 0, np.full(31, -1, np.int32), *cols, b"k" * 16, 0, 2)  # not a power of two


def test_close_stops_readers_and_removes_the_files(shared):
    store, lock, si, reader = shared
    keys = block_keys(NS, np.arange(16 * 2, dtype=np.uint32))
    _put(store, lock, keys)
    nid = store.namespace_id(NS, create=False)
    assert reader.lookup(nid, b"".join(keys)) == (2, bytes([2, 2]))
    si.close()
    assert reader.closed and reader.lookup(nid, b"".join(keys)) is None
    assert not [n for n in os.listdir(wire.SHM_DIR) if n.startswith(si.prefix)]
    assert lock.on_take is None and lock.on_give is None
    with lock:  # the store goes on working without it
        _put(store, lock, block_keys(NS, np.arange(16 * 3000, dtype=np.uint32) + 5))  # growth: plain arrays now
        assert store.lookup(NS, keys).hit_blocks == 2
    assert not [n for n in os.listdir(wire.SHM_DIR) if n.startswith(si.prefix)]


def test_reader_refuses_what_is_not_a_header(tmp_path):
    with pytest.raises(OSError):
        SharedIndexReader(str(tmp_path / "kvstore-idx-0-1-ab.hdr"))  # not in /dev/shm
    with pytest.raises(OSError):
        SharedIndexReader("/dev/shm/../etc/passwd")


def test_files_of_dead_daemons_are_swept(tmp_path):
    dead = 2**22 + 12345  # above pid_max's default: no such process
    uid = os.getuid()
    for name in (f"kvstore-idx-{uid}-{dead}-ab.hdr", f"kvstore-idx-{uid}-{dead}-ab.3",
                 f"kvstore-idx-{uid}-{os.getpid()}-cd.1", "unrelated"):
        (tmp_path / name).write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == sorted([f"kvstore-idx-{uid}-{os.getpid()}-cd.1", "unrelated"])


def test_slots_give_dram_blocks_and_stop_at_one_elsewhere(shared):
    store, lock, si, reader = shared
    keys = block_keys(NS, np.arange(16 * 5, dtype=np.uint32))
    _put(store, lock, keys)
    with lock:
        nid = store.namespace_id(NS, create=False)
        rows = store.index.find_committed(nid, np.frombuffer(b"".join(keys), "<u8").reshape(-1, 2))
    hit, clean, slots = reader.slots(nid, b"".join(keys))
    assert (hit, clean) == (5, True)
    assert slots[:, 0].tolist() == rows.tolist()
    assert slots[:, 1].tolist() == store.index.offsets(rows).tolist()
    assert slots[:, 2].tolist() == [4096] * 5
    assert slots[:, 3].view(np.uint64).tolist() == store.index.csum[rows].tolist()
    with lock:
        store.index.tier[rows[3]] = 2  # as if on SSD: only the daemon can serve it (promotion)
    hit, clean, _ = reader.slots(nid, b"".join(keys))
    assert (hit, clean) == (3, False)
    other = block_keys(NS, np.arange(16, dtype=np.uint32) + 50)
    assert reader.slots(nid, b"".join(keys[:2] + other))[:2] == (2, True)  # a miss ends it cleanly


def test_slots_give_the_byte_offset_of_a_slot_past_4_gib(shared):
    """``loc`` keeps a DRAM slot's number in 32 bits; the probe gives back its
    64-bit byte offset, up to the last slot of the largest slab (8 TiB)."""
    from kvstore.core.index import LOC_SHIFT
    from tiers.slots import SLAB_LIMIT

    assert wire.LOC_SHIFT == LOC_SHIFT == wire.load_native().LOC_SHIFT
    store, lock, si, reader = shared
    keys = block_keys(NS, np.arange(16 * 2, dtype=np.uint32) + 900)
    _put(store, lock, keys)
    with lock:
        nid = store.namespace_id(NS, create=False)
        rows = store.index.find_committed(nid, np.frombuffer(b"".join(keys), "<u8").reshape(-1, 2))
        was = store.index.offsets(rows)
        far = np.asarray([5 << 32, SLAB_LIMIT - 4096])
        store.index.set_offsets(rows, far)  # (only the index: no slab is that large here)
    try:
        hit, _, slots = reader.slots(nid, b"".join(keys))
        assert hit == 2 and slots[:, 1].tolist() == far.tolist() == store.index.offsets(rows).tolist()
    finally:
        with lock:
            store.index.set_offsets(rows, was)


def test_a_zombie_daemon_counts_as_gone(tmp_path):
    import subprocess
    import sys
    import time

    from kvstore.daemon.slab_owner import pid_alive

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while pid_alive(p.pid) and time.monotonic() < deadline:  # exited, not reaped: a zombie
        time.sleep(0.01)
    assert not pid_alive(p.pid)
    uid = os.getuid()
    (tmp_path / f"kvstore-idx-{uid}-{p.pid}-ab.hdr").write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == 1
    p.wait()
    assert pid_alive(os.getpid())


def test_grown_column_files_back_only_the_rows_used(shared):
    """A column file made when the index grows is copied up to the rows in
    use and not filled past them, so tmpfs backs those rows, not the slack
    (rows past them are never read: a probe reaches rows through the table)."""
    store, lock, si, reader = shared
    n = 4000
    chain = block_keys(NS, np.arange(16 * n, dtype=np.uint32))
    for a in range(0, n, 100):  # 1.25x steps: 4,000 rows end in a capacity of 4,882
        _put(store, lock, chain[a : a + 100], parent=chain[a - 1] if a else None)
    with lock:
        cap = store.index.size.size
    page = 4096
    used, whole = -(-n * 8 // page) * page, -(-cap * 8 // page) * page
    assert used < whole  # the slack spans pages of its own
    sizes = []
    for name in os.listdir(wire.SHM_DIR):
        st = os.stat(os.path.join(wire.SHM_DIR, name))
        if name.startswith(si.prefix) and st.st_size == cap * 8:  # k0, k1, csum
            sizes.append(st.st_blocks * 512)
    assert len(sizes) == 3 and max(sizes) <= used, (sizes, used, whole)
    assert _both(store, lock, reader, chain)[1][0] == n


def test_a_header_of_another_layout_is_refused_and_lookups_go_to_the_daemon(shared):
    """A daemon of another version publishes its header with the same magic but
    another layout (other columns, widths or header size): the reader must not map it."""
    store, lock, si, reader = shared
    assert reader.map()  # this version's own header is read
    si.hdr[4] = si.hdr[4] ^ np.uint64(0x5A5A)  # what a daemon of another layout writes there
    with pytest.raises(OSError, match="layout"):
        SharedIndexReader(si.path)


def test_the_header_of_a_daemon_with_int64_locations_is_refused(shared):
    """Before the twenty-first round ``loc`` was int64 byte offsets: that
    daemon's header (same magic, its layout digest) must not be read as this one."""
    from kvstore import checksum

    old_arrays = tuple((n, "i8" if n == "loc" else dt) for n, dt in wire.ARRAYS)
    old = checksum.checksum(repr((wire.HEADER_BYTES, wire.NAMES_AT, wire.NAME_BYTES, old_arrays,
                                  wire.COMMITTED_STATE, wire.DRAM_TIER, "tier byte = TierKind + 1")).encode())
    store, lock, si, reader = shared
    si.hdr[4] = np.uint64(old)
    with pytest.raises(OSError, match="another layout"):
        SharedIndexReader(si.path)


def test_an_index_column_of_another_dtype_is_not_shared():
    """The daemon publishes only columns whose dtypes are the ones the readers assume."""
    store = TieredStore(StoreConfig(dram_bytes=8 << 20))
    lock = StoreLock()
    si = SharedIndex(store, lock)
    try:
        with pytest.raises(OSError, match="loc"):
            si.alloc("loc", 16, "i8")  # a build whose index keeps loc as int64 (before the 21st round)
    finally:
        si.close()
        store.close()
    assert not [n for n in os.listdir(wire.SHM_DIR) if n.startswith(si.prefix)]
