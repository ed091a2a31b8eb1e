"""The same-host socket's faults as the client library sees them: a call
that times out leaves the stream out of step (its answer comes later), so
the socket must be dropped, never read again as if the next answer were
the next call's."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import KeyStatus, KVStoreError
from kvstore.keys import Namespace, block_keys

BS = 4096


@pytest.fixture
def uds_daemon(make_daemon, tmp_path):
    return make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"))


class _LateOnce:
    """A socket whose next ``recv`` times out although the daemon answers
    (as when its answer comes just after the client's deadline)."""

    def __init__(self, sock):
        self.sock, self.late = sock, True

    def recv(self, n):
        if self.late:
            self.late = False
            raise TimeoutError("timed out")
        return self.sock.recv(n)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _stored(d) -> tuple[Namespace, list[bytes], list[np.ndarray]]:
    ns = Namespace(tenant="t", model_id="m", block_size=16)
    keys = block_keys(ns, np.arange(16 * 2, dtype=np.uint32))
    data = [np.full(BS, 1, np.uint8), np.full(BS, 2, np.uint8)]
    with Client(d.target) as w:
        assert w.put(ns, keys, data) == [KeyStatus.OK] * 2
        w.flush()
    return ns, keys, data


@pytest.mark.parametrize("first", ["get_into", "lookup", "put"])
def test_a_socket_read_that_times_out_drops_the_socket(uds_daemon, first):
    """The first use of a namespace asks the daemon for its id (an nsid
    frame), the first put for a staging file (a stage frame); when that
    read times out, the answer still comes, and a socket kept open would
    hand it to the next call (an Acquire or Reserve parsed from it, then
    every answer one call late: another get's lease)."""
    ns, keys, data = _stored(uds_daemon)
    with Client(uds_daemon.target) as c:
        assert c._shared is not None
        c._fast.sock = _LateOnce(c._fast.sock)
        try:
            if first == "get_into":
                out = np.zeros(BS, np.uint8)
                st = c.get_into(ns, keys[:1], [out])
                assert st != [KeyStatus.OK] or np.array_equal(out, data[0])
            elif first == "lookup":
                assert c.lookup(ns, keys).hit_blocks in (0, 2)
            else:
                assert c.put(ns, keys, data) in ([KeyStatus.EXISTS] * 2, [KeyStatus.OK] * 2)
        except KVStoreError:
            pass  # (a documented error type: the adapters serve it as a miss)
        for _ in range(3):  # every later answer is this call's own
            outs = [np.zeros(BS, np.uint8)]
            st = c.get_into(ns, keys[1:], outs)
            assert st == [KeyStatus.OK] and np.array_equal(outs[0], data[1])
            outs = [np.zeros(BS, np.uint8)]
            st = c.get_into(ns, keys[:1], outs)
            assert st == [KeyStatus.OK] and np.array_equal(outs[0], data[0])
            assert c.lookup(ns, keys).hit_blocks == 2
