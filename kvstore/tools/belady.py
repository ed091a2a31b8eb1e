"""Bélády's optimum over a prepared trace, chains kept contiguous (the
``kvstore.tools.replay`` module docstring has the argument)."""

from __future__ import annotations

import heapq
import time

import numpy as np

from kvstore.tools.replay_report import ReplayResult, base_result
from kvstore.tools.trace import PreparedTrace

__all__ = ["belady"]


def belady(pt: PreparedTrace, capacity_blocks: int, bypass: bool = False) -> ReplayResult:
    """Hits of Bélády's policy with chains kept contiguous (module docstring).

    ``bypass=False`` (policy ``belady``): like the store, every missing block
    of a request is stored; to make room, the cached block whose next use is
    furthest ahead is evicted, never one of the request's own blocks.
    ``bypass=True`` (policy ``belady_min``): MIN, which also declines to store
    a block whose own next use is the furthest (with the rest of its chain):
    optimal admission as well as eviction, the bound for a store with perfect
    admission control."""
    t0 = time.perf_counter()
    cap = int(capacity_blocks)
    res = base_result(pt, "belady_min" if bypass else "belady", cap)
    n = pt.blocks
    nxt = pt.next_use()
    depth = np.arange(n, dtype=np.int64) - np.repeat(pt.offsets[:-1], np.diff(pt.offsets))
    # the rank of a block after its use at position p: its next use, or, if
    # never used again, past every position, deeper blocks first
    rank = np.where(nxt >= 0, nxt, n + 1 + depth).tolist()
    ids = pt.ids
    ids_l = ids.tolist()
    nid = pt.distinct_blocks
    present = np.zeros(nid, dtype=bool)
    inreq = np.full(nid, -1, dtype=np.int64)  # the request that last used a block
    cur = [-1] * nid  # current rank of a cached block
    heap: list[tuple[int, int]] = []  # (-rank, id), lazily invalidated
    push, pop = heapq.heappush, heapq.heappop
    size = hits = evicted = bypassed = stored = rejected = 0
    offs = pt.offsets.tolist()
    per_req = np.zeros(pt.requests, dtype=np.int64)
    for r in range(pt.requests):
        s, e = offs[r], offs[r + 1]
        if s == e:
            continue
        bid = ids[s:e]
        pres = present[bid]
        h = (e - s) if pres.all() else int(pres.argmin())
        hits += h
        per_req[r] = h
        inreq[bid] = r
        for p in range(s, s + h):
            b, k = ids_l[p], rank[p]
            cur[b] = k
            push(heap, (-k, b))
        aside: list[tuple[int, int]] = []  # valid entries of this request's blocks
        for p in range(s + h, e):
            b, k = ids_l[p], rank[p]
            if size >= cap:
                v, negk = -1, 0
                while heap:  # the valid top: the cached block used furthest ahead
                    negk, v = heap[0]
                    if not (present[v] and cur[v] == -negk):
                        pop(heap)
                    elif not bypass and inreq[v] == r:
                        aside.append(pop(heap))  # the request's own blocks stay
                    else:
                        break
                else:
                    v = -1
                if v < 0 or (bypass and -negk <= k):
                    if v < 0:
                        rejected += e - p
                    else:
                        bypassed += e - p  # this block and the rest of its chain
                    break
                pop(heap)
                present[v] = False
                cur[v] = -1
                size -= 1
                evicted += 1
            present[b] = True
            cur[b] = k
            push(heap, (-k, b))
            size += 1
            stored += 1
        for item in aside:
            push(heap, item)
        if len(heap) > 4 * (size + 1024):  # drop stale entries now and then
            heap = [(nk, v) for nk, v in heap if present[v] and cur[v] == -nk]
            heapq.heapify(heap)
    res.hit_blocks = hits
    res.request_hits = per_req
    res.tier_hits = {"dram": hits}
    res.evictions = {"dram/evicted": evicted}
    res.put_blocks = stored
    res.bypassed_blocks = bypassed
    res.rejected_blocks = rejected
    res.seconds = time.perf_counter() - t0
    return res

