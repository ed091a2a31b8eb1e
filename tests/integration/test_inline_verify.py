"""An inline read (no shared slab: another host, or ``use_shm=False``) checks
every block against the checksum the daemon sent with it, as docs/daemon.md
promises for ``get`` and ``get_into``: bytes damaged after the daemon's own
check (on the wire, a bug between) are a miss, never handed over as good.
The test damages one block's bytes in the answer stream itself."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from kvstore.client import AsyncClient, Client
from kvstore.errors import KeyStatus
from kvstore.keys import Namespace, block_keys
from proto import kvstore_pb2 as pb

NS = Namespace(tenant="t", model_id="inline-verify", block_size=4)


def _damaged(chunk: pb.GetChunk) -> pb.GetChunk:
    if chunk.index == 1 and chunk.data:
        out = pb.GetChunk()
        out.CopyFrom(chunk)
        out.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
        return out
    return chunk


class DamagingStub:
    """The client's stub, with block 1's first byte flipped in every Get answer."""

    def __init__(self, stub: Any, aio: bool) -> None:
        self._stub, self._aio = stub, aio

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def Get(self, *a: Any, **kw: Any) -> Any:  # noqa: N802 (the gRPC method's name)
        it = self._stub.Get(*a, **kw)
        if not self._aio:
            return (_damaged(c) for c in it)

        async def gen() -> Any:
            async for c in it:
                yield _damaged(c)
        return gen()


def _blocks() -> tuple[list[bytes], list[np.ndarray]]:
    return block_keys(NS, list(range(12))), [np.full(4096, i + 1, np.uint8) for i in range(3)]


def test_sync_inline_get_and_get_into_refuse_a_block_damaged_after_the_daemons_check(daemon) -> None:
    keys, blocks = _blocks()
    with Client(daemon.target, use_shm=False) as c:
        assert c.put(NS, keys, blocks) == [KeyStatus.OK] * 3
        plain = c.stub
        c.stub = DamagingStub(plain, aio=False)
        got = c.get(NS, keys)
        assert got[1] is None  # was the damaged bytes, handed over as good
        assert [int(g[0]) for g in (got[0], got[2])] == [1, 3]  # type: ignore[index]
        assert c.lookup(NS, keys).hit_blocks == 1  # reported: the daemon dropped block 1 (and its child)
        assert c.put(NS, keys, blocks)[1:] == [KeyStatus.OK] * 2
        outs = [np.zeros(4096, np.uint8) for _ in range(3)]
        st = c.get_into(NS, keys, outs)
        assert st == [KeyStatus.OK, KeyStatus.CORRUPT, KeyStatus.OK]
        assert [int(o[0]) for o in (outs[0], outs[2])] == [1, 3]


@pytest.mark.parametrize("call", ["get", "get_into"])
def test_async_inline_reads_refuse_a_block_damaged_after_the_daemons_check(daemon, call: str) -> None:
    keys, blocks = _blocks()

    async def run() -> list[Any]:
        async with AsyncClient(daemon.target, use_shm=False) as c:
            assert await c.put(NS, keys, blocks) == [KeyStatus.OK] * 3
            c.stub = DamagingStub(c.stub, aio=True)
            if call == "get":
                return [None if g is None else int(g[0]) for g in await c.get(NS, keys)]
            return await c.get_into(NS, keys, [np.zeros(4096, np.uint8) for _ in range(3)])

    got = asyncio.run(run())
    want = [1, None, 3] if call == "get" else [KeyStatus.OK, KeyStatus.CORRUPT, KeyStatus.OK]
    assert got == want
