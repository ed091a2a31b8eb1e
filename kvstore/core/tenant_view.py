"""One tenant's part of the store's stats: what a non-admin credential's
``Stats`` answer covers (kvstore/daemon/kv_service.py).

Its tiers keep their capacity (the operator's sizing); used bytes, blocks
and pinned bytes are the tenant's blocks' payload bytes and counts, read
from the index; hits and evictions per tier, puts, gets and their bytes come
from the per-namespace counters (``Namespaces.counts``, kept by
``Placement.committed``, ``served`` and ``drop``), as do promotions and
demotions per tier (``Placement.emit_moved``), checksum failures
(``Placement.corrupt``, ``TieredStore.count_checksum_failures``) and bytes
promoted (read from SSD into DRAM) and demoted (written from DRAM to SSD:
demotions and write-through copies), counted where ``SsdMover`` counts the
daemon's, and expired reservations and leases (``Holds.reap``); lookups from
the per-namespace lookup counters. The store has no block TTL: a stored
block never expires (an expired reservation's uncommitted slots do). The other
``Counters`` fields (calls, blocks asked for, capacity rejects, evictions by
reason) and the holds open now are 0 here.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvstore.core.index import BlockIndex
from kvstore.core.namespaces import (BYTES_DEMOTED, BYTES_PROMOTED, CHECKSUM_FAILURES, COUNT_COLUMNS, DEMOTIONS,
                                     EVICTIONS, GET_BLOCKS, GET_BYTES, HITS, LEASES_EXPIRED, PROMOTIONS, PUT_BLOCKS,
                                     PUT_BYTES, RESERVATIONS_EXPIRED, Namespaces)
from kvstore.results import Counters, TierStats
from tiers.base import Tier, TierKind


def tenant_view(idx: BlockIndex, tiers: Mapping[TierKind, Tier], registry: Namespaces,
                tenant: str) -> tuple[list[TierStats], Counters, tuple[int, int]]:
    """(per-tier stats, counters, (bytes promoted, bytes demoted)) of
    ``tenant``'s namespaces alone."""
    rows = idx.used_rows()
    mask = registry.tenant_mask(tenant)
    mine = rows[mask[idx.ns[rows].astype(np.int64)]] if mask.size and rows.size else rows[:0]
    sums = registry.tenant_counts(tenant)
    out = []
    for kind, t in tiers.items():
        sel = mine[idx.tier[mine] == kind]
        used = int(idx.size[sel].sum())
        pinned = sel[idx.pins[sel] > 0]
        out.append(TierStats(kind, t.capacity_bytes, used, int(sel.size), int(idx.size[pinned].sum()),
                             int(sums[EVICTIONS + int(kind)]), int(sums[PROMOTIONS + int(kind)]),
                             int(sums[DEMOTIONS + int(kind)]), disk_bytes=used, hits=int(sums[HITS + int(kind)])))
    n_l, q, h, qt, ht = (int(v) for v in sums[COUNT_COLUMNS:])
    c = Counters(lookups=n_l, lookup_blocks=q, lookup_hit_blocks=h, lookup_tokens=qt, lookup_hit_tokens=ht,
                 put_blocks=int(sums[PUT_BLOCKS]), put_bytes=int(sums[PUT_BYTES]),
                 get_hit_blocks=int(sums[GET_BLOCKS]), get_bytes=int(sums[GET_BYTES]),
                 checksum_failures=int(sums[CHECKSUM_FAILURES]), reservations_expired=int(sums[RESERVATIONS_EXPIRED]),
                 leases_expired=int(sums[LEASES_EXPIRED]))
    return out, c, (int(sums[BYTES_PROMOTED]), int(sums[BYTES_DEMOTED]))
