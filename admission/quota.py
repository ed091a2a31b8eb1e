"""Per-tenant capacity shares, request-rate limits and class fairness (issue 7).

Three independent pieces of pure decision code (no I/O; time from an injected
clock):

- **Capacity shares per tier.** :class:`TenantShares` names each tenant's
  share of a tier; a tenant over its share is where eviction looks first, so
  tenant B's burst evicts B's own blocks and leaves tenant A's blocks, within
  A's share, untouched. The store calls the vectorized :func:`victim_mask` /
  :func:`victim_order` on its candidate arrays. Shares are not caps: a tenant
  may use free room beyond its share (work conserving); it only becomes the
  first victim once eviction is needed.
- **Request-rate limits.** :class:`TokenBucket` and :class:`TenantRateLimiter`
  (one bucket per tenant, lazily created, bounded in number).
- **Class fairness (Preble).** Requests are classed, by default by cache-hit
  ratio (:class:`HitClass`), and :class:`ClassFairness` guarantees each class a
  minimum share of the grants (admissions, or queue slots) within a sliding
  window, so that a hot prefix cannot starve requests with short or no hits.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from tiers.base import TierKind

__all__ = [
    "ClassFairness", "HitClass", "RateLimit", "TenantRateLimiter", "TenantShares", "TokenBucket",
    "hit_class", "over_share_mask", "victim_mask", "victim_order",
]

Clock = Callable[[], float]


def _check_share(name: str, v: float) -> float:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0):
        raise InvalidArgument(f"{name} must be a fraction in [0, 1], got {v!r}")
    return float(v)


# ============================================================ capacity shares
class TenantShares:
    """Each tenant's share of a tier's capacity (fractions in [0, 1]).

    ``shares`` applies to every tier unless ``per_tier`` overrides it for a
    tier; tenants not named get ``default``. The named shares of one tier must
    sum to at most 1 (a guarantee cannot be oversubscribed).
    ``TenantShares({}, default=1.0)`` is "no quotas": nobody is ever over.
    """

    def __init__(self, shares: Mapping[str, float], default: float = 0.0,
                 per_tier: Mapping[TierKind, Mapping[str, float]] | None = None) -> None:
        self.default = _check_share("default share", default)
        self._shares = {str(t): _check_share(f"share of tenant {t!r}", v) for t, v in shares.items()}
        self._per_tier: dict[TierKind, dict[str, float]] = {}
        for tier, m in (per_tier or {}).items():
            if not isinstance(tier, TierKind):
                raise InvalidArgument(f"per_tier keys must be TierKind, got {tier!r}")
            self._per_tier[tier] = {str(t): _check_share(f"{tier.label} share of tenant {t!r}", v)
                                    for t, v in m.items()}
        for label, m in [("all tiers", self._shares)] + [(t.label, m) for t, m in self._per_tier.items()]:
            total = sum(m.values())
            if total > 1.0 + 1e-9:
                raise InvalidArgument(f"tenant shares for {label} sum to {total:.3f}; they must sum to <= 1")

    def _table(self, tier: TierKind | None) -> dict[str, float]:
        if tier is not None and tier in self._per_tier:
            return self._per_tier[tier]
        return self._shares

    def share(self, tenant: str, tier: TierKind | None = None) -> float:
        """The tenant's share of ``tier`` (of every tier when None)."""
        return self._table(tier).get(tenant, self.default)

    def array(self, tenants: Sequence[str], tier: TierKind | None = None) -> np.ndarray:
        """Shares of ``tenants`` as a float64 array (tenant id = position), for
        :func:`victim_mask`."""
        t = self._table(tier)
        return np.array([t.get(x, self.default) for x in tenants], dtype=np.float64)

    def over_share(self, usage_by_tenant: Mapping[str, int], capacity: int,
                   tier: TierKind | None = None) -> set[str]:
        """Tenants whose usage (bytes) exceeds share * capacity."""
        if capacity < 0:
            raise InvalidArgument(f"capacity must be >= 0, got {capacity}")
        return {t for t, u in usage_by_tenant.items() if u > self.share(t, tier) * capacity}

    def usage_ratio(self, usage_by_tenant: Mapping[str, int], capacity: int,
                    tier: TierKind | None = None) -> dict[str, float]:
        """usage / (share * capacity) per tenant (> 1 = over; inf for a zero
        share with usage): the ``kvstore_quota_usage_ratio`` gauge."""
        out = {}
        for t, u in usage_by_tenant.items():
            allowed = self.share(t, tier) * capacity
            out[t] = (u / allowed) if allowed > 0 else (math.inf if u > 0 else 0.0)
        return out

    def eviction_order_hint(self, usage_by_tenant: Mapping[str, int], capacity: int,
                            tier: TierKind | None = None) -> list[str]:
        """Over-share tenants, most bytes over their share first: whose blocks
        eviction should take first, in that order."""
        over = [(u - self.share(t, tier) * capacity, t) for t, u in usage_by_tenant.items()
                if u > self.share(t, tier) * capacity]
        return [t for _, t in sorted(over, key=lambda x: (-x[0], x[1]))]


def _arrays(tenant_ids: np.ndarray, usage: np.ndarray, shares: np.ndarray,
            capacity_bytes: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tid = np.asarray(tenant_ids)
    use = np.asarray(usage, dtype=np.float64).reshape(-1)
    sh = np.asarray(shares, dtype=np.float64).reshape(-1)
    if use.shape != sh.shape:
        raise InvalidArgument(f"usage_bytes_by_tenant and shares must have one entry per tenant; "
                              f"got {use.size} and {sh.size}")
    if not np.issubdtype(tid.dtype, np.integer) and tid.size:
        raise InvalidArgument(f"tenant ids must be integers, got dtype {tid.dtype}")
    tid = tid.astype(np.int64, copy=False).reshape(-1)
    if tid.size and (tid.min() < 0 or tid.max() >= use.size):
        raise InvalidArgument(f"tenant ids must be in [0, {use.size}); got {int(tid.min())}..{int(tid.max())}")
    if not (capacity_bytes >= 0):
        raise InvalidArgument(f"capacity_bytes must be >= 0, got {capacity_bytes!r}")
    return tid, use, sh


def over_share_mask(usage_bytes_by_tenant: np.ndarray, capacity_bytes: float, shares: np.ndarray) -> np.ndarray:
    """Per tenant id: is the tenant over its share (usage > share * capacity)?"""
    _, use, sh = _arrays(np.zeros(0, np.int64), usage_bytes_by_tenant, shares, capacity_bytes)
    return np.asarray(use > sh * float(capacity_bytes), dtype=bool)


def victim_mask(tenant_ids_of_candidates: np.ndarray, usage_bytes_by_tenant: np.ndarray, capacity_bytes: float,
                shares: np.ndarray) -> np.ndarray:
    """Which eviction candidates belong to tenants over their share.

    ``tenant_ids_of_candidates``: int array, one tenant id per candidate;
    ``usage_bytes_by_tenant`` and ``shares``: one entry per tenant id (bytes
    held in this tier; share fraction). Returns a bool mask over candidates.
    The store evicts from the masked candidates first (in policy order) and
    falls back to the rest only when they run out.
    """
    tid, use, sh = _arrays(tenant_ids_of_candidates, usage_bytes_by_tenant, shares, capacity_bytes)
    over = use > sh * float(capacity_bytes)
    return np.asarray(over[tid], dtype=bool)


def victim_order(tenant_ids_of_candidates: np.ndarray, rank: np.ndarray, usage_bytes_by_tenant: np.ndarray,
                 capacity_bytes: float, shares: np.ndarray, sizes: np.ndarray | None = None) -> np.ndarray:
    """Candidate positions in eviction order: over-share tenants' blocks first.

    ``rank``: the eviction policy's rank per candidate (lower = evict sooner).
    Preferred candidates (of over-share tenants) come first in rank order, then
    the rest in rank order. With ``sizes`` (bytes per candidate), a tenant's
    blocks are preferred only until its overage is covered, so eviction never
    pushes a tenant below its share while another is still over.
    """
    tid, use, sh = _arrays(tenant_ids_of_candidates, usage_bytes_by_tenant, shares, capacity_bytes)
    rk = np.asarray(rank, dtype=np.float64).reshape(-1)
    if rk.size != tid.size:
        raise InvalidArgument(f"rank must have one entry per candidate; got {rk.size} for {tid.size}")
    n = tid.size
    pos = np.arange(n, dtype=np.int64)
    over_by = use - sh * float(capacity_bytes)
    preferred = over_by[tid] > 0
    if sizes is not None:
        sz = np.asarray(sizes, dtype=np.float64).reshape(-1)
        if sz.size != n:
            raise InvalidArgument(f"sizes must have one entry per candidate; got {sz.size} for {n}")
        by_tenant = np.lexsort((pos, rk, tid))  # tenant, then rank order within a tenant
        cs = np.cumsum(sz[by_tenant])
        t_sorted = tid[by_tenant]
        starts = np.flatnonzero(np.r_[True, t_sorted[1:] != t_sorted[:-1]]) if n else np.zeros(0, np.int64)
        base = np.zeros(n, dtype=np.float64)
        if n:
            before = np.r_[0.0, cs[:-1]]
            group_start = np.repeat(before[starts], np.diff(np.r_[starts, n]))
            base = before - group_start  # bytes of the same tenant ranked before this one
        keep = np.zeros(n, dtype=bool)
        keep[by_tenant] = base < over_by[t_sorted]
        preferred &= keep
    return np.lexsort((pos, rk, ~preferred))


# ============================================================ rate limits
class TokenBucket:
    """A token bucket: ``rate_per_s`` tokens a second, at most ``burst`` held."""

    def __init__(self, rate_per_s: float, burst: float, clock: Clock, *, start_full: bool = True) -> None:
        if not (math.isfinite(rate_per_s) and rate_per_s > 0):
            raise InvalidArgument(f"rate_per_s must be > 0, got {rate_per_s!r}")
        if not (math.isfinite(burst) and burst >= 1):
            raise InvalidArgument(f"burst must be >= 1, got {burst!r}")
        self.rate = float(rate_per_s)
        self.burst = float(burst)
        self.clock = clock
        self._tokens = self.burst if start_full else 0.0
        self._t = clock()

    def _refill(self) -> None:
        now = self.clock()
        if now > self._t:
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        self._t = max(self._t, now)

    @property
    def tokens(self) -> float:
        """Tokens available now."""
        self._refill()
        return self._tokens

    def peek(self, n: float = 1.0) -> float:
        """0 when ``n`` tokens are available now, else seconds until they are."""
        if n > self.burst:
            raise InvalidArgument(f"cannot take {n} tokens from a bucket of burst {self.burst}")
        self._refill()
        return 0.0 if self._tokens >= n else (n - self._tokens) / self.rate

    def acquire(self, n: float = 1.0) -> float:
        """Take ``n`` tokens and answer 0, or take nothing and answer the wait."""
        wait = self.peek(n)
        if wait == 0.0:
            self._tokens -= n
        return wait

    def try_take(self, n: float = 1.0) -> bool:
        """Take ``n`` tokens if available."""
        return self.acquire(n) == 0.0


@dataclass(slots=True, frozen=True)
class RateLimit:
    """A tenant's request rate: ``rate_per_s`` sustained, ``burst`` at once."""

    rate_per_s: float
    burst: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s > 0):
            raise InvalidArgument(f"rate_per_s must be > 0, got {self.rate_per_s!r}")
        if not (math.isfinite(self.burst) and self.burst >= 1):
            raise InvalidArgument(f"burst must be >= 1, got {self.burst!r}")


class TenantRateLimiter:
    """One :class:`TokenBucket` per tenant.

    ``default`` applies to tenants not in ``per_tenant``; ``None`` (either
    place) means unlimited. At most ``max_tenants`` buckets are kept; the least
    recently used is dropped (it comes back full: lenient, never unbounded).
    """

    def __init__(self, default: RateLimit | None, clock: Clock,
                 per_tenant: Mapping[str, RateLimit | None] | None = None, max_tenants: int = 10_000) -> None:
        if max_tenants < 1:
            raise InvalidArgument(f"max_tenants must be >= 1, got {max_tenants}")
        self.default = default
        self.per_tenant = dict(per_tenant or {})
        self.clock = clock
        self.max_tenants = max_tenants
        self._buckets: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self.limited: collections.Counter[str] = collections.Counter()
        """Requests refused per tenant."""

    def _bucket(self, tenant: str) -> TokenBucket | None:
        b = self._buckets.get(tenant)
        if b is not None:
            self._buckets.move_to_end(tenant)
            return b
        lim = self.per_tenant.get(tenant, self.default)
        if lim is None:
            return None
        b = TokenBucket(lim.rate_per_s, lim.burst, self.clock)
        self._buckets[tenant] = b
        if len(self._buckets) > self.max_tenants:
            self._buckets.popitem(last=False)
        return b

    def peek(self, tenant: str, n: float = 1.0) -> float:
        """0 when the tenant may make ``n`` requests now, else the wait (nothing taken)."""
        b = self._bucket(tenant)
        return 0.0 if b is None else b.peek(n)

    def acquire(self, tenant: str, n: float = 1.0) -> float:
        """Take ``n`` tokens and answer 0, or answer the wait (counted as limited)."""
        b = self._bucket(tenant)
        if b is None:
            return 0.0
        wait = b.acquire(n)
        if wait > 0.0:
            self.limited[tenant] += 1
        return wait


# ============================================================ class fairness
class HitClass(IntEnum):
    """Requests by cache-hit ratio (Preble groups requests this way)."""

    NONE = 0
    LOW = 1
    MEDIUM = 2
    HIGH = 3

    @property
    def label(self) -> str:
        return self.name.lower()


DEFAULT_HIT_EDGES: tuple[float, float, float] = (0.05, 0.5, 0.9)
"""Ratio edges: < 0.05 NONE, < 0.5 LOW, < 0.9 MEDIUM, else HIGH."""


def hit_class(hit_ratio: float, edges: tuple[float, float, float] = DEFAULT_HIT_EDGES) -> HitClass:
    """The class of a request whose cached tokens are ``hit_ratio`` of its prompt."""
    if not (0.0 <= hit_ratio <= 1.0):
        raise InvalidArgument(f"hit_ratio must be in [0, 1], got {hit_ratio!r}")
    return HitClass(int(np.searchsorted(np.asarray(edges), hit_ratio, side="right")))


DEFAULT_MIN_SHARES: Mapping[Hashable, float] = {HitClass.NONE: 0.1, HitClass.LOW: 0.1, HitClass.MEDIUM: 0.1,
                                                HitClass.HIGH: 0.1}
"""Default guarantees: every hit class may claim up to 10% of the grants."""


class ClassFairness:
    """Guaranteed minimum shares of grants per class over a sliding window.

    Each class has a minimum share (its quota) of the grants. :meth:`pick`
    serves classes under their quota first. A class's guarantee is ``min(min_share, its share of the arrivals)``: a
    class cannot be owed more than it asked for. It is *starved* when its share
    of the grants in the window is below its guarantee (once the window holds
    at least ``min_samples`` grants). Grants are admissions when the
    :class:`admission.slo.AdmissionController` holds this object, or service
    starts when an engine's local queue uses :meth:`pick` to form batches.

    The window is ``buckets`` sub-windows of ``window_s / buckets`` each, so
    every call is O(classes); at most ``max_classes`` labels are tracked.
    """

    def __init__(self, clock: Clock, min_shares: Mapping[Hashable, float] | None = None, *,
                 default_share: float = 0.0, window_s: float = 10.0, buckets: int = 20, min_samples: int = 20,
                 tolerance: float = 0.0, max_classes: int = 64) -> None:
        shares = dict(DEFAULT_MIN_SHARES if min_shares is None else min_shares)
        for k, v in shares.items():
            _check_share(f"min share of class {k!r}", v)
        if sum(shares.values()) > 1.0 + 1e-9:
            raise InvalidArgument(f"class min shares sum to {sum(shares.values()):.3f}; they must sum to <= 1")
        if not (math.isfinite(window_s) and window_s > 0):
            raise InvalidArgument(f"window_s must be > 0, got {window_s!r}")
        if buckets < 1 or max_classes < 1 or min_samples < 0:
            raise InvalidArgument("buckets and max_classes must be >= 1, min_samples >= 0")
        self.clock = clock
        self.min_shares = shares
        self.default_share = _check_share("default_share", default_share)
        self.window_s = float(window_s)
        self.min_samples = int(min_samples)
        self.tolerance = float(tolerance)
        self.max_classes = int(max_classes)
        self._width = self.window_s / buckets
        self._nb = buckets
        self._idx: dict[Hashable, int] = {}
        self._labels: list[Hashable] = []
        self._arr = np.zeros((max_classes, buckets), dtype=np.int64)
        self._grant = np.zeros((max_classes, buckets), dtype=np.int64)
        self._share = np.zeros(max_classes, dtype=np.float64)
        self._epoch = int(math.floor(clock() / self._width))
        self._sum_arr = np.zeros(max_classes, dtype=np.int64)
        self._sum_grant = np.zeros(max_classes, dtype=np.int64)
        self._deficit_cache: tuple[int, np.ndarray] | None = None
        self._version = 0

    def _slot(self, label: Hashable) -> int:
        i = self._idx.get(label)
        if i is None:
            if len(self._labels) >= self.max_classes:
                raise InvalidArgument(f"more than {self.max_classes} fairness classes; classify more coarsely")
            i = len(self._labels)
            self._idx[label] = i
            self._labels.append(label)
            self._share[i] = self.min_shares.get(label, self.default_share)
        return i

    def _advance(self) -> None:
        epoch = int(math.floor(self.clock() / self._width))
        if epoch <= self._epoch:
            return
        steps = min(epoch - self._epoch, self._nb)
        for k in range(1, steps + 1):
            b = (self._epoch + k) % self._nb
            self._sum_arr -= self._arr[:, b]
            self._sum_grant -= self._grant[:, b]
            self._arr[:, b] = 0
            self._grant[:, b] = 0
        self._epoch = epoch
        self._version += 1

    def note_arrival(self, label: Hashable) -> None:
        """A request of ``label`` asked (counts toward its demand share)."""
        self._advance()
        i = self._slot(label)
        self._arr[i, self._epoch % self._nb] += 1
        self._sum_arr[i] += 1
        self._version += 1

    def note_grant(self, label: Hashable) -> None:
        """A request of ``label`` was granted (admitted, or started)."""
        self._advance()
        i = self._slot(label)
        self._grant[i, self._epoch % self._nb] += 1
        self._sum_grant[i] += 1
        self._version += 1

    def _deficits(self) -> np.ndarray:
        """guarantee - granted share per tracked class (positive = starved)."""
        self._advance()
        if self._deficit_cache is not None and self._deficit_cache[0] == self._version:
            return self._deficit_cache[1]
        n = len(self._labels)
        arr, gr = self._sum_arr[:n], self._sum_grant[:n]
        ta, tg = int(arr.sum()), int(gr.sum())
        if n == 0 or ta == 0 or tg < self.min_samples:
            d = np.zeros(n, dtype=np.float64)
        else:
            guarantee = np.minimum(self._share[:n], arr / ta)
            d = guarantee - gr / tg - self.tolerance
            d[arr == 0] = -1.0
        self._deficit_cache = (self._version, d)
        return d

    def deficit(self, label: Hashable) -> float:
        """Guaranteed share minus granted share in the window (> 0: starved)."""
        i = self._idx.get(label)
        return 0.0 if i is None else float(self._deficits()[i])

    def quota_gap(self, label: Hashable) -> float:
        """Minimum share minus granted share in the window; > 0: the class is
        under its quota and is served before classes over theirs. -1 for a
        class with no arrivals in the window."""
        self._advance()
        i = self._idx.get(label)
        if i is None or self._sum_arr[i] == 0:
            return -1.0
        n = len(self._labels)
        tg = int(self._sum_grant[:n].sum())
        return float(self._share[i] - (self._sum_grant[i] / tg if tg else 0.0))

    def is_starved(self, label: Hashable) -> bool:
        """Below its guaranteed share of the grants in the window."""
        return self.deficit(label) > 0.0

    def any_starved(self, exclude: Hashable | None = None) -> bool:
        """Is any class (other than ``exclude``) starved?"""
        d = self._deficits()
        j = self._idx.get(exclude) if exclude is not None else None
        if j is not None:
            d = np.delete(d, j)
        return bool((d > 0).any())

    def pick(self, queued: Sequence[Hashable]) -> int:
        """Index into ``queued`` (class labels in arrival order) of the request to
        serve next: the oldest request of the class furthest under its quota
        (minimum share minus granted share), else the oldest (FIFO). Classes
        under their quota go first, so a hot class over its share never makes
        them wait: Preble's per-class quota at batch formation."""
        if not queued:
            raise InvalidArgument("pick needs a non-empty queue")
        best_i, best_g = 0, 0.0
        seen: set[Hashable] = set()
        for pos, label in enumerate(queued):
            if label in seen:
                continue
            seen.add(label)
            g = self.quota_gap(label)
            if g > best_g:
                best_i, best_g = pos, g
        return best_i

    def snapshot(self) -> dict[Hashable, tuple[int, int, float]]:
        """label -> (arrivals, grants, deficit) in the window."""
        d = self._deficits()
        return {lab: (int(self._sum_arr[i]), int(self._sum_grant[i]), float(d[i]))
                for i, lab in enumerate(self._labels)}
