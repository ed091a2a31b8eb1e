"""The ``Admin`` gRPC service: operator actions (``kvstore admin ...``):
the effective config, resizing a tier, switching the eviction policy."""

from __future__ import annotations

import json
from typing import Any

from kvstore import errors
from kvstore.config import Config
from kvstore.daemon.auth import Principal
from kvstore.daemon.rpc import rpc
from kvstore.daemon.state import DaemonState
from kvstore.errors import InvalidArgument
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tiers.base import TierKind


class AdminService(DaemonState, pb_grpc.AdminServicer):
    """The Admin servicer."""

    # ------------------------------------------------------------- admin
    @rpc("GetConfig", admin=True)
    async def GetConfig(self, request: pb.GetConfigRequest, context: Any, who: Principal) -> pb.GetConfigResponse:
        running = self.running_config()
        return pb.GetConfigResponse(toml=running.to_toml(), json=json.dumps(running.to_dict()))

    def running_config(self) -> Config:
        """The config as the daemon runs now: with the capacities and the
        eviction policy that ResizeTier and SetEvictionPolicy changed since
        start (the config read at start is kept as it was)."""
        changes: dict[str, Any] = {"eviction.policy": self.store.policy.name.value}
        for tier, t in self.store.tiers.items():
            if tier in (TierKind.DRAM, TierKind.SSD, TierKind.HBM):
                changes[f"{tier.label}.capacity"] = t.capacity_bytes
        return self.config.replace(**changes)

    @rpc("ResizeTier", admin=True)
    async def ResizeTier(self, request: pb.ResizeTierRequest, context: Any, who: Principal) -> pb.ResizeTierResponse:
        if request.tier == 0:
            raise InvalidArgument("tier is required (dram, ssd, hbm)")
        if request.tier - 1 not in {TierKind.DRAM, TierKind.SSD, TierKind.HBM}:  # remote: peers' tiers, not ours
            raise InvalidArgument(f"tier {request.tier} cannot be resized; allowed: dram, ssd, hbm")
        tier = TierKind(request.tier - 1)
        t = self.store.tiers.get(tier)
        if t is None:
            raise errors.NotFound(f"tier {tier.label} is not configured")
        old = t.capacity_bytes
        evicted = await self.disk.always(self.store.resize, tier, int(request.capacity_bytes))
        return pb.ResizeTierResponse(old_capacity_bytes=old, new_capacity_bytes=t.capacity_bytes,
                                     evicted_blocks=evicted)

    @rpc("SetEvictionPolicy", admin=True)
    async def SetEvictionPolicy(self, request: pb.SetEvictionPolicyRequest, context: Any,
                                who: Principal) -> pb.SetEvictionPolicyResponse:
        old = self.store.set_policy(request.policy)
        return pb.SetEvictionPolicyResponse(old_policy=old, new_policy=self.store.policy.name.value)
