"""kvstore.checksum: XXH3-64 checksums, fused copy + checksum, batches.

Every path (the C extension and the pure-Python fallback) must give
``xxhash.xxh3_64_intdigest`` of the bytes, so a checksum written by one is
verified by the other.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore import checksum as cks

REPO = Path(__file__).resolve().parents[3]

needs_native = pytest.mark.skipif(not cks.HAVE_NATIVE, reason="kvstore._native is not built")


@pytest.fixture(params=["native", "python"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once with the C extension (when built) and once without."""
    if request.param == "native":
        if not cks.HAVE_NATIVE:
            pytest.skip("kvstore._native is not built")
    else:
        monkeypatch.setattr(cks, "_native", None)
    return str(request.param)


_LENGTHS = [0, 1, 15, 16, 17, 128, 129, 240, 241, 255, 256, 1023, 1024, 1025, 1087, 1088, 2047,
            4096, 65536 + 7, (1 << 20) - 1, 1 << 20, (1 << 20) + 63, 3 * (1 << 20) + 1]


@pytest.mark.parametrize("n", _LENGTHS)
def test_checksum_and_copy_match_xxhash(n: int, impl: str) -> None:
    src = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8)
    want = xxhash.xxh3_64_intdigest(src.tobytes())
    assert cks.checksum(src) == want
    assert cks.checksum(src.tobytes()) == want
    dst = np.zeros_like(src)
    assert cks.copy_checksum(dst, src) == want
    assert np.array_equal(dst, src)
    dst2 = bytearray(n)
    assert cks.copy_verify(dst2, memoryview(src.tobytes()), want) is True
    assert bytes(dst2) == src.tobytes()
    assert cks.copy_checksum(src, src) == want  # identical buffers: just hashes


@pytest.mark.parametrize("n", [1, 200, 4096, 1 << 20])
def test_copy_verify_detects_a_flipped_bit(n: int, impl: str) -> None:
    src = np.random.default_rng(7).integers(0, 256, size=n, dtype=np.uint8)
    good = cks.checksum(src)
    for pos in {0, n // 2, n - 1}:
        bad = src.copy()
        bad[pos] ^= 0x10
        dst = np.zeros_like(src)
        assert cks.copy_verify(dst, bad, good) is False
        assert np.array_equal(dst, bad)  # written either way
        assert cks.copy_verify(dst, src, good) is True


def test_checksum_any_dtype_and_tensor(impl: str) -> None:
    x = np.linspace(0, 1, 1000, dtype=np.float32).reshape(10, 100)
    assert cks.checksum(x) == xxhash.xxh3_64_intdigest(x.tobytes())
    y = np.zeros_like(x)
    assert cks.copy_checksum(y, x) == xxhash.xxh3_64_intdigest(x.tobytes())
    assert np.array_equal(x, y)
    z = np.zeros(4000, dtype=np.uint8)  # other shape and dtype, same byte length
    assert cks.copy_checksum(z, x) == cks.checksum(x)
    torch = pytest.importorskip("torch")
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        t = torch.arange(0, 3000).to(dt)
        raw = t.view(torch.uint8).numpy().tobytes()
        out = torch.zeros_like(t)
        assert cks.checksum(t) == xxhash.xxh3_64_intdigest(raw)
        assert cks.copy_checksum(out, t) == xxhash.xxh3_64_intdigest(raw)
        assert torch.equal(out, t)


def test_checksum_errors(impl: str) -> None:
    x = np.arange(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="C-contiguous"):
        cks.checksum(x[::2])
    with pytest.raises(TypeError):
        cks.checksum(12345)
    with pytest.raises(TypeError, match="writable"):
        cks.copy_checksum(bytes(100), x)
    with pytest.raises(ValueError, match="same length"):
        cks.copy_checksum(bytearray(99), x)
    with pytest.raises(ValueError, match="C-contiguous"):
        cks.copy_checksum(np.zeros(100, np.uint8)[::1].reshape(10, 10).T, x)
    with pytest.raises(ValueError, match="overlap"):
        cks.copy_checksum(x[1:], x[:-1])
    with pytest.raises(TypeError, match="int"):
        cks.copy_verify(bytearray(100), x, "0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2\\*\\*64"):
        cks.copy_verify(bytearray(100), x, -1)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        cks.copy_verify(bytearray(100), x, 2**64)
    assert cks.copy_verify(bytearray(100), x, np.uint64(cks.checksum(x))) is True


@pytest.mark.parametrize("n,size", [(0, 64), (1, 100), (16, 4096), (8, 1 << 20)])
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_blocks_copies_every_block_with_no_checksum(n: int, size: int, threads: int, impl: str) -> None:
    """``copy_blocks``: each source into its destination, on one thread or
    split over two; a pair of other lengths is refused before anything is
    copied."""
    srcs = _blocks(n, size, n + size)
    dsts: list[object] = [bytearray(size) if i % 2 else np.zeros(size, np.uint8) for i in range(n)]
    assert cks.copy_blocks(dsts, srcs, threads=threads) is None
    assert all(bytes(d) == s.tobytes() for d, s in zip(dsts, srcs))  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="same length"):
        cks.copy_blocks([np.zeros(3, np.uint8)], [np.ones(4, np.uint8)])
    with pytest.raises(TypeError):
        cks.copy_blocks([b"abcd"], [np.ones(4, np.uint8)])


@pytest.mark.parametrize("n,size", [(0, 64), (1, 100), (16, 4096), (8, 1 << 20)])
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_run_copies_blocks_lying_back_to_back(n: int, size: int, threads: int, impl: str) -> None:
    """``copy_run``: block ``i`` of a run starting at ``at`` in one array
    into ``dsts[i]``, on one thread or split over two (8 x 1 MiB), streamed
    as ``copy_blocks`` streams; a destination the native helper refuses (of
    another size, not writable, not a buffer) gives False with nothing
    written, and so does no native helper at all (the caller's other path
    copies then)."""
    at = 3 * size + 5
    src = _blocks(1, at + n * size + 7, n + size)[0]
    dsts: list[object] = [bytearray(size) if i % 2 else np.zeros(size, np.uint8) for i in range(n)]
    ok = cks.copy_run(dsts, src, at, size, threads)
    if impl == "python":
        assert ok is False and not any(any(bytes(d)) for d in dsts)  # type: ignore[call-overload]
        return
    assert ok is True
    assert all(bytes(d) == src[at + i * size : at + (i + 1) * size].tobytes() for i, d in enumerate(dsts))
    for bad in (np.zeros(size + 1, np.uint8), bytes(size), "not a buffer"):
        outs: list[object] = [np.zeros(size, np.uint8) for _ in range(max(n, 1) - 1)] + [bad]
        assert cks.copy_run(outs, src, at, size, 1) is False
        assert not any(o.any() for o in outs[:-1])  # type: ignore[union-attr]


def test_copy_run_streams_where_copy_blocks_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch size ``copy_run`` hands the native helper: its own below
    ``READ_STREAM_MIN``, at least ``STREAM_MIN`` (non-temporal stores) from there."""
    if not cks.HAVE_NATIVE:
        pytest.skip("kvstore._native is not built")
    seen: list[int] = []

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(native, name)

        @staticmethod
        def copy_checksum_many(d: object, s: object, sums: object, batch_bytes: int) -> None:
            seen.append(batch_bytes)
            native.copy_checksum_many(d, s, sums, batch_bytes)

    native = cks._native
    monkeypatch.setattr(cks, "_native", Spy())
    small, big = 4096, cks.READ_STREAM_MIN // 2
    src = np.ones(4 * big, np.uint8)
    assert cks.copy_run([np.zeros(small, np.uint8)] * 2, src, 0, small, 1)
    assert cks.copy_run([np.zeros(big, np.uint8) for _ in range(2)], src, big, big, 1)
    assert seen == [2 * small, max(2 * big, cks.STREAM_MIN)]


def _blocks(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=size, dtype=np.uint8) for _ in range(n)]


# 16 x 4 KiB stays on the calling thread; 8 x 1 MiB (>= 4 MiB) is split over threads
@pytest.mark.parametrize("n,size", [(0, 64), (1, 100), (16, 4096), (8, 1 << 20)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_batches_match_the_single_calls(n: int, size: int, threads: int, impl: str) -> None:
    srcs = _blocks(n, size, n * 7 + size)
    want = np.array([xxhash.xxh3_64_intdigest(s.tobytes()) for s in srcs], dtype=np.uint64)
    assert np.array_equal(cks.checksum_many(srcs, threads=threads), want)
    dsts = [np.zeros(size, np.uint8) for _ in range(n)]
    got = cks.copy_many(dsts, srcs, threads=threads)
    assert got.dtype == np.uint64 and got.shape == (n,) and np.array_equal(got, want)
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    dsts2 = [bytearray(size) for _ in range(n)]
    ok = cks.verify_many(dsts2, srcs, want, threads=threads)
    assert ok.dtype == bool and ok.shape == (n,) and bool(ok.all())
    assert all(bytes(d) == s.tobytes() for d, s in zip(dsts2, srcs))


@pytest.mark.parametrize("size", [100, 1 << 20])
def test_verify_many_flags_exactly_the_corrupt_blocks(size: int, impl: str) -> None:
    srcs = _blocks(8, size, size)
    sums = [cks.checksum(s) for s in srcs]
    bad = {1, 6}
    for i in bad:
        srcs[i][size // 3] ^= 0x01  # corrupted after its checksum was taken
    dsts = [np.zeros(size, np.uint8) for _ in srcs]
    ok = cks.verify_many(dsts, srcs, np.asarray(sums, np.uint64), threads=2)
    assert set(np.flatnonzero(~ok).tolist()) == bad
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))  # written either way


def test_batch_errors_propagate(impl: str) -> None:
    srcs = _blocks(2, 64, 0)
    with pytest.raises(ValueError, match="same length"):
        cks.copy_many([np.zeros(64, np.uint8), np.zeros(63, np.uint8)], srcs)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        cks.verify_many([bytearray(64), bytearray(64)], srcs, [0, -1])


@needs_native
@pytest.mark.parametrize("n", [0, 1, 1000, (1 << 20) + 5])
def test_native_and_fallback_agree(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    src = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8)
    native = (cks.checksum(src), cks.copy_checksum(np.zeros_like(src), src))
    monkeypatch.setattr(cks, "_native", None)
    fallback = (cks.checksum(src), cks.copy_checksum(np.zeros_like(src), src))
    assert native == fallback == (xxhash.xxh3_64_intdigest(src.tobytes()),) * 2


def test_no_kvstore_native_selects_the_fallback() -> None:
    code = ("from kvstore import checksum as c, keys as k; "
            "print(c.HAVE_NATIVE, k.HAVE_NATIVE, c.load_native() is None, c.checksum(b'abc'))")
    env = dict(os.environ, NO_KVSTORE_NATIVE="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True", str(xxhash.xxh3_64_intdigest(b"abc"))]


# ------------------------------------------------------------ verify_scatter
def _pieces(*rows: tuple[int, int, int, int, int]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, cks.PIECE_FIELDS)


@pytest.mark.parametrize("n", [300, 4096, 3 * 4096 + 5, 1 << 20])
def test_verify_scatter_places_the_checked_bytes(n: int, impl: str) -> None:
    """Pieces of a checked block land at base + index * stride of their
    destination; bytes no piece names are hashed but go nowhere."""
    src = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8)
    a, b = np.zeros((6, 128), np.uint8), np.zeros(6 * 64 + 32, np.uint8)
    pieces = _pieces((0, 128, 0, 0, 128), (n - 64, 32, 1, 32, 64), (n - 32, 32, 1, 0, 64))
    scratch = np.empty(n, np.uint8)
    assert cks.verify_scatter(src, cks.checksum(src), scratch, pieces, (a, b), 4) is True
    assert np.array_equal(a[4], src[:128]) and not a[[0, 1, 2, 3, 5]].any()
    assert np.array_equal(b[4 * 64 : 4 * 64 + 32], src[n - 32 :])
    assert np.array_equal(b[4 * 64 + 32 : 5 * 64], src[n - 64 : n - 32])
    assert np.count_nonzero(b[: 4 * 64]) == 0 and np.count_nonzero(b[5 * 64 :]) == 0


def test_verify_scatter_writes_nothing_on_a_mismatch(impl: str) -> None:
    src = np.random.default_rng(3).integers(1, 256, size=8192, dtype=np.uint8)
    a = np.zeros((4, 8192), np.uint8)
    assert cks.verify_scatter(src, cks.checksum(src) ^ 1, np.empty(8192, np.uint8),
                              _pieces((0, 8192, 0, 0, 8192)), (a,), 2) is False
    assert not a.any()


@pytest.mark.parametrize("rows,index", [
    ([(0, 4097, 0, 0, 0)], 0),        # past the end of the block
    ([(-1, 10, 0, 0, 0)], 0),         # negative offset
    ([(0, 10, 1, 0, 0)], 0),          # no such destination
    ([(0, 64, 0, 0, 64)], 16),        # slot 16 of a 16-slot destination
    ([(0, 64, 0, 1000, 0)], 0),       # base past the destination
    ([(0, 64, 0, 0, 1 << 62)], 3),    # stride * index would overflow
])
def test_verify_scatter_refuses_a_place_outside_its_buffers(rows: list[tuple[int, ...]], index: int,
                                                            impl: str) -> None:
    src = np.random.default_rng(5).integers(0, 256, size=4096, dtype=np.uint8)
    a = np.zeros(16 * 64, np.uint8)
    with pytest.raises(ValueError):
        cks.verify_scatter(src, cks.checksum(src), np.empty(4096, np.uint8), _pieces(*rows), (a,), index)
    assert not a.any()


def test_verify_scatter_many_equals_one_call_per_block(impl: str) -> None:
    """A batch places exactly what one call per block would, skips a block
    that fails its checksum, and checks every place of every block (the
    highest index included) before it writes anything."""
    rng = np.random.default_rng(7)
    srcs = [rng.integers(0, 256, size=512, dtype=np.uint8) for _ in range(5)]
    sums = [cks.checksum(x) for x in srcs]
    sums[3] ^= 1
    pieces = _pieces((0, 256, 0, 0, 256), (256, 256, 1, 0, 256))
    idx = [4, 0, 7, 2, 5]
    a, b = np.zeros((8, 256), np.uint8), np.zeros((8, 256), np.uint8)
    ok = cks.verify_scatter_many(srcs, sums, np.empty(512, np.uint8), pieces, (a, b), idx)
    assert ok.tolist() == [True, True, True, False, True]
    a1, b1 = np.zeros_like(a), np.zeros_like(b)
    for x, e, i in zip(srcs, sums, idx):
        cks.verify_scatter(x, e, np.empty(512, np.uint8), pieces, (a1, b1), i)
    assert np.array_equal(a, a1) and np.array_equal(b, b1) and not a[2].any()
    with pytest.raises(ValueError):  # block index 8 does not fit: nothing at all is written
        cks.verify_scatter_many(srcs[:2], [cks.checksum(x) for x in srcs[:2]], np.empty(512, np.uint8), pieces,
                                (np.zeros((8, 256), np.uint8), c := np.zeros((8, 256), np.uint8)), [1, 8])
    assert not c.any()
    with pytest.raises(ValueError):
        cks.verify_scatter_many(srcs[:1], [-1], np.empty(512, np.uint8), pieces, (a, b), [0])


def _slots(slab: np.ndarray, at: list[int], size: int, sums: list[int]) -> np.ndarray:
    """The shared index's rows (row, offset, length, checksum bits) of blocks at ``at``."""
    rows = np.zeros((len(at), 4), np.int64)
    rows[:, 0] = np.arange(len(at)) + 40
    rows[:, 1] = at
    rows[:, 2] = size
    rows[:, 3] = np.asarray(sums, np.uint64).view(np.int64)
    return rows


@pytest.mark.skipif(not cks.HAVE_NATIVE, reason="kvstore._native is not built")
@pytest.mark.parametrize("size", [200, 4096 + 3, 3 * 4096])
def test_scatter_slots_places_what_the_direct_scatter_does_and_stops_at_a_bad_block(size: int) -> None:
    """Blocks read straight from the slab rows the shared index answers land
    where ``verify_scatter_many``'s direct scatter puts them; the answer is
    how many leading blocks matched (it stops at the first that does not);
    a slot of another length or outside the slab gives -1 and writes
    nothing; bad pieces, indices or rows are a ValueError."""
    rng = np.random.default_rng(size)
    slab = rng.integers(0, 256, size=6 * size + 100, dtype=np.uint8)
    at = [3 * size + 7, 100, 5 * size + 100, size + 9]
    blocks = [slab[o:o + size] for o in at]
    sums = [cks.checksum(b) for b in blocks]
    h = size // 2
    pieces = _pieces((h, size - h, 1, 0, size), (0, h - 1, 0, 5, h))  # a gap: byte h - 1 goes nowhere
    idx = np.array([6, 0, 3, 2, 1], np.int64)  # one more than the slots: the extra is unused

    def fresh() -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(8 * h + 5, np.uint8), np.zeros(8 * size, np.uint8)

    a, b = fresh()
    assert cks.scatter_slots(slab, _slots(slab, at, size, sums), size, pieces, (a, b), idx) == 4
    a1, b1 = fresh()
    assert cks.verify_scatter_many(blocks, sums, None, pieces, (a1, b1), idx[:4]).all()
    assert np.array_equal(a, a1) and np.array_equal(b, b1) and b.any()
    bad = list(sums)
    bad[2] ^= 1
    assert cks.scatter_slots(slab, _slots(slab, at, size, bad), size, pieces, fresh(), idx) == 2
    for rows in (_slots(slab, at, size, sums)[[0, 1]], _slots(slab, [0, slab.size - size + 1], size, sums[:2])):
        if rows[0, 1] == at[0]:
            rows[1, 2] = size - 1  # a slot of another length
        a, b = fresh()
        assert cks.scatter_slots(slab, rows, size, pieces, (a, b), idx) == -1
        assert not a.any() and not b.any()
    ok = _slots(slab, at, size, sums)
    with pytest.raises(ValueError):  # a piece longer than the block
        cks.scatter_slots(slab, ok, size, _pieces((0, size + 1, 1, 0, size + 1)), fresh(), idx)
    with pytest.raises(ValueError):  # a destination too short for engine block 6
        cks.scatter_slots(slab, ok, size, pieces, (np.zeros(6 * h, np.uint8), np.zeros(8 * size, np.uint8)), idx)
    with pytest.raises(ValueError):  # overlapping pieces need a staged copy
        cks.scatter_slots(slab, ok, size, _pieces((0, h, 0, 0, h), (h - 1, h, 1, 0, size)), fresh(), idx)
    with pytest.raises(ValueError):
        cks.scatter_slots(slab, ok, size, pieces, fresh(), idx[:3])  # fewer indices than slots
    with pytest.raises(ValueError):
        cks.scatter_slots(slab, ok, size, pieces, fresh(), -idx)
    with pytest.raises(ValueError):
        cks.scatter_slots(slab, ok.reshape(-1)[:-1], size, pieces, fresh(), idx)  # rows of 4
    assert cks.scatter_slots(slab, ok[:0], size, pieces, fresh(), idx[:0]) == 0


def test_verify_scatter_needs_a_scratch_as_long_as_the_block(impl: str) -> None:
    src = np.ones(4096, np.uint8)
    with pytest.raises(ValueError):
        cks.verify_scatter(src, cks.checksum(src), np.empty(4095, np.uint8), _pieces((0, 1, 0, 0, 0)),
                           (np.zeros(4, np.uint8),), 0)


@pytest.mark.parametrize("n", [100, 300, 1000, 4096, 3 * 4096 + 5, 1 << 20])
def test_direct_scatter_places_what_the_staged_one_does(n: int, impl: str) -> None:
    """``scratch=None`` (no staging copy) gives the same answers and the
    same destinations as the staged scatter, for pieces that straddle the
    1 KiB hashing chunks, leave gaps (another rank's bytes) and come in any
    order; a block that fails is False either way."""
    rng = np.random.default_rng(n)
    srcs = [rng.integers(0, 256, size=n, dtype=np.uint8) for _ in range(4)]
    sums = [cks.checksum(x) for x in srcs]
    sums[2] ^= 1 << 63
    q = n // 4
    rows = [(q + 7, q - 9, 1, 3, q), (0, q - 1, 0, 0, q), (3 * q, n - 3 * q, 0, 4 * q, 2 * n)]
    pieces = _pieces(*rows)
    idx = [3, 0, 1, 2]
    outs = []
    for scratch in (np.empty(n, np.uint8), None):
        a, b = np.zeros(8 * 2 * n, np.uint8), np.zeros(8 * q + 8, np.uint8)
        ok = cks.verify_scatter_many(srcs, sums, scratch, pieces, (a, b), idx)
        assert ok.tolist() == [True, True, False, True]
        outs.append((a, b))
    (a0, b0), (a1, b1) = outs
    for x, i in zip(srcs, idx):
        if i == 1:  # the failing block: the staged scatter wrote nothing, the direct one may have
            continue
        assert np.array_equal(a1[i * q : i * q + q - 1], x[: q - 1])
        assert np.array_equal(b1[3 + i * q : 3 + i * q + q - 9], x[q + 7 : 2 * q - 2])
        at = 4 * q + i * 2 * n
        assert np.array_equal(a1[at : at + n - 3 * q], x[3 * q :])
    assert not a0[q : 2 * q].any()  # staged: the failing block's places untouched
    mask = np.ones(a0.size, bool)
    for at, ln in ((1 * q, q - 1), (4 * q + 2 * n, n - 3 * q)):
        mask[at : at + ln] = False
    assert np.array_equal(a0[mask], a1[mask])


@pytest.mark.parametrize("n", [200, 4 * 1024 + 5, 4 * 1024 + 100, 64 * 1024])
def test_direct_scatter_hashes_the_bytes_no_piece_names(n: int, impl: str) -> None:
    """Chunks in no piece (another rank's shard) are hashed where they lie:
    pieces that name only the head and the last few bytes, or only the last
    three (the final stripe then reaches back into an unplaced chunk), still
    check the whole block, and one flipped bit in the unplaced bytes fails it."""
    src = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8)
    good = cks.checksum(src)
    for rows in (((0, 100, 0, 0, 0), (n - 5, 5, 0, 100, 0)), ((n - 3, 3, 0, 0, 0),)):
        out = np.zeros(128, np.uint8)
        assert cks.verify_scatter_many([src], [good], None, _pieces(*rows), (out,), [0]).tolist() == [True]
        at = 0
        for off, ln, _, _, _ in rows:
            assert np.array_equal(out[at : at + ln], src[off : off + ln])
            at += ln
        bad = src.copy()
        bad[n // 2] ^= 4
        assert cks.verify_scatter_many([bad], [good], None, _pieces(*rows), (out,), [0]).tolist() == [False]


def test_direct_scatter_refuses_overlapping_pieces(impl: str) -> None:
    src = np.arange(4096, dtype=np.uint64).view(np.uint8)[:4096]
    pieces = _pieces((0, 2048, 0, 0, 4096), (1024, 2048, 1, 0, 4096))
    a, b = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    if impl == "native":
        with pytest.raises(ValueError, match="overlap"):
            cks.verify_scatter_many([src], [cks.checksum(src)], None, pieces, (a, b), [0])
        assert not a.any() and not b.any()
    else:  # the fallback always stages: overlapping pieces are fine there
        assert cks.verify_scatter_many([src], [cks.checksum(src)], None, pieces, (a, b), [0]).all()
        assert np.array_equal(b[:2048], src[1024:3072])


# ------------------------------------------------------------ gather_many
def _gather_case(n: int, seed: int) -> tuple[np.ndarray, tuple[np.ndarray, ...], list[int]]:
    """Pieces that tile a block of ``n`` bytes from two arrays, out of order,
    straddling the 1 KiB hashing chunks (the last one runs to the end)."""
    q = n // 4
    rows = [(q + 7, 2 * q - 7, 1, 5, 2 * q), (0, q + 7, 0, 0, q + 7), (3 * q, n - 3 * q, 0, 8 * (q + 7), n)]
    rng = np.random.default_rng(seed)
    srcs = (rng.integers(0, 256, size=8 * (q + 7) + 8 * n, dtype=np.uint8),
            rng.integers(0, 256, size=5 + 8 * 2 * q, dtype=np.uint8))
    return _pieces(*rows), srcs, [3, 0, 7, 2]


def _gathered(pieces: np.ndarray, srcs: tuple[np.ndarray, ...], index: int, n: int) -> np.ndarray:
    want = np.zeros(n, np.uint8)
    for off, ln, s, base, stride in pieces.tolist():
        want[off : off + ln] = srcs[s][base + index * stride : base + index * stride + ln]
    return want


@pytest.mark.parametrize("n", [100, 241, 1024, 1025, 4096 + 3, 65536 + 7, (1 << 20) + 63])
def test_gather_many_fills_each_slot_and_returns_its_checksum(n: int, impl: str) -> None:
    """Each block is gathered from its pieces into its slot, and the checksum
    returned is XXH3-64 of exactly those bytes (so a block saved this way
    verifies on every read path)."""
    pieces, srcs, idx = _gather_case(n, n)
    dsts = [np.full(n, 0xAB, np.uint8) for _ in idx]
    sums = cks.gather_many(dsts, pieces, srcs, idx)
    assert sums is not None and sums.dtype == np.uint64 and sums.shape == (4,)
    for d, i, s in zip(dsts, idx, sums.tolist()):
        want = _gathered(pieces, srcs, i, n)
        assert np.array_equal(d, want)
        assert s == xxhash.xxh3_64_intdigest(want.tobytes())


def test_gather_many_without_checksums_writes_only_the_pieces(impl: str) -> None:
    """``checksums=False`` (one TP rank's shard): the pieces' bytes land in
    each slot, every other byte (another rank's) is left as it was."""
    n = 8192
    pieces = _pieces((4096, 2048, 0, 0, 2048), (6144, 2048, 1, 0, 2048))
    rng = np.random.default_rng(2)
    srcs = (rng.integers(0, 256, size=4 * 2048, dtype=np.uint8), rng.integers(0, 256, size=4 * 2048, dtype=np.uint8))
    dsts = [np.full(n, 7, np.uint8) for _ in range(2)]
    assert cks.gather_many(dsts, pieces, srcs, [3, 1], checksums=False) is None
    for d, i in zip(dsts, (3, 1)):
        assert (d[:4096] == 7).all()
        assert np.array_equal(d[4096:6144], srcs[0][i * 2048 : (i + 1) * 2048])
        assert np.array_equal(d[6144:], srcs[1][i * 2048 : (i + 1) * 2048])


@pytest.mark.parametrize("rows,slot,index,checksums", [
    ([(0, 100, 0, 0, 100), (150, 106, 0, 0, 0)], 256, 0, True),   # a gap: those slot bytes would be stale
    ([(0, 200, 0, 0, 200), (100, 156, 0, 0, 0)], 256, 0, True),   # overlapping pieces
    ([(0, 200, 0, 0, 200), (100, 156, 0, 0, 0)], 256, 0, False),  # ... with or without checksums
    ([(0, 256, 0, 0, 256)], 255, 0, False),                        # a slot too short
    ([(0, 128, 0, 0, 128)], 256, 0, True),                         # a slot longer than the block
    ([(0, 256, 1, 0, 256)], 256, 0, True),                         # no such source
    ([(0, 256, 0, 0, 256)], 256, 4, True),                         # engine block 4 of a 4-block source
    ([(0, 256, 0, 0, 1 << 62)], 256, 3, True),                     # stride * index would overflow
    ([(-1, 257, 0, 0, 256)], 256, 0, True),                        # negative offset
])
def test_gather_many_refuses_before_writing_anything(rows: list[tuple[int, ...]], slot: int, index: int,
                                                     checksums: bool, impl: str) -> None:
    src = np.random.default_rng(9).integers(1, 256, size=4 * 256, dtype=np.uint8)
    good, bad = np.zeros(256, np.uint8), np.zeros(slot, np.uint8)
    with pytest.raises(ValueError):
        cks.gather_many([good, bad], _pieces(*rows), (src,), [0, index], checksums)
    assert not good.any() and not bad.any()
    with pytest.raises(ValueError):
        cks.gather_many([good], _pieces((0, 256, 0, 0, 256)), (src,), [-1])


def test_gather_many_refuses_a_slot_that_overlaps_a_source(impl: str) -> None:
    buf = np.random.default_rng(4).integers(0, 256, size=4 * 512, dtype=np.uint8)
    before = buf.copy()
    with pytest.raises(ValueError, match="overlap"):
        cks.gather_many([buf[1024:1536]], _pieces((0, 512, 0, 0, 512)), (buf,), [2])
    assert np.array_equal(buf, before)


@pytest.mark.parametrize("threads", [1, 2])
def test_layer_scatter_gather_is_the_inverse_of_its_scatter(threads: int, impl: str) -> None:
    """A block gathered by ``LayerScatter.gather`` (a save) and scattered
    back by the same layout (a load) puts the engine's bytes back, and its
    checksum is the one the load verifies."""
    from kvstore.client.sinks import LayerScatter

    layer, blocks, nl = 4096 + 32, 6, 3
    rng = np.random.default_rng(threads)
    arrays = [rng.integers(0, 256, size=blocks * layer, dtype=np.uint8) for _ in range(nl)]
    pieces = _pieces(*[(i * layer, layer, i, 0, layer) for i in range(nl)])
    lay = LayerScatter(nl * layer, pieces, arrays, threads=threads)
    ids = [5, 0, 2, 3, 1, 4] * 40  # 240 blocks: past the two-thread split
    slots = [np.zeros(nl * layer, np.uint8) for _ in ids]
    sums = lay.gather(slots, ids, threads=threads)
    assert sums is not None
    back = [np.zeros_like(a) for a in arrays]
    ok = cks.verify_scatter_many(slots[:blocks], sums[:blocks].tolist(), None, pieces, tuple(back), ids[:blocks])
    assert ok.all()
    assert all(np.array_equal(a, b) for a, b in zip(arrays, back))
