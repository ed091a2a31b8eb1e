"""Granted puts (issue 18): the ``grant``/``gput`` frames of the same-host
socket (kvstore/daemon/granted.py, kvstore/client/grants.py,
kvstore/core/grants.py), against a real daemon."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.checksum import checksum
from kvstore.client import Client, ns_pb
from kvstore.client.socket import LookupSocketClient
from kvstore.errors import InvalidArgument, KeyStatus, PermissionDenied
from kvstore.keys import Namespace, block_keys
from kvstore.wire import frames

MIB = 1 << 20
BIG = 4 * MIB
"""Three blocks of this size (12 MiB) pass the staging ring's 8 MiB: granted puts."""


@pytest.fixture
def uds_daemon(make_daemon, tmp_path):
    # 256 MiB of DRAM: a session may hold 16 MiB granted (kvstore.daemon.granted.limit)
    return make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"), dram__capacity="256MiB")


def _ns(model: str = "gr") -> Namespace:
    return Namespace(tenant="t", model_id=model, block_size=16)


def _keys(ns: Namespace, n: int, start: int) -> list[bytes]:
    return block_keys(ns, np.arange(16 * n, dtype=np.uint32) + np.uint32(start))


def _data(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]


def _granted(d, sid: str) -> dict[int, int]:
    """The daemon's granted slots of session ``sid``: offset -> slot bytes."""
    g = d.call(lambda: dict(d.store.grants.slots))
    return {loc: held[1] for loc, held in g.items() if held[0] == sid}


def test_a_large_put_goes_through_granted_slots_and_reads_back(uds_daemon):
    """The first large put goes through Reserve and asks for a grant; the
    next ones copy into granted slots and send one frame, not waited for.
    The writer reads its own blocks at once, another client once landed."""
    with Client(uds_daemon.target) as a, Client(uds_daemon.target) as b:
        ns = _ns()
        assert a.put(ns, _keys(ns, 1, 1 << 20), _data(1, BIG, 0)) == [KeyStatus.OK]  # (the namespace)
        a.flush()
        for r in range(3):
            keys, data = _keys(ns, 3, 1000 * (r + 1)), _data(3, BIG, r + 1)
            assert a.put(ns, keys, data) == [KeyStatus.OK] * 3
            if r == 2:
                assert a._fast.owed[-2:] == ["Put", "Grant"]  # the granted put and the next grant
                outs = [np.zeros(BIG, np.uint8) for _ in keys]
                assert a.get_into(ns, keys, outs) == [KeyStatus.OK] * 3
                assert all(np.array_equal(o, d) for o, d in zip(outs, data))
            a.flush()
            got = b.get(ns, keys)
            assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data))
        assert a.late_rejected == 0 and a._fast.late_errors == 0
        held = _granted(uds_daemon, a.session)
        assert len(held) == 3 and set(held.values()) == {BIG}  # the refill for the next put
        text = uds_daemon.daemon.metrics.render().decode()
        shown = [float(x.split()[1]) for x in text.splitlines() if x.startswith("kvstore_granted_bytes ")]
        assert shown == [3 * BIG]  # operators see what grants hold
        stats = uds_daemon.call(uds_daemon.store.stats)
        assert stats.reservations == 0


def test_grant_and_gput_frames_are_checked_and_nothing_stored_is_lost(uds_daemon):
    with Client(uds_daemon.target) as c, Client(uds_daemon.target) as other:
        ns = _ns()
        wire = ns_pb(ns).SerializeToString(deterministic=True)
        kept = _keys(ns, 2, 7)
        assert c.put(ns, kept, _data(2, 4096, 9)) == [KeyStatus.OK] * 2
        c.flush()
        raw = LookupSocketClient(uds_daemon.running.fast.path, c.session)
        stranger = LookupSocketClient(uds_daemon.running.fast.path, other.session)
        try:
            def call(conn: LookupSocketClient, msg: bytes) -> bytes:
                return conn.answer(conn.send_frame("Grant", msg, keep=True))

            body = call(raw, frames.grant_frame(wire, 2, 4096))
            _, life, most = frames.GRANT_OK.unpack_from(b"\0" + body[:12])
            offs = np.frombuffer(body, "<u8", offset=12).tolist()
            assert life == 30_000 and most == 16 * MIB and len(offs) == 2
            for bad, err in ((frames.grant_frame(wire, 0, 4096), InvalidArgument),
                             (frames.grant_frame(wire, (1 << 20) + 1, 4096), InvalidArgument),
                             (frames.grant_frame(wire, 1, 8192), InvalidArgument),  # the namespace holds 4 KiB
                             (frames.grant_frame(b"\xff\x01", 1, 4096), InvalidArgument)):
                with pytest.raises(err):
                    call(raw, bad)
            new = _keys(ns, 2, 500)
            blocks = _data(2, 4096, 3)
            for o, blk in zip(offs, blocks):
                c.view(o, 4096)[:] = blk
            sums = np.asarray([checksum(x) for x in blocks], "<u8").tobytes()

            def gput(conn: LookupSocketClient, at: list[int], keys: list[bytes] = new) -> bytes:
                msg = frames.granted_put_frame(wire, kept[-1], b"".join(keys), 4096, sums[: 8 * len(keys)],
                                               np.asarray(at, "<u8").tobytes())
                return conn.answer(conn.send_frame("Put", msg, keep=True))

            with pytest.raises(PermissionDenied):  # another session cannot name these slots
                gput(stranger, offs)
            with pytest.raises(PermissionDenied):  # nor this one a slot it was not granted
                gput(raw, [offs[0], offs[1] + 4096])
            with pytest.raises(InvalidArgument):
                gput(raw, [offs[0], offs[0]])
            assert c.lookup(ns, kept + new).hit_blocks == 2  # nothing stored, nothing lost
            assert sorted(_granted(uds_daemon, c.session)) == sorted(offs)
            assert gput(raw, offs) == bytes([KeyStatus.OK] * 2)
            assert c.lookup(ns, kept + new).hit_blocks == 4
            got = other.get(ns, new)
            assert all(np.array_equal(g, x) for g, x in zip(got, blocks))
            with pytest.raises(PermissionDenied):  # a slot is used once
                gput(raw, offs)
        finally:
            raw.close()
            stranger.close()


def test_a_session_that_ends_leaves_no_granted_slot(uds_daemon):
    d = uds_daemon
    with Client(d.target) as c:
        base = d.call(lambda: d.store.dram.used_bytes)
        wire = ns_pb(_ns()).SerializeToString(deterministic=True)
        raw = LookupSocketClient(d.running.fast.path, c.session)
        try:
            body = raw.answer(raw.send_frame("Grant", frames.grant_frame(wire, 4, MIB), keep=True))
            assert len(body) == 12 + 4 * 8
            assert d.call(lambda: d.store.dram.used_bytes) == base + 4 * MIB
        finally:
            raw.close()
    deadline = time.monotonic() + 10
    while d.call(lambda: d.store.dram.used_bytes) != base and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d.call(lambda: d.store.dram.used_bytes) == base
    assert d.call(lambda: d.store.grants.locs().size) == 0


def test_a_writer_holds_grants_of_one_size_and_gives_the_others_back(uds_daemon):
    with Client(uds_daemon.target) as c:
        for i, size in enumerate((BIG, 3 * MIB, BIG)):
            ns = _ns(f"s{i}")
            for r in range(3):
                assert c.put(ns, _keys(ns, 3, 100 * r), _data(3, size, r)) == [KeyStatus.OK] * 3
            c.flush()
            held = _granted(uds_daemon, c.session)
            assert set(held.values()) == {size} and len(held) == 3
            assert c.late_rejected == 0


def test_a_put_larger_than_the_sessions_grant_limit_stays_on_reserve(make_daemon, tmp_path):
    """On a 128 MiB DRAM tier a session may hold 8 MiB granted: the first
    12 MiB put learns that from the grant's answer, and the next ones put
    through Reserve instead of asking again."""
    d = make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"), dram__capacity="128MiB")
    with Client(d.target) as c:
        ns = _ns()
        assert c.put(ns, _keys(ns, 1, 1 << 20), _data(1, BIG, 0)) == [KeyStatus.OK]
        c.flush()
        for r in range(3):
            keys, data = _keys(ns, 3, 1000 * (r + 1)), _data(3, BIG, r)
            assert c.put(ns, keys, data) == [KeyStatus.OK] * 3
            c.flush()
            assert all(np.array_equal(g, x) for g, x in zip(c.get(ns, keys), data))
        assert c._wb.grants.limit == 8 * MIB
        assert len(_granted(d, c.session)) <= 2  # at most the 8 MiB the first ask got
        assert c.late_rejected == 0 and c._fast.late_errors == 0


def test_a_client_that_dies_mid_granted_put_leaves_nothing(uds_daemon):
    """A grant, half a gput frame, then the client goes (its socket, then its
    session): nothing is stored and every granted slot is free again."""
    d = uds_daemon
    with Client(d.target) as watcher:
        ns = _ns()
        assert watcher.put(ns, _keys(ns, 1, 1 << 20), _data(1, 4096, 0)) == [KeyStatus.OK]  # (4 KiB blocks)
        watcher.flush()
        base = d.call(lambda: d.store.dram.used_bytes)
        wire = ns_pb(ns).SerializeToString(deterministic=True)
        new = _keys(ns, 2, 77)
        dying = Client(d.target)
        raw = LookupSocketClient(d.running.fast.path, dying.session)
        body = raw.answer(raw.send_frame("Grant", frames.grant_frame(wire, 2, 4096), keep=True))
        offs = np.frombuffer(body, "<u8", offset=12)
        assert offs.size == 2 and d.call(lambda: d.store.dram.used_bytes) == base + 2 * 4096
        msg = frames.granted_put_frame(wire, None, b"".join(new), 4096, b"\x00" * 16, offs.tobytes())
        raw.sock.sendall(msg[: len(msg) // 2])
        raw.close()
        dying.close()  # the session ends: its grants go
        deadline = time.monotonic() + 10
        while d.call(lambda: d.store.grants.locs().size) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d.call(lambda: d.store.grants.locs().size) == 0
        assert d.call(lambda: d.store.dram.used_bytes) == base
        assert watcher.lookup(ns, new).hit_blocks == 0
        assert d.call(d.store.stats).reservations == 0
