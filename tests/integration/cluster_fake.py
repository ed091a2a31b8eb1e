"""An in-process stand-in for the block transport (``transport.ucx``'s
BlockServer/BlockClient contract), for cluster tests of the layers above it:
daemons on their own loops in one process fetch from each other through a
registry. It copies each served region into the destination the fetcher
allocated and verifies its xxh3_64 as the real transport does (unless
``verify=False``, as there); faults are
switches: ``corrupt`` (flip a byte of the next N blocks), ``paused`` (never
answer: a SIGSTOPped peer) and ``dead`` (refuse: a killed one). A sized
fetch (``sizes=``) allocates before it asks, and a block whose length is
not the one asked for is not copied, as in the real transport."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument
from transport.ucx import MAX_HEADER, FetchFault, FetchResult  # the real types (importing them does not start UCX)

REGISTRY: dict[str, "FakeBlockServer"] = {}
_ids = itertools.count(1)


class FakeBlockServer:
    def __init__(self, provider: Callable[[bytes], Any], host: str = "127.0.0.1", port: int = 0,
                 max_wait_s: float = 3600.0, max_requests: int = 64, max_connections: int = 256) -> None:
        self.provider = provider
        self.max_connections = max_connections
        self.max_wait_s = max_wait_s
        self.max_requests = max_requests
        self.corrupt = 0
        self.paused = False
        self.dead = False
        self.served = 0
        self.address = ""

    async def start(self) -> str:
        self.loop = asyncio.get_running_loop()
        self.address = f"fake-{next(_ids)}:0"
        REGISTRY[self.address] = self
        return self.address

    async def stop(self) -> None:
        REGISTRY.pop(self.address, None)

    async def serve(self, header: bytes) -> Any:
        if self.paused:
            await asyncio.Event().wait()
        self.served += 1
        return await self.provider(header)


class FakeBlockClient:
    def __init__(self, *, connect_timeout_s: float = 2.0) -> None:
        self.sized = 0
        """Sized fetches asked for."""
        self.pooled: list[str] = []
        """Addresses fetched from and not dropped (the real client's pooled endpoints)."""

    async def close(self) -> None:
        self.pooled.clear()

    def retain(self, addresses: Any) -> int:
        keep = set(addresses)
        gone = [a for a in self.pooled if a not in keep]
        self.pooled[:] = [a for a in self.pooled if a in keep]
        return len(gone)

    async def fetch(self, address: str, header: bytes, count: int,
                    alloc: Callable[[np.ndarray], Sequence[memoryview | None]], deadline_s: float, *,
                    sizes: np.ndarray | None = None, verify: bool = True) -> FetchResult:
        if len(header) > MAX_HEADER:  # the real client's limits
            raise InvalidArgument(f"header of {len(header)} bytes exceeds the limit of {MAX_HEADER}")
        if sizes is not None and len(header) + 8 * count > MAX_HEADER:
            sizes = None
        t0 = time.perf_counter()
        none = np.zeros(count, bool)
        dests: Sequence[memoryview | None] | None = None
        if sizes is not None:
            self.sized += 1
            dests = alloc(np.asarray(sizes, np.int64).copy())

        def fail(msg: str, fault: FetchFault) -> FetchResult:
            return FetchResult(none, np.zeros(count, np.int64), 0, time.perf_counter() - t0, msg, fault=fault)

        if address not in self.pooled:
            self.pooled.append(address)
        srv = REGISTRY.get(address)
        if srv is None or srv.dead:
            return fail(f"connection to {address} refused", FetchFault.LINK)
        fut = asyncio.run_coroutine_threadsafe(srv.serve(header), srv.loop)
        try:
            served = await asyncio.wait_for(asyncio.wrap_future(fut), deadline_s)
        except asyncio.TimeoutError:
            fut.cancel()
            return fail(f"deadline of {deadline_s}s passed", FetchFault.LINK)
        except PermissionError as e:
            return fail(f"{type(e).__name__}: {e}", FetchFault.REFUSED)
        except ValueError as e:
            return fail(f"{type(e).__name__}: {e}", FetchFault.INVALID)
        try:
            lengths = np.asarray(served.lengths, np.int64)
            ok = np.zeros(lengths.size, bool)
            if count == 0:
                return FetchResult(ok, lengths, 0, time.perf_counter() - t0, None)
            if dests is None:
                dests = alloc(lengths)
            corrupt = 0
            nbytes = 0
            r = 0
            for i in range(lengths.size):
                if lengths[i] <= 0:
                    continue
                region = served.regions[r]
                r += 1
                d = dests[i]
                if d is None or d.nbytes != lengths[i]:
                    continue
                dst = np.frombuffer(d, np.uint8)
                dst[:] = np.frombuffer(region, np.uint8)
                if srv.corrupt > 0:
                    srv.corrupt -= 1
                    dst[0] ^= 0xFF
                if verify and xxhash.xxh3_64_intdigest(dst) != int(served.checksums[i]):
                    corrupt += 1
                    continue
                ok[i] = True
                nbytes += int(lengths[i])
            return FetchResult(ok, lengths, nbytes, time.perf_counter() - t0, None, corrupt,
                               np.asarray(served.checksums, np.uint64))
        finally:
            served.release()


def fake_transport() -> tuple[type, type]:
    return FakeBlockServer, FakeBlockClient
