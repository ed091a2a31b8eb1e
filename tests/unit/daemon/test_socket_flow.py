"""Flow control of the same-host socket's connections
(kvstore/daemon/socket_server.py): what a client sends behind a call that
waits is bounded in the daemon's memory. A stand-in daemon and transport;
no loop."""

from __future__ import annotations

from types import SimpleNamespace

import grpc

from kvstore.daemon.socket_server import _Connection
from kvstore.wire import frames
from kvstore.wire.frames import MAX_FRAME


class _Transport:
    def __init__(self) -> None:
        self.reading = True
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        pass


def _connection() -> tuple[_Connection, _Transport]:
    server = SimpleNamespace(daemon=SimpleNamespace(sessions={"s-1": "t"}), conns=set(), shared=None, staged=0)
    conn = _Connection(server)  # type: ignore[arg-type]
    t = _Transport()
    conn.connection_made(t)  # type: ignore[arg-type]
    conn.data_received(frames.hello_frame("s-1"))
    assert conn.lookups is not None and t.reading
    return conn, t


class _Waiting:
    """A call still running (its frames behind it wait)."""


def test_frames_sent_behind_a_waiting_call_stop_being_read_at_a_frame_s_worth():
    conn, t = _connection()
    conn.waiting = _Waiting()  # type: ignore[assignment]
    chunk = frames.tally_frame(b"x" * 65535)  # (refused when its turn comes, without the daemon)
    for _ in range(MAX_FRAME // len(chunk) + 1):
        conn.data_received(chunk)
    assert not t.reading  # the rest stays in the client's socket
    assert len(conn.buf) < 2 * MAX_FRAME

    conn.resumed(SimpleNamespace(cancelled=lambda: False, exception=lambda: None, result=lambda: b"a"),  # type: ignore[arg-type]
                 lambda v: frames.frame(v))
    assert t.reading and conn.buf == b""  # the call done, the frames behind it answered, reading again


def test_a_hello_of_another_socket_version_is_refused_with_a_clear_error():
    """A client of a newer socket protocol is refused at its hello (it then
    goes over gRPC), not taken for an unknown session or served frames it reads otherwise."""
    rejected: list[tuple] = []
    daemon = SimpleNamespace(sessions={"s-1": "t"}, metrics=SimpleNamespace(rejected=lambda *a: rejected.append(a)))
    server = SimpleNamespace(daemon=daemon, conns=set(), shared=None, staged=0)
    conn = _Connection(server)  # type: ignore[arg-type]
    t = _Transport()
    conn.connection_made(t)  # type: ignore[arg-type]
    conn.data_received(frames.frame(b"kvs/2 s-1"))
    assert rejected == [("SocketHello", grpc.StatusCode.FAILED_PRECONDITION)]
    assert conn.lookups is None and conn.closing
    body = b"".join(t.out)[4:]
    assert body[0] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert b"socket protocol version 2" in body and b"speaks 1" in body
