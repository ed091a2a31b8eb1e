"""The store's namespace registry: namespace <-> small integer id, the
tenant of each, the payload size of its blocks once known, and the lookup
counters behind the per-namespace stats.

Namespaces are told apart by their full frame, not by their digest, so two
whose digests collide never share blocks. Ids are dense (0, 1, ...) and never
reused: ``BlockIndex`` stores them per row.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace

NO_NS = 0xFFFFFFFF
"""Namespace id of calls that only read, for a namespace never stored into (no block has it)."""
# Columns of ``Namespaces.counts`` (one row per namespace id): what a
# tenant's ``Stats`` answer sums over its namespaces (kvstore/core/store.py).
PUT_BLOCKS, PUT_BYTES, GET_BLOCKS, GET_BYTES = 0, 1, 2, 3
HITS = 4
"""Columns HITS + TierKind value: blocks served from each tier."""
EVICTIONS = 8
"""Columns EVICTIONS + TierKind value: blocks that left each tier for room (ROOM_REASONS)."""
PROMOTIONS = 12
"""Columns PROMOTIONS + TierKind value: blocks moved up into each tier (SSD to DRAM, DRAM to HBM)."""
DEMOTIONS = 16
"""Columns DEMOTIONS + TierKind value: blocks moved down out of each tier (DRAM to SSD, HBM to DRAM)."""
CHECKSUM_FAILURES = 20
"""Blocks that failed their checksum (in a tier, on a move, at a reader, on a peer fetch)."""
BYTES_PROMOTED, BYTES_DEMOTED = 21, 22
"""Payload bytes read from SSD into DRAM, and written from DRAM to SSD
(demotions and write-through copies): the admin's ``bytes_promoted``/``bytes_demoted``."""
RESERVATIONS_EXPIRED, LEASES_EXPIRED = 23, 24
"""Reservations never committed and leases past their ttl, ended by ``Holds.reap``."""
COUNT_COLUMNS = 25
QUERY_NAMESPACES = 1024
"""Lookups register an unknown namespace (for its stats) only while fewer
namespaces than this are known; stores always do."""


def namespace_label(ns: Namespace) -> str:
    """Readable, unique-enough label: tenant/model[@adapter]/dtype/bsN[/tpN][/ppN]."""
    parts = [ns.tenant, ns.model_id + (f"@{ns.adapter_id}" if ns.adapter_id else ""),
             ns.kv_dtype.value, f"bs{ns.block_size}"]
    if ns.tp_size > 1:
        parts.append(f"tp{ns.tp_size}")
    if ns.pp_stage:
        parts.append(f"pp{ns.pp_stage}")
    return "/".join(parts)


class Namespaces:
    """Every namespace the store has seen, by id."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}  # namespace frame -> id
        self._digest_tenant: dict[bytes, str | None] = {}
        self._ns: list[Namespace] = []
        self._size: dict[int, int] = {}
        self._tenant_ids: dict[str, int] = {}
        self._ns_tenant: list[int] = []
        self._hits: dict[int, list[int]] = {}
        self.counts: list[list[int]] = []
        """Per-namespace activity counters (``COUNT_COLUMNS`` ints), by namespace id:
        plain ints, so a call's count is a few integer adds."""

    def __len__(self) -> int:
        return len(self._ns)

    def id_of(self, ns: Namespace, create: bool = True) -> tuple[int, bool]:
        """(the namespace's id, whether it is new). ``create=False`` answers
        ``NO_NS``, an id no block has, for a namespace never seen."""
        if not isinstance(ns, Namespace):
            raise InvalidArgument(f"namespace must be a kvstore.keys.Namespace, got {type(ns).__name__}")
        frame = ns.framed()
        nid = self._ids.get(frame)
        if nid is not None:
            return nid, False
        if not create:
            return NO_NS, False
        d = ns.digest
        nid = len(self._ns)
        self._ids[frame] = nid
        self._ns.append(ns)
        self.counts.append([0] * COUNT_COLUMNS)
        self._ns_tenant.append(self._tenant_ids.setdefault(ns.tenant, len(self._tenant_ids)))
        if self._digest_tenant.setdefault(d, ns.tenant) != ns.tenant:
            self._digest_tenant[d] = None  # two tenants' digests collide: their events go to neither
        return nid, True

    def find(self, ns: Namespace) -> int | None:
        """The id of a known namespace, else None (registers nothing)."""
        return self._ids.get(ns.framed())

    def get(self, nid: int) -> Namespace:
        return self._ns[nid]

    def digest(self, nid: int) -> bytes:
        return self._ns[nid].digest

    def all(self) -> list[Namespace]:
        """Every namespace, in id order."""
        return list(self._ns)

    def tenant_of(self, digest: bytes) -> str | None:
        """The tenant of the namespace with this digest; None when unknown or
        when namespaces of two tenants share the digest."""
        return self._digest_tenant.get(digest)

    # ---------------------------------------------------------- block size
    def size_of(self, nid: int) -> int | None:
        """Payload bytes of the namespace's blocks, once fixed by its first block."""
        return self._size.get(nid)

    def set_size(self, nid: int, nbytes: int) -> None:
        self._size[nid] = nbytes

    def forget_size(self, nid: int) -> None:
        """The namespace holds no block any more: its next block may fix another size."""
        self._size.pop(nid, None)

    # ------------------------------------------------------------ tenants
    def tenant_ids(self) -> list[int]:
        """Tenant id of each namespace, by namespace id."""
        return self._ns_tenant

    def tenant_names(self) -> list[str]:
        """Tenant names, by tenant id."""
        return sorted(self._tenant_ids, key=self._tenant_ids.__getitem__)

    # -------------------------------------------------------------- stats
    def count_lookup(self, nid: int, queried: int, hit: int, lookups: int = 1) -> None:
        h = self._hits.setdefault(nid, [0, 0, 0])
        h[0] += lookups
        h[1] += queried
        h[2] += hit

    def count_blocks(self, nsids: np.ndarray, column: int, each: int = 1) -> None:
        """Add ``each`` (one block, or its bytes) to ``column`` of each block's
        namespace (``nsids``: the blocks' namespace ids): one ``bincount``, an
        add per namespace present."""
        if nsids.size == 0:
            return
        first = int(nsids[0])
        if bool((nsids == first).all()):
            self.counts[first][column] += int(nsids.size) * each
            return
        per = np.bincount(nsids.astype(np.int64))
        for nid in np.flatnonzero(per).tolist():
            self.counts[nid][column] += int(per[nid]) * each

    def lookups(self, nid: int) -> tuple[int, int, int]:
        """(lookups, queried blocks, hit blocks) of a namespace."""
        n, q, h = self._hits.get(nid, (0, 0, 0))
        return n, q, h

    def tenant_counts(self, tenant: str) -> np.ndarray:
        """The ``counts`` columns summed over ``tenant``'s namespaces, and its
        (lookups, queried blocks, hit blocks, queried tokens, hit tokens)."""
        out = np.zeros(COUNT_COLUMNS + 5, dtype=np.int64)
        tid = self._tenant_ids.get(tenant)
        if tid is None:
            return out
        mine = [nid for nid, t in enumerate(self._ns_tenant) if t == tid]
        for nid in mine:
            out[:COUNT_COLUMNS] += self.counts[nid]
            n, q, h = self.lookups(nid)
            bs = self._ns[nid].block_size
            out[COUNT_COLUMNS:] += (n, q, h, q * bs, h * bs)
        return out

    def tenant_mask(self, tenant: str) -> np.ndarray:
        """Per namespace id: whether it is ``tenant``'s."""
        tid = self._tenant_ids.get(tenant, -1)
        return np.asarray(self._ns_tenant, dtype=np.int64) == tid

    def items(self) -> Iterable[tuple[int, Namespace]]:
        return enumerate(self._ns)
