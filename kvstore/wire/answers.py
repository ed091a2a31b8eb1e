"""Protobuf answers -> typed results (what the clients return): lookups,
stats, events, cluster lookups and admin answers. Pure functions, no I/O;
the inverse direction of the daemon's ``kvstore.wire.convert``."""

from __future__ import annotations

from typing import Any

from kvstore.results import (BlockLocation, ChainDecisionKind, ClusterLookup, DaemonStats, DropReason, Event, EventKind, HbmRegion,
                             LookupResult, NamespaceStats, PolicyChange, ResizeResult, TierStats)
from kvstore.wire.convert import REASONS, tier_codes_from_pb, tier_from_pb
from proto import kvstore_pb2 as pb
from tiers.base import TierKind

DECISIONS: dict[int, ChainDecisionKind] = {pb.CHAIN_DECISION_LOCAL: ChainDecisionKind.LOCAL, pb.CHAIN_DECISION_FETCH: ChainDecisionKind.FETCH,
             pb.CHAIN_DECISION_RECOMPUTE: ChainDecisionKind.RECOMPUTE}


def lookup_from_pb(r: pb.LookupResponse) -> LookupResult:
    return LookupResult(int(r.hit_blocks), tier_codes_from_pb(r.tiers_packed if r.tiers_packed else r.tiers))


def lookup_from_values(hit_blocks: int, tier_values: bytes) -> LookupResult:
    """The same-host socket's answer: one wire Tier byte per hit block."""
    return LookupResult(hit_blocks, tier_codes_from_pb(tier_values))


def cluster_lookup_from_pb(r: pb.LookupResponse) -> ClusterLookup:
    return ClusterLookup(int(r.local_blocks), int(r.remote_blocks),
                         DECISIONS.get(int(r.decision), ChainDecisionKind.LOCAL),
                         float(r.fetch_s), float(r.recompute_s),
                         [BlockLocation(tier_from_pb(x.tier), x.peer, float(x.load_s)) for x in r.locations],
                         r.cluster_status)


def _tier_stats(t: pb.TierStats) -> TierStats:
    kind = tier_from_pb(t.tier)
    return TierStats(tier=kind if kind is not None else TierKind.DRAM, capacity_bytes=t.capacity_bytes,
                     used_bytes=t.used_bytes, blocks=t.blocks, pinned_bytes=t.pinned_bytes, evictions=t.evictions,
                     promotions=t.promotions, demotions=t.demotions, hits=t.hits,
                     disk_bytes=t.disk_bytes)


def stats_from_pb(r: pb.StatsResponse) -> DaemonStats:
    return DaemonStats(
        tiers=[_tier_stats(t) for t in r.tiers],
        namespaces=[NamespaceStats(label=n.namespace_label, tenant="", digest=n.ns_digest, lookups=n.lookups,
                                   queried_blocks=n.queried_blocks, hit_blocks=n.hit_blocks, blocks=n.blocks)
                    for n in r.namespaces],
        lookups=r.lookups, hit_blocks=r.hit_blocks, miss_blocks=r.miss_blocks, hit_tokens=r.hit_tokens,
        miss_tokens=r.miss_tokens, puts=r.puts, gets=r.gets, bytes_written=r.bytes_written,
        bytes_read=r.bytes_read, bytes_promoted=r.bytes_promoted, bytes_demoted=r.bytes_demoted,
        checksum_failures=r.checksum_failures, active_reservations=r.active_reservations,
        active_leases=r.active_leases, reservations_expired=r.reservations_expired,
        leases_expired=r.leases_expired, sessions=r.sessions, uptime_seconds=r.uptime_seconds,
        admitted=r.admitted, admitted_degraded=r.admitted_degraded, rejected=r.rejected,
        prefill_tokens_per_s=r.prefill_tokens_per_s, ttft_error_ewma_s=r.ttft_error_ewma_s,
        cluster_members=r.cluster_members, cluster_status=r.cluster_status, tenant=r.tenant)


def event_from_pb(ev: pb.Event) -> Event:
    kind = ev.WhichOneof("kind")
    common: dict[str, Any] = {"seq": int(ev.seq), "time_unix_ns": int(ev.time_unix_ns), "run_id": int(ev.run_id)}
    if kind == "stored":
        s = ev.stored
        return Event(EventKind.STORED, s.ns_digest, list(s.keys), tier_from_pb(s.tier), parent=s.parent or None,
                     **common)
    if kind == "removed":
        m = ev.removed
        return Event(EventKind.REMOVED, m.ns_digest, list(m.keys), tier_from_pb(m.tier),
                     reason=REASONS.get(int(m.reason), DropReason.NONE), **common)
    if kind == "cleared":
        return Event(EventKind.CLEARED, ev.cleared.ns_digest, [], all_namespaces=ev.cleared.all_namespaces,
                     **common)
    return Event(EventKind.GAP, b"", [], first_available_seq=int(ev.gap.first_available_seq), **common)


def hbm_region_from_pb(m: pb.DeviceMemInfo) -> HbmRegion:
    return HbmRegion(device=int(m.device), ipc_handle=bytes(m.ipc_handle), size_bytes=int(m.size_bytes),
                     base_offset=int(m.base_offset), ipc=bool(m.ipc), slab_id=m.slab_id, device_name=m.device_name)


def resize_from_pb(r: pb.ResizeTierResponse) -> ResizeResult:
    return ResizeResult(int(r.old_capacity_bytes), int(r.new_capacity_bytes), int(r.evicted_blocks))


def policy_from_pb(r: pb.SetEvictionPolicyResponse) -> PolicyChange:
    return PolicyChange(r.old_policy, r.new_policy)

