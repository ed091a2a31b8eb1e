"""Rebuilding the index from the SSD tier at start (``SsdMover.recover``).

In arrays end to end: the tier hands over every live block, parents before
children, with each parent's position (``SsdTier.recovered``); blocks whose
namespace is not persisted, or whose chain does not reach a root on the SSD,
are dropped (their SSD space freed); the rest go into the index with one
``BlockIndex.insert`` per namespace. Access ticks follow the tier's order
(parents first, then write sequence), as when blocks were inserted in that
order one batch at a time.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import numpy as np

from kvstore.core.index import IN_BATCH, NO_ROW, BlockState
from kvstore.core.placement import Placement
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from tiers.base import TierKind
from tiers.ssd import SsdTier

log = logging.getLogger("kvstore.ssd")


@dataclass(slots=True)
class Recovery:
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    dropped: int = 0


def persisted_namespaces(place: Placement, tier: SsdTier) -> dict[bytes, int]:
    """Register every namespace the tier persisted; digest -> namespace id."""
    nsids: dict[bytes, int] = {}
    for digest, desc in tier.namespaces().items():
        try:
            doc = json.loads(desc)
            ns = Namespace.from_dict(doc["namespace"])
            block_bytes = doc.get("block_bytes")
        except (KVStoreError, ValueError, KeyError, TypeError) as e:
            log.warning("ssd: unreadable namespace descriptor %s: %s", digest.hex(), e)
            continue
        if ns.digest != digest:
            log.warning("ssd: namespace descriptor %s does not hash to its digest", digest.hex())
            continue
        nsids[digest] = place.nsid(ns, persist=False)
        if isinstance(block_bytes, int) and block_bytes > 0:
            place.namespaces.set_size(nsids[digest], block_bytes)
    return nsids


def namespace_ids(digests: np.ndarray, nsids: dict[bytes, int]) -> np.ndarray:
    """The namespace id of each (n, 16) uint8 digest, or -1 when not persisted."""
    n = digests.shape[0]
    out = np.full(n, -1, dtype=np.int64)
    if not n or not nsids:
        return out
    known = np.frombuffer(b"".join(nsids), dtype="<u8").reshape(-1, 2)
    ids = np.fromiter(nsids.values(), dtype=np.int64, count=len(nsids))
    w = np.ascontiguousarray(digests).view("<u8")
    order = np.argsort(known[:, 0])
    k0 = known[order, 0]
    i = np.minimum(np.searchsorted(k0, w[:, 0]), k0.size - 1)
    hit = (k0[i] == w[:, 0]) & (known[order[i], 1] == w[:, 1])
    out[hit] = ids[order[i[hit]]]
    if k0.size > 1 and bool((k0[1:] == k0[:-1]).any()):  # two digests share 8 bytes: exact, one by one
        exact = dict(zip(nsids, nsids.values()))
        out = np.fromiter((exact.get(bytes(d), -1) for d in digests), dtype=np.int64, count=n)
    return out


def restore_index(place: Placement, tier: SsdTier) -> Recovery:
    """Index rows for every block the SSD tier holds; see the module docstring."""
    t0 = time.perf_counter()
    rec = Recovery()
    nsids = persisted_namespaces(place, tier)
    blocks = tier.recovered()
    n = len(blocks)
    idx = place.index
    nid = namespace_ids(blocks.ns, nsids)
    ok = (nid >= 0) & blocks.rooted
    keys = np.ascontiguousarray(blocks.keys).view("<u8")
    drop = [blocks.locs[~ok]]
    local = np.full(n, -1, dtype=np.int64)  # position of a block within its namespace's batch
    first_tick = place.ticks(int(np.count_nonzero(ok)))
    rank = np.cumsum(ok) - 1  # the tier's order among the blocks kept
    where = np.full(n, NO_ROW, dtype=np.int64)  # the existing row of a block already in the index
    for k in np.unique(nid[ok]).tolist():
        sel = np.flatnonzero(ok & (nid == k))
        present = idx.find(k, keys[sel])  # already in the index: a duplicate copy, dropped
        new = present < 0
        drop.append(blocks.locs[sel[~new]])
        ins = sel[new]
        if not ins.size:
            continue
        local[ins] = np.arange(ins.size)
        pp = blocks.parent_pos[ins]  # a rooted block's parent is held, in its namespace, and earlier
        parents = np.full(ins.size, NO_ROW, dtype=np.int64)
        has = pp >= 0
        where[sel] = present
        existing = has & (where[np.maximum(pp, 0)] >= 0)
        parents[existing] = where[pp[existing]]
        fresh = has & ~existing
        parents[fresh] = IN_BATCH - local[pp[fresh]]
        rows = idx.insert(k, keys[ins], parents, int(TierKind.SSD), blocks.locs[ins], blocks.sizes[ins],
                          BlockState.COMMITTED, first_tick)
        idx.last[rows] = first_tick + rank[ins]
        idx.csum[rows] = blocks.csums[ins]
        place.policy.on_insert(idx, rows)
        if place.namespaces.size_of(k) is None:
            place.namespaces.set_size(k, int(blocks.sizes[ins[0]]))
        rec.blocks += int(ins.size)
        rec.bytes += int(blocks.sizes[ins].sum())
    orphans = np.concatenate(drop) if drop else np.zeros(0, dtype=np.int64)
    if orphans.size:
        tier.free(orphans)
    rec.dropped = int(orphans.size)
    rec.seconds = time.perf_counter() - t0
    return rec


__all__ = ["Recovery", "namespace_ids", "persisted_namespaces", "restore_index"]
