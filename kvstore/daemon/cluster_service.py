"""The ``Cluster`` gRPC service: what peers ask of this daemon (its node
info, directory updates it owns, where blocks are; admin-only calls), and
``lookup_response``, Lookup's cluster-mode answer. The work is done by
``kvstore.daemon.peers.ClusterNode``."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.buffers import split_keys
from kvstore.daemon.auth import Principal
from kvstore.daemon.peers import ClusterNode, ClusterView
from kvstore.daemon.rpc import rpc
from kvstore.daemon.state import DaemonState
from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace
from kvstore.results import LookupResult
from kvstore.wire.convert import digest_of
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tiers.base import TierKind


class ClusterService(DaemonState, pb_grpc.ClusterServicer):
    """The Cluster servicer (peers' calls)."""

    # ----------------------------------------------------------- cluster
    @rpc("NodeInfo", admin=True)
    async def NodeInfo(self, request: pb.NodeInfoRequest, context: Any, who: Principal) -> pb.NodeInfoResponse:
        c = self.need_cluster()
        me = c.membership.me
        return pb.NodeInfoResponse(node_id=me.node_id, grpc_address=me.grpc_address,
                                   block_address=me.block_address, capacity_bytes=dict(me.capacities),
                                   block_wire=me.wire)

    @rpc("Publish", admin=True)
    async def Publish(self, request: pb.PublishRequest, context: Any, who: Principal) -> pb.PublishResponse:
        for i, u in enumerate(request.updates):
            digest_of(u.ns_digest, f"updates[{i}].ns_digest", allow_empty=u.cleared)
            if len(u.keys_packed) % 16:
                raise InvalidArgument(f"updates[{i}].keys_packed is {len(u.keys_packed)} bytes, not a multiple "
                                      "of 16 (16-byte keys)")
        return pb.PublishResponse(applied=self.need_cluster().apply(request))

    @rpc("Locate", admin=True)
    async def Locate(self, request: pb.LocateRequest, context: Any, who: Principal) -> pb.LocateResponse:
        digest = digest_of(request.ns_digest)
        if len(request.keys_packed) % 16:
            raise InvalidArgument(f"keys_packed is {len(request.keys_packed)} bytes, not a multiple of 16 "
                                  "(16-byte keys)")
        return self.need_cluster().locate_local(digest, split_keys(request.keys_packed))


async def lookup_response(daemon: Any, request: pb.LookupRequest, ns: Namespace, res: LookupResult,
                          keys: bytes | list[bytes]) -> pb.LookupResponse:
    """Lookup's cluster-mode answer: per block its best location and load
    estimate, and the chain decision with both estimates."""
    out = pb.LookupResponse(hit_blocks=res.hit_blocks, local_blocks=res.hit_blocks)
    if request.keys_packed:
        out.tiers_packed = (res.tier_codes.astype(np.uint8) + 1).tobytes()
    else:
        out.tiers.extend((res.tier_codes.astype(np.int64) + 1).tolist())
    node: ClusterNode | None = daemon.cluster
    bb = daemon.store.block_bytes(ns) or int(request.block_bytes)
    loads = daemon.admission.predictor.config.tier_loads
    if node is None:
        v = ClusterView(res)
        out.cluster_status = "cluster off"
    else:
        v = await node.view(ns, keys if isinstance(keys, list) else split_keys(keys), res,
                            to_hbm=request.to_hbm, block_bytes=int(request.block_bytes))
        bb = v.block_bytes or bb
        out.cluster_status = node.status
    for t in res.tier_codes.tolist():
        tl = loads[t]
        out.locations.add(tier=int(t) + 1, load_s=tl.per_block_s + bb / tl.bytes_per_s)  # type: ignore[arg-type]
    for _ in range(v.remote_blocks):
        out.locations.add(tier=int(TierKind.REMOTE) + 1, peer=v.peer or "", load_s=v.block_load_s)  # type: ignore[arg-type]
    e = v.estimate
    out.remote_blocks = v.remote_blocks
    out.decision = int(e.decision) + 1  # type: ignore[assignment]
    out.fetch_s, out.recompute_s = e.transfer_s, e.recompute_s
    return out
