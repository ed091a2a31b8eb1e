"""The serving side of a cluster fetch (``peers.ClusterNode`` hands
``BlockProvider.provide`` to its block server): decode the peer's
``BlockFetchHeader``, authorize it with the caller's credential it carries,
pin the present prefix for the send (a lease released when the send ends)
and hand out views over the slab.

Runs on the daemon's event loop (each store call under the store lock);
the read of blocks on SSD runs on the daemon's disk worker, never on the
loop. ``Served.release`` may be called from a transport thread and hops
back to the loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError
from proto import kvstore_pb2 as pb
from transport.ucx_wire import Served  # the wire's types only: importing it does not start UCX


class BlockProvider:
    """Serves peers' fetches from this daemon's store."""

    def __init__(self, daemon: Any, lease_s: float, is_member: Callable[[str], bool]) -> None:
        self.daemon = daemon
        self.store = daemon.store
        self.metrics = daemon.metrics
        self.lease_s = lease_s
        """How long what is served stays pinned at most (it outlasts the longest send)."""
        self.is_member = is_member
        self.loop = asyncio.get_running_loop()

    async def provide(self, header: bytes) -> Served:
        """Serve a peer's fetch: authorize, pin the present prefix, hand out
        views over the slab; ``release`` unpins."""
        try:
            h = pb.BlockFetchHeader.FromString(bytes(header))
        except Exception:
            raise ValueError("malformed block fetch header") from None
        if len(h.keys_packed) % 16:
            raise ValueError("keys_packed is not a multiple of 16 bytes")
        d = self.daemon
        try:
            who = d.auth.principal([("authorization", f"Bearer {h.credential}")] if h.credential else [])
            if not h.keys_packed:  # a link probe: a cluster call, as NodeInfo needs the peers' (admin) token
                if not who.admin:
                    raise PermissionError("a link probe needs the cluster's peer token")
                return Served(np.zeros(0, np.int64), np.zeros(0, np.uint64), [], lambda: None)
            if d.auth.enabled and who.tenant is not None and not who.admin and h.ns.tenant != who.tenant:
                raise PermissionError(f"tenant {who.tenant!r} may not read namespace of tenant {h.ns.tenant!r}")
            ns = d.namespace(h.ns, who)
        except PermissionError:
            raise
        except KVStoreError as e:
            if isinstance(e, InvalidArgument):
                raise ValueError(str(e)) from None
            raise PermissionError(str(e)) from None
        owner = f"peer:{h.node_id}"
        store, keys = self.store, h.keys_packed
        # blocks on SSD are read on the disk worker, never on this loop (every other call would wait)
        res = await d.disk.run(lambda: store.needs_disk_read(ns, keys), store.acquire, ns, keys, owner=owner,
                               ttl=self.lease_s, promote=True, undo=lambda r: r.handle and store.release(r.handle, owner))
        present = int(np.count_nonzero(res.offsets >= 0))
        regions = [memoryview(store.dram.view(int(o), int(n)))
                   for o, n in zip(res.offsets[:present].tolist(), res.lengths[:present].tolist())]
        handle = res.handle
        loop = self.loop
        done = [False]

        def unpin() -> None:
            if done[0] or not handle:
                return
            done[0] = True
            try:
                store.release(handle, owner)
            except KVStoreError:
                pass  # reaped already

        def release() -> None:
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if on_loop:
                unpin()
            else:
                loop.call_soon_threadsafe(unpin)

        nbytes = int(res.lengths[:present].sum())
        # the header's node id is the requester's word: a series only for a live member
        self.metrics.peer_served(h.node_id if self.is_member(h.node_id) else "other", present, nbytes)
        lengths = res.lengths.copy()
        lengths[present:] = 0
        return Served(lengths, res.checksums.copy(), regions, release)


__all__ = ["BlockProvider"]
