"""The synchronous client's plain gRPC calls: cluster lookups, statistics,
removal, events and administration (``kvstore.client.sync.Client``
extends ``ControlCalls``; the shared-memory path's calls stay there)."""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence, cast

import grpc

from kvstore.buffers import pack_keys
from kvstore.client.base import ClientBase
from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.keys import Namespace
from kvstore.results import ClusterLookup, DaemonStats, Event, PolicyChange, ResizeResult
from kvstore.wire.answers import cluster_lookup_from_pb, event_from_pb, policy_from_pb, resize_from_pb, stats_from_pb
from kvstore.wire.convert import ns_pb
from kvstore.wire.frames import UNKNOWN_METHOD
from kvstore.wire.status import error_from_rpc
from proto import kvstore_pb2 as pb
from tiers.base import TierKind

__all__ = ["ControlCalls"]

log = logging.getLogger("kvstore.client")


class ControlCalls(ClientBase):
    """Calls that go over gRPC whatever the host (``Client`` provides
    ``stub``, ``admin`` and ``_call``)."""

    stub: Any
    admin: Any

    lookup_over_socket = True
    """Whether ``cluster_lookup`` goes over the same-host socket when there is
    one (off once a daemon from before the socket carried it said no)."""

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        raise NotImplementedError  # (Client: the gRPC call, after this client's pipelined ones)

    def _unary(self, name: str, request: Any) -> Any:
        raise NotImplementedError  # (Client: over the same-host socket when there is one, else gRPC)

    def cluster_lookup(self, ns: Namespace, keys: Sequence[bytes] | bytes, to_hbm: bool = False) -> "ClusterLookup":
        """Lookup in cluster mode (docs/cluster.md): where each block is and
        whether to fetch or recompute what peers hold. Over the same-host
        socket when there is one (the daemon answers it as the gRPC call),
        else, or when the daemon does not know it there, over gRPC."""
        req = pb.LookupRequest(ns=ns_pb(ns), keys_packed=pack_keys(keys, check=True), cluster=True, to_hbm=to_hbm)
        if self.lookup_over_socket:
            try:
                return cluster_lookup_from_pb(self._unary("Lookup", req))
            except InvalidArgument as e:
                if UNKNOWN_METHOD not in str(e):
                    raise
                self.lookup_over_socket = False  # an older daemon: gRPC from now on
                log.info("the daemon's same-host socket does not carry Lookup: cluster lookups go over gRPC")
        return cluster_lookup_from_pb(self._call(self.stub.Lookup, req))

    def stats(self, include_namespaces: bool = True) -> DaemonStats:
        r = self._call(self.stub.Stats, pb.StatsRequest(include_namespaces=include_namespaces))
        return stats_from_pb(r)

    def remove(self, ns: Namespace, keys: Sequence[bytes]) -> list[KeyStatus]:
        return self._statuses(self._call(self.stub.Remove, pb.RemoveRequest(ns=ns_pb(ns), keys=list(keys))).results)

    def report_corrupt(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Tell the daemon these blocks failed their checksum on our side."""
        return int(self._call(self.stub.ReportCorrupt, pb.ReportCorruptRequest(ns=ns_pb(ns), keys=list(keys))).dropped)

    def clear(self, ns: Namespace | None = None) -> int:
        req = pb.ClearRequest(ns=ns_pb(ns)) if ns is not None else pb.ClearRequest(all_namespaces=True)
        return int(self._call(self.stub.Clear, req).removed)

    def watch_events(self, after_seq: int = 0, ns: Namespace | None = None,
                     timeout: float | None = None, run_id: int = 0) -> Iterator[Event]:
        """The daemon's events after ``after_seq`` (a GAP event first when some
        were lost, or when ``run_id``, the run ``after_seq`` came from, is not
        the daemon's now), until ``timeout`` seconds pass (None: for ever)."""
        req = pb.WatchRequest(after_seq=after_seq, run_id=run_id)
        if ns is not None:
            req.ns.CopyFrom(ns_pb(ns))
        try:
            for ev in self.stub.WatchEvents(req, metadata=self._md(), timeout=timeout):
                yield event_from_pb(ev)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            raise error_from_rpc(e) from None

    def admin_get_config(self) -> str:
        return str(self._call(self.admin.GetConfig, pb.GetConfigRequest()).toml)

    def admin_resize(self, tier: str, capacity_bytes: int) -> ResizeResult:
        r = self._call(self.admin.ResizeTier, pb.ResizeTierRequest(
            tier=cast(Any, int(TierKind.parse(tier)) + 1), capacity_bytes=capacity_bytes))
        return resize_from_pb(r)

    def admin_set_policy(self, name: str) -> PolicyChange:
        r = self._call(self.admin.SetEvictionPolicy, pb.SetEvictionPolicyRequest(policy=name))
        return policy_from_pb(r)
