"""``AsyncClient`` has the calls docs/daemon.md promises it shares with
``Client``: the batch data calls take keys as a list or packed in one
``bytes``, and ``get`` / ``clear`` exist, on the shared-memory path and inline."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore.client import AsyncClient, Client
from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.core.index import keys_to_array
from kvstore.keys import Namespace, block_keys

NS = Namespace(tenant="t", model_id="m", block_size=4)


@pytest.mark.parametrize("use_shm", [True, False])
def test_async_client_data_calls_match_the_sync_client(daemon, use_shm: bool) -> None:
    keys = block_keys(NS, list(range(12)))
    packed = b"".join(keys)
    blocks = [np.full(4096, i + 1, np.uint8) for i in range(3)]

    async def run() -> None:
        async with AsyncClient(daemon.target, use_shm=use_shm) as c:
            assert await c.put(NS, packed, blocks) == [KeyStatus.OK] * 3
            assert (await c.lookup(NS, packed)).hit_blocks == 3
            got = await c.get(NS, keys + [b"\x07" * 16])
            assert [None if g is None else int(g[0]) for g in got] == [1, 2, 3, None]
            assert all(np.array_equal(g, b) for g, b in zip(got, blocks))
            outs = [np.zeros(4096, np.uint8) for _ in range(3)]
            assert await c.get_into(NS, packed, outs) == [KeyStatus.OK] * 3
            assert [int(o[0]) for o in outs] == [1, 2, 3]
            with pytest.raises(InvalidArgument):
                await c.put(NS, packed[:17], blocks[:1])
            assert await c.remove(NS, keys[2:3]) == [KeyStatus.OK]
            assert await c.clear(NS) == 2
            assert (await c.lookup(NS, keys)).hit_blocks == 0

    asyncio.run(run())
    with Client(daemon.target, use_shm=use_shm) as s:  # the sync client agrees
        assert s.clear(NS) == 0
    got = asyncio.run(_corrupt_then_get(daemon, keys, blocks, use_shm))
    assert got[:2] == [1, None] and got[2] in (3, None)  # (the daemon may drop the flipped block's child)


async def _corrupt_then_get(daemon, keys: list[bytes], blocks: list[np.ndarray], use_shm: bool) -> list[int | None]:
    """Flip a bit of block 1 in the slab: ``get`` answers it as a miss, never its bytes."""
    async with AsyncClient(daemon.target, use_shm=use_shm) as c:
        assert await c.put(NS, keys[:3], blocks) == [KeyStatus.OK] * 3

        def flip() -> None:
            st = daemon.store
            row = int(st.index.find_committed(st.namespace_id(NS, create=False), keys_to_array(keys[1:2]))[0])
            st.dram.corrupt_for_test(st.index.offset(row), 8 * 100)

        daemon.call(flip)
        got = await c.get(NS, keys[:3])
        return [None if g is None else int(g[0]) for g in got]
