"""The client's typed boundary: protobuf answers -> kvstore.results types
(kvstore.wire.answers), never a dict or a message."""

from __future__ import annotations

import numpy as np
from google.protobuf.json_format import MessageToDict

from kvstore.keys import Namespace
from kvstore.results import ChainDecisionKind, DaemonStats, LookupResult
from kvstore.wire.answers import (cluster_lookup_from_pb, lookup_from_pb, lookup_from_values, policy_from_pb,
                                  resize_from_pb, stats_from_pb)
from kvstore.wire.convert import ns_from_pb, ns_pb, tier_codes_from_pb, tier_from_pb, tier_name
from proto import kvstore_pb2 as pb
from tiers.base import TierKind


def _stats_msg() -> pb.StatsResponse:
    return pb.StatsResponse(
        tiers=[pb.TierStats(tier=pb.TIER_DRAM, capacity_bytes=1 << 30, used_bytes=256 << 20, blocks=4096,
                            pinned_bytes=1 << 20, evictions=12, hits=3),
               pb.TierStats(tier=pb.TIER_SSD, capacity_bytes=0, demotions=4)],
        lookups=10, hit_blocks=300, miss_blocks=100, puts=500, checksum_failures=2, uptime_seconds=3725.5,
        reservations_expired=4, leases_expired=5,
        prefill_tokens_per_s=1e4, cluster_members=2, cluster_status="ok",
        namespaces=[pb.NamespaceStats(namespace_label="acme/llama", ns_digest=b"\x01" * 16, lookups=8,
                                      hit_blocks=300, queried_blocks=320, blocks=4000)])


def test_lookup_results_are_one_type() -> None:
    a = lookup_from_pb(pb.LookupResponse(hit_blocks=2, tiers=[pb.TIER_DRAM, pb.TIER_SSD]))
    b = lookup_from_pb(pb.LookupResponse(hit_blocks=2, tiers_packed=bytes([2, 3])))
    c = lookup_from_values(2, bytes([2, 3]))
    assert isinstance(a, LookupResult) and a == b == c
    assert a.tiers == [TierKind.DRAM, TierKind.SSD] and a.hit_blocks == 2
    assert lookup_from_pb(pb.LookupResponse()).tiers == []
    assert a != lookup_from_values(2, bytes([2, 2]))


def test_stats_are_typed_and_keep_the_json_shape() -> None:
    msg = _stats_msg()
    st = stats_from_pb(msg)
    assert isinstance(st, DaemonStats)
    assert st.lookups == 10 and st.checksum_failures == 2 and st.cluster_status == "ok"
    assert (st.reservations_expired, st.leases_expired) == (4, 5)
    dram = st.tier(TierKind.DRAM)
    assert dram is not None and dram.blocks == 4096 and dram.hits == 3
    assert st.tier(TierKind.HBM) is None
    assert st.namespaces[0].label == "acme/llama" and st.namespaces[0].digest == b"\x01" * 16
    # the JSON a user saw before (``kvstore stats --json``) is unchanged
    want = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    assert st.to_dict() == want
    assert DaemonStats.from_dict(want) == st


def test_cluster_lookup_and_admin_answers() -> None:
    r = pb.LookupResponse(local_blocks=1, remote_blocks=2, decision=pb.CHAIN_DECISION_FETCH, fetch_s=0.1,
                          recompute_s=0.5, cluster_status="ok")
    r.locations.add(tier=pb.TIER_DRAM, load_s=0.01)
    r.locations.add(tier=pb.TIER_REMOTE, peer="n2", load_s=0.05)
    cl = cluster_lookup_from_pb(r)
    assert cl.decision is ChainDecisionKind.FETCH and cl.decision == "fetch"
    assert [(x.tier, x.peer) for x in cl.locations] == [(TierKind.DRAM, ""), (TierKind.REMOTE, "n2")]
    rz = resize_from_pb(pb.ResizeTierResponse(old_capacity_bytes=8, new_capacity_bytes=4, evicted_blocks=1))
    assert (rz.old_capacity_bytes, rz.new_capacity_bytes, rz.evicted_blocks) == (8, 4, 1)
    p = policy_from_pb(pb.SetEvictionPolicyResponse(old_policy="lru", new_policy="cost"))
    assert (p.old_policy, p.new_policy) == ("lru", "cost")


def test_tier_conversions() -> None:
    assert tier_from_pb(0) is None and tier_from_pb(pb.TIER_HBM) is TierKind.HBM
    assert tier_name(0) == "unspecified" and tier_name(pb.TIER_SSD) == "ssd"
    assert tier_codes_from_pb(b"").size == 0
    assert tier_codes_from_pb([pb.TIER_REMOTE]).tolist() == [int(TierKind.REMOTE)]
    assert tier_codes_from_pb(b"\x02").dtype == np.uint8


def test_ns_pb_round_trip() -> None:
    ns = Namespace(tenant="acme", model_id="m", block_size=16, tp_size=2, salt="s")
    assert ns_from_pb(ns_pb(ns), None) == ns
    assert ns_from_pb(ns_pb(ns), "acme") == ns
