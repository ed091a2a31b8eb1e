"""Sealed sharded blocks (kvstore.client.shards, ``ShardScatter``/``ShardSink``):
the seal's format, and a rank's read that checks only its own shard."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.checksum import HAVE_NATIVE, checksum
from kvstore.client.shards import SEAL_HEADER, SEAL_MAGIC, own_sums, read_seals, seal_bytes, write_seals
from kvstore.client.sinks import BufferSink, LayerScatter, ShardScatter, ShardSink, is_sink, scatter_parts
from kvstore.errors import InvalidArgument

SHARD = 4096
TP = 2
BLOCK = TP * SHARD + seal_bytes(TP)
KEYS = [bytes([i]) * 16 for i in range(1, 4)]


def test_seal_bytes_is_the_header_and_one_sum_per_shard_in_64_byte_steps():
    assert [seal_bytes(k) for k in (1, 2, 4, 5, 8, 12)] == [64, 64, 64, 128, 128, 128]
    with pytest.raises(InvalidArgument):
        seal_bytes(0)


def test_two_ranks_write_one_seal_and_rank_0_zeroes_the_padding():
    tp = 3
    blocks = [np.full(tp * SHARD + seal_bytes(tp), 0xFF, np.uint8) for _ in KEYS]
    sums = {r: np.arange(len(KEYS), dtype=np.uint64) * 10 + r for r in range(tp)}
    for r in (2, 0, 1):  # any order
        write_seals(blocks, r, tp, SHARD, KEYS, sums[r])
    ok, got = read_seals(blocks, tp, SHARD, KEYS)
    assert ok.all() and got.shape == (3, tp)
    assert np.array_equal(got, np.stack([sums[r] for r in range(tp)], axis=1))
    seal = blocks[1][tp * SHARD:]
    assert bytes(seal[:8]) == SEAL_MAGIC and int.from_bytes(bytes(seal[8:16]), "little") == SHARD
    assert bytes(seal[16:SEAL_HEADER]) == KEYS[1]
    assert not seal[SEAL_HEADER + 8 * tp:].any()  # padding: zero, whatever the slot held
    assert (blocks[1][:tp * SHARD] == 0xFF).all()  # the shards are not the seal writer's


def test_a_seal_is_refused_for_its_length_magic_shard_size_or_key():
    blocks = [np.zeros(BLOCK, np.uint8) for _ in range(5)]
    for r in range(TP):
        write_seals(blocks, r, TP, SHARD, [KEYS[0]] * 5, np.full(5, 7 + r, np.uint64))
    blocks[1][TP * SHARD] ^= 1  # magic
    blocks[2][TP * SHARD + 8] ^= 1  # shard size
    blocks[3][TP * SHARD + 20] ^= 1  # key
    short = blocks[4][:-1]
    ok, sums = read_seals([blocks[0], blocks[1], blocks[2], blocks[3], short], TP, SHARD, [KEYS[0]] * 5)
    assert ok.tolist() == [True, False, False, False, False]
    assert sums[0].tolist() == [7, 8]
    assert not read_seals([blocks[0]], TP, SHARD, [KEYS[1]])[0][0]  # another block's key


@pytest.mark.parametrize("native", [True, False])
def test_own_sums_gives_each_rank_its_entry_and_refuses_what_read_seals_refuses(native):
    """The native seal check and the numpy one (``native=False``) agree."""
    tp = 3
    blocks = [np.zeros(tp * SHARD + seal_bytes(tp), np.uint8) for _ in range(6)]
    keys = [bytes([7 + i]) * 16 for i in range(6)]
    for r in range(tp):
        write_seals(blocks, r, tp, SHARD, keys, np.arange(6, dtype=np.uint64) * 100 + r + 2**63)
    blocks[1][tp * SHARD] ^= 1  # magic
    blocks[2][tp * SHARD + 8] ^= 1  # shard size
    blocks[3][tp * SHARD + 31] ^= 1  # key
    srcs = [blocks[0], blocks[1], blocks[2], blocks[3], blocks[4][:-64], bytes(blocks[5])]
    want_ok, want = read_seals(srcs, tp, SHARD, keys)
    for rank in range(tp):
        ok, sums = own_sums(srcs, tp, rank, SHARD, keys, native=native)
        assert ok.dtype == bool and sums.dtype == np.uint64
        assert ok.tolist() == want_ok.tolist() == [True, False, False, False, False, True]
        assert sums.tolist() == [int(want[0, rank]), 0, 0, 0, 0, int(want[5, rank])]
        assert sums[5] == 500 + rank + 2**63
    assert own_sums([], tp, 0, SHARD, [], native=native)[0].size == 0
    with pytest.raises(InvalidArgument):
        own_sums(srcs, tp, tp, SHARD, keys, native=native)  # rank outside the group
    with pytest.raises(InvalidArgument):
        own_sums(srcs, tp, 0, SHARD, keys[:-1], native=native)  # a key short


def test_write_seals_refuses_a_block_of_another_length_or_a_rank_outside_the_group():
    with pytest.raises(InvalidArgument):
        write_seals([np.zeros(BLOCK - 64, np.uint8)], 0, TP, SHARD, KEYS[:1], [1])
    with pytest.raises(InvalidArgument):
        write_seals([np.zeros(BLOCK, np.uint8)], 2, TP, SHARD, KEYS[:1], [1])


def _ranks(rng: np.random.Generator) -> list[tuple[ShardScatter, list[np.ndarray]]]:
    """Per rank: its shard split over two layers of 8 engine blocks."""
    half = SHARD // 2
    out = []
    for r in range(TP):
        layers = [rng.integers(0, 256, (8, half), dtype=np.uint8) for _ in range(2)]
        pieces = np.array([(0, half, 0, 0, half), (half, half, 1, 0, half)], np.int64)
        out.append((ShardScatter(LayerScatter(SHARD, pieces, layers), r, TP), layers))
    return out


def test_ranks_gather_a_sealed_block_and_each_reads_back_only_its_shard():
    rng = np.random.default_rng(3)
    ranks = _ranks(rng)
    blocks = [np.full(BLOCK, 0xAA, np.uint8) for _ in KEYS]
    ids = [5, 0, 7]
    for lay, _ in ranks:
        assert lay.block_bytes == BLOCK
        sums = lay.gather(blocks, ids, KEYS)
        assert sums.tolist() == [checksum(b[lay.rank * SHARD:(lay.rank + 1) * SHARD]) for b in blocks]
    for (lay, layers), r in zip(ranks, range(TP)):
        for b, i in zip(blocks, ids):  # the slot: shard r at r * SHARD, layer-major
            assert np.array_equal(b[r * SHARD:r * SHARD + SHARD // 2], layers[0][i])
    # each rank reads into fresh arrays: its shard lands in place; "expected" (the
    # daemon's whole-block checksum) is not what a sealed read checks
    for r in range(TP):
        fresh = _ranks(np.random.default_rng(99))[r]
        sink = fresh[0].sink([1, 2, 3], KEYS)
        assert isinstance(sink, ShardSink) and is_sink(sink) and sink.sizes(3) == [BLOCK] * 3
        assert sink.write(range(3), blocks, [0, 0, 0]).tolist() == [True] * 3
        for j, i in enumerate(ids):
            assert np.array_equal(fresh[1][0][j + 1], ranks[r][1][0][i])
            assert np.array_equal(fresh[1][1][j + 1], ranks[r][1][1][i])


def test_a_save_with_packed_keys_seals_what_a_save_with_a_key_list_does():
    """The vLLM worker's TP save passes the planned blocks' keys packed in one
    string (``write_seals`` and ``ShardScatter.gather``): the same slot bytes
    as one key per block; a packed length that is not 16 per block is refused."""
    ranks = _ranks(np.random.default_rng(5))
    made = []
    for keys in (KEYS, b"".join(KEYS)):
        blocks = [np.zeros(BLOCK, np.uint8) for _ in KEYS]
        for (lay, _), r in zip(ranks, range(TP)):
            sums = lay.gather(blocks, [4, 1, 6], keys)
            write_seals(blocks, r, TP, SHARD, keys, sums)  # (again, by hand: the staged save's call)
        made.append(blocks)
    assert all(np.array_equal(a, b) for a, b in zip(*made))
    assert read_seals(made[1], TP, SHARD, KEYS)[0].all()
    for bad in (b"".join(KEYS)[:-1], b"".join(KEYS[:2])):  # 2.9 keys, or 2 keys for 3 blocks
        with pytest.raises(InvalidArgument):
            write_seals(made[1], 0, TP, SHARD, bad, [1, 2, 3])


def test_damage_fails_only_the_rank_whose_shard_it_is_and_a_bad_seal_places_nothing():
    ranks = _ranks(np.random.default_rng(4))
    blocks = [np.zeros(BLOCK, np.uint8) for _ in KEYS]
    for lay, _ in ranks:
        lay.gather(blocks, [1, 2, 3], KEYS)
    blocks[0][SHARD + 100] ^= 0x10  # rank 1's shard of block 0
    blocks[1][TP * SHARD + 16] ^= 1  # block 1's seal: its key
    blocks[2][TP * SHARD + SEAL_HEADER] ^= 1  # block 2: rank 0's entry in the seal
    got = {}
    for r in range(TP):
        lay, layers = _ranks(np.random.default_rng(50 + r))[r]
        before = [a.copy() for a in layers]
        got[r] = lay.sink([0, 4, 6], KEYS).write([0, 1, 2], blocks, [1, 2, 3]).tolist()
        assert np.array_equal(layers[0][4], before[0][4]) and np.array_equal(layers[1][4], before[1][4])
    assert got == {0: [True, False, False], 1: [False, False, True]}


@pytest.mark.skipif(not HAVE_NATIVE, reason="kvstore._native is not built")
def test_a_read_from_slab_slots_places_what_write_does_and_stops_at_damage():
    """``read_slots`` (the shared read's one native call, straight from the
    slab rows the shared index answers) against ``write`` of the same
    blocks: the same places on each rank; it stops at the first block whose
    seal or shard fails; a staged layout or a plain buffer sink declines it."""
    ranks = _ranks(np.random.default_rng(8))
    slab = np.zeros(5 * BLOCK, np.uint8)
    at = [2 * BLOCK, 0, 4 * BLOCK]
    blocks = [slab[o:o + BLOCK] for o in at]
    for lay, _ in ranks:
        lay.gather(blocks, [1, 2, 3], KEYS)
    rows = np.zeros((3, 4), np.int64)
    rows[:, 1], rows[:, 2] = at, BLOCK
    rows[:, 3] = np.array([checksum(b) for b in blocks], np.uint64).view(np.int64)
    for r in range(TP):
        placed = []
        for how in ("write", "read_slots"):
            lay, layers = _ranks(np.random.default_rng(70 + r))[r]
            sink = lay.sink([6, 0, 4], KEYS if how == "write" else b"".join(KEYS))
            got = sink.write(range(3), blocks, [0, 0, 0]).all() if how == "write" else \
                sink.read_slots(slab, rows.tobytes())
            placed.append((got, [a.copy() for a in layers]))
        assert placed[0][0] and placed[1][0] == 3
        assert all(np.array_equal(x, y) for x, y in zip(placed[0][1], placed[1][1]))
    blocks[1][SHARD + 5] ^= 1  # rank 1's shard of block 1
    blocks[2][TP * SHARD + 20] ^= 1  # block 2's key in its seal
    assert [_ranks(np.random.default_rng(9))[r][0].sink([6, 0, 4], KEYS).read_slots(slab, rows.tobytes())
            for r in range(TP)] == [2, 1]
    rows[1, 2] = BLOCK - 64  # a slot of another size: not read here
    raw = rows.tobytes()
    assert _ranks(np.random.default_rng(9))[0][0].sink([6, 0, 4], KEYS).read_slots(slab, raw) == -1
    staged = ShardScatter(LayerScatter(SHARD, ranks[0][0].shard.pieces, ranks[0][1], staged=True), 0, TP)
    assert staged.sink([0, 1, 2], KEYS).read_slots(slab, raw) is None
    assert ShardSink(BufferSink([np.zeros(SHARD, np.uint8)] * 3), 0, TP, SHARD, KEYS).read_slots(slab, raw) is None


def test_scatter_parts_answers_for_all_the_rows_in_order():
    """Parts on threads: -1 from any part wins; else the leading matched
    blocks, stopping at the first part that stopped short."""
    def answer(parts: dict[int, int]):
        return lambda a, b: parts.get(a, b - a)

    assert scatter_parts(8, 1 << 20, 2, answer({})) == 8
    assert scatter_parts(8, 1 << 20, 2, answer({0: 3})) == 3
    assert scatter_parts(8, 1 << 20, 2, answer({4: 1})) == 5
    assert scatter_parts(8, 1 << 20, 2, answer({0: 2, 4: -1})) == -1
    assert scatter_parts(8, 16, 2, answer({0: 7})) == 7  # too small to split: one part


def test_a_sealed_read_needs_one_key_per_block():
    lay = _ranks(np.random.default_rng(5))[0][0]
    with pytest.raises(InvalidArgument):
        lay.sink([0, 1])
    with pytest.raises(InvalidArgument):
        lay.sink([0, 1], KEYS[:1])
    with pytest.raises(InvalidArgument):
        ShardScatter(lay.shard, 2, TP)


def test_a_sealed_read_into_buffers_keeps_this_ranks_shard_only():
    """The staged way (engine arrays a layout cannot name, e.g. device
    tensors): shard-wide buffers get rank r's shard of each block."""
    ranks = _ranks(np.random.default_rng(6))
    blocks = [np.zeros(BLOCK, np.uint8) for _ in KEYS]
    for lay, _ in ranks:
        lay.gather(blocks, [1, 2, 3], KEYS)
    blocks[2][100] ^= 1  # rank 0's shard of block 2
    for r, keys in zip(range(TP), (KEYS, b"".join(KEYS))):  # keys one by one, or packed as the scheduler sends them
        outs = [np.zeros(SHARD, np.uint8) for _ in KEYS]
        sink = ShardSink(BufferSink(outs), r, TP, SHARD, keys)
        assert len(sink) == 3 and sink.sizes(3) == [BLOCK] * 3 and sink.size_of(0) == BLOCK
        assert sink.write(range(3), blocks, [0, 0, 0]).tolist() == [True, True, r == 1]
        assert all(np.array_equal(o, b[r * SHARD:(r + 1) * SHARD]) for o, b in zip(outs[:2], blocks))
    for keys in (KEYS, b"".join(KEYS), b"".join(KEYS)[:-1]):  # 3 keys (or 2.9) for 2 blocks
        with pytest.raises(InvalidArgument):
            ShardSink(BufferSink([np.zeros(SHARD, np.uint8)] * 2), 0, TP, SHARD, keys)


@pytest.mark.skipif(not HAVE_NATIVE, reason="kvstore._native is not built")
@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_read_from_slab_slots_places_the_same_on_one_or_two_threads(threads):
    """A read of at least 4 MiB splits over ``threads`` (each part its own
    rows and engine ids); the places and the answer are a one-call read's,
    and a block that fails in the second part stops the read there."""
    block, n = 1 << 18, 20  # 5 MiB: split in two on two threads
    half = block // 2
    rng = np.random.default_rng(11)
    slab = rng.integers(0, 256, (n + 2) * block, dtype=np.uint8)
    at = (rng.permutation(n + 2)[:n] * block).astype(np.int64)
    rows = np.zeros((n, 4), np.int64)
    rows[:, 1], rows[:, 2] = at, block
    rows[:, 3] = np.array([checksum(slab[o:o + block]) for o in at.tolist()], np.uint64).view(np.int64)
    pieces = np.array([(0, half, 0, 0, half), (half, half, 1, 0, half)], np.int64)
    ids = rng.permutation(2 * n)[:n].tolist()

    def read(threads: int, rows: np.ndarray) -> tuple[int | None, list[np.ndarray]]:
        layers = [np.zeros(2 * n * half, np.uint8) for _ in range(2)]
        return LayerScatter(block, pieces, layers, threads=threads).sink(ids).read_slots(slab, rows.tobytes()), layers

    want, placed = read(1, rows)
    got, layers = read(threads, rows)
    assert want == got == n and all(np.array_equal(a, b) for a, b in zip(placed, layers))
    for i in (3, 15):
        o = int(at[i])
        assert np.array_equal(layers[0][ids[i] * half:(ids[i] + 1) * half], slab[o:o + half])
    rows[15, 3] ^= 1  # block 15's checksum: the second part stops there
    assert read(threads, rows)[0] == 15


@pytest.mark.parametrize("ids", [[1, 2], np.array([1, 2]), (1, 2), np.array([1, 2], np.uint32)])
def test_engine_block_ids_as_a_list_or_an_array_give_the_same_sink(ids):
    lay = LayerScatter(4096, np.array([(0, 4096, 0, 0, 4096)], np.int64), [np.zeros(8 * 4096, np.uint8)])
    sink = lay.sink(ids)
    assert len(sink) == 2 and sink.ids.dtype == np.int64 and sink.ids.tolist() == [1, 2]


@pytest.mark.parametrize("bad", [[1, -1], np.array([1, -1]), [1.5], np.array([1.5]), ["a"], [1 << 63]])
def test_engine_block_ids_that_are_not_int64_and_not_negative_are_refused(bad):
    lay = LayerScatter(4096, np.array([(0, 4096, 0, 0, 4096)], np.int64), [np.zeros(8 * 4096, np.uint8)])
    with pytest.raises(InvalidArgument, match="engine block ids"):
        lay.sink(bad)


@pytest.mark.skipif(not HAVE_NATIVE, reason="kvstore._native is not built")
def test_a_large_sealed_read_places_the_same_on_one_or_two_threads():
    """A sealed read of at least 4 MiB of shards splits over two threads
    (each part its rows, engine ids and keys); the places and the answer
    are a one-call read's, and a wrong key in the second part's seal stops
    the read there."""
    shard, n = 1 << 18, 20  # 5 MiB of rank 0's shards
    half, block = shard // 2, TP * shard + seal_bytes(TP)
    rng = np.random.default_rng(12)
    keys = [rng.bytes(16) for _ in range(n)]
    pieces = np.array([(0, half, 0, 0, half), (half, half, 1, 0, half)], np.int64)
    slab = np.zeros((n + 1) * block, np.uint8)
    at = (rng.permutation(n + 1)[:n] * block).astype(np.int64)
    blocks = [slab[o:o + block] for o in at.tolist()]
    src = [rng.integers(0, 256, (2 * n, half), dtype=np.uint8) for _ in range(2)]
    for r in range(TP):
        ShardScatter(LayerScatter(shard, pieces, src), r, TP).gather(blocks, list(range(n)), keys)
    rows = np.zeros((n, 4), np.int64)
    rows[:, 1], rows[:, 2] = at, block
    ids = rng.permutation(2 * n)[:n].tolist()

    def read(threads: int) -> tuple[int | None, list[np.ndarray]]:
        layers = [np.zeros((2 * n, half), np.uint8) for _ in range(2)]
        sink = ShardScatter(LayerScatter(shard, pieces, layers, threads=threads), 0, TP).sink(ids, keys)
        return sink.read_slots(slab, rows.tobytes()), layers

    (want, placed), (got, layers) = read(1), read(2)
    assert want == got == n and all(np.array_equal(a, b) for a, b in zip(placed, layers))
    assert np.array_equal(layers[1][ids[15]], src[1][15])
    blocks[15][TP * shard + 20] ^= 1  # block 15's key in its seal
    assert read(2)[0] == 15
