"""Client-side pieces without a daemon: the shared buffer helpers
(kvstore.buffers), the request tier field, and the same-host socket client
(kvstore.client.socket) against a scripted peer speaking kvstore.wire.frames."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import threading
from typing import Callable

import grpc
import numpy as np
import pytest

from kvstore.buffers import as_u8, as_u8_writable, pack_keys, split_keys
from kvstore.client.base import tier_field
from kvstore.client.socket import LookupSocketClient
from kvstore.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from kvstore.wire import frames


def test_as_u8_views_without_copying() -> None:
    a = np.arange(4, dtype=np.uint32)
    v = as_u8(a)
    assert v.dtype == np.uint8 and v.size == 16 and np.shares_memory(v, a)
    assert as_u8(b"abc").tolist() == [97, 98, 99]
    buf = bytearray(4)
    as_u8_writable(buf)[:] = 7
    assert buf == b"\x07" * 4
    mv = memoryview(bytearray(8)).cast("I")
    as_u8_writable(mv)[0] = 1
    assert mv.obj[0] == 1  # type: ignore[index]
    m = np.zeros((4, 8), np.uint16)
    as_u8_writable(m[1:3])[:] = 255  # rows of a C-contiguous array: a view that writes through
    assert m[1:3].all() and not m[0].any() and not m[3].any()
    for strided in (np.zeros((4, 8), np.uint8)[:, :3], np.zeros(16, np.uint8)[::2]):
        with pytest.raises(InvalidArgument, match="C-contiguous"):  # a flat copy would swallow the bytes
            as_u8_writable(strided)


def test_pack_and_split_keys() -> None:
    keys = [bytes([i]) * 16 for i in range(3)]
    packed = pack_keys(keys, check=True)
    assert packed == b"".join(keys) and split_keys(packed) == keys
    assert pack_keys(packed) is packed
    assert pack_keys([]) == b""
    with pytest.raises(InvalidArgument, match="key 1 must be 16 bytes, got 3"):
        pack_keys([keys[0], b"abc"], check=True)


def test_tier_field() -> None:
    assert tier_field(None) == 0 and tier_field("hbm") == 1 and tier_field("dram") == 2
    with pytest.raises(InvalidArgument):
        tier_field("ssd")
    with pytest.raises(InvalidArgument):
        tier_field("tape")


def _peer(script: Callable[[socket.socket], None]) -> tuple[str, threading.Thread]:
    d = tempfile.mkdtemp()
    path = os.path.join(d, "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            script(conn)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return path, t


def _read(conn: socket.socket) -> bytes:
    (n,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
    return conn.recv(n, socket.MSG_WAITALL) if n else b""


def test_socket_client_speaks_the_frames() -> None:
    seen: list[bytes] = []

    def script(conn: socket.socket) -> None:
        seen.append(_read(conn))  # hello
        conn.sendall(frames.frame(b"\x00"))
        seen.append(_read(conn))  # lookup
        conn.sendall(frames.answer_frame(2, b"\x02\x03"))
        seen.append(_read(conn))  # call
        conn.sendall(frames.reply_frame(b"RESP"))
        seen.append(_read(conn))  # call answered with an error
        conn.sendall(frames.error_frame(grpc.StatusCode.PERMISSION_DENIED.value[0], "not yours"))
        _read(conn)
        conn.sendall(frames.frame(frames.HIT.pack(0, 3) + b"\x02"))  # malformed: 3 hits, 1 tier

    path, t = _peer(script)
    c = LookupSocketClient(path, "s-1", timeout=30, token="tok")
    try:
        assert c.lookup(b"NS", b"k" * 32) == (2, b"\x02\x03")
        assert c.call("Commit", b"REQ") == b"RESP"
        with pytest.raises(PermissionDenied, match="PERMISSION_DENIED: not yours"):
            c.call("Release", b"")
        with pytest.raises(ConnectionError, match="malformed"):  # (a broken socket: the client fails over)
            c.lookup(b"NS", b"")
    finally:
        c.close()
        t.join(30)
    assert frames.parse_hello(seen[0]) == ("s-1", "tok")
    assert frames.parse_lookup(seen[1]).keys == b"k" * 32
    assert frames.call_method(seen[2]) == "Commit" and seen[2][3:] == b"REQ"


def test_refused_hello_raises_the_status_class() -> None:
    def script(conn: socket.socket) -> None:
        _read(conn)
        conn.sendall(frames.error_frame(grpc.StatusCode.NOT_FOUND.value[0], "session 's-x' is unknown"))

    path, t = _peer(script)
    with pytest.raises(NotFound, match="NOT_FOUND: session"):
        LookupSocketClient(path, "s-x", timeout=30)
    t.join(30)


def test_a_closed_socket_is_an_os_error_not_an_answer() -> None:
    def script(conn: socket.socket) -> None:
        _read(conn)
        conn.sendall(frames.frame(b"\x00"))
        _read(conn)  # then hang up without answering

    path, t = _peer(script)
    c = LookupSocketClient(path, "s-1", timeout=30)
    with pytest.raises(ConnectionError):
        c.lookup(b"NS", b"")
    c.close()
    t.join(30)
    assert not issubclass(ConnectionError, Unavailable)


def test_own_writes_find_runs_of_one_put_in_flight_only():
    from kvstore.client.shared import OwnWrites

    own = OwnWrites(limit=2)
    buf = np.zeros(64, np.uint8)
    keys = b"".join(bytes([i]) * 16 for i in range(4))
    own.add(b"ns", keys, [0, 8, 16, 24], 8, [1, 2, 3, 2**64 - 1], buf, seq=1)
    live = {1}
    in_flight = live.__contains__
    run = own.find(b"ns", keys[16:48], in_flight)
    assert run is not None and run.buf is buf
    assert (run.offsets, run.sizes, run.sums) == ([8, 16], [8, 8], [2, 3])
    last = own.find(b"ns", keys[48:], in_flight)
    assert last is not None and last.sums == [2**64 - 1]  # the checksum as given: unsigned
    assert own.find(b"other", keys[:16], in_flight) is None
    assert own.find(b"ns", keys[8:24], in_flight) is None  # not on a key boundary
    assert own.find(b"ns", keys + b"\x09" * 16, in_flight) is None  # runs past the put
    live.clear()
    assert own.find(b"ns", keys[:16], in_flight) is None  # its answer was read: the daemon has it
    own.add(b"ns", b"\x05" * 16, [32], 8, [5], buf, seq=2)
    own.add(b"ns", b"\x06" * 16, [40], 8, [6], buf, seq=3)
    live.update({2, 3})
    assert own.find(b"ns", b"\x06" * 16, in_flight) is not None
    assert len(own.recent) == 2


def test_own_writes_keep_a_staged_puts_offsets_and_checksums_as_given():
    """A write-behind put records its ring offsets as a range and its
    checksums as the copy's uint64 array (no table built on the put's
    path); a read gets them as plain Python ints."""
    from kvstore.client.shared import OwnWrites

    own = OwnWrites()
    buf = np.zeros(64, np.uint8)
    keys = b"".join(bytes([i]) * 16 for i in range(3))
    sums = np.array([7, 2**63, 2**64 - 2], dtype=np.uint64)
    own.add(b"ns", keys, range(16, 40, 8), 8, sums, buf, seq=1)
    run = own.find(b"ns", keys[16:], {1}.__contains__)
    assert run is not None
    assert (run.offsets, run.sizes, run.sums) == ([24, 32], [8, 8], [2**63, 2**64 - 2])
    assert all(type(x) is int for x in run.offsets + run.sizes + run.sums)
    assert not run.quiet  # (nothing said about corked frames: the daemon may be landing it)
    quiet = own.find(b"ns", keys[16:], {1}.__contains__, {1}.__contains__)
    assert quiet is not None and quiet.quiet and quiet.offsets == [24, 32]  # its frame is still corked
    assert not own.find(b"ns", keys[16:], {1}.__contains__, set().__contains__).quiet  # type: ignore[union-attr]


def test_own_writes_say_whether_a_staged_put_is_still_held():
    """A put recorded as ``private`` (in the client's staging ring) comes
    back with ``held``: whether it is still in flight, asked when called (a
    read asks it after its copy); a put into the slab has none (its read is
    verified against the checksums)."""
    from kvstore.client.shared import OwnWrites

    own = OwnWrites()
    buf = np.zeros(64, np.uint8)
    live = {1, 2}
    own.add(b"ns", b"\x01" * 16, [0], 8, [1], buf, seq=1, private=True)
    own.add(b"ns", b"\x02" * 16, [8], 8, [2], buf, seq=2)
    ring = own.find(b"ns", b"\x01" * 16, live.__contains__)
    slab = own.find(b"ns", b"\x02" * 16, live.__contains__)
    assert ring is not None and ring.held is not None and ring.held()
    assert slab is not None and slab.held is None
    live.discard(1)  # its answer is read after the find: the ring may be written again
    assert not ring.held()


@pytest.mark.parametrize("answer, call", [
    (struct.pack("<I", 0), "lookup"),  # a frame with no status byte
    (struct.pack("<I", 0xFFFFFFFF), "lookup"),  # past any answer the daemon may send
    (frames.frame(b"\x00"), "lookup"),  # OK, but no hit count
    (frames.frame(b"\x00\x01"), "nsid"),
    (frames.frame(b"\x00"), "stage"),
])
def test_a_malformed_answer_is_a_broken_socket(answer: bytes, call: str) -> None:
    """The daemon's answer is checked before it is used: a malformed one
    closes the socket and raises ConnectionError (the client then goes over
    gRPC), never an IndexError or struct.error into the engine."""
    def script(conn: socket.socket) -> None:
        _read(conn)
        conn.sendall(frames.frame(b"\x00"))
        _read(conn)
        conn.sendall(answer)
        conn.recv(1)  # (until the client hangs up)

    path, t = _peer(script)
    c = LookupSocketClient(path, "s-1", timeout=30)
    try:
        with pytest.raises(ConnectionError, match="malformed"):
            if call == "lookup":
                c.lookup(b"NS", b"k" * 16)
            elif call == "nsid":
                c.nsid(b"NS")
            else:
                c.stage()
        assert c.sock.fileno() == -1  # closed: the stream is out of step
    finally:
        c.close()
        t.join(30)


class _Asked:
    """A socket that refuses a ``recv`` asking for more than ``most`` bytes."""

    def __init__(self, sock: socket.socket, most: int) -> None:
        self.sock, self.most = sock, most

    def recv(self, n: int) -> bytes:
        assert n <= self.most, f"recv of {n} bytes"
        return self.sock.recv(n)

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


def test_an_answer_is_read_as_it_arrives_not_by_its_stated_length() -> None:
    """A length the daemon states (here 2 GiB - 1, then a hang-up) is not
    allocated up front: the buffer grows with the bytes that arrive."""
    def script(conn: socket.socket) -> None:
        _read(conn)
        conn.sendall(frames.frame(b"\x00"))
        _read(conn)
        conn.sendall(struct.pack("<I", (1 << 31) - 1) + b"\x00" * 10)

    path, t = _peer(script)
    c = LookupSocketClient(path, "s-1", timeout=30)
    c.sock = _Asked(c.sock, 1 << 20)  # type: ignore[assignment]
    try:
        with pytest.raises(ConnectionError, match="closed"):
            c.lookup(b"NS", b"k" * 16)
    finally:
        c.close()
        t.join(30)


def test_a_close_from_another_thread_fails_a_blocked_write_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call whose write waits for room (the daemon reads nothing) while
    another thread closes the client fails at once with the broken-socket
    error (an OSError: the client fails over to gRPC), not a ValueError from
    ``select`` nor a wait for its whole timeout on a descriptor that may be
    another file's by then."""
    import kvstore.client.socket as mod

    hold = threading.Event()

    def script(conn: socket.socket) -> None:
        _read(conn)
        conn.sendall(frames.frame(b"\x00"))
        hold.wait(300)  # then read nothing

    path, t = _peer(script)
    c = LookupSocketClient(path, "s-1", timeout=300)
    waiting = threading.Event()
    real = mod.select.select

    def select(*a: object) -> object:
        waiting.set()
        return real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(mod.select, "select", select)
    got: list[BaseException] = []

    def call() -> None:
        try:
            c.call("Commit", b"x" * (16 << 20))
        except BaseException as e:  # noqa: BLE001 (what the caller sees)
            got.append(e)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    try:
        assert waiting.wait(60)
        c.close()
        caller.join(60)  # (only a hang fails this: the call waits 300 s if nothing wakes it)
        assert not caller.is_alive()
        assert len(got) == 1 and isinstance(got[0], OSError), got
    finally:
        hold.set()
        t.join(30)


def test_corked_frames_go_out_with_the_next_frame_in_order() -> None:
    """A frame sent with ``cork`` is numbered at once but written only with
    the client's next frame (corked ones first, in one write), and its answer
    is read in its turn; ``flush`` writes what is still corked before it
    waits. With a long ``cork_s`` the timer never writes them here."""
    seen: list[bytes] = []
    got = threading.Event()

    def script(conn: socket.socket) -> None:
        _read(conn)  # hello
        conn.sendall(frames.frame(b"\x00"))
        seen.append(conn.recv(1 << 16))  # the two corked frames and the lookup, in one write
        got.set()
        conn.sendall(frames.frame(b"\x00\x00") + frames.frame(b"\x00\x00") + frames.answer_frame(0, b""))
        seen.append(_read(conn))  # the third corked frame, written by flush
        conn.sendall(frames.frame(b"\x00\x00"))
        conn.recv(1)  # (until the client hangs up)

    path, t = _peer(script)
    c = LookupSocketClient(path, "s-1", timeout=30, cork_s=300.0)
    try:
        first = c.send_frame("Put", frames.frame(b"A" * 5), cork=True)
        second = c.send_frame("Put", frames.frame(b"B" * 6), cork=True)
        assert (first, second) == (1, 2) and c.owed == ["Put", "Put"]
        assert c.is_corked(first) and c.is_corked(second) and c.in_flight(second)
        assert not got.wait(0.2)  # nothing written yet
        assert c.lookup(b"NS", b"k" * 16) == (0, b"")
        assert seen[0].startswith(frames.frame(b"A" * 5) + frames.frame(b"B" * 6))
        assert len(seen[0]) > 2 * 4 + 11  # (the lookup frame follows them)
        assert not c.is_corked(second) and not c.in_flight(second) and c.owed == []
        third = c.send_frame("Put", frames.frame(b"C" * 7), cork=True)
        assert c.is_corked(third)
        c.flush()
        assert seen[1] == b"C" * 7 and not c.in_flight(third) and c.uncorked == 0
    finally:
        c.close()
        t.join(30)


def test_a_corked_frame_goes_out_on_its_own_after_cork_s() -> None:
    """No later frame: the timer thread writes the corked frame ``cork_s``
    after it was corked (and counts it); without ``cork_s`` a corked frame
    is written at once."""
    seen: list[bytes] = []
    wrote = threading.Event()

    def script(conn: socket.socket) -> None:
        _read(conn)  # hello
        conn.sendall(frames.frame(b"\x00"))
        seen.append(_read(conn))
        wrote.set()
        conn.sendall(frames.frame(b"\x00\x00"))
        conn.recv(1)  # (until the client hangs up)

    for cork_s in (0.05, 0.0):
        seen.clear()
        wrote.clear()
        path, t = _peer(script)
        c = LookupSocketClient(path, "s-1", timeout=30, cork_s=cork_s)
        try:
            seq = c.send_frame("Put", frames.frame(b"D" * 9), cork=True)
            assert c.is_corked(seq) == (cork_s > 0)
            assert wrote.wait(30) and seen == [b"D" * 9]
            c.flush()  # (under the lock the timer wrote it with: its count is in by then)
            assert not c.is_corked(seq) and c.uncorked == (1 if cork_s else 0)
            assert not c.in_flight(seq) and c.late_errors == 0
        finally:
            c.close()
            t.join(30)


def test_a_client_dropped_without_close_is_collected_and_its_timer_ends() -> None:
    """The timer thread holds the client only while it looks at it: a
    client dropped after corking (its frames flushed) is collected, and the
    thread ends."""
    import gc
    import weakref

    def script(conn: socket.socket) -> None:
        _read(conn)  # hello
        conn.sendall(frames.frame(b"\x00"))
        _read(conn)
        conn.sendall(frames.frame(b"\x00\x00"))
        conn.recv(1)  # (until the client hangs up)

    path, t = _peer(script)
    c = LookupSocketClient(path, "s-1", timeout=30, cork_s=0.01)
    c.send_frame("Put", frames.frame(b"E" * 3), cork=True)
    c.flush()
    timer = c._timer
    assert timer is not None and timer.is_alive()
    ref = weakref.ref(c)
    del c
    gc.collect()
    assert ref() is None
    timer.join(30)
    assert not timer.is_alive()
    t.join(30)
