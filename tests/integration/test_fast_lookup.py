"""The same-host fast Lookup socket (kvstore.daemon.socket_server, kvstore.client.socket): same answers as
gRPC Lookup, bound to the session's tenant, clean errors, gRPC fallback."""

from __future__ import annotations

import os
import socket
import stat
import struct

import numpy as np
import pytest

from kvstore.client import Client, ns_pb
from kvstore.errors import InvalidArgument, KeyStatus, NotFound, PermissionDenied, Unauthenticated, Unavailable
from kvstore.client.socket import LookupSocketClient
from kvstore.keys import Namespace, block_keys
from tiers.base import TierKind

BS = 4096


@pytest.fixture
def uds_daemon(make_daemon, tmp_path):
    sock = str(tmp_path / "kv.sock")
    return make_daemon(server__host="", server__unix_socket=sock)


def _ns(tenant: str = "t") -> Namespace:
    return Namespace(tenant=tenant, model_id="m", block_size=16)


def _fill(c: Client, ns: Namespace, n: int) -> list[bytes]:
    keys = block_keys(ns, np.arange(n * 16, dtype=np.uint32))
    v = np.zeros(BS, np.uint8)
    c.put(ns, keys, [v] * n)
    return keys


def test_fast_lookup_answers_like_grpc(uds_daemon):
    path = uds_daemon.running.fast.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with Client(uds_daemon.target) as fast, Client(uds_daemon.target, fast_lookup=False) as slow:
        assert fast._fast is not None and slow._fast is None
        ns = _ns()
        keys = _fill(fast, ns, 40)
        other = block_keys(ns, np.arange(16 * 8, dtype=np.uint32) + 7)
        before = uds_daemon.store.counters.lookups
        for probe in (keys, keys[:1], keys[:17] + other, other, []):
            a, b = fast.lookup(ns, probe), slow.lookup(ns, probe)
            assert a == b
        assert fast.lookup(ns, keys).hit_blocks == 40 and fast.lookup(ns, keys).tiers == [TierKind.DRAM] * 40
        # the same-host client answered its lookups from the daemon's shared index ...
        assert fast._shared is not None and fast.shared_lookups == 7
        # ... and each is counted by the store like a gRPC one once its tally is sent
        fast.flush()
        assert uds_daemon.store.counters.lookups - before == 12
        with pytest.raises(InvalidArgument):
            fast.lookup(ns, [b"short"])


def test_raw_frames_round_trip_and_bad_input(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = _fill(c, ns, 5)
        wire = ns_pb(ns).SerializeToString(deterministic=True)
        raw = LookupSocketClient(uds_daemon.running.fast.path, c.session)
        try:
            hit, tiers = raw.lookup(wire, b"".join(keys))
            assert hit == 5 and tiers == bytes([2]) * 5  # Tier value of DRAM, one byte per block
            with pytest.raises(InvalidArgument, match="multiple of 16"):
                raw.lookup(wire, b"x" * 17)
            with pytest.raises(InvalidArgument, match="Namespace"):
                raw.lookup(b"\xff\xff\xff", b"".join(keys))
            assert raw.lookup(wire, b"".join(keys[:2]))[0] == 2  # still usable after errors
        finally:
            raw.close()


def test_unknown_session_is_refused(uds_daemon):
    with pytest.raises(NotFound, match="unknown"):
        LookupSocketClient(uds_daemon.running.fast.path, "s-not-a-session")
    # a frame longer than allowed closes the connection with an error
    with Client(uds_daemon.target) as c:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(uds_daemon.running.fast.path)
        sid = c.session.encode()
        s.sendall(struct.pack("<I", len(sid)) + sid)
        n = struct.unpack("<I", s.recv(4))[0]
        hello = s.recv(n)  # OK, then the shared index's header path
        assert hello[:1] == b"\x00" and hello[1:].decode() == uds_daemon.running.fast.shared.path
        s.sendall(struct.pack("<I", 1 << 30))
        head = s.recv(5)
        assert struct.unpack("<I", head[:4])[0] > 1 and head[4] == 3  # INVALID_ARGUMENT
        s.close()


def test_tenant_comes_from_the_session_and_ends_with_it(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns("t")
        keys = _fill(c, ns, 3)
        assert c.lookup(ns, keys).hit_blocks == 3
        fast = c._fast
        sid = c.session
        # the daemon forgets the session (its KeepAlive ended): the socket refuses
        uds_daemon.call(uds_daemon.daemon.sessions.pop, sid)
        with pytest.raises(NotFound, match="ended"):
            fast.lookup(c._ns_wire[ns], b"".join(keys))


def test_client_falls_back_to_grpc_when_the_socket_breaks(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = _fill(c, ns, 4)
        c._fast.sock.close()  # as if the daemon side went away
        assert c.lookup(ns, keys).hit_blocks == 4
        assert c._fast is None
        assert c.lookup(ns, keys).hit_blocks == 4


def test_tcp_daemon_opens_its_socket_in_a_private_dir(make_daemon):
    """Embedded defaults (TCP only, no --unix-socket): the same-host socket is
    on, in a directory only the daemon's user may enter, and the client finds
    it through Handshake (issue 18)."""
    d = make_daemon()
    path = d.running.fast.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    parent = os.stat(os.path.dirname(path))
    assert stat.S_IMODE(parent.st_mode) == 0o700 and parent.st_uid == os.getuid()
    with Client(d.target) as c:
        assert c._fast is not None and c._fast_path == path
        ns = _ns()
        keys = _fill(c, ns, 2)
        assert c.lookup(ns, keys).hit_blocks == 2
    d.stop()
    assert not os.path.exists(path)  # removed on stop


def test_private_dir_refuses_a_directory_open_to_others(tmp_path, monkeypatch):
    from kvstore.daemon.socket_server import default_path, private_dir
    from kvstore.errors import Unavailable

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    assert private_dir() == str(run / "kvstore")
    assert stat.S_IMODE(os.stat(run / "kvstore").st_mode) == 0o700
    assert os.path.dirname(default_path("")) == str(run / "kvstore")
    assert default_path("/x/kv.sock") == "/x/kv.sock.lookup"
    stale = run / "kvstore" / "kv-999999999-abcd.sock"  # a daemon that died without stopping
    stale.write_bytes(b"")
    default_path("")
    assert not stale.exists()
    os.chmod(run / "kvstore", 0o755)
    with pytest.raises(Unavailable, match="private"):
        private_dir()


def test_lookup_socket_off(make_daemon, tmp_path):
    d = make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"), server__lookup_socket="off")
    assert d.running.fast is None
    with Client(d.target) as c:
        assert c._fast is None


# ---------------------------------------------- control calls of the shm path
class _NoGrpc:
    """Stands in for the gRPC stub: any data-path call through it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"{name} went over gRPC, not the fast socket")


def test_put_get_and_two_phase_calls_go_over_the_socket(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 6, dtype=np.uint32))
        data = [np.full(BS, i, np.uint8) for i in range(6)]
        stub, c.stub = c.stub, _NoGrpc()
        try:
            assert c.put(ns, keys, data) == [KeyStatus.OK] * 6
            outs = [np.zeros(BS, np.uint8) for _ in keys]
            assert c.get_into(ns, keys, outs) == [KeyStatus.OK] * 6
            assert all(np.array_equal(o, d) for o, d in zip(outs, data))
            more = block_keys(ns, np.arange(16 * 8, dtype=np.uint32))[6:]
            res = c.reserve(ns, more, BS, parent=keys[-1])
            for off, ln in zip(res.offsets, res.lengths):
                c._view(off, ln)[:] = 7
            assert c.commit(res) == [KeyStatus.OK] * 2
            with c.acquire(ns, keys + more) as lease:
                assert lease.hit_blocks == 8 and int(lease.views[7][0]) == 7
                assert uds_daemon.call(uds_daemon.store.stats).tiers[0].pinned_bytes == 8 * BS
            r2 = c.reserve(ns, block_keys(ns, np.arange(16 * 9, dtype=np.uint32))[8:], BS, parent=more[-1])
            assert c.abort(r2) == 1
        finally:
            c.stub = stub
        assert uds_daemon.call(uds_daemon.store.stats).tiers[0].pinned_bytes == 0  # the lease was released
        assert c.lookup(ns, keys + more).hit_blocks == 8


def test_socket_calls_keep_the_handlers_checks(make_daemon, tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n')
    d = make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"),
                    server__tenants_file=str(tenants))
    from proto import kvstore_pb2 as pb

    with Client(d.target, token="tok-acme") as c:
        ns = _ns("acme")
        keys = _fill(c, ns, 3)
        assert c.lookup(ns, keys).hit_blocks == 3
        with pytest.raises(PermissionDenied):  # another tenant's namespace: refused, socket kept
            c.lookup(_ns("beta"), keys)
        assert c._fast is not None
        # without the token the same session gets UNAUTHENTICATED for a call
        raw = LookupSocketClient(d.running.fast.path, c.session)
        try:
            with pytest.raises(Unauthenticated):
                raw.call("Release", pb.ReleaseRequest(lease_id="x").SerializeToString())
        finally:
            raw.close()
        raw = LookupSocketClient(d.running.fast.path, c.session, token="tok-acme")
        try:
            with pytest.raises(NotFound):  # a lease this session does not hold
                raw.call("Release", pb.ReleaseRequest(lease_id="nope").SerializeToString())
            with pytest.raises(InvalidArgument):
                raw.call("Acquire", b"\xff\xff\xff")
            raw.sock.sendall(struct.pack("<I", 3) + b"\xff\xff\x09")  # method 9 does not exist
            with pytest.raises(InvalidArgument, match="unknown method"):
                raw._answer()
        finally:
            raw.close()


def test_a_broken_socket_fails_the_call_then_grpc_takes_over(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 2, dtype=np.uint32))
        c._fast.sock.close()
        with pytest.raises(Unavailable):
            c.put(ns, keys, [np.zeros(BS, np.uint8)] * 2)
        assert c._fast is None
        assert c.put(ns, keys, [np.zeros(BS, np.uint8)] * 2) == [KeyStatus.OK] * 2
        assert c.get(ns, keys)[1] is not None


# ---------------------------------------------- pipelined Commit and Release
def test_pipelined_commit_and_release_run_before_the_next_call(uds_daemon):
    """put sends its Commit and get_into its Release without waiting (issue
    18): the same client reads its writes at once, another client sees them
    once the daemon took the Commit in, and nothing stays held. (Without
    the shared index: its reads take no lease, so there is no Release.)"""
    with Client(uds_daemon.target, shared_index=False) as a, Client(uds_daemon.target) as b:
        assert a.pipeline and a._fast is not None
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 4, dtype=np.uint32))
        data = [np.full(BS, i + 1, np.uint8) for i in range(4)]
        assert a.put(ns, keys, data) == [KeyStatus.OK] * 4
        assert a._fast.owed == ["Commit"]
        outs = [np.zeros(BS, np.uint8) for _ in keys]
        assert a.get_into(ns, keys, outs) == [KeyStatus.OK] * 4  # read-your-writes on one connection
        assert all(np.array_equal(o, d) for o, d in zip(outs, data))
        assert a._fast.owed == ["Release"]
        a.flush()
        assert a._fast.owed == [] and a._fast.late_errors == 0
        assert b.lookup(ns, keys).hit_blocks == 4
        st = uds_daemon.call(uds_daemon.store.stats)
        assert (st.leases, st.reservations, st.tiers[0].pinned_bytes) == (0, 0, 0)


def test_a_pipelined_call_that_fails_is_counted_not_raised(uds_daemon):
    from proto import kvstore_pb2 as pb

    with Client(uds_daemon.target) as c:
        c._fast.send("Release", pb.ReleaseRequest(lease_id="l-nope").SerializeToString())
        ns = _ns()
        assert c.lookup(ns, block_keys(ns, np.arange(16, dtype=np.uint32))).hit_blocks == 0  # answers in order
        assert c._fast.late_errors == 1 and c._fast.owed == []


def test_pipeline_off_waits_for_commit(uds_daemon):
    with Client(uds_daemon.target, pipeline=False) as c:
        ns = _ns()
        keys = _fill(c, ns, 3)
        assert c._fast.owed == []
        assert uds_daemon.call(lambda: uds_daemon.store.lookup(ns, keys).hit_blocks) == 3


def test_close_settles_pipelined_calls(uds_daemon):
    ns = _ns()
    keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))
    with Client(uds_daemon.target) as c:
        c.put(ns, keys, [np.zeros(BS, np.uint8)] * 3)
    # the Commit ran before the session ended (which would have aborted it)
    assert uds_daemon.call(lambda: uds_daemon.store.lookup(ns, keys).hit_blocks) == 3


def test_a_call_that_waits_keeps_the_order_of_the_frames(make_daemon, tmp_path):
    """A call that cannot finish at once (here: queued behind a full QoS gate)
    continues in a task; the frames behind it wait, and all answer in order."""
    d = make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"),
                    admission__qos_max_concurrency=1)
    with Client(d.target) as c:
        ns = _ns()
        keys = _fill(c, ns, 2)
        c.flush()  # the put's Commit answered
        ticket = d.call(lambda: d.daemon.qos.try_enter(0))  # hold the only slot
        wire = c._ns_wire.get(ns) or ns_pb(ns).SerializeToString(deterministic=True)
        from kvstore.wire import frames

        c._fast.sock.sendall(frames.lookup_frame(wire, b"".join(keys)) + frames.lookup_frame(wire, keys[0]))
        wait = d.call(lambda: len(d.running.fast.conns) and next(iter(d.running.fast.conns)).waiting is not None)
        assert wait
        d.call(lambda: d.daemon.qos.release(ticket))
        first, second = c._fast._answer(), c._fast._answer()
        assert first[1:5] == (2).to_bytes(4, "little") and second[1:5] == (1).to_bytes(4, "little")


def test_a_process_that_exits_without_close_lands_its_last_put(uds_daemon, repo_root):
    import subprocess
    import sys

    child = (
        "import numpy as np\n"
        "from kvstore.client import Client\n"
        "from kvstore.keys import Namespace, block_keys\n"
        f"c = Client({uds_daemon.target!r})\n"
        "ns = Namespace(tenant='t', model_id='m', block_size=16)\n"
        "keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))\n"
        "assert c._fast is not None\n"
        "c.put(ns, keys, [np.zeros(4096, np.uint8)] * 3)\n"  # no close(): the Commit is settled at exit
    )
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    subprocess.run([sys.executable, "-c", child], check=True, env=env, cwd=repo_root, timeout=120)
    ns = _ns()
    keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))
    assert uds_daemon.call(lambda: uds_daemon.store.lookup(ns, keys).hit_blocks) == 3


# ------------------------------------------------------------ shared index
def test_lookups_from_the_shared_index_read_their_own_writes(uds_daemon):
    with Client(uds_daemon.target) as c:
        assert c._shared is not None
        ns = _ns()
        for r in range(20):  # each put's Commit is pipelined; the next lookup must see it
            keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32) + np.uint32(1000 * r))
            assert c.put(ns, keys, [np.zeros(BS, np.uint8)] * 3) == [KeyStatus.OK] * 3
            assert c.lookup(ns, keys).hit_blocks == 3
            c.remove(ns, keys[1:2])
            assert c.lookup(ns, keys).hit_blocks == 1
        # each from the shared index, but for a probe that raced a change in the daemon (it then asks
        # the daemon, as a loaded CI machine makes a few do): at least half, as bench/peer_mooncake.py checks
        assert 20 <= c.shared_lookups <= 40


@pytest.mark.parametrize("write_behind", [False, True], ids=["commit", "write-behind"])
def test_a_full_answer_does_not_wait_for_commits_in_flight(uds_daemon, write_behind):
    """Read-your-writes costs a wait only when a probe comes back short: a
    prefix already all there is answered (looked up, read) while the
    client's own Commit (or write-behind put) of other blocks is still
    unanswered; a probe of the blocks being committed sees them (waiting
    for the Commit when it has not landed yet)."""
    sent = "Put" if write_behind else "Commit"
    with Client(uds_daemon.target, write_behind=write_behind) as c:
        ns = _ns()
        a = _fill(c, ns, 4)
        assert c.lookup(ns, a).hit_blocks == 4  # (asks the namespace's id: a call, which settles)
        b = block_keys(ns, np.arange(16 * 3, dtype=np.uint32) + np.uint32(5000))
        assert c.put(ns, b, [np.ones(BS, np.uint8)] * 3) == [KeyStatus.OK] * 3
        assert sent in c._fast.owed
        own = c._own_commits
        waits: list[bool] = []
        c._own_commits = lambda: waits.append(True) or own()  # the read-your-writes wait, counted
        assert c.lookup(ns, a).hit_blocks == 4
        outs = [np.full(BS, 9, np.uint8) for _ in a]
        assert c.get_into(ns, a, outs) == [KeyStatus.OK] * 4 and not any(o.any() for o in outs)
        # neither waited for it. (Not "the Commit is still owed": a probe that races the daemon's
        # change to the index 4 times asks the daemon, a call that reads the owed answers first;
        # on a loaded machine that happens.)
        assert waits == []
        del c._own_commits
        assert c.lookup(ns, b).hit_blocks == 3  # (waited for the Commit unless it had landed already)
        outs = [np.zeros(BS, np.uint8) for _ in b]
        c.put(ns, b[:1] + [b"\x07" * 16], [np.ones(BS, np.uint8)] * 2)  # b[0] EXISTS; one new block in flight
        assert c.get_into(ns, b, outs) == [KeyStatus.OK] * 3 and all(o.all() for o in outs)
        assert c.shared_reads == 2


def test_shared_index_tallies_count_like_daemon_lookups(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = _fill(c, ns, 10)
        st0 = c.stats()
        before = (st0.lookups, st0.hit_blocks)
        counters = uds_daemon.store.counters
        blocks0 = counters.lookup_blocks
        for n in (1, 5, 10):
            assert c.lookup(ns, keys[:n] + [b"\x01" * 16]).hit_blocks == n
        assert c.shared_lookups == 3
        st = c.stats()  # a gRPC call: the pending tally goes first
        assert (st.lookups, st.hit_blocks) == (before[0] + 3, before[1] + 16)
        assert counters.lookup_blocks - blocks0 == 19
        nid = uds_daemon.call(uds_daemon.store.namespace_id, ns, False)
        assert uds_daemon.call(uds_daemon.store.ns_registry.lookups, nid)[0] >= 3


def test_tallies_only_for_namespaces_the_session_was_told(uds_daemon):
    from kvstore.wire.frames import tally_frame
    from kvstore.wire.shared_index import TALLY

    with Client(uds_daemon.target) as c:
        _fill(c, _ns(), 2)
        before = uds_daemon.store.counters.lookups
        raw = LookupSocketClient(uds_daemon.running.fast.path, c.session)
        try:
            raw.send_frame("Tally", tally_frame(TALLY.pack(0, 100, 100, 100, 0, 100, 0)))  # never asked nsid
            raw.flush()
            assert raw.late_errors == 1
            nid = raw.nsid(ns_pb(_ns()).SerializeToString(deterministic=True))
            raw.send_frame("Tally", tally_frame(TALLY.pack(nid, 2, 4, 9, 0, 9, 0)))  # more hits than blocks
            raw.send_frame("Tally", tally_frame(b"\x00" * 5))  # not whole records
            raw.flush()
            assert raw.late_errors == 3
            raw.send_frame("Tally", tally_frame(TALLY.pack(nid, 2, 4, 3, 0, 3, 0)))
            raw.flush()
            assert raw.late_errors == 3
        finally:
            raw.close()
        assert uds_daemon.store.counters.lookups - before == 2


def test_another_tenants_namespace_is_never_read_from_the_shared_index(make_daemon, tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n\n[[tenant]]\nname = "beta"\ntoken = "tok-beta"\n')
    d = make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"),
                    server__tenants_file=str(tenants))
    with Client(d.target, token="tok-acme") as a, Client(d.target, token="tok-beta") as b:
        keys = _fill(a, _ns("acme"), 4)
        assert a.lookup(_ns("acme"), keys).hit_blocks == 4
        with pytest.raises(PermissionDenied):
            b.lookup(_ns("acme"), keys)
        assert b.lookup(_ns("beta"), keys).hit_blocks == 0  # beta's own namespace: nothing there
        assert b._shared is not None and b.shared_lookups == 0


def test_shared_index_off_and_daemon_stop(make_daemon, tmp_path):
    d = make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"), server__shared_index=False)
    assert d.running.fast.shared is None
    with Client(d.target) as c:
        assert c._fast is not None and c._shared is None
        keys = _fill(c, _ns(), 3)
        assert c.lookup(_ns(), keys).hit_blocks == 3
    d2 = make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv2.sock"))
    path = d2.running.fast.shared.path
    c = Client(d2.target)
    try:
        keys = _fill(c, _ns(), 3)
        assert c.lookup(_ns(), keys).hit_blocks == 3
        shared = c._shared.reader
        d2.stop()
        assert shared.closed and not os.path.exists(path)  # readers stop; the files go
    finally:
        c.close()


def test_get_into_reads_dram_blocks_without_a_lease(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 6, dtype=np.uint32))
        data = [np.full(BS, i + 1, np.uint8) for i in range(6)]
        assert c.put(ns, keys, data) == [KeyStatus.OK] * 6
        c.flush()
        raw = uds_daemon.store.raw
        rows = uds_daemon.call(raw.index.find_committed, raw.namespace_id(ns, False),
                               np.frombuffer(b"".join(keys), "<u8").reshape(-1, 2))
        assert (rows >= 0).all()
        last0 = raw.index.last[rows].copy()  # (lru: recency is what it ranks with)
        gets0 = raw.counters.gets
        outs = [np.zeros(BS, np.uint8) for _ in range(7)]
        other = block_keys(ns, np.arange(16, dtype=np.uint32) + 99)
        assert c.get_into(ns, keys + other, outs) == [KeyStatus.OK] * 6 + [KeyStatus.MISS]
        assert c.shared_reads == 1 and all(np.array_equal(o, d) for o, d in zip(outs, data))
        assert not outs[6].any()
        assert uds_daemon.call(uds_daemon.store.stats).tiers[0].pinned_bytes == 0  # no lease was taken
        c.flush()  # the reads frame: counted as a get, the blocks as accessed (eviction sees the hit)
        assert raw.counters.gets == gets0 + 1 and raw.counters.get_hit_blocks >= 6
        assert (raw.index.last[rows] > last0).all()


def _moved(answer):
    """A probe's answer with every slot 4 KiB further on (as if the index changed)."""
    hit, clean, rows = answer
    return hit, clean, (np.frombuffer(rows, np.int64) + 4096).tobytes()


@pytest.mark.parametrize("into", ["buffers", "engine"])
def test_a_read_that_races_a_change_or_fails_its_checksum_takes_the_lease_path(uds_daemon, into):
    """``engine``: a ``ScatterSink`` (the one-call read straight from the
    slab, ``read_slots``); ``buffers``: one buffer per block."""
    from kvstore.client.sinks import LayerScatter

    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))
        data = [np.full(BS, i + 1, np.uint8) for i in range(3)]
        c.put(ns, keys, data)
        outs = [np.zeros(BS, np.uint8) for _ in keys]
        layer = np.zeros((4, BS), np.uint8)
        if into == "engine":
            lay = LayerScatter(BS, np.array([(0, BS, 0, 0, BS)], np.int64), [layer])
            outs = lay.sink([2, 0, 3])  # type: ignore[assignment]
            outs_of = lambda: [layer[2], layer[0], layer[3]]  # noqa: E731
        else:
            outs_of = lambda: outs  # noqa: E731
        # the index named other slots after the copy than before it: the bytes are not kept
        reader = c._shared.reader
        real = reader.raw_slots
        answers = iter([real, lambda nid, packed: _moved(real(nid, packed))])
        reader.raw_slots = lambda nid, packed: next(answers)(nid, packed)
        try:
            assert c.get_into(ns, keys, outs) == [KeyStatus.OK] * 3
        finally:
            reader.raw_slots = real
        assert c.shared_reads == 0 and all(np.array_equal(o, d) for o, d in zip(outs_of(), data))
        assert c.get_into(ns, keys, outs) == [KeyStatus.OK] * 3  # with no race: read from the shared index
        assert c.shared_reads == 1
        # a block whose bytes fail their checksum: the lease path answers CORRUPT and the daemon drops it
        raw = uds_daemon.store.raw
        row = int(raw.index.find_committed(raw.namespace_id(ns, False),
                                           np.frombuffer(keys[1], "<u8").reshape(1, 2))[0])
        uds_daemon.call(raw.dram.corrupt_for_test, raw.index.offset(row), 3)
        assert c.get_into(ns, keys, outs) == [KeyStatus.OK, KeyStatus.CORRUPT, KeyStatus.OK]
        assert c.shared_reads == 1
        assert c.lookup(ns, keys).hit_blocks == 1


def test_reads_frames_only_for_namespaces_the_session_was_told(uds_daemon):
    from kvstore.wire.frames import reads_frame

    with Client(uds_daemon.target) as c:
        keys = _fill(c, _ns(), 2)
        gets0 = uds_daemon.store.counters.gets
        raw = LookupSocketClient(uds_daemon.running.fast.path, c.session)
        try:
            raw.send_frame("Reads", reads_frame(0, 2, b"".join(keys)))
            raw.send_frame("Reads", reads_frame(0, 2, b"x" * 5))
            raw.flush()
            assert raw.late_errors == 2
            nid = raw.nsid(ns_pb(_ns()).SerializeToString(deterministic=True))
            raw.send_frame("Reads", reads_frame(nid, 2, b"".join(keys)))
            raw.flush()
            assert raw.late_errors == 2
        finally:
            raw.close()
        assert uds_daemon.store.counters.gets - gets0 == 1


# ---------------------------------------------- Reserve answered later
def test_reserve_later_answers_like_reserve_while_other_calls_run(uds_daemon):
    """``reserve_later`` sends its Reserve without waiting; a lookup and a put
    in between read their own answers, the reservation's answer is kept in
    order for ``result()``, and its slots commit like ``reserve``'s."""
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))
        pending = c.reserve_later(ns, keys, BS)
        assert c._fast.owed == ["Reserve"]
        other = block_keys(_ns("t"), np.arange(16 * 2, dtype=np.uint32) + 7)
        assert c.lookup(ns, keys).hit_blocks == 0  # answered in order, after the Reserve's answer is kept
        assert c.put(ns, other, [np.zeros(BS, np.uint8)] * 2) == [KeyStatus.OK] * 2
        resv = pending.result()
        assert pending.result() is resv  # read once
        assert resv.statuses == [KeyStatus.OK] * 3 and resv.reservation_id
        for i, (o, n) in enumerate(zip(resv.offsets, resv.lengths)):
            c.view(o, n)[:] = i + 1
        assert c.commit(resv) == [KeyStatus.OK] * 3
        got = c.get(ns, keys)
        assert [int(g[0]) for g in got] == [1, 2, 3]
        assert c._fast.kept == {} and c._fast.keep == set() and c._fast.late_errors == 0


def test_reserve_later_raises_the_daemons_error_from_result(uds_daemon):
    """A Reserve the daemon refuses raises from ``result()`` (not at a later
    call, and not counted as a late error); a parent that is not stored is a
    status, as with ``reserve``."""
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 2, dtype=np.uint32))
        bad = c.reserve_later(ns, keys, 0)  # block_bytes 0: InvalidArgument
        orphan = c.reserve_later(ns, keys[1:], BS, parent=keys[0])
        assert c.lookup(ns, keys).hit_blocks == 0
        with pytest.raises(InvalidArgument):
            bad.result()
        assert orphan.result().statuses == [KeyStatus.PARENT_MISSING]
        assert c._fast.late_errors == 0


def test_reserve_later_without_the_socket_is_a_plain_reserve(uds_daemon):
    with Client(uds_daemon.target, pipeline=False) as c:
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 2, dtype=np.uint32))
        pending = c.reserve_later(ns, keys, BS)
        assert c._fast.owed == []  # already answered
        resv = pending.result()
        assert c.commit(resv) == [KeyStatus.OK] * 2


def test_commit_without_waiting_runs_before_the_next_call(uds_daemon):
    """``commit(wait=False)`` sends the Commit without waiting and answers the
    reservation's statuses; the blocks are stored before the client's next
    call runs. A pipelined commit the daemon refuses (its reservation was
    aborted meanwhile) is counted, never raised, and stores nothing."""
    with Client(uds_daemon.target) as c, Client(uds_daemon.target) as other:
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))
        first = c.reserve(ns, keys[:1], BS)
        assert c.commit(first, wait=False) == [KeyStatus.OK]
        resv = c.reserve(ns, keys, BS)  # the Commit ran before this Reserve: block 0 exists
        assert resv.statuses == [KeyStatus.EXISTS, KeyStatus.OK, KeyStatus.OK]
        assert c.commit(resv, wait=False) == [KeyStatus.EXISTS, KeyStatus.OK, KeyStatus.OK]
        assert c._fast.owed == ["Commit"]
        c.flush()
        assert other.lookup(ns, keys).hit_blocks == 3
        gone = c.reserve(ns, block_keys(ns, np.arange(16 * 4, dtype=np.uint32) + 3)[3:], BS, parent=keys[2])
        with pytest.raises(PermissionDenied):  # (another session's reservation)
            other.abort(gone)
        c.abort(gone)
        assert c.commit(gone, wait=False) == [KeyStatus.OK]
        c.flush()
        assert c._fast.late_errors == 1
        assert uds_daemon.call(lambda: uds_daemon.store.stats().reservations) == 0


def test_an_unknown_frame_type_is_refused_not_answered_as_a_lookup(uds_daemon):
    """Two-byte marks from ``MAX_NS_WIRE`` up are frame types; one this daemon
    does not know gets INVALID_ARGUMENT, never a lookup's OK answer."""
    with Client(uds_daemon.target) as c:
        wire = ns_pb(_ns()).SerializeToString(deterministic=True)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(uds_daemon.running.fast.path)
        try:
            sid = c.session.encode()
            s.sendall(struct.pack("<I", len(sid)) + sid)
            n = struct.unpack("<I", s.recv(4))[0]
            assert s.recv(n)[:1] == b"\x00"
            body = b"\xff\xf0" + wire  # (a namespace message after an unknown mark)
            s.sendall(struct.pack("<I", len(body)) + body)
            head = s.recv(5)
            assert head[4] == 3  # INVALID_ARGUMENT
            rest = struct.unpack("<I", head[:4])[0] - 1
            got = b""
            while len(got) < rest:
                got += s.recv(rest - len(got))
            assert b"unknown frame type" in got
        finally:
            s.close()


def test_a_client_of_another_socket_version_is_refused_and_goes_over_grpc(uds_daemon, monkeypatch):
    """Mid-upgrade: a client whose hello names a socket version the daemon does
    not speak is refused (counted), and its calls go over gRPC with the same answers."""
    from kvstore.client import socket as client_socket
    from kvstore.wire import frames

    with Client(uds_daemon.target) as plain:
        ns = _ns()
        keys = _fill(plain, ns, 4)
    monkeypatch.setattr(client_socket.frames, "hello_frame",
                        lambda session, token=None: frames.frame(b"kvs/2 " + session.encode()))
    with Client(uds_daemon.target) as c:
        assert c._fast is None
        r = c.lookup(ns, keys)
        assert r.hit_blocks == 4
    text = uds_daemon.daemon.metrics.render().decode()
    assert 'kvstore_rpc_rejected_total{code="FAILED_PRECONDITION",method="SocketHello"} 1.0' in text
