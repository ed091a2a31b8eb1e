"""Proto <-> Python conversions both ends use: namespaces (``ns_pb`` /
``ns_from_pb``), keys, tiers, per-key results, slot arrays, HBM descriptors
and TTFT parts. Pure functions, no I/O. Status codes live in
``kvstore.wire.status`` (re-exported here for old callers)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from admission.slo import TTFTBreakdown
from kvstore.errors import InvalidArgument, KeyStatus, PermissionDenied
from kvstore.keys import Namespace
from kvstore.results import BatchResult, DropReason, SlotResult
from kvstore.wire.status import STATUS_TABLE, status_for
from proto import kvstore_pb2 as pb
from tiers.base import TierKind
from tiers.hbm import HbmTier

MAX_KEYS = 1 << 20
"""Most keys one call may carry."""

REASONS: dict[int, DropReason] = {
    pb.REMOVE_REASON_UNSPECIFIED: DropReason.NONE, pb.REMOVE_REASON_EVICTED: DropReason.EVICTED,
    pb.REMOVE_REASON_REMOVED: DropReason.REMOVED, pb.REMOVE_REASON_CORRUPT: DropReason.CORRUPT,
    pb.REMOVE_REASON_MOVED: DropReason.MOVED, pb.REMOVE_REASON_ABORTED: DropReason.ABORTED}
"""Wire DropReason -> enum."""
REASON_PB: dict[DropReason, Any] = {v: k for k, v in REASONS.items() if v is not DropReason.NONE}
"""Enum -> wire DropReason."""

def tier_pb(t: TierKind | int) -> Any:
    """Wire value of a tier (TierKind + 1; typed Any for the generated stubs)."""
    return int(t) + 1


def tier_from_pb(value: int) -> TierKind | None:
    """A wire tier value back to a ``TierKind`` (None for TIER_UNSPECIFIED)."""
    return TierKind(value - 1) if value else None


def tier_name(value: int) -> str:
    """Label of a wire tier value ("dram"; "unspecified" for 0)."""
    return TierKind(value - 1).label if value else "unspecified"


def tier_codes_from_pb(values: Any) -> np.ndarray:
    """Wire tier values (a bytes string or a repeated field) -> ``TierKind``
    values as uint8 (what ``LookupResult.tier_codes`` holds)."""
    if isinstance(values, (bytes, bytearray)):
        arr = np.frombuffer(values, np.uint8)
    else:
        arr = np.asarray(list(values), np.int64).astype(np.uint8)
    return arr - np.uint8(1) if arr.size else arr.copy()


def status_pb(s: KeyStatus | int) -> Any:
    return int(s)


def ns_from_pb(msg: pb.Namespace, tenant: str | None) -> Namespace:
    """Proto namespace -> ``Namespace``; ``tenant`` (from credentials) wins."""
    if tenant is not None and msg.tenant and msg.tenant != tenant:
        raise PermissionDenied(f"namespace tenant {msg.tenant!r} is not the caller's tenant")
    kw: dict[str, Any] = {
        "tenant": tenant if tenant is not None else (msg.tenant or "default"),
        "model_id": msg.model_id,
        "weights_digest": msg.weights_digest,
        "adapter_id": msg.adapter_id,
        "block_size": msg.block_size,
        "tp_size": msg.tp_size or 1,
        "pp_stage": msg.pp_stage,
        "schema_version": msg.schema_version or 1,
        "salt": msg.salt,
    }
    for name in ("kv_dtype", "layout", "hash_algo"):
        v = getattr(msg, name)
        if v:
            kw[name] = v
    return Namespace(**kw)


def ns_pb(ns: Namespace) -> pb.Namespace:
    """``Namespace`` -> proto (what a client sends, and a peer's fetch header)."""
    d: dict[str, Any] = dict(ns.to_dict())
    fields = pb.Namespace.DESCRIPTOR.fields_by_name
    return pb.Namespace(**{k: v for k, v in d.items() if k in fields})


def results_pb(keys: list[bytes], res: BatchResult) -> list[pb.KeyResult]:
    return [pb.KeyResult(key=k, status=status_pb(s), detail=res.messages.get(i, ""))
            for i, (k, s) in enumerate(zip(keys, res.statuses))]


def slots_pb(res: SlotResult) -> pb.SlotArray:
    has = res.offsets >= 0
    return pb.SlotArray(status=cast(Any, res.statuses),  # KeyStatus values are the wire values (status_pb)
                        tier=np.where(has, res.tier_codes.astype(np.int64) + 1, 0).tolist(),
                        offset=np.maximum(res.offsets, 0).tolist(), length=res.lengths.tolist(),
                        checksum=res.checksums.tolist())


def keys_of(msg_keys: Any) -> list[bytes]:
    keys = list(msg_keys)
    if len(keys) > MAX_KEYS:
        raise InvalidArgument(f"{len(keys)} keys in one call; at most {MAX_KEYS}")
    for i, k in enumerate(keys):
        if len(k) != 16:
            raise InvalidArgument(f"key {i} must be 16 bytes, got {len(k)}")
    return keys


def chain_keys(request: Any) -> bytes | list[bytes]:
    """``keys`` or ``keys_packed`` of a request (exactly one may be set)."""
    packed = request.keys_packed
    if packed:
        if len(request.keys):
            raise InvalidArgument("give keys or keys_packed, not both")
        if len(packed) % 16:
            raise InvalidArgument(f"keys_packed is {len(packed)} bytes, not a multiple of 16")
        if len(packed) // 16 > MAX_KEYS:
            raise InvalidArgument(f"{len(packed) // 16} keys in one call; at most {MAX_KEYS}")
        return bytes(packed)
    return keys_of(request.keys)


def want_tier(value: int) -> TierKind | None:
    """A request's tier field: None when unset; HBM or DRAM."""
    if value == 0:
        return None
    if value not in (TierKind.HBM + 1, TierKind.DRAM + 1):
        raise InvalidArgument(f"tier {value} cannot be asked for here; allowed: TIER_HBM, TIER_DRAM")
    return TierKind(value - 1)


def hbm_pb(tier: HbmTier, slab_id: str) -> pb.DeviceMemInfo:
    """What a same-host client needs to map the HBM slab (raw IPC handle
    bytes, offset, size, device; never a pickled object)."""
    info = pb.DeviceMemInfo(device=tier.device_index, size_bytes=tier.size, ipc=tier.is_cuda,
                            slab_id=slab_id, device_name=str(tier.device))
    if tier.is_cuda:
        exp = tier.ipc_export()
        info.ipc_handle, info.base_offset = exp.handle, exp.offset
    return info


def ttft_pb(b: TTFTBreakdown) -> pb.TTFTParts:
    return pb.TTFTParts(queue_s=b.queue_s, prefill_s=b.prefill_s, load_hbm_s=float(b.load_s[0]),
                        load_dram_s=float(b.load_s[1]), load_ssd_s=float(b.load_s[2]),
                        load_remote_s=float(b.load_s[3]), remote_fetch_s=b.remote_fetch_s, total_s=b.total_s,
                        cached_tokens=int(b.cached_tokens), uncached_tokens=int(b.uncached_tokens))


__all__ = ["MAX_KEYS", "REASONS", "REASON_PB", "STATUS_TABLE", "chain_keys", "hbm_pb", "keys_of", "ns_from_pb", "ns_pb", "results_pb",
           "slots_pb", "status_for", "status_pb", "tier_codes_from_pb", "tier_from_pb", "tier_name", "tier_pb",
           "ttft_pb", "want_tier"]
