"""PrefixRouter follows two real daemons' WatchEvents streams and ranks
endpoints by the leading blocks of a prompt each holds."""

from __future__ import annotations

import numpy as np

from engine_adapter.router import PrefixRouter
from kvstore.client import Client
from kvstore.keys import Namespace, block_keys

NS = Namespace(tenant="default", model_id="m", block_size=4)
TOKENS = np.arange(40, dtype=np.int64)  # 10 blocks


def _put(c: Client, n: int) -> list[bytes]:
    keys = block_keys(NS, TOKENS)[:n]
    c.put(NS, keys, [bytes([i]) * 64 for i in range(n)])
    return keys


def test_router_ranks_endpoints_from_watch_events(make_daemon) -> None:
    a, b = make_daemon(), make_daemon()
    r = PrefixRouter()
    with Client(a.target) as ca, Client(b.target) as cb:
        keys = _put(ca, 6)
        _put(cb, 3)
        assert r.poll("a", ca, 0.3) >= 1 and r.poll("b", cb, 0.3) >= 1
        assert [(h.endpoint, h.blocks) for h in r.rank(NS, TOKENS)] == [("a", 6), ("b", 3)]
        other = Namespace(tenant="default", model_id="other", block_size=4)
        assert r.rank(other, TOKENS) == []  # another namespace's keys differ
        # a removal in the middle of a's chain cuts a's prefix there
        ca.remove(NS, [keys[2]])
        r.poll("a", ca, 0.3)
        assert [(h.endpoint, h.blocks) for h in r.rank(NS, TOKENS)] == [("b", 3), ("a", 2)]
        # clearing b's namespace forgets every block of b
        cb.clear(NS)
        r.poll("b", cb, 0.3)
        assert [(h.endpoint, h.blocks) for h in r.rank(NS, TOKENS)] == [("a", 2)]
        assert r.known_blocks("b") == 0
        # a router that lost track (a sequence the daemon never issued) is told
        # so with a Gap, forgets a's blocks and refills from a full replay
        r.seq["a"] = 10**9
        r.poll("a", ca, 0.3)
        assert r.gaps["a"] == 1
        assert [(h.endpoint, h.blocks) for h in r.rank(NS, TOKENS)] == [("a", 2)]
        assert r.known_blocks("a") == 2  # (removing block 2 removed its descendants too)
