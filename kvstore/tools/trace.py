"""A request trace hashed once for replays: :class:`TraceRequest` (one
request), :func:`prepare` (every request's full-block keys in one array,
dense block ids, next-use table), :func:`capacity_levels` and
:func:`read_trace` (the JSON-lines trace format)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace, as_token_array, block_keys_array

__all__ = ["PreparedTrace", "TraceRequest", "capacity_levels", "prepare", "read_trace"]


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request as the replay needs it (the JSON-lines trace format)."""

    tenant: str
    tokens: np.ndarray
    arrival: float = 0.0


@dataclass(slots=True)
class PreparedTrace:
    """A trace hashed once: every request's block keys, in one array."""

    block_size: int
    model_id: str
    tenants: list[str]
    tenant_of: np.ndarray
    """Per request: index into ``tenants`` (int32)."""
    n_tokens: np.ndarray
    """Per request: prompt length in tokens (int64)."""
    offsets: np.ndarray
    """Request r's blocks are ``keys[offsets[r]:offsets[r + 1]]`` (int64, R + 1)."""
    keys: np.ndarray
    """Every request's block keys, ``(N, 2)`` uint64 (the 16 key bytes)."""
    ids: np.ndarray
    """Dense block id per entry of ``keys``: equal keys, equal ids (int64)."""
    name: str = ""
    _next: np.ndarray | None = field(default=None, repr=False)

    @property
    def requests(self) -> int:
        return int(self.tenant_of.size)

    @property
    def blocks(self) -> int:
        return int(self.keys.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.n_tokens.sum())

    @property
    def distinct_blocks(self) -> int:
        return int(self.ids.max()) + 1 if self.ids.size else 0

    def namespaces(self) -> list[Namespace]:
        return [Namespace(tenant=t, model_id=self.model_id, block_size=self.block_size) for t in self.tenants]

    def next_use(self) -> np.ndarray:
        """Per position p: the next position holding the same block, or -1."""
        if self._next is None:
            ids = self.ids
            nxt = np.full(ids.size, -1, dtype=np.int64)
            if ids.size:
                order = np.argsort(ids, kind="stable")
                same = ids[order[1:]] == ids[order[:-1]]
                nxt[order[:-1][same]] = order[1:][same]
            self._next = nxt
        return self._next

    def request_of(self) -> np.ndarray:
        """Per position: the request it belongs to."""
        return np.repeat(np.arange(self.requests, dtype=np.int64), np.diff(self.offsets))

    def live_peak(self) -> int:
        """The most blocks that, just before some request, have been used
        and will be used again (by that request or a later one): the
        smallest capacity at which MIN (:func:`kvstore.tools.belady.belady` with ``bypass``)
        reaches the hits of an unbounded cache."""
        if not self.requests:
            return 0
        nxt = self.next_use()
        req = self.request_of()
        live = nxt >= 0
        delta = np.zeros(self.requests + 2, dtype=np.int64)
        # live from the boundary after its use through the one before its next use
        np.add.at(delta, req[live] + 1, 1)
        np.add.at(delta, req[nxt[live]] + 1, -1)
        return int(max(0, np.cumsum(delta).max()))


def _as_request(r: Any, i: int) -> TraceRequest:
    if isinstance(r, TraceRequest):
        return r
    if isinstance(r, tuple):
        tenant, tokens = r[0], r[1]
        arrival = float(r[2]) if len(r) > 2 else float(i)
    else:
        tenant, tokens, arrival = r.tenant, r.tokens, float(getattr(r, "arrival", i))
    return TraceRequest(str(tenant), np.asarray(tokens, dtype=np.uint32), arrival)


def prepare(trace: Iterable[Any], block_size: int = 16, model_id: str = "replay", name: str = "") -> PreparedTrace:
    """Hash every request's full blocks (one call per request) and give each
    distinct key a dense id. Requests are kept in the given order."""
    if block_size < 1:
        raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
    reqs = [_as_request(r, i) for i, r in enumerate(trace)]
    tenants = sorted({r.tenant for r in reqs})
    tix = {t: i for i, t in enumerate(tenants)}
    nss = [Namespace(tenant=t, model_id=model_id, block_size=block_size) for t in tenants]
    parts = [block_keys_array(nss[tix[r.tenant]], r.tokens) for r in reqs]
    counts = np.fromiter((p.shape[0] for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = np.concatenate(parts) if parts else np.zeros((0, 16), np.uint8)
    keys = np.ascontiguousarray(flat).view("<u8").reshape(-1, 2)
    if keys.shape[0]:
        rec = keys.view([("a", "<u8"), ("b", "<u8")]).reshape(-1)
        _, ids = np.unique(rec, return_inverse=True)
        ids = ids.reshape(-1).astype(np.int64)
    else:
        ids = np.zeros(0, dtype=np.int64)
    return PreparedTrace(block_size, model_id, tenants,
                         np.fromiter((tix[r.tenant] for r in reqs), dtype=np.int32, count=len(reqs)),
                         np.fromiter((r.tokens.size for r in reqs), dtype=np.int64, count=len(reqs)),
                         offsets, keys, ids, name)


def capacity_levels(pt: PreparedTrace, fractions: Sequence[float]) -> list[int]:
    """Capacities (blocks) as fractions of the trace's live peak (see
    :meth:`PreparedTrace.live_peak`), rounded up to a multiple of 16."""
    peak = max(pt.live_peak(), 1)
    return [max(16, -(-math.ceil(peak * f) // 16) * 16) for f in fractions]



def read_trace(path: str) -> list[TraceRequest]:
    """A JSON-lines trace: one ``{"tenant", "tokens": [...], "arrival"}`` per
    line (``tokens`` required), sorted by arrival."""
    out: list[TraceRequest] = []
    i = -1
    try:
        with open(path) as f:
            for i, line in enumerate(f):
                if line.strip():
                    d = json.loads(line)
                    if not isinstance(d, dict):
                        raise ValueError(f"line {i + 1}: expected a JSON object, got {type(d).__name__}")
                    if "tokens" not in d:
                        raise ValueError(f'line {i + 1}: no "tokens" list')
                    # ids validated as the engines' keys take them: a negative, too large or
                    # non-integer id is an error, never wrapped or truncated into another id
                    tokens = as_token_array(d["tokens"], f"line {i + 1}: tokens")
                    out.append(TraceRequest(str(d.get("tenant", "default")), tokens,
                                            float(d.get("arrival", i))))
    except InvalidArgument as e:
        raise InvalidArgument(f"cannot read trace {path}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        where = f"line {i + 1}: " if i >= 0 and not str(e).startswith("line ") else ""
        raise InvalidArgument(f"cannot read trace {path}: {where}{e}") from None
    out.sort(key=lambda r: r.arrival)
    return out
