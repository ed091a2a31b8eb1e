"""The fetching side of a cluster fetch (``peers.ClusterNode.fetch`` hands
each remote run here): split the run into block requests that each fit the
peer's receive buffer, fetch them in order into DRAM slots
(``fetch_slots.FetchSlots``), commit what arrived whole with the peer's
checksums, and make the peer suspect when its link failed. The blocks are
not hashed on arrival (``verify=False``) when the store verifies its DRAM
reads (the daemon's always does): their first reader checks them, a
damaged one is a miss there, reported and dropped; a store that does not
(``StoreConfig.verify_reads`` off) has them checked on arrival.

One request carries the ``BlockFetchHeader`` (namespace, credential, 16
bytes per key) and, when sized, 8 bytes per block: it must fit
``transport.ucx_wire.MAX_HEADER`` (1 MiB, past about 43,000 blocks sized or
65,000 in two steps) and hold at most ``MAX_BLOCKS`` blocks. A longer run is
fetched as several pieces, one after another, each reserved with the last
key of the piece before as its parent once that piece is committed: a piece
that fails (or arrives short) ends the run, and the pieces before it stay a
hit (prefix semantics; never a wrong block). The whole run shares one
deadline, ``cluster.fetch_timeout``.

Runs on the daemon's event loop; every change to the store is a store method.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

import numpy as np

from kvstore.buffers import pack_keys
from kvstore.daemon.fetch_slots import FetchSlots
from kvstore.keys import Namespace
from kvstore.wire.convert import ns_pb
from proto import kvstore_pb2 as pb
from transport.ucx_wire import MAX_BLOCKS, MAX_HEADER, FetchFault  # the wire's limits only: importing it does not start UCX

log = logging.getLogger("kvstore.cluster")

REQUEST_BYTES: int = MAX_HEADER
"""The most bytes one block request may carry (its header, plus 8 per block
when sized): the peer's receive buffer. The split reads it here (tests lower it)."""

KEYS_FIELD = 6
"""Most bytes the ``keys_packed`` field adds besides its keys (tag, length varint)."""

def piece_blocks(base_bytes: int, sized: bool) -> int:
    """The most blocks one request may ask for, with a header of
    ``base_bytes`` before its keys; 0 when not even one fits."""
    per = 16 + (8 if sized else 0)
    return max(0, min(MAX_BLOCKS, (REQUEST_BYTES - base_bytes - KEYS_FIELD) // per))


class RunFetch:
    """Fetches the remote runs of one daemon (``peers.ClusterNode`` owns one)."""

    def __init__(self, node_id: str, store: Any, metrics: Any, cfg: Any, client: Any, cost: Any) -> None:
        self.node_id, self.store, self.metrics, self.cfg, self.client, self.cost = \
            node_id, store, metrics, cfg, client, cost

    async def fetch(self, ns: Namespace, want: Sequence[bytes], parent: bytes | None, peer: str,
                    address: str, credential: str) -> int:
        """Fetch ``want`` (after ``parent``, the last local block) from ``peer``
        at ``address`` into DRAM; returns the blocks committed, a prefix of
        ``want``. The cost model fits the link to the whole call (header,
        reservation, wire, checksums, commit), the fetch path's cost after the
        decision, not the wire's alone (the Locate before it is paid either way)."""
        started = time.perf_counter()
        end = time.monotonic() + self.cfg.fetch_timeout
        base = len(pb.BlockFetchHeader(ns=ns_pb(ns), credential=credential, node_id=self.node_id).SerializeToString())
        done = nbytes = 0
        seconds = 0.0
        while done < len(want):
            # sized (one round trip) once this store knows the namespace's block size (fixed by its
            # first block, so after a first piece; never the directory's figure: docs/transport.md)
            own = self.store.block_bytes(ns)
            k = piece_blocks(base, bool(own))
            if k == 0:
                log.warning("a fetch header of %d bytes leaves no room for a key: a miss", base)
                self.metrics.peer_fetch_failed(peer, "error")
                break
            piece = list(want[done:done + k])
            got = await self._piece(ns, piece, want[done - 1] if done else parent, peer, address, credential,
                                    own, max(0.0, end - time.monotonic()))
            if got is None:
                break
            n, b, s = got
            done, nbytes, seconds = done + n, nbytes + b, seconds + s
            if n < len(piece):
                break
        if done:
            self.cost.observe_fetch(peer, nbytes, time.perf_counter() - started)
            self.metrics.peer_fetched(peer, done, nbytes, seconds)
        return done

    async def _piece(self, ns: Namespace, want: list[bytes], parent: bytes | None, peer: str, address: str,
                     credential: str, own: int, timeout: float) -> tuple[int, int, float] | None:
        """One request of a run: (blocks committed, their bytes, seconds), or
        None when it failed as a whole (the metrics and suspicion counted)."""
        header = pb.BlockFetchHeader(ns=ns_pb(ns), credential=credential, keys_packed=pack_keys(want),
                                     node_id=self.node_id).SerializeToString()
        store = self.store
        slots = FetchSlots(store, ns, want, parent)
        sizes = np.full(len(want), own, dtype=np.int64) if own else None
        t0 = time.perf_counter()
        # not hashed on arrival when this store checks every DRAM read against the peer's checksum:
        # each block is hashed once, by its first reader (docs/architecture.md)
        verify = not getattr(getattr(store, "config", None), "verify_reads", False)
        transfer = asyncio.ensure_future(self.client.fetch(address, header, len(want), slots.alloc, timeout,
                                                           sizes=sizes, verify=verify))
        try:  # never cancelled with the caller: the slots end only once the transport is done with them
            finished, _ = await asyncio.wait({transfer}, timeout=timeout + 5.0)
        except asyncio.CancelledError:
            transfer.add_done_callback(slots.settle)
            transfer.add_done_callback(lambda t: self.settled(peer, t))  # (a caller that gave up first)
            raise
        try:
            if not finished:
                transfer.add_done_callback(slots.settle)
                raise TimeoutError(f"the transport overran its deadline of {timeout:g}s")
            res = transfer.result()
        except Exception as e:  # the transport must not hurt the caller: a miss
            log.warning("fetch of %d blocks from %s failed: %s", len(want), peer, e)
            if finished:
                slots.abort()
            else:
                self.suspect(peer, "the transport overran its deadline")
            self.metrics.peer_fetch_failed(peer, "error")
            return None
        if res.error is not None:
            self.settled(peer, transfer)
            slots.failed(res)
            reason = "refused" if res.fault is FetchFault.REFUSED else "error"
            log.info("fetch of %d blocks from %s: %s", len(want), peer, res.error)
            self.metrics.peer_fetch_failed(peer, reason)
            return None
        ok = np.asarray(res.ok, dtype=bool)
        if res.corrupt:
            store.count_checksum_failures(int(res.corrupt), ns)  # (a store method: under the store lock)
            self.metrics.peer_fetch_failed(peer, "corrupt", int(res.corrupt))
        if not slots.handle:
            if ok.size and not ok[0]:
                self.metrics.peer_fetch_failed(peer, "absent")  # a stale directory entry
            return 0, 0, 0.0
        done = slots.commit(ok, res.checksums, verified=verify)
        nbytes = int(np.asarray(res.lengths, dtype=np.int64)[:done].sum())
        seconds = float(res.seconds) if res.seconds else time.perf_counter() - t0
        if done < len(want) and not res.corrupt:
            self.metrics.peer_fetch_failed(peer, "absent" if done == 0 else "partial")
        return done, nbytes, seconds

    def settled(self, peer: str | None, transfer: asyncio.Future[Any]) -> None:
        """A transfer from ``peer`` ended: a link fault (``FetchFault.link``, never its error's words)
        makes the peer suspect."""
        if peer is None or transfer.cancelled() or transfer.exception() is not None:
            return
        res = transfer.result()
        if res.error is not None and res.fault is not None and res.fault.link:
            self.suspect(peer, res.error)

    def suspect(self, peer: str, why: str) -> None:
        """The link to ``peer`` failed: its blocks are misses at once for the back-off, then it is probed."""
        if not self.cost.suspect(peer) and self.cfg.peer_backoff > 0:
            log.warning("cluster: the link to %s failed (%s): its blocks are recomputed for %gs, then it is "
                        "probed again", peer, why, self.cfg.peer_backoff)
        self.cost.mark_suspect(peer)


__all__ = ["KEYS_FIELD", "REQUEST_BYTES", "RunFetch", "piece_blocks"]
