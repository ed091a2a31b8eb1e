"""The save calls take packed keys (16 bytes a block, back to back), as the
vLLM connector's worker passes them on (engine_adapter/vllm_saves.py):
``Client.put`` (write-behind, Reserve and inline paths), ``reserve`` and
``reserve_later``, with the statuses a list of keys gets."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.keys import Namespace, block_keys

BS = 4096
PATHS = {"write_behind": {}, "reserve": {"shared_index": False}, "inline": {"use_shm": False}}


@pytest.fixture
def uds_daemon(make_daemon, tmp_path):
    return make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"), dram__capacity="64MiB")


def _keys(ns: Namespace, n: int, start: int = 0) -> list[bytes]:
    return block_keys(ns, np.arange(16 * n, dtype=np.uint32) + np.uint32(start))


def _asked(keys: list[bytes], packed: bool) -> list[bytes] | bytes:
    return b"".join(keys) if packed else keys


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("how", list(PATHS))
def test_put_takes_packed_keys_on_every_path(uds_daemon, how, packed):
    ns = Namespace(tenant="t", model_id=f"put-{how}", block_size=16)
    with Client(uds_daemon.target, **PATHS[how]) as c:
        first = _keys(ns, 1, 1 << 20)  # the namespace made (a write-behind put needs its id)
        assert c.put(ns, first, [np.zeros(BS, np.uint8)]) == [KeyStatus.OK]
        c.flush()
        assert c.lookup(ns, first).hit_blocks == 1
        keys = _keys(ns, 6)
        data = [np.full(BS, i + 1, np.uint8) for i in range(6)]
        assert c.put(ns, _asked(keys[:3], packed), data[:3]) == [KeyStatus.OK] * 3
        c.flush()
        # three stored, two new: the new ones hang off keys[2] (the parent cut from the packed keys)
        assert c.put(ns, _asked(keys[:5], packed), data[:5]) == [KeyStatus.EXISTS] * 3 + [KeyStatus.OK] * 2
        c.flush()
        assert c.put(ns, _asked(keys[5:], packed), data[5:], parent=keys[4]) == [KeyStatus.OK]
        c.flush()
        assert c.lookup(ns, keys).hit_blocks == 6
        got = c.get(ns, keys)
        assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data))
        with pytest.raises(InvalidArgument, match="2 keys but 3 payloads"):
            c.put(ns, _asked(keys[:2], packed), data[:3])
        bad = b"".join(keys[:3])[:-1] if packed else [keys[0], keys[1][:15], keys[2]]
        with pytest.raises(InvalidArgument, match="16 bytes"):
            c.put(ns, bad, data[:3])


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("later", [False, True])
def test_reserve_takes_packed_keys_with_the_same_statuses(uds_daemon, later, packed):
    ns = Namespace(tenant="t", model_id="reserve", block_size=16)
    with Client(uds_daemon.target) as c:
        keys = _keys(ns, 5, 1000 * later + 100 * packed)

        def reserve(ks: list[bytes], parent: bytes | None = None):
            asked = _asked(ks, packed)
            return c.reserve_later(ns, asked, BS, parent=parent).result() if later else \
                c.reserve(ns, asked, BS, parent=parent)

        r = reserve(keys[:3])
        assert r.statuses == [KeyStatus.OK] * 3
        for i, (o, n) in enumerate(zip(r.offsets, r.lengths)):
            c.view(o, n)[:] = i + 1
        assert c.commit(r) == [KeyStatus.OK] * 3
        r = reserve(keys[:5])  # three there already: EXISTS, two reserved
        assert r.statuses == [KeyStatus.EXISTS] * 3 + [KeyStatus.OK] * 2
        assert c.abort(r) == 2
        r = reserve(keys[4:], parent=keys[3])  # parent not stored
        assert r.statuses == [KeyStatus.PARENT_MISSING] and not r.reservation_id
        assert c.lookup(ns, keys).hit_blocks == 3
        got = c.get(ns, keys[:3])
        assert all(g is not None and (g == i + 1).all() for i, g in enumerate(got))
        bad = b"".join(keys)[:-1] if packed else [keys[0], keys[1][:15]]
        with pytest.raises(InvalidArgument, match="16 bytes"):
            c.reserve_later(ns, bad, BS) if later else c.reserve(ns, bad, BS)
