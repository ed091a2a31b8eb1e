"""Eviction policies over the index: ``lru``, ``lfu`` and ``cost``.

A policy only ranks blocks; the store decides which blocks are candidates.
Candidates are always leaves *within their tier*: committed, unpinned, and with
no cached child in the same tier (``BlockIndex.has_child_among``), so a chain is cut from
its tail and never in the middle. Victims are chosen one rank at a time: the
lowest-ranked candidate goes first, ties broken by older last access, then by
row. Selection is vectorised (``argpartition`` over the candidates) so one
eviction round costs O(candidates), not a Python loop per block.

- ``lru``: rank = last access tick.
- ``lfu``: rank = (hits, last access): the least used goes first, the older of
  equally used ones first. ``hits`` is kept only under ``lfu`` and ``cost``
  (``POLICY_COLUMNS``): a switch from ``lru`` starts every count at 0, so
  ``lfu`` ranks by last access until counts build up.
- ``cost``: GreedyDual-Size-Frequency. rank = L + freq x cost / size where
  freq = hits + 1, size in MiB, cost = 1 + depth_weight x depth (``depth``
  kept only under ``cost``, computed for every block on the switch): recomputing
  a block deeper in its chain costs more (its tokens attend over a longer
  prefix, and a lost deep block wastes the whole prefix's hit on reuse). L is
  the inflation value: the rank of the last evicted block, so blocks not
  touched for a while fall behind newly touched ones (recency).
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

import numpy as np

from kvstore.core.index import BlockIndex
from kvstore.errors import InvalidArgument

_MIB = float(1 << 20)


class PolicyName(str, Enum):
    LRU = "lru"
    LFU = "lfu"
    COST = "cost"

    @classmethod
    def parse(cls, name: str | PolicyName) -> PolicyName:
        if isinstance(name, PolicyName):
            return name
        try:
            return cls(str(name).strip().lower())
        except ValueError:
            allowed = ", ".join(p.value for p in cls)
            raise InvalidArgument(f"unknown eviction policy {name!r}; allowed: {allowed}") from None


class Policy(Protocol):
    name: PolicyName
    columns: frozenset[str]
    """The index's ``POLICY_COLUMNS`` it ranks with: the index keeps those
    (``BlockIndex.keep``) and leaves the others unwritten."""

    def on_insert(self, index: BlockIndex, rows: np.ndarray) -> None: ...

    def on_access(self, index: BlockIndex, rows: np.ndarray) -> None: ...

    def rank(self, index: BlockIndex, rows: np.ndarray) -> np.ndarray: ...

    def on_evict(self, index: BlockIndex, rows: np.ndarray) -> None: ...


class LRU:
    name = PolicyName.LRU
    columns: frozenset[str] = frozenset()

    def on_insert(self, index: BlockIndex, rows: np.ndarray) -> None:
        pass

    def on_access(self, index: BlockIndex, rows: np.ndarray) -> None:
        pass

    def rank(self, index: BlockIndex, rows: np.ndarray) -> np.ndarray:
        return index.last[rows].astype(np.float64)

    def on_evict(self, index: BlockIndex, rows: np.ndarray) -> None:
        pass


class LFU(LRU):
    name = PolicyName.LFU
    columns = frozenset({"hits"})

    def rank(self, index: BlockIndex, rows: np.ndarray) -> np.ndarray:
        # ties on hits are broken by last access in select_victims
        return index.hits[rows].astype(np.float64)


class CostAware:
    name = PolicyName.COST
    columns = frozenset({"hits", "depth", "prio"})

    def __init__(self, depth_weight: float = 0.125) -> None:
        if depth_weight < 0:
            raise InvalidArgument(f"depth_weight must be >= 0, got {depth_weight}")
        self.depth_weight = depth_weight
        self.inflation = 0.0

    def _value(self, index: BlockIndex, rows: np.ndarray) -> np.ndarray:
        freq = index.hits[rows].astype(np.float64) + 1.0
        cost = 1.0 + self.depth_weight * index.depth[rows].astype(np.float64)
        size = np.maximum(index.size[rows].astype(np.float64), 1.0) / _MIB
        return self.inflation + freq * cost / size

    def on_insert(self, index: BlockIndex, rows: np.ndarray) -> None:
        index.prio[rows] = self._value(index, rows)

    def on_access(self, index: BlockIndex, rows: np.ndarray) -> None:
        index.prio[rows] = self._value(index, rows)

    def rank(self, index: BlockIndex, rows: np.ndarray) -> np.ndarray:
        return index.prio[rows]

    def on_evict(self, index: BlockIndex, rows: np.ndarray) -> None:
        if rows.size:
            self.inflation = max(self.inflation, float(index.prio[rows].max()))


def make_policy(name: str | PolicyName, index: BlockIndex | None = None) -> Policy:
    """A policy by name. With ``index``, the new policy is initialised over the
    blocks already there (a run-time policy switch keeps every block)."""
    kind = PolicyName.parse(name)
    policy: Policy
    if kind is PolicyName.LRU:
        policy = LRU()
    elif kind is PolicyName.LFU:
        policy = LFU()
    else:
        policy = CostAware()
    if index is not None:
        index.keep(policy.columns)
        rows = index.used_rows()
        if rows.size:
            policy.on_insert(index, rows)
    return policy


def select_victims(index: BlockIndex, policy: Policy, candidates: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` lowest-ranked candidates, in eviction order."""
    n = candidates.size
    if k <= 0 or n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = policy.rank(index, candidates)
    if k < n:
        kth = np.partition(rank, k - 1)[k - 1]
        sel = rank <= kth  # every candidate at or below the k-th rank (ties kept)
        candidates, rank = candidates[sel], rank[sel]
    order = np.lexsort((candidates, index.last[candidates], rank))
    return candidates[order[:k]]


# ------------------------------------------------------- subtree selection
def _parent_positions(index: BlockIndex, rows: np.ndarray) -> np.ndarray:
    """For each of ``rows``, the position in ``rows`` of its parent, or -1
    when the parent is not one of ``rows`` (a root, or another tier)."""
    pos = np.full(index.parent.size, -1, dtype=np.int64)
    pos[rows] = np.arange(rows.size)
    par = index.parent[rows].astype(np.int64)
    return np.where(par >= 0, pos[np.maximum(par, 0)], -1)


def subtree_max(index: BlockIndex, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each of ``rows``: the largest of ``values`` over its subtree, the
    subtree following parent links *within* ``rows``. Pointer doubling: one
    vectorised pass per power of two of the depth, no loop per block."""
    out = np.asarray(values, dtype=np.float64).copy()
    anc = _parent_positions(index, rows)  # ancestor at distance 2^j
    while True:
        has = anc >= 0
        if not has.any():
            return out
        # out[v] = max over u whose path to v is shorter than 2^(j+1)
        nxt = out.copy()
        np.maximum.at(nxt, anc[has], out[has])
        out = nxt
        anc = np.where(has, anc[np.maximum(anc, 0)], -1)


def ancestor_min(index: BlockIndex, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each of ``rows``: the smallest of ``values`` over it and its
    ancestors, following parent links *within* ``rows`` (``subtree_max``'s
    other direction; pointer doubling, no loop per block)."""
    out = np.asarray(values, dtype=np.float64).copy()
    anc = _parent_positions(index, rows)
    while True:
        has = anc >= 0
        if not has.any():
            return out
        out = np.minimum(out, np.where(has, out[np.maximum(anc, 0)], np.inf))
        anc = np.where(has, anc[np.maximum(anc, 0)], -1)


def close_upward(index: BlockIndex, rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``mask`` extended to every ancestor (within ``rows``) of a marked row."""
    return subtree_max(index, rows, mask.astype(np.float64)) > 0


def select_subtrees(index: BlockIndex, policy: Policy, rows: np.ndarray, blocked: np.ndarray, k: int,
                    first: np.ndarray | None = None) -> np.ndarray:
    """Up to ``k`` victims among ``rows`` (the blocks of one tier), exactly
    those that "evict the lowest-ranked leaf, ``k`` times" would pick, in
    one pass.

    Each block is ranked by its position in the policy order (rank, then
    older last access, then row: the order of ``select_victims``); a block
    may leave only after its descendants in ``rows``, so its effective rank
    is the *highest* position in its subtree. ``blocked`` blocks (pinned,
    being written, of another size class, with children elsewhere) rank
    past everything, and so do their ancestors: they never leave. The ``k``
    lowest effective ranks win, deeper first on ties (a block shares its
    effective rank only with descendants), so the set is closed under
    descendants and chains are cut from their tails. A cold subtree is
    drained leaf by leaf before a hot chain loses its tail, however many
    leaves the tier has. ``first`` (optional mask, constant within a
    subtree, e.g. blocks of tenants over their share) goes before the rest.
    Returned in eviction order (children before parents)."""
    n = rows.size
    if k <= 0 or n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = policy.rank(index, rows).astype(np.float64)
    order = np.lexsort((rows, index.last[rows], rank))
    pos = np.empty(n, dtype=np.float64)
    pos[order] = np.arange(n, dtype=np.float64)
    eff = subtree_max(index, rows, np.where(blocked, np.inf, pos))
    cand = np.flatnonzero(np.isfinite(eff))
    if cand.size == 0:
        return np.zeros(0, dtype=np.int64)
    e = eff[cand]
    if first is not None:
        e = e + np.where(first[cand], 0.0, float(n))  # every ``first`` block before the rest
    if k < cand.size:
        kth = np.partition(e, k - 1)[k - 1]
        keep = e <= kth
        cand, e = cand[keep], e[keep]
    # equal ``e``: a block and ancestors of it, all among ``cand`` (each
    # between it and the highest also shares ``e``), so levels within
    # ``cand`` order them as depths would
    sel = np.lexsort((-index.levels(rows[cand]), e))[:k]
    return rows[cand[sel]]


# --------------------------------------------------------- DRAM admission
class FrequencySketch:
    """How often each key was asked for, hits and misses alike (TinyLFU's
    frequency sketch): one hashed array of saturating counters, halved
    every ``age`` x (blocks stored) recorded keys so old popularity fades.
    Collisions only over-estimate. Vectorised: one fancy-index increment
    per lookup."""

    def __init__(self, slots: int = 1 << 16, age: float = 10.0) -> None:
        size = 1 << max(16, min(22, int(slots - 1).bit_length()))
        self.counts = np.zeros(size, dtype=np.uint16)
        self.mask = np.uint64(size - 1)
        self.age = float(age)
        self.added = 0

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        h = (keys[:, 0] ^ (keys[:, 1] * np.uint64(0x9E3779B97F4A7C15))) * np.uint64(0xBF58476D1CE4E5B9)
        return ((h >> np.uint64(40)) & self.mask).astype(np.int64)

    def record(self, keys: np.ndarray, stored_blocks: int) -> None:
        """Count one request for each of ``keys`` ((n, 2) uint64)."""
        if keys.shape[0] == 0:
            return
        s = self._slots(keys)
        c = self.counts
        c[s] = np.minimum(c[s].astype(np.uint32) + 1, 0xFFFF).astype(np.uint16)
        self.added += keys.shape[0]
        if self.added >= self.age * max(64, stored_blocks):
            c >>= 1
            self.added = 0

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        if keys.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        return self.counts[self._slots(keys)].astype(np.int64)


def admitted(incoming: np.ndarray, victims: np.ndarray) -> int:
    """How many of the ``incoming`` frequencies (a chain, in order) win a
    slot against the ``victims``' (any order): the j-th new block displaces
    the j-th cheapest victim only if it was asked for at least as often.
    A chain stops at its first loser (its children need it)."""
    v = np.sort(victims)
    m = min(incoming.size, v.size)
    win = incoming[:m] >= v[:m]
    return m if win.all() else int(np.argmin(win))
