"""Proto <-> Python conversions both ends use: namespaces (``ns_pb`` /
``ns_from_pb``), keys, tiers, per-key results, slot arrays, HBM descriptors
and TTFT parts. Pure functions, no I/O. Status codes live in
``kvstore.wire.status`` (re-exported here for old callers)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
from google.protobuf import unknown_fields

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
    """Proto namespace -> ``Namespace``; ``tenant`` (from credentials) wins.

    The wire's defaults (docs/keys.md, "The namespace over gRPC"): an empty
    tenant is the caller's ("default" with auth off), ``tp_size`` 0 is 1, an
    unset ``schema_version`` is 1 (a set 0 stays 0), empty enum names take
    their defaults; integers above the spec's i64 range are refused. A
    field this side does not know (a newer client's) is refused, never
    ignored: every field of a namespace keeps apart blocks that are not
    interchangeable (docs/operations.md, Upgrades)."""
    unknown = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(msg)})
    if unknown:
        raise InvalidArgument(f"namespace field {', '.join(map(str, unknown))} is unknown to this kvstore "
                              f"(a newer client's): upgrade the daemon before its clients")
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
        "schema_version": msg.schema_version if msg.HasField("schema_version") else 1,
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


_REASON: dict[KeyStatus, str] = {
    KeyStatus.MISS: "not stored",
    KeyStatus.EXISTS: "already stored: nothing to write",
    KeyStatus.CAPACITY: "no room in the tier, even after eviction",
    KeyStatus.INVALID: "invalid input for this key",
    KeyStatus.CORRUPT: "checksum mismatch: the block was dropped",
    KeyStatus.BUSY: "another writer holds a reservation on this key",
    KeyStatus.NOT_OWNER: "the caller does not own the reservation or lease",
}
"""The reason a non-OK key gets when the store named none."""


def details_pb(statuses: Any, messages: dict[int, str]) -> dict[int, str]:
    """Key index -> reason for every non-OK key (the store's message where it
    gave one, else the status's reason; PARENT_MISSING names the refused
    parent). Loops over the non-OK keys only."""
    st = np.asarray(statuses, dtype=np.int64).reshape(-1)
    out: dict[int, str] = {}
    for i in np.flatnonzero(st != int(KeyStatus.OK)).tolist():
        msg = messages.get(i)
        if not msg:
            s = KeyStatus(int(st[i]))
            if s is not KeyStatus.PARENT_MISSING:
                msg = _REASON.get(s, s.name.lower())
            elif i == 0:
                msg = "parent block is not stored"
            else:
                prev = KeyStatus(int(st[i - 1]))
                msg = (f"its parent keys[{i - 1}] is not stored ({prev.name})" if prev is not KeyStatus.OK
                       else f"its parent keys[{i - 1}] is not stored")
        out[i] = msg
    return out


def results_pb(keys: list[bytes] | None, res: BatchResult) -> list[pb.KeyResult]:
    """One KeyResult per key; every non-OK key carries its reason."""
    details = details_pb(res.statuses, res.messages)
    if keys is None:
        return [pb.KeyResult(status=status_pb(s), detail=details.get(i, "")) for i, s in enumerate(res.statuses)]
    return [pb.KeyResult(key=k, status=status_pb(s), detail=details.get(i, ""))
            for i, (k, s) in enumerate(zip(keys, res.statuses))]


def slots_pb(res: SlotResult) -> pb.SlotArray:
    has = res.offsets >= 0
    return pb.SlotArray(status=cast(Any, res.statuses),  # KeyStatus values are the wire values (status_pb)
                        tier=np.where(has, res.tier_codes.astype(np.int64) + 1, 0).tolist(),
                        offset=np.maximum(res.offsets, 0).tolist(), length=res.lengths.tolist(),
                        checksum=res.checksums.tolist())


def keys_of(msg_keys: Any, field: str = "keys") -> list[bytes]:
    """A repeated key field; a bad entry is named by its field and index."""
    keys = list(msg_keys)
    if len(keys) > MAX_KEYS:
        raise InvalidArgument(f"{len(keys)} {field} in one call; at most {MAX_KEYS}")
    for i, k in enumerate(keys):
        if len(k) != 16:
            raise InvalidArgument(f"{field}[{i}] must be 16 bytes (a block key), got {len(k)} bytes")
    return keys


def parent_of(request: Any) -> bytes | None:
    """A request's ``parent`` (the key before ``keys[0]``): None when empty."""
    p = bytes(request.parent)
    if not p:
        return None
    if len(p) != 16:
        raise InvalidArgument(f"parent must be 16 bytes (the block key before keys[0]) or empty for a chain "
                              f"root, got {len(p)} bytes")
    return p


def digest_of(value: bytes, field: str = "ns_digest", *, allow_empty: bool = False) -> bytes:
    """A namespace digest field (16 bytes; empty only where it means 'all')."""
    d = bytes(value)
    if len(d) != 16 and not (allow_empty and not d):
        empty = " or empty" if allow_empty else ""
        raise InvalidArgument(f"{field} must be 16 bytes (a namespace digest){empty}, got {len(d)} bytes")
    return d


def chain_keys(request: Any) -> bytes | list[bytes]:
    """``keys`` or ``keys_packed`` of a request (exactly one may be set)."""
    packed = request.keys_packed
    if packed:
        if len(request.keys):
            raise InvalidArgument("give keys or keys_packed, not both")
        if len(packed) % 16:
            raise InvalidArgument(f"keys_packed is {len(packed)} bytes, not a multiple of 16 (16-byte keys)")
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


__all__ = ["MAX_KEYS", "REASONS", "REASON_PB", "STATUS_TABLE", "chain_keys", "details_pb", "digest_of", "hbm_pb", "keys_of", "parent_of", "ns_from_pb", "ns_pb", "results_pb",
           "slots_pb", "status_for", "status_pb", "tier_codes_from_pb", "tier_from_pb", "tier_name", "tier_pb",
           "ttft_pb", "want_tier"]
