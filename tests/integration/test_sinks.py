"""Reads into a sink (kvstore.client.sinks): ``get_into`` puts checked
blocks straight where a ``LayerScatter`` says, through each of its paths
(the shared index without a lease, a lease, inline bytes from another host),
and a block failing its checksum reaches no destination."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.checksum import PIECE_FIELDS
from kvstore.client import Client
from kvstore.client.sinks import LayerScatter, ShardScatter
from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.keys import Namespace, block_keys

BS = 8192
HALF = BS // 2


@pytest.fixture
def uds_daemon(make_daemon, tmp_path):
    return make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"))


def _layout(staged: bool = False) -> tuple[LayerScatter, list[np.ndarray]]:
    """Two destinations of 8 slots: the first half of a block goes to
    layer 0, the second to layer 1."""
    layers = [np.zeros((8, HALF), np.uint8) for _ in range(2)]
    pieces = np.array([(0, HALF, 0, 0, HALF), (HALF, HALF, 1, 0, HALF)], np.int64).reshape(-1, PIECE_FIELDS)
    return LayerScatter(BS, pieces, layers, staged=staged), layers


def test_overlapping_pieces_force_a_staged_layout():
    layers = [np.zeros((8, HALF), np.uint8) for _ in range(2)]
    both = np.array([(0, HALF, 0, 0, HALF), (HALF - 1, HALF, 1, 0, HALF)], np.int64)
    assert LayerScatter(BS, both, layers).staged
    assert not _layout()[0].staged and _layout(staged=True)[0].staged


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("how", ["shared", "lease", "inline"])
def test_get_into_a_sink_places_blocks_through_every_path(uds_daemon, how, packed):
    """``packed``: the keys in one string, as the vLLM worker passes them on."""
    kw = {"shared": {}, "lease": {"shared_index": False}, "inline": {"use_shm": False}}[how]
    with Client(uds_daemon.target, **kw) as c:
        ns = Namespace(tenant="t", model_id="m", block_size=16)
        keys = block_keys(ns, np.arange(16 * 4, dtype=np.uint32))
        data = [np.random.default_rng(i).integers(0, 256, BS, dtype=np.uint8) for i in range(3)]
        assert c.put(ns, keys[:3], data) == [KeyStatus.OK] * 3
        place, layers = _layout()
        slots = [5, 0, 6, 2]
        asked = b"".join(keys) if packed else keys
        assert c.get_into(ns, asked, place.sink(slots)) == [KeyStatus.OK] * 3 + [KeyStatus.MISS]
        assert c.shared_reads == (1 if how == "shared" else 0)
        for d, s in zip(data, slots):
            assert np.array_equal(layers[0][s], d[:HALF]) and np.array_equal(layers[1][s], d[HALF:])
        assert not layers[0][[1, 3, 4, 7, 2]].any()  # slot 2 was the missing block's


@pytest.mark.parametrize("staged", [True, False])
def test_a_corrupt_block_is_never_reported_loaded(uds_daemon, staged):
    """Staged: a corrupt block reaches no destination. Direct (the default):
    its places may hold its bytes, but it is CORRUPT, never OK, so the
    engine recomputes them; the block before it is placed either way."""
    with Client(uds_daemon.target) as c:
        ns = Namespace(tenant="t", model_id="m", block_size=16)
        keys = block_keys(ns, np.arange(16 * 2, dtype=np.uint32))
        c.put(ns, keys, [np.full(BS, 7, np.uint8), np.full(BS, 9, np.uint8)])
        c.flush()
        raw = uds_daemon.store.raw
        row = int(raw.index.find_committed(raw.namespace_id(ns, False), np.frombuffer(keys[1], "<u8").reshape(1, 2))[0])
        uds_daemon.call(raw.dram.corrupt_for_test, raw.index.offset(row), 3)
        place, layers = _layout(staged)
        assert c.get_into(ns, keys, place.sink([1, 3])) == [KeyStatus.OK, KeyStatus.CORRUPT]
        assert (layers[0][1] == 7).all() and (layers[1][1] == 7).all()
        if staged:
            assert not layers[0][3].any() and not layers[1][3].any()
        assert c.lookup(ns, keys).hit_blocks == 1  # reported: the daemon dropped it


@pytest.mark.parametrize("how", ["shared", "lease"])
def test_packed_keys_report_the_corrupt_block_by_its_own_key(uds_daemon, how):
    """Keys packed in one string: the middle block fails its checksum; the
    daemon is told that block's key (it is dropped), not its neighbours'."""
    with Client(uds_daemon.target, **({} if how == "shared" else {"shared_index": False})) as c:
        ns = Namespace(tenant="t", model_id="m", block_size=16)
        keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))
        c.put(ns, keys, [np.full(BS, v, np.uint8) for v in (7, 8, 9)])
        c.flush()
        raw = uds_daemon.store.raw
        row = int(raw.index.find_committed(raw.namespace_id(ns, False), np.frombuffer(keys[1], "<u8").reshape(1, 2))[0])
        uds_daemon.call(raw.dram.corrupt_for_test, raw.index.offset(row), 3)
        outs = [np.zeros(BS, np.uint8) for _ in keys]
        assert c.get_into(ns, b"".join(keys), outs)[:2] == [KeyStatus.OK, KeyStatus.CORRUPT]
        assert (outs[0] == 7).all()
        # keys[1] was reported (dropped, with the chain after it), not keys[0] (kept) or keys[2] alone
        assert [c.lookup(ns, [k]).hit_blocks for k in keys[:2]] == [1, 0]
        with pytest.raises(InvalidArgument):
            c.get_into(ns, b"".join(keys)[:-1], outs[:2])


def test_a_sink_of_another_block_size_reads_nothing(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = Namespace(tenant="t", model_id="m", block_size=16)
        keys = block_keys(ns, np.arange(16, dtype=np.uint32))
        c.put(ns, keys, [np.ones(2 * BS, np.uint8)])
        place, layers = _layout()
        assert c.get_into(ns, keys, place.sink([0])) == [KeyStatus.INVALID]
        assert not layers[0].any() and not layers[1].any()


def test_blocks_gathered_into_reserved_slots_read_back_through_every_path(uds_daemon):
    """A save the connector's way: ``reserve``, ``LayerScatter.gather`` of
    engine blocks straight into the slots (checksums on the way), ``commit``
    with those checksums. The daemon keeps them (a wrong checksum would make
    every read a miss), and each read path brings back the engine's bytes."""
    place, layers = _layout()
    rng = np.random.default_rng(11)
    for layer in layers:
        layer[:] = rng.integers(0, 256, layer.shape, dtype=np.uint8)
    ns = Namespace(tenant="t", model_id="gather", block_size=16)
    keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))
    ids = [6, 1, 3]
    with Client(uds_daemon.target) as c:
        resv = c.reserve(ns, keys, BS)
        assert resv.statuses == [KeyStatus.OK] * 3
        sums = place.gather([c.view(o, n) for o, n in zip(resv.offsets, resv.lengths)], ids)
        assert sums is not None
        assert c.commit(resv, sums.tolist()) == [KeyStatus.OK] * 3
    for kw in ({}, {"shared_index": False}, {"use_shm": False}):  # shared index, lease, inline bytes
        with Client(uds_daemon.target, **kw) as c:
            outs = [np.zeros(BS, np.uint8) for _ in keys]
            assert c.get_into(ns, keys, outs) == [KeyStatus.OK] * 3
            assert c.shared_reads == (1 if not kw else 0)
            for g, i in zip(outs, ids):
                assert np.array_equal(g[:HALF], layers[0][i]) and np.array_equal(g[HALF:], layers[1][i])


def test_shards_gathered_by_two_ranks_make_one_block(uds_daemon):
    """TP = 2 the connector's way: each rank's layout names only its half of
    the slot and gathers without checksums; the commit without checksums has
    the daemon hash the whole slot, and a read returns both halves."""
    rng = np.random.default_rng(12)
    ranks = []
    for r in range(2):
        arr = rng.integers(0, 256, (8, HALF), dtype=np.uint8)
        pieces = np.array([(r * HALF, HALF, 0, 0, HALF)], np.int64)
        ranks.append((LayerScatter(BS, pieces, [arr]), arr))
    ns = Namespace(tenant="t", model_id="gather-tp", block_size=16)
    keys = block_keys(ns, np.arange(16 * 2, dtype=np.uint32))
    ids = [4, 7]
    with Client(uds_daemon.target) as c:
        resv = c.reserve(ns, keys, BS)
        slots = [c.view(o, n) for o, n in zip(resv.offsets, resv.lengths)]
        for lay, _ in ranks:
            assert lay.gather(slots, ids, checksums=False) is None
        assert c.commit(resv) == [KeyStatus.OK] * 2
        got = c.get(ns, keys)
    for g, i in zip(got, ids):
        assert g is not None
        assert np.array_equal(g[:HALF], ranks[0][1][i]) and np.array_equal(g[HALF:], ranks[1][1][i])


@pytest.mark.parametrize("how", ["shared", "lease", "inline"])
def test_sealed_shards_through_every_path_and_damage_fails_only_its_rank(uds_daemon, how):
    """TP = 2 with a seal (kvstore.client.shards): each rank gathers its
    shard and its part of the seal, the daemon hashes the whole slot at
    commit, and each rank's ``ShardSink`` reads back its own shard through
    every read path. A bit flipped in rank 1's shard fails rank 1's read
    only (inline bytes: the daemon's own check of the whole block fails it
    for both); the failure is reported and the daemon drops the block."""
    rng = np.random.default_rng(13)
    tp, shard = 2, HALF
    ranks = []
    for r in range(tp):
        arr = rng.integers(0, 256, (8, shard), dtype=np.uint8)
        ranks.append((ShardScatter(LayerScatter(shard, np.array([(0, shard, 0, 0, shard)], np.int64), [arr]), r, tp),
                      arr))
    block = ranks[0][0].block_bytes
    ns = Namespace(tenant="t", model_id=f"sealed-{how}", block_size=16)
    keys = block_keys(ns, np.arange(16 * 3, dtype=np.uint32))
    ids = [4, 7, 1]
    with Client(uds_daemon.target) as c:
        resv = c.reserve(ns, keys, block)
        slots = [c.view(o, n) for o, n in zip(resv.offsets, resv.lengths)]
        for lay, _ in ranks:
            lay.gather(slots, ids, keys)
        assert c.commit(resv) == [KeyStatus.OK] * 3  # the daemon hashes each slot, seal included
        whole = c.get(ns, keys)  # a whole-block read checks every byte against the daemon's checksum
        assert all(g is not None and g.size == block for g in whole)
    kw = {"shared": {}, "lease": {"shared_index": False}, "inline": {"use_shm": False}}[how]

    def read(r: int) -> tuple[list[KeyStatus], np.ndarray]:
        out = np.zeros((8, shard), np.uint8)
        lay = ShardScatter(LayerScatter(shard, np.array([(0, shard, 0, 0, shard)], np.int64), [out]), r, tp)
        with Client(uds_daemon.target, **kw) as c:
            return c.get_into(ns, keys, lay.sink([0, 1, 2], keys)), out

    for r in range(tp):
        st, out = read(r)
        assert st == [KeyStatus.OK] * 3
        assert all(np.array_equal(out[j], ranks[r][1][i]) for j, i in enumerate(ids))
    raw = uds_daemon.store.raw
    row = int(raw.index.find_committed(raw.namespace_id(ns, False), np.frombuffer(keys[1], "<u8").reshape(1, 2))[0])
    uds_daemon.call(raw.dram.corrupt_for_test, raw.index.offset(row), (shard + 77) * 8 + 2)  # rank 1's shard
    if how == "inline":  # the daemon checks the whole block before it sends it: every rank sees the damage
        assert read(0)[0][:2] == [KeyStatus.OK, KeyStatus.CORRUPT]
    else:
        assert read(0)[0] == [KeyStatus.OK] * 3  # rank 0 reads neither rank 1's shard nor its damage
        assert read(1)[0][:2] == [KeyStatus.OK, KeyStatus.CORRUPT]
    with Client(uds_daemon.target) as c:
        assert c.lookup(ns, keys).hit_blocks == 1  # reported by rank 1: dropped
