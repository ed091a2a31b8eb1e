"""The daemon's side of granted puts (issue 18): the same-host socket's
``grant`` and ``gput`` frames (kvstore/wire/frames.py) on the store's
``Grants`` (kvstore/core/grants.py).

Both run through the one RPC wrapper (``kvstore.daemon.rpc``: the socket
session's credentials, QoS as a ``Reserve``/``Put``, metrics, error codes)
with the session as owner, as a ``Reserve`` over the socket does: a
session's grants end with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.daemon.auth import Principal
from kvstore.daemon.rpc import rpc
from kvstore.errors import InvalidArgument
from kvstore.wire import frames
from kvstore.wire.convert import MAX_KEYS

if TYPE_CHECKING:
    from kvstore.daemon.state import DaemonState

GRANT_BYTES = 64 << 20
"""The most bytes of slots one session holds granted (less on a small
DRAM tier: at most a sixteenth of it)."""


def limit(d: "DaemonState") -> int:
    return min(GRANT_BYTES, d.store.dram.capacity_bytes // 16)


@rpc("Grant")
async def grant(d: "DaemonState", body: bytes, context: Any, who: Principal) -> bytes:
    """A grant frame -> its answer: the slots granted (maybe none)."""
    ns_wire, count, size, returned = frames.parse_grant(body)
    if not 0 < count <= MAX_KEYS or len(returned) > MAX_KEYS:
        raise InvalidArgument(f"a grant of {count} slots giving back {len(returned)}")
    ns = d.namespace_from_wire(ns_wire, who)
    owner, _ = d.owner(context, who)
    locs = await d.disk.run(lambda: d.store.needs_disk_write(count, size), d.store.grant, ns, size, count,
                            owner, limit(d), returned)
    life_ms = int(d.config.server.reservation_timeout * 1000)
    head = frames.GRANT_OK.pack(frames.OK, life_ms, limit(d))
    return frames.frame(head + np.asarray(locs, dtype="<u8").tobytes())


@rpc("PutGranted")
async def put(d: "DaemonState", body: bytes, context: Any, who: Principal) -> bytes:
    """A granted put frame -> its answer: one status per key, as a put frame's."""
    put, offsets = frames.parse_granted_put(body)
    n = len(put.keys) // 16
    if not 0 < n <= MAX_KEYS or put.block_bytes <= 0:
        raise InvalidArgument(f"granted put of {n} blocks of {put.block_bytes} bytes")
    ns = d.namespace_from_wire(put.ns_wire, who)
    owner, _ = d.owner(context, who)
    res = await d.disk.run(lambda: False, d.store.put_granted, ns, put.keys, put.block_bytes, offsets,
                           put.checksums, owner, put.parent or None)
    return frames.frame(bytes([frames.OK]) + bytes(int(s) for s in res.statuses))
