"""Unread answers on the same-host socket (kvstore/daemon/socket_server.py,
kvstore/client/socket.py): a client that sends frames and never reads the
answers holds a bounded backlog in the daemon (it stops reading that
connection), the daemon serves the others meanwhile, and the client
library, which may pipeline more answers than that backlog, reads them
while it sends and never waits for ever."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from kvstore.client import Client, ns_pb
from kvstore.client.socket import MAX_OWED, LookupSocketClient
from kvstore.daemon.socket_server import OUT_LIMIT
from kvstore.keys import Namespace, block_keys
from kvstore.wire import frames
from kvstore.wire.frames import MAX_FRAME
from tests.support.waits import wait_until

STAGE = frames.stage_frame()  # 6 bytes, answered with ~70 (its staging file's path): answers outgrow requests


@pytest.fixture
def uds_daemon(make_daemon, tmp_path):
    return make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"))


def _send_quietly(s: socket.socket, data: bytes) -> None:
    try:
        s.sendall(data)
    except OSError:
        pass  # (shut down by the test)


def test_a_client_that_never_reads_its_answers_holds_a_bounded_backlog(uds_daemon):
    d, server = uds_daemon, uds_daemon.running.fast
    ns = Namespace(tenant="t", model_id="m", block_size=16)
    keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))
    with Client(d.target) as c:
        c.put(ns, keys, [np.zeros(4096, np.uint8)] * 3)
        c.flush()
        before, staged = d.call(lambda: (set(server.conns), server.staged))
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(server.path)
        s.sendall(frames.hello_frame(c.session))
        assert s.recv(4096)[4] == frames.OK
        conn = d.call(lambda: (set(server.conns) - before).pop())
        flood = STAGE * 400_000  # 2.4 MB of frames, ~28 MB of answers if all were answered
        sender = threading.Thread(target=_send_quietly, args=(s, flood), daemon=True)
        sender.start()
        try:
            wait_until(lambda: not sender.is_alive() or d.call(lambda: conn.read_paused), 60, "the flood to stop")
            held = d.call(lambda: conn.transport.get_write_buffer_size() + len(conn.buf))
            assert held <= OUT_LIMIT + 2 * MAX_FRAME  # (was every answer: ~28 MB)
            assert sender.is_alive()  # the rest waits in its socket
            other = LookupSocketClient(server.path, c.session)  # the daemon serves other connections meanwhile
            try:
                assert other.lookup(ns_pb(ns).SerializeToString(deterministic=True), b"".join(keys))[0] == 3
            finally:
                other.close()
        finally:
            s.shutdown(socket.SHUT_RDWR)
            s.close()
        sender.join(30)
        wait_until(lambda: d.call(lambda: conn not in server.conns and server.staged == staged), 30,
                   "the connection and its staging file to go")


def _pipeline(fast: LookupSocketClient, n: int, batch: bool) -> None:
    if batch:
        fast.send_frames("Stage", [STAGE] * n)
    else:
        for _ in range(n):
            fast.send_frame("Stage", STAGE)
    fast.flush()


@pytest.mark.parametrize("n, batch", [(MAX_OWED, False), (MAX_OWED + 1, False), (200_000, True)])
def test_the_client_library_pipelining_never_waits_for_ever(uds_daemon, n, batch):
    """``send_frames`` (the reads and tally frames a busy reader queued) may
    owe far more answers than the daemon holds for it (200,000 x ~70 bytes):
    the library reads them while it sends."""
    with Client(uds_daemon.target) as c:
        fast = LookupSocketClient(uds_daemon.running.fast.path, c.session)
        try:
            t = threading.Thread(target=_pipeline, args=(fast, n, batch), daemon=True)
            t.start()
            t.join(120)  # (fails only on a hang)
            assert not t.is_alive(), "the client waits on a daemon that stopped reading it"
            assert fast.settled == fast.sent == n and fast.late_errors == 0 and not fast.buf
            assert fast.nsid(ns_pb(Namespace(tenant="t", model_id="m", block_size=16))
                             .SerializeToString(deterministic=True)) >= 0  # still in step
        finally:
            fast.close()
