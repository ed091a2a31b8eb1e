"""What each backend's daemon holds, by tier, from its ``WatchEvents`` stream.

One :class:`CacheView` per backend follows the daemon's numbered events on a
daemon thread (the sync :class:`kvstore.client.Client`; a broken stream is
reopened from the last sequence seen) and keeps ``key -> tier``. A ``Gap``
(the view fell behind the daemon's ring buffer, or the daemon restarted)
forgets everything, which then refills from the replay; so does an event
whose ``run_id`` is not the run the table came from (the daemon restarted
and its new sequence already passed the one the view resumes from). Either
also forgets the sequence seen: the next stream resumes from the daemon's
oldest buffered event, never from an old run's number (which, in the new
run, would skip that run's first events). :meth:`chain_tiers`
answers, for a prompt's keys, the tier of each leading block held (a chain
stops at its first miss), with one dict lookup per block.

Optionally (``cluster = true`` on the backend) :meth:`cluster_tiers` asks the
daemon a cluster-mode ``Lookup`` for the blocks after the local run that a
peer could supply; those count in the ``remote`` tier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.results import DropReason, Event, EventKind
from tiers.base import TierKind

log = logging.getLogger("kvstore.router")

__all__ = ["CacheView"]

_REMOTE = int(TierKind.REMOTE)


class CacheView:
    """``key -> tier`` of one daemon, maintained from its events."""

    def __init__(self, name: str, target: str, token: str | None = None) -> None:
        self.name = name
        self.target = target
        self.token = token or None
        self._tier: dict[bytes, int] = {}
        self._ns: dict[bytes, bytes] = {}
        self.seq = 0
        self.run_id = 0
        """The daemon run the table describes (its events' ``run_id``; 0 until one is seen)."""
        self.gaps = 0
        self.events = 0
        self.connected = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Client | None = None
        self._lookup_client: Client | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ events
    def apply(self, ev: Event) -> None:
        """Fold one event (the client's typed ``Event``) into the table."""
        self.events += 1
        if ev.run_id:
            if self.run_id and ev.run_id != self.run_id:  # the daemon restarted: its old blocks are gone
                self.gaps += 1
                self._tier, self._ns = {}, {}
                self.seq = 0  # the old run's numbers mean nothing in the new one
            self.run_id = ev.run_id
        if ev.seq:
            self.seq = ev.seq
        if ev.kind is EventKind.STORED:
            t = int(ev.tier) if ev.tier is not None else int(TierKind.DRAM)
            for k in ev.keys:
                self._tier[k] = t
                self._ns[k] = ev.ns_digest
        elif ev.kind is EventKind.REMOVED:
            if ev.reason is DropReason.MOVED:
                return  # changed tier: the stored event of the new tier says where
            for k in ev.keys:
                self._tier.pop(k, None)
                self._ns.pop(k, None)
        elif ev.kind is EventKind.CLEARED:
            if ev.all_namespaces:
                self._tier, self._ns = {}, {}
            else:
                gone = [k for k, nd in self._ns.items() if nd == ev.ns_digest]
                for k in gone:
                    self._tier.pop(k, None)
                    self._ns.pop(k, None)
        elif ev.kind is EventKind.GAP:
            self.gaps += 1
            self._tier, self._ns = {}, {}
            self.seq = 0  # the replay that follows renumbers it; a stream cut first resumes from the start

    def poll(self, client: Client, seconds: float) -> int:
        """Apply the events after the last one seen, waiting up to ``seconds``."""
        n = 0
        for ev in client.watch_events(after_seq=self.seq, timeout=seconds, run_id=self.run_id):
            self.apply(ev)
            self.connected = True
            n += 1
        return n

    def start(self) -> None:
        """Follow the daemon on a daemon thread until :meth:`stop`."""
        def run() -> None:
            while not self._stop.is_set():
                try:
                    if self._client is None:
                        self._client = Client(self.target, token=self.token, use_shm=False, session=False)
                    self.poll(self._client, 1.0)
                    self.connected = True
                except KVStoreError as e:
                    if self.connected:
                        log.warning("backend %s: event stream from %s broke: %s", self.name, self.target, e)
                    self.connected = False
                    self._stop.wait(0.5)
                except Exception as e:  # a daemon that is not up yet, a channel that closed
                    self.connected = False
                    log.debug("backend %s: event stream: %s", self.name, e)
                    self._stop.wait(0.5)

        self._thread = threading.Thread(target=run, daemon=True, name=f"kvstore-route-events-{self.name}")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        for c in (self._client, self._lookup_client):
            if c is not None:
                try:
                    c.close()
                except Exception:
                    pass
        if self._thread is not None:
            self._thread.join(timeout=3.0)

    # ------------------------------------------------------------ queries
    def chain_tiers(self, keys: Sequence[bytes]) -> np.ndarray:
        """The tier (``TierKind`` value) of each leading held block of ``keys``."""
        tier = self._tier
        out: list[int] = []
        for k in keys:  # one dict lookup per block
            t = tier.get(k)
            if t is None:
                break
            out.append(t)
        return np.asarray(out, dtype=np.int64)

    def cluster_tiers(self, ns: Namespace, keys: Sequence[bytes], local: np.ndarray) -> np.ndarray:
        """``local`` extended by the run a cluster peer could supply after it
        (a blocking cluster-mode Lookup: call it off the event loop)."""
        if len(local) >= len(keys):
            return local
        with self._lock:
            if self._lookup_client is None:
                self._lookup_client = Client(self.target, token=self.token, use_shm=False, session=False)
            c = self._lookup_client
        try:
            r = c.cluster_lookup(ns, keys)
        except KVStoreError as e:
            log.debug("backend %s: cluster lookup failed: %s", self.name, e)
            return local
        # counts from the wire: at most up to the prompt's last key (never allocate what a daemon claims)
        claimed = int(r.local_blocks) + int(r.remote_blocks) if r.decision == "fetch" else 0
        extra = min(max(claimed - len(local), 0), len(keys) - len(local))
        if not extra:
            return local
        return np.concatenate([local, np.full(extra, _REMOTE, dtype=np.int64)])

    def held_blocks(self) -> int:
        return len(self._tier)
