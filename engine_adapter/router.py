"""A prefix-aware router fed by kvstore's own event stream (``WatchEvents``).

Each daemon numbers its ``BlockStored``/``BlockRemoved``/``Cleared``
events; :class:`PrefixRouter` follows one stream per endpoint (an engine
node with its daemon) and keeps, per block key, the endpoints that hold
it. :meth:`PrefixRouter.rank` hashes a prompt once (``block_keys``) and
orders the endpoints by how many leading blocks each holds, which is what
a request router needs to send a prompt where its prefix is cached.

It trusts nothing it cannot see: a ``Gap`` (the router fell behind the
daemon's ring buffer, or the daemon restarted), or an event from another
daemon run (its ``run_id``), forgets everything known about that endpoint,
which then refills from new events. Block keys are
already namespace-seeded (16-byte chained digests), so the router needs
the namespace only to hash a prompt, never to tell namespaces apart.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable

from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, TokenInput, block_keys
from kvstore.results import Event, EventKind, DropReason

__all__ = ["EndpointHit", "PrefixRouter"]


@dataclass(slots=True, frozen=True)
class EndpointHit:
    endpoint: str
    blocks: int
    """Leading blocks of the prompt this endpoint's daemon holds."""


class PrefixRouter:
    """Per-key endpoint sets, maintained from each daemon's ``WatchEvents``."""

    def __init__(self) -> None:
        self._where: dict[bytes, set[str]] = {}
        self._keys: dict[str, dict[bytes, bytes]] = {}  # endpoint -> key -> ns digest
        self.seq: dict[str, int] = {}
        self.run_ids: dict[str, int] = {}
        """Per endpoint, the daemon run its table describes (events' ``run_id``)."""
        self.gaps: dict[str, int] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ events
    def apply(self, endpoint: str, ev: Event) -> None:
        """Fold one event from ``endpoint``'s daemon into the table."""
        kind = ev.kind
        with self._lock:
            mine = self._keys.setdefault(endpoint, {})
            if ev.run_id:
                run = self.run_ids.get(endpoint, 0)
                if run and ev.run_id != run:  # the daemon restarted: its old blocks are gone
                    self.gaps[endpoint] = self.gaps.get(endpoint, 0) + 1
                    self._drop(endpoint, list(mine))
                    self.seq[endpoint] = 0  # the old run's numbers mean nothing in the new one
                self.run_ids[endpoint] = ev.run_id
            if ev.seq:
                self.seq[endpoint] = ev.seq
            if kind is EventKind.STORED:
                for k in ev.keys:
                    mine[k] = ev.ns_digest
                    self._where.setdefault(k, set()).add(endpoint)
            elif kind is EventKind.REMOVED:
                if ev.reason is DropReason.MOVED:
                    return  # changed tier, still held (its new tier arrives as a stored event)
                self._drop(endpoint, ev.keys)
            elif kind is EventKind.CLEARED:
                d = ev.ns_digest
                self._drop(endpoint, [k for k, nd in mine.items() if ev.all_namespaces or nd == d])
            elif kind is EventKind.GAP:
                self.gaps[endpoint] = self.gaps.get(endpoint, 0) + 1
                self._drop(endpoint, list(mine))
                self.seq[endpoint] = 0  # the replay that follows renumbers it (a cut stream starts over)

    def _drop(self, endpoint: str, keys: Iterable[bytes]) -> None:
        mine = self._keys.get(endpoint, {})
        for k in keys:
            mine.pop(k, None)
            eps = self._where.get(k)
            if eps is not None:
                eps.discard(endpoint)
                if not eps:
                    del self._where[k]

    def poll(self, endpoint: str, client: Client, seconds: float = 0.5) -> int:
        """Apply the events ``endpoint``'s daemon has after the last one seen,
        waiting up to ``seconds`` for more; returns how many were applied."""
        n = 0
        for ev in client.watch_events(after_seq=self.seq.get(endpoint, 0), timeout=seconds,
                                      run_id=self.run_ids.get(endpoint, 0)):
            self.apply(endpoint, ev)
            n += 1
        return n

    def follow(self, endpoint: str, client: Client, stop: threading.Event) -> threading.Thread:
        """Keep applying ``endpoint``'s events on a daemon thread until ``stop``
        is set (a broken stream is reopened from the last seen sequence)."""
        def run() -> None:
            while not stop.is_set():
                try:
                    self.poll(endpoint, client, 1.0)
                except KVStoreError:
                    stop.wait(1.0)

        t = threading.Thread(target=run, daemon=True, name=f"kvstore-router-{endpoint}")
        t.start()
        return t

    # ------------------------------------------------------------ queries
    def rank(self, ns: Namespace, tokens: TokenInput) -> list[EndpointHit]:
        """Endpoints by leading cached blocks of ``tokens`` (most first; only those with a hit)."""
        keys = block_keys(ns, tokens)
        with self._lock:
            alive: set[str] | None = None
            depth: dict[str, int] = {}
            for i, k in enumerate(keys):  # one dict lookup per block
                eps = self._where.get(k, set())
                alive = set(eps) if alive is None else alive & eps
                if not alive:
                    break
                for e in alive:
                    depth[e] = i + 1
        return sorted((EndpointHit(e, b) for e, b in depth.items()), key=lambda h: (-h.blocks, h.endpoint))

    def known_blocks(self, endpoint: str) -> int:
        with self._lock:
            return len(self._keys.get(endpoint, {}))
