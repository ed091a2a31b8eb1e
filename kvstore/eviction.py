"""Eviction policies over the index: ``lru``, ``lfu`` and ``cost``.

A policy only ranks blocks; the store decides which blocks are candidates.
Candidates are always leaves *within their tier*: committed, unpinned, and with
no cached child in the same tier (``nchild_tier == 0``), so a chain is cut from
its tail and never in the middle. Victims are chosen one rank at a time: the
lowest-ranked candidate goes first, ties broken by older last access, then by
row. Selection is vectorised (``argpartition`` over the candidates) so one
eviction round costs O(candidates), not a Python loop per block.

- ``lru``: rank = last access tick.
- ``lfu``: rank = (hits, last access): the least used goes first, the older of
  equally used ones first.
- ``cost``: GreedyDual-Size-Frequency. rank = L + freq x cost / size where
  freq = hits + 1, size in MiB, cost = 1 + depth_weight x depth: recomputing
  a block deeper in its chain costs more (its tokens attend over a longer
  prefix, and a lost deep block wastes the whole prefix's hit on reuse). L is
  the inflation value: the rank of the last evicted block, so blocks not
  touched for a while fall behind newly touched ones (recency).
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.index import BlockIndex

_MIB = float(1 << 20)


class PolicyName(str, Enum):
    LRU = "lru"
    LFU = "lfu"
    COST = "cost"

    @classmethod
    def parse(cls, name: str | "PolicyName") -> "PolicyName":
        if isinstance(name, PolicyName):
            return name
        try:
            return cls(str(name).strip().lower())
        except ValueError:
            allowed = ", ".join(p.value for p in cls)
            raise InvalidArgument(f"unknown eviction policy {name!r}; allowed: {allowed}") from None


class Policy(Protocol):
    name: PolicyName

    def on_insert(self, index: BlockIndex, rows: np.ndarray) -> None: ...

    def on_access(self, index: BlockIndex, rows: np.ndarray) -> None: ...

    def rank(self, index: BlockIndex, rows: np.ndarray) -> np.ndarray: ...

    def on_evict(self, index: BlockIndex, rows: np.ndarray) -> None: ...


class LRU:
    name = PolicyName.LRU

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

    def rank(self, index: BlockIndex, rows: np.ndarray) -> np.ndarray:
        # ties on hits are broken by last access in select_victims
        return index.hits[rows].astype(np.float64)


class CostAware:
    name = PolicyName.COST

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
