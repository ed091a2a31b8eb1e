"""The fetch hint of a cluster load (``ClusterLookup.hint``): the run a
cluster Lookup found at a peer, counted in each load's own keys, which the
vLLM connector passes to its worker's ``Acquire(cluster=True)`` so that the
daemon does not locate the run again."""

from __future__ import annotations

from kvstore.results import BlockLocation, ChainDecisionKind, ClusterLookup
from tiers.base import TierKind


def looked(local: int, remote: int, peer: str = "node-a") -> ClusterLookup:
    locs = [BlockLocation(TierKind.DRAM, "", 0.0)] * local + [BlockLocation(None, peer, 1e-3)] * remote
    return ClusterLookup(local, remote, ChainDecisionKind.FETCH, 1e-3, 1.0, locs, "ok")


def test_the_hint_is_the_lookups_run_in_the_loads_own_keys():
    cl = looked(3, 5)  # blocks 0-2 local, 3-7 at node-a
    assert cl.hint() == ("node-a", 3, 5)
    assert cl.hint(0, 8) == ("node-a", 3, 5)
    assert cl.hint(2, 8) == ("node-a", 1, 5)  # vLLM had blocks 0-1: the load starts at 2
    assert cl.hint(4, 8) == ("node-a", 0, 4)  # ... or inside the run
    assert cl.hint(0, 6) == ("node-a", 3, 3)  # a load that stops inside the run
    assert cl.hint(8, 10) == ("", 0, 0)  # past the run: nothing to fetch
    assert cl.hint(0, 3) == ("", 0, 0)  # before it
    assert looked(3, 0).hint() == ("", 0, 0)  # no run
    assert looked(3, 5, peer="").hint() == ("", 0, 0)  # no peer named
