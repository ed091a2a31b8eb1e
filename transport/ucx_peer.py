"""A stand-alone block peer for tests and ``bench/transport.py``.

``python -m transport.ucx_peer [--port P] [--slab-mib N]`` starts a
:class:`~transport.ucx.BlockServer` whose provider serves views of a slab
filled with :func:`pattern` bytes, as the request header (JSON) asks, and
prints one JSON line ``{"address": "host:port", "pid": ...}`` on stdout.
Commands, one JSON line each on stdin, answered by one JSON line:
``{"op": "stats"}`` -> provider calls begun (``asked``), release/serve counters; ``{"op": "stop"}`` -> stops.

Header fields (all optional but ``n`` and ``size``): ``n`` blocks of ``size``
bytes, block ``i`` is ``slab[(off + i * size) % ...]``; ``absent``: indices
reported absent; ``lie``: indices whose checksum is reported wrong;
``refuse`` / ``invalid``: the provider raises PermissionError / ValueError;
``delay``: seconds the provider sleeps first.  Test data only: this is not
how the daemon encodes requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
from typing import Any

import numpy as np

from kvstore.checksum import checksum
from transport.ucx import BlockServer, Served, shutdown


def pattern(nbytes: int, seed: int = 7) -> np.ndarray:
    """The bytes every peer's slab holds (same in every process)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def block(slab: np.ndarray, i: int, size: int, off: int = 0) -> np.ndarray:
    start = (off + i * size) % max(1, slab.nbytes - size + 1)
    return slab[start:start + size]


class Peer:
    def __init__(self, slab_bytes: int) -> None:
        self.slab = pattern(slab_bytes)
        self.sums: dict[tuple[int, int, int], int] = {}
        self.served = 0
        self.released = 0
        self.pinned = 0
        self.asked = 0

    async def provide(self, header: bytes) -> Served:
        self.asked += 1
        h = json.loads(header)
        if h.get("delay"):
            await asyncio.sleep(float(h["delay"]))
        if h.get("refuse"):
            raise PermissionError("namespace not readable by this caller")
        if h.get("invalid"):
            raise ValueError("malformed request")
        n, size, off = int(h["n"]), int(h["size"]), int(h.get("off", 0))
        absent, lie = set(h.get("absent", ())), set(h.get("lie", ()))
        lengths = np.full(n, size, dtype=np.int64)
        sums = np.zeros(n, dtype=np.uint64)
        regions: list[memoryview] = []
        for i in range(n):
            if i in absent:
                lengths[i] = 0
                continue
            b = block(self.slab, i, size, off)
            key = (i, size, off)
            if key not in self.sums:
                self.sums[key] = checksum(b)
            sums[i] = self.sums[key] ^ (1 if i in lie else 0)
            regions.append(memoryview(b.data).toreadonly())
        self.served += 1
        self.pinned += 1
        done = [False]

        def release() -> None:
            if done[0]:
                self.released += 1000  # makes a double release visible
            done[0] = True
            self.released += 1
            self.pinned -= 1

        return Served(lengths, sums, regions, release)


async def amain(a: argparse.Namespace) -> int:
    peer = Peer(a.slab_mib << 20)
    more: dict[str, Any] = {"max_requests": a.max_requests} if a.max_requests else {}
    if a.max_wait:
        more["max_wait_s"] = a.max_wait
    server = BlockServer(peer.provide, a.host, a.port, **more)
    address = await server.start()
    print(json.dumps({"address": address, "pid": os.getpid()}), flush=True)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str] = asyncio.Queue()

    def reader() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, "")

    threading.Thread(target=reader, daemon=True).start()
    while True:
        line = await lines.get()
        cmd: dict[str, Any] = json.loads(line) if line.strip() else {"op": "stop"}
        if cmd["op"] == "stats":
            print(json.dumps({"asked": peer.asked, "served": peer.served, "released": peer.released, "pinned": peer.pinned,
                              "requests": server.requests, "endpoints": server.endpoints}), flush=True)
        elif cmd["op"] == "stop":
            await server.stop()
            shutdown()
            print(json.dumps({"stopped": True, "released": peer.released, "served": peer.served}), flush=True)
            return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--slab-mib", type=int, default=16)
    ap.add_argument("--max-requests", type=int, default=0, help="requests per connection at once (0: the default)")
    ap.add_argument("--max-wait", type=float, default=0.0, help="seconds a request is served at most (0: the default)")
    try:
        return asyncio.run(amain(ap.parse_args(argv)))
    finally:
        shutdown()  # also after a failed start: UCX's notifier thread would keep the process alive


if __name__ == "__main__":
    sys.exit(main())
