"""Write-behind puts and reads of a client's own puts in flight (issue 18):
the ``stage``/``put`` frames of the same-host socket
(kvstore/daemon/socket_server.py, kvstore/client/staging.py) and
``OwnWrites`` (kvstore/client/shared.py), against a real daemon."""

from __future__ import annotations

import os
import stat
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import pytest

from kvstore.checksum import checksum
from kvstore.client import Client, ns_pb
from kvstore.client.socket import LookupSocketClient
from kvstore.daemon.socket_server import STAGING_BYTES
from kvstore.errors import InvalidArgument, KeyStatus, KVStoreError
from kvstore.keys import Namespace, block_keys
from kvstore.wire import frames

BS = 4096


@pytest.fixture
def uds_daemon(make_daemon, tmp_path):
    return make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"), dram__capacity="64MiB")


def _ns() -> Namespace:
    return Namespace(tenant="t", model_id="wb", block_size=16)


def _keys(ns: Namespace, n: int, start: int = 0) -> list[bytes]:
    return block_keys(ns, np.arange(16 * n, dtype=np.uint32) + np.uint32(start))


@contextmanager
def _paused(d: Any) -> Iterator[None]:
    """The daemon's loop is held (it reads no frame) inside the block."""
    go, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        go.wait(30)

    t = threading.Thread(target=d.call, args=(hold,))
    t.start()
    assert held.wait(30)
    try:
        yield
    finally:
        go.set()
        t.join(30)


def _ready(c: Client, ns: Namespace) -> None:
    """Make the namespace and learn its id (a write-behind put needs it)."""
    first = _keys(ns, 1, 1 << 20)
    assert c.put(ns, first, [np.zeros(BS, np.uint8)]) == [KeyStatus.OK]
    c.flush()
    assert c.lookup(ns, first).hit_blocks == 1


def test_a_write_behind_put_lands_and_its_writer_reads_it_at_once(uds_daemon):
    with Client(uds_daemon.target) as a, Client(uds_daemon.target) as b:
        ns = _ns()
        _ready(a, ns)
        keys = _keys(ns, 6)
        data = [np.full(BS, i + 1, np.uint8) for i in range(6)]
        outs = [np.zeros(BS, np.uint8) for _ in keys]
        owed = a.tally_pending
        with _paused(uds_daemon):  # the put has not landed while the writer reads it
            assert a.put(ns, keys, data) == [KeyStatus.OK] * 6
            assert a._fast.owed == ["Put"]  # one frame, not waited for
            assert a.get_into(ns, keys, outs) == [KeyStatus.OK] * 6
        assert all(np.array_equal(o, d) for o, d in zip(outs, data))
        assert a.own_write_reads == 6 and a._fast.owed == ["Put"]  # read from the staging ring
        assert a.tally_pending == owed + 1  # its reads frame goes with later ones
        assert a.lookup(ns, keys).hit_blocks == 6  # a short probe waits for the put (read-your-writes)
        assert b.lookup(ns, keys).hit_blocks == 6
        got = b.get(ns, keys)
        assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data))
        st = uds_daemon.call(uds_daemon.store.stats)
        assert (st.leases, st.reservations) == (0, 0) and a.late_rejected == 0
        # a chain continued from a stored parent, and a put of blocks already there
        more = _keys(ns, 8)[6:]
        assert a.put(ns, more, data[:2], parent=keys[-1]) == [KeyStatus.OK] * 2
        assert a._fast.owed[-1] == "Put"
        a.flush()
        assert a.put(ns, keys[:3] + more, data[:5]) == [KeyStatus.EXISTS] * 5  # no call at all
        assert a._fast.owed == []
        assert b.lookup(ns, keys + more).hit_blocks == 8


def test_what_write_behind_cannot_vouch_for_goes_through_reserve(uds_daemon):
    """A missing parent, a namespace without an id yet, sizes that differ and
    a put larger than half the staging ring are answered by Reserve (exact
    statuses)."""
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = _keys(ns, 3)
        assert c.put(ns, keys, [np.zeros(BS, np.uint8)] * 3) == [KeyStatus.OK] * 3
        assert c._fast.owed == ["Commit"]  # a new namespace: Reserve made it
        c.flush()
        orphan = _keys(ns, 2, 9000)
        assert c.put(ns, orphan, [np.zeros(BS, np.uint8)] * 2, parent=b"\x05" * 16) == \
            [KeyStatus.PARENT_MISSING] * 2
        wide = Namespace(tenant="t", model_id="wb-3MiB", block_size=16)
        big = _keys(wide, 6)
        blob = np.zeros(3 << 20, np.uint8)
        assert STAGING_BYTES // 2 < 3 * blob.size
        assert c.put(wide, big[:1], [blob]) == [KeyStatus.OK]
        c.flush()
        assert c.lookup(wide, big).hit_blocks == 1  # (learns the namespace's id)
        assert c.put(wide, big[1:4], [blob] * 3, parent=big[0]) == [KeyStatus.OK] * 3  # over half the ring
        assert c._fast.owed[-1] == "Commit"
        assert c.put(wide, big[4:], [blob] * 2, parent=big[3]) == [KeyStatus.OK] * 2  # fits
        assert c._fast.owed[-1] == "Put"
        c.flush()
        assert c.lookup(wide, big).hit_blocks == 6 and c.late_rejected == 0
        mixed = _keys(ns, 2, 8000)
        c.put(ns, mixed, [np.zeros(BS, np.uint8), np.zeros(2 * BS, np.uint8)])
        assert c._fast.owed[-1:] != ["Put"]
        with Client(uds_daemon.target, write_behind=False) as off:
            off.put(ns, _keys(ns, 1, 6000), [np.zeros(BS, np.uint8)])
            assert off._fast.owed == ["Commit"]


def test_a_block_the_daemon_refuses_later_is_counted(uds_daemon):
    """The namespace's blocks are 4 KiB; a write-behind put of 8 KiB blocks
    answers OK at once, and the daemon's INVALID comes back as late_rejected."""
    with Client(uds_daemon.target) as c:
        ns = _ns()
        _ready(c, ns)
        keys = _keys(ns, 3, 100)
        assert c.put(ns, keys, [np.zeros(2 * BS, np.uint8)] * 3) == [KeyStatus.OK] * 3
        assert c._fast.owed == ["Put"]
        c.flush()
        assert c.late_rejected == 3 and c._fast.late_errors == 0
        assert c.lookup(ns, keys).hit_blocks == 0
        assert uds_daemon.call(uds_daemon.store.stats).reservations == 0


def test_staging_is_private_and_put_frames_are_checked(uds_daemon):
    """The staging file is 0600 and loses its name at the first put; a put
    frame that overruns it, lies about its length or comes before a stage
    frame is refused with the right status, and nothing stored is lost."""
    with Client(uds_daemon.target, write_behind=False) as c:
        ns = _ns()
        keys = _keys(ns, 4)
        c.put(ns, keys, [np.ones(BS, np.uint8)] * 4)
        c.flush()
        wire = ns_pb(ns).SerializeToString(deterministic=True)
        raw = LookupSocketClient(uds_daemon.running.fast.path, c.session)
        try:
            new = _keys(ns, 2, 500)
            sums = b"\x00" * 16
            raw.send_frame("Put", frames.put_frame(wire, None, b"".join(new), BS, 0, sums))
            with pytest.raises(KVStoreError, match="FAILED_PRECONDITION.*staging"):
                _answer(raw)
            size, path = raw.stage()
            assert size == STAGING_BYTES and stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert raw.stage() == (size, path)  # one per connection
            for bad, what in (
                    (frames.put_frame(wire, None, b"".join(new), BS, size - BS, sums), "overruns"),
                    (frames.put_frame(wire, None, b"".join(new), BS, -1 & (2**64 - 1), sums), "overruns"),
                    (frames.put_frame(wire, None, b"".join(new), 0, 0, sums), "blocks of 0 bytes"),
                    (frames.put_frame(wire, None, b"".join(new), BS, 0, sums)[:-3], "does not hold"),
                    (frames.put_frame(b"\xff\xff\xff", None, b"".join(new), BS, 0, sums), "Namespace")):
                body = bad[4:]
                raw.sock.sendall(struct.pack("<I", len(body)) + body)
                with pytest.raises(InvalidArgument, match=what):
                    _answer(raw)
            assert not os.path.exists(path)  # unlinked at the first put frame: nobody else can open it
            with pytest.raises(KVStoreError, match="FAILED_PRECONDITION.*mapped already"):
                raw.stage()
        finally:
            raw.close()
        assert c.lookup(ns, keys).hit_blocks == 4
        assert uds_daemon.call(uds_daemon.store.stats).reservations == 0


def _answer(raw: LookupSocketClient) -> None:
    """Read one answer frame (raising its error)."""
    with raw.lock:
        if raw.owed:
            raw.owed.pop(0)
        raw._answer()


def test_a_client_that_dies_mid_put_leaves_nothing(uds_daemon):
    """Half a put frame, then the connection closes: nothing is reserved,
    nothing stored, and the staging file is gone."""
    with Client(uds_daemon.target, write_behind=False) as c:
        ns = _ns()
        _ready(c, ns)
        wire = ns_pb(ns).SerializeToString(deterministic=True)
        raw = LookupSocketClient(uds_daemon.running.fast.path, c.session)
        _, path = raw.stage()
        new = _keys(ns, 2, 300)
        msg = frames.put_frame(wire, None, b"".join(new), BS, 0, b"\x00" * 16)
        raw.sock.sendall(msg[: len(msg) // 2])
        raw.close()
        deadline = time.monotonic() + 30
        while os.path.exists(path) and time.monotonic() < deadline:  # the daemon sees the close
            time.sleep(0.01)
        assert not os.path.exists(path)
        assert c.lookup(ns, new).hit_blocks == 0
        assert uds_daemon.call(uds_daemon.store.stats).reservations == 0


def test_a_put_through_reserve_is_read_from_its_slots_before_its_commit_lands(uds_daemon):
    with Client(uds_daemon.target, write_behind=False) as c, ExitStack() as stack:
        ns = _ns()
        _ready(c, ns)
        keys = _keys(ns, 3, 40)
        data = [np.full(BS, 9 - i, np.uint8) for i in range(3)]
        fill = c._fill_slots

        def fill_then_pause(*a: Any) -> Any:  # Reserve answered, slots written: hold the daemon before the Commit
            got = fill(*a)
            stack.enter_context(_paused(uds_daemon))
            return got

        c._fill_slots = fill_then_pause  # type: ignore[method-assign]
        assert c.put(ns, keys, data) == [KeyStatus.OK] * 3
        assert c._fast.owed == ["Commit"]
        outs = [np.zeros(BS, np.uint8) for _ in keys]
        assert c.get_into(ns, keys, outs) == [KeyStatus.OK] * 3  # the daemon has not taken the Commit in
        stack.close()
        assert all(np.array_equal(o, d) for o, d in zip(outs, data)) and c.own_write_reads == 3
        c.flush()
        assert c.lookup(ns, keys).hit_blocks == 3 and c._fast.late_errors == 0
        # the answer read, those slots are the store's again: a read goes through the shared index
        assert c.get_into(ns, keys, outs) == [KeyStatus.OK] * 3 and c.own_write_reads == 3


@pytest.mark.parametrize("via", ["list", "sink"])
def test_a_read_of_an_own_staged_put_is_kept_only_while_the_put_is_in_flight(uds_daemon, monkeypatch, via):
    """A read of the writer's own staged put copies its ring with no
    checksum: buffers given as a list through ``SharedPath.read_staged``
    (``copy_run``), a ``BufferSink`` through ``SharedPath.read``
    (``copy_blocks``). That is sound only because the ring is written again
    after the put is answered: here the answer is read under the copy and
    the ring then scribbled over (as a later put would), so the copy got
    other bytes, and the read must drop them and take the lease path, which
    reads the landed blocks. Without the check after the copy the read
    returns the scribbled bytes."""
    import kvstore.client.shared as shared
    import kvstore.client.sinks as sinks
    from kvstore.client.sinks import BufferSink

    with Client(uds_daemon.target) as a:
        ns = _ns()
        _ready(a, ns)
        keys = _keys(ns, 4, 800)
        data = [np.full(BS, 40 + i, np.uint8) for i in range(4)]
        assert a.put(ns, keys, data) == [KeyStatus.OK] * 4
        run = a._own.recent[-1]
        assert run.private and run.buf is a._wb.ring.buf  # (the staging ring)
        copies: list[int] = []
        if via == "list":
            copy_run = shared.copy_run

            def answered_then_reused_run(dsts: Any, src: Any, at: int, size: int, threads: int = 2) -> bool:
                a.flush()  # the put's answer is read: its ring bytes are free again
                src[at : at + len(dsts) * size] = 0xEE
                copies.append(len(dsts))
                return copy_run(dsts, src, at, size, threads)

            monkeypatch.setattr(shared, "copy_run", answered_then_reused_run)
        else:
            copy = sinks.copy_blocks

            def answered_then_reused(dsts: Any, srcs: Any, threads: int = 2) -> None:
                a.flush()
                for s in srcs:
                    s[:] = 0xEE
                copies.append(len(srcs))
                copy(dsts, srcs, threads)

            monkeypatch.setattr(sinks, "copy_blocks", answered_then_reused)

        def outs_for(n: int) -> tuple[list[np.ndarray], Any]:
            bufs = [np.zeros(BS, np.uint8) for _ in range(n)]
            return bufs, (bufs if via == "list" else BufferSink(bufs))

        bufs, outs = outs_for(4)
        reads = a.own_write_reads
        assert a.get_into(ns, keys, outs) == [KeyStatus.OK] * 4
        assert copies == [4] and a.own_write_reads == reads  # copied from the ring, then dropped
        assert all(np.array_equal(o, d) for o, d in zip(bufs, data))  # the lease path's bytes
        monkeypatch.undo()
        more = _keys(ns, 2, 900)
        assert a.put(ns, more, data[:2]) == [KeyStatus.OK] * 2
        bufs, outs = outs_for(2)
        assert a.get_into(ns, more, outs) == [KeyStatus.OK] * 2 and a.own_write_reads == reads + 2
        assert all(np.array_equal(o, d) for o, d in zip(bufs, data))


def test_a_get_of_a_whole_own_staged_put_goes_straight_to_the_copy(uds_daemon, monkeypatch):
    """``get_into`` of every key of the writer's staged put in flight (or
    of a run inside it), into a list or tuple of buffers, is one
    ``copy_run`` out of the ring: no index probe, no ``SharedPath.read``.
    Buffers it refuses (a size that does not fit, bytes not writable, an
    array that is not C-contiguous) take the ordinary path, which answers
    as before, and other buffers (bytearrays, memoryviews) are copied too."""
    import kvstore.client.shared as shared

    with Client(uds_daemon.target) as a:
        ns = _ns()
        _ready(a, ns)
        reader = a._shared.reader
        probes: list[int] = []
        raw_slots = reader.raw_slots
        monkeypatch.setattr(reader, "raw_slots", lambda *x: probes.append(1) or raw_slots(*x))
        runs: list[bool] = []
        copy_run = shared.copy_run
        monkeypatch.setattr(shared, "copy_run", lambda *x: runs.append(copy_run(*x)) or runs[-1])
        keys = _keys(ns, 5, 1500)
        data = [np.full(BS, 90 + i, np.uint8) for i in range(5)]
        assert a.put(ns, keys, data) == [KeyStatus.OK] * 5  # in flight until a call reads its answer
        reads = a.own_write_reads
        outs: list[Any] = [bytearray(BS), memoryview(bytearray(BS)), *(np.zeros(BS, np.uint8) for _ in range(3))]
        assert a.get_into(ns, keys, outs) == [KeyStatus.OK] * 5
        assert runs == [True] and probes == [] and a.own_write_reads == reads + 5
        assert all(bytes(o) == d.tobytes() for o, d in zip(outs, data))
        assert a.get_into(ns, keys[1:4], tuple(outs[:3])) == [KeyStatus.OK] * 3  # a run inside the put
        assert runs == [True] * 2 and probes == [] and bytes(outs[0]) == data[1].tobytes()
        # buffers the copy refuses, with nothing written: the ordinary path answers as it did
        with pytest.raises(TypeError, match="writable"):
            a.get_into(ns, keys[:1], [bytes(BS)])
        strided = np.zeros((BS, 2), np.uint8)[:, 0]  # its flat form is a copy: bytes written there would be lost
        with pytest.raises(InvalidArgument, match="C-contiguous"):
            a.get_into(ns, keys[:1], [strided])
        assert runs == [True] * 2 + [False] * 2 and probes and not strided.any()
        short = [np.zeros(BS, np.uint8) for _ in range(4)] + [np.zeros(BS // 2, np.uint8)]
        got = a.get_into(ns, keys, short)
        assert runs[-1] is False and got[:4] == [KeyStatus.OK] * 4 and got[4] != KeyStatus.OK
        assert all(np.array_equal(o, d) for o, d in zip(short[:4], data)) and not short[4].any()
        a.flush()
        assert a.lookup(ns, keys).hit_blocks == 5


def test_a_staged_put_carries_no_checksums_and_reads_of_it_still_check_what_they_must(uds_daemon):
    """A ring put's frame is ``PUT_UNHASHED``: the daemon stores the hashes
    of its landing copy, so another client's verified read of those blocks
    passes. The writer reads blocks of it in flight unhashed into buffers,
    also behind stored blocks (those verified from the slab), and through an
    engine sink (verified against hashes taken from the ring)."""
    from kvstore.client.sinks import LayerScatter

    with Client(uds_daemon.target) as a, Client(uds_daemon.target) as b:
        ns = _ns()
        _ready(a, ns)
        keys = _keys(ns, 6, 1000)
        data = [np.full(BS, 60 + i, np.uint8) for i in range(6)]
        sent: list[bytes] = []
        send = a._fast.send_frame

        def spy(name: str, msg: bytes, keep: bool = False, cork: bool = False) -> int:
            sent.append(msg)
            return send(name, msg, keep, cork)

        a._fast.send_frame = spy  # type: ignore[method-assign]
        assert a.put(ns, keys[:3], data[:3]) == [KeyStatus.OK] * 3
        assert sent[-1][4:6] == frames.PUT_MARK and frames.parse_put(sent[-1][4:]).checksums is None
        a.flush()
        got = b.get(ns, keys[:3])  # verified against the hashes the daemon took as it landed them
        assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data[:3]))
        reads = a.own_write_reads
        assert a.put(ns, keys[3:], data[3:], parent=keys[2]) == [KeyStatus.OK] * 3
        outs = [np.zeros(BS, np.uint8) for _ in keys]
        assert a.get_into(ns, keys, outs) == [KeyStatus.OK] * 6  # 3 from the slab, 3 from the ring
        assert a.own_write_reads == reads + 3 and a._fast.corked
        assert all(np.array_equal(o, d) for o, d in zip(outs, data))
        layer = np.zeros(8 * BS, np.uint8)
        lay = LayerScatter(BS, np.array([(0, BS, 0, 0, BS)], np.int64), [layer])
        assert a.get_into(ns, keys[3:], lay.sink([5, 1, 7])) == [KeyStatus.OK] * 3
        assert a.own_write_reads == reads + 6 and a._fast.corked
        for slot, d in zip([5, 1, 7], data[3:]):
            assert np.array_equal(layer[slot * BS : (slot + 1) * BS], d)
        a.flush()
        got = b.get(ns, keys)
        assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data)) and a.late_rejected == 0


def test_a_put_whose_staging_bytes_do_not_match_their_checksums_stores_nothing(uds_daemon):
    with Client(uds_daemon.target, write_behind=False) as c:
        ns = _ns()
        _ready(c, ns)
        wire = ns_pb(ns).SerializeToString(deterministic=True)
        raw = LookupSocketClient(uds_daemon.running.fast.path, c.session)
        try:
            _, path = raw.stage()
            ring = np.memmap(path, dtype=np.uint8, mode="r+")
            new = _keys(ns, 2, 700)
            ring[: 2 * BS] = 5
            good = int(checksum(ring[:BS]))
            sums = struct.pack("<2Q", good, good ^ 1)  # the second block's checksum is wrong
            raw.send_frame("Put", frames.put_frame(wire, None, b"".join(new), BS, 0, sums))
            with pytest.raises(InvalidArgument, match="does not match its checksum"):
                _answer(raw)
            raw.send_frame("Put", frames.put_frame(wire, None, b"".join(new), BS, 0, struct.pack("<2Q", good, good)))
            _answer(raw)  # the same blocks with the right checksums land
            del ring
        finally:
            raw.close()
        assert c.lookup(ns, new).hit_blocks == 2
        assert uds_daemon.call(uds_daemon.store.stats).reservations == 0


def test_a_write_behind_put_waits_for_its_writers_next_frame_or_its_delay(uds_daemon):
    """A write-behind put's frame is corked: the daemon does not see the put
    (another client's lookup misses) while its writer reads the blocks back
    from its ring with nothing sent; the writer's next frame (here a flush)
    takes it out. With a short ``write_behind_delay`` it goes out on its own;
    with 0, at once."""
    ns = _ns()
    data = [np.full(BS, i + 3, np.uint8) for i in range(4)]
    with Client(uds_daemon.target, write_behind_delay=300.0) as a, Client(uds_daemon.target) as b:
        _ready(a, ns)
        keys = _keys(ns, 4, 500)
        assert a.put(ns, keys, data) == [KeyStatus.OK] * 4
        assert a._fast.owed == ["Put"] and a._fast.corked and a.write_behind_delay == 300.0
        assert b.lookup(ns, keys).hit_blocks == 0  # the daemon has not seen it
        outs = [np.zeros(BS, np.uint8) for _ in keys]
        assert a.get_into(ns, keys, outs) == [KeyStatus.OK] * 4 and a.own_write_reads == 4
        assert all(np.array_equal(o, d) for o, d in zip(outs, data))
        assert a._fast.corked  # the read sent nothing
        a.flush()
        assert not a._fast.corked and b.lookup(ns, keys).hit_blocks == 4 and a._fast.uncorked == 0
    with Client(uds_daemon.target, write_behind_delay=0.05) as c, Client(uds_daemon.target) as b:
        assert c.lookup(ns, _keys(ns, 1, 1 << 20)).hit_blocks == 1  # (learns the namespace's id)
        keys = _keys(ns, 4, 600)
        assert c.put(ns, keys, data) == [KeyStatus.OK] * 4
        deadline = time.monotonic() + 30
        while b.lookup(ns, keys).hit_blocks < 4 and time.monotonic() < deadline:  # no call of c's meanwhile
            time.sleep(0.01)
        c.flush()  # (under the lock the timer wrote the frame with: its count is in by then)
        assert b.lookup(ns, keys).hit_blocks == 4 and c._fast.uncorked == 1 and c.late_rejected == 0
    for bad in (-1.0, float("nan")):
        with pytest.raises(InvalidArgument, match="write_behind_delay"):
            Client(uds_daemon.target, write_behind_delay=bad)
    with Client(uds_daemon.target, write_behind_delay=0) as d:
        assert d.lookup(ns, _keys(ns, 1, 1 << 20)).hit_blocks == 1
        assert d.put(ns, _keys(ns, 2, 700), data[:2]) == [KeyStatus.OK] * 2
        assert d._fast.owed == ["Put"] and not d._fast.corked
