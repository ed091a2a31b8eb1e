"""A client that holds its shared-index counts (``Client(hold_counts=True)``):
reads and lookups served from the daemon's shared index send nothing
themselves, even when their counts are due; ``send_counts`` sends them (the
vLLM worker does so after the forward, not in the middle of a load)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.client import shared as shared_mod
from kvstore.errors import KeyStatus
from kvstore.keys import Namespace, block_keys

BS = 4096


@pytest.fixture
def uds_daemon(make_daemon, tmp_path):
    return make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"))


@pytest.mark.parametrize("hold", [False, True])
def test_held_counts_are_sent_only_by_send_counts(uds_daemon, monkeypatch, hold):
    monkeypatch.setattr(shared_mod, "TALLY_SECONDS", 0.0)  # every count is due at once
    ns = Namespace(tenant="t", model_id="m", block_size=16)
    keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))
    counters = uds_daemon.store.counters
    with Client(uds_daemon.target, hold_counts=hold) as c:
        assert c.put(ns, keys, [np.full(BS, 7, np.uint8)] * 3) == [KeyStatus.OK] * 3
        c.flush()
        gets0 = counters.gets
        outs = [np.zeros(BS, np.uint8) for _ in range(3)]
        for _ in range(3):
            assert c.get_into(ns, keys, outs) == [KeyStatus.OK] * 3
        assert c.lookup(ns, keys).hit_blocks == 3
        assert c.shared_reads == 3 and c.shared_lookups == 1
        # held: the three reads and the lookup wait for send_counts; else each went when due
        assert c.tally_pending == (4 if hold else 0)
        c.send_counts()
        assert c.tally_pending == 0
        c.flush()
        assert counters.gets == gets0 + 3
        c.send_counts()  # nothing owed: sends nothing
        assert c.tally_pending == 0


def test_prepare_reads_asks_for_the_namespace_id_before_the_first_read(uds_daemon, monkeypatch):
    """``prepare_reads``: the namespace's id asked (and the shared index
    mapped) ahead, so the first ``get_into`` makes no round trip."""
    from kvstore.client.socket import LookupSocketClient

    ns = Namespace(tenant="t", model_id="m", block_size=16)
    keys = block_keys(ns, np.arange(16 * 2, dtype=np.uint32))
    with Client(uds_daemon.target) as w:
        assert w.put(ns, keys, [np.full(BS, 3, np.uint8)] * 2) == [KeyStatus.OK] * 2
        w.flush()
    with Client(uds_daemon.target) as c:
        assert c.prepare_reads(ns) is True
        assert c.prepare_reads(Namespace(tenant="t", model_id="other", block_size=16)) is False  # no id yet
        asked: list[bytes] = []
        real = LookupSocketClient.nsid
        monkeypatch.setattr(LookupSocketClient, "nsid", lambda self, wire: asked.append(wire) or real(self, wire))
        outs = [np.zeros(BS, np.uint8) for _ in range(2)]
        assert c.get_into(ns, keys, outs) == [KeyStatus.OK] * 2
        assert c.shared_reads == 1 and asked == [] and all((o == 3).all() for o in outs)
    with Client(uds_daemon.target, shared_index=False) as c:
        assert c.prepare_reads(ns) is False  # no shared index: nothing to prepare
