"""kvstore._native's copy kernels, below kvstore.checksum's API: every
kernel (SSE2, AVX2, AVX-512) with ordinary and non-temporal stores, at every
offset between its buffers and of its destination, and the store policy of
a batch (when it streams, and a batch with no checksums).

Each result must be ``xxhash.xxh3_64_intdigest`` of the bytes, with every
byte placed and nothing outside the destination written.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvstore import checksum as cks

needs_native = pytest.mark.skipif(not cks.HAVE_NATIVE, reason="kvstore._native is not built")


def _blocks(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=size, dtype=np.uint8) for _ in range(n)]


@needs_native
@pytest.mark.parametrize("n", [241, 1024, 1025, 1088, 5000, (1 << 20) + 17])
def test_every_native_copy_kernel_matches(n: int) -> None:
    nat = cks._native
    assert nat is not None
    src = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8)
    want = xxhash.xxh3_64_intdigest(src.tobytes())
    assert nat.COPY_KERNEL == nat.kernels()[-1]
    for kernel in nat.kernels():
        for nontemporal in (False, True):
            dst = np.zeros_like(src)
            assert nat._copy_checksum_with(dst, src, kernel, nontemporal) == want
            assert np.array_equal(dst, src)
            # unaligned destination and source
            big = np.zeros(n + 3, np.uint8)
            assert nat._copy_checksum_with(big[3:], src, kernel, nontemporal) == want
            assert np.array_equal(big[3:], src)
    with pytest.raises(ValueError, match="not available"):
        nat._copy_checksum_with(np.zeros_like(src), src, "mmx", False)
    assert isinstance(nat.simd_target(), str)


@needs_native
@pytest.mark.parametrize("gap", [0, 8, 16, 48, 64, 100, 2064, 4080])
def test_every_kernel_copies_at_every_page_offset_between_its_buffers(gap: int) -> None:
    """The kernels' own chunk copy (each 64 bytes loaded before the 64
    before them are stored) places every byte, whatever the distance between
    the two buffers modulo a page (``gap``: how far past src's page offset
    dst starts) and whatever the tail of the last 1 KiB chunk."""
    nat = cks._native
    assert nat is not None
    rng = np.random.default_rng(gap)
    for n in (241, 1087, 1151, 3 * 1024 + 129, 4096 + 63, (1 << 16) + 1):
        raw_src = rng.integers(0, 256, size=n + 8192, dtype=np.uint8)
        raw_dst = np.zeros(n + 8192, np.uint8)
        s0 = (-raw_src.ctypes.data) % 4096
        d0 = (-raw_dst.ctypes.data) % 4096
        src = raw_src[s0 + 32 : s0 + 32 + n]
        want = xxhash.xxh3_64_intdigest(src.tobytes())
        for kernel in nat.kernels():
            for nontemporal in (False, True):
                raw_dst[:] = 0
                dst = raw_dst[d0 + 32 + gap : d0 + 32 + gap + n]
                assert nat._copy_checksum_with(dst, src, kernel, nontemporal) == want
                assert np.array_equal(dst, src)
                assert not raw_dst[: d0 + 32 + gap].any() and not raw_dst[d0 + 32 + gap + n :].any()


@needs_native
@pytest.mark.parametrize("n", [4095, 4096, 4097, 4096 + 63, 4096 + 64, 4096 + 65, 5 * 1024, 5 * 1024 + 1,
                               (1 << 16) + 1000])
def test_the_streamed_copy_places_and_hashes_every_byte_at_every_destination_offset(n: int) -> None:
    """Non-temporal copies of 4 KiB or more take the AVX-512 kernel's
    register path (no bounce buffer), which realigns stripes to the
    destination's 64-byte boundaries: at every destination offset modulo 64
    (those not a multiple of 4 take the bounce kernel) and around 1 KiB
    block and 64-byte stripe tails, the hash is the source's, every byte is
    placed, and nothing outside the destination is written."""
    nat = cks._native
    assert nat is not None
    rng = np.random.default_rng(n)
    raw_src = rng.integers(0, 256, size=n + 128, dtype=np.uint8)
    raw_dst = np.zeros(n + 256, np.uint8)
    base = (-raw_dst.ctypes.data) % 64
    for s0 in (0, 16, 3):
        src = raw_src[s0 : s0 + n]
        want = xxhash.xxh3_64_intdigest(src.tobytes())
        for kernel in nat.kernels():
            for d0 in range(base, base + 64):
                raw_dst[:] = 0
                dst = raw_dst[d0 : d0 + n]
                assert nat._copy_checksum_with(dst, src, kernel, True) == want, (kernel, s0, d0 - base)
                assert np.array_equal(dst, src), (kernel, s0, d0 - base)
                assert not raw_dst[:d0].any() and not raw_dst[d0 + n :].any()


@needs_native
@pytest.mark.parametrize("batch_bytes", [0, 1, None])
def test_a_batch_copied_with_non_temporal_stores_is_the_same_copy(batch_bytes: int | None) -> None:
    """``copy_checksum_many``'s ``batch_bytes`` (the whole batch a thread
    copies part of) only picks the stores: the bytes and checksums are the
    same either way (None: the native helper's own threshold)."""
    nat = cks._native
    assert nat is not None
    srcs = _blocks(5, 3 * 1024 + 77, 11)
    dsts = [np.zeros_like(s) for s in srcs]
    sums = np.zeros(5, np.uint64)
    nat.copy_checksum_many(dsts, srcs, sums, nat.NONTEMPORAL_MIN if batch_bytes is None else batch_bytes)
    assert sums.tolist() == [xxhash.xxh3_64_intdigest(s.tobytes()) for s in srcs]
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    with pytest.raises(ValueError, match="batch_bytes"):
        nat.copy_checksum_many(dsts, srcs, sums, -1)


@needs_native
def test_reads_stream_from_a_quarter_of_the_cache_and_writes_from_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read (``verify_many``) of ``READ_STREAM_MIN`` bytes asks the native
    helper for non-temporal stores (its ``batch_bytes`` reach
    ``NONTEMPORAL_MIN``); a write (``copy_many``) of the same batch does not,
    and a read just under the threshold does not either. The bytes and the
    verdicts are the same whatever the stores."""
    nat = cks._native
    assert nat is not None
    assert cks.STREAM_MIN == nat.NONTEMPORAL_MIN
    assert cks.READ_STREAM_MIN == max(1 << 20, nat.NONTEMPORAL_MIN // 2)
    asked: list[int] = []

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(nat, name)

        def copy_checksum_many(self, dsts: object, srcs: object, sums: object, batch_bytes: int = 0) -> None:
            asked.append(batch_bytes)
            nat.copy_checksum_many(dsts, srcs, sums, batch_bytes)

    monkeypatch.setattr(cks, "_native", Spy())
    size = 1 << 16
    for n, op, streams in ((cks.READ_STREAM_MIN // size, "read", True),
                           (cks.READ_STREAM_MIN // size - 1, "read", False),
                           (cks.READ_STREAM_MIN // size, "plain", True),  # copy_blocks: a read too
                           (cks.READ_STREAM_MIN // size - 1, "plain", False),
                           (cks.READ_STREAM_MIN // size, "write", cks.READ_STREAM_MIN >= nat.NONTEMPORAL_MIN)):
        srcs = _blocks(n, size, n)
        want = [xxhash.xxh3_64_intdigest(s.tobytes()) for s in srcs]
        dsts = [np.zeros(size, np.uint8) for _ in range(n)]
        asked.clear()
        if op == "read":
            assert bool(cks.verify_many(dsts, srcs, want, threads=1).all())
        elif op == "plain":
            cks.copy_blocks(dsts, srcs, threads=1)
        else:
            assert cks.copy_many(dsts, srcs, threads=1).tolist() == want
        assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
        assert asked and all((b >= nat.NONTEMPORAL_MIN) == streams for b in asked), (n, op, asked)


@needs_native
@pytest.mark.parametrize("batch_bytes", [0, None])
def test_a_batch_copy_with_no_sums_copies_only(batch_bytes: int | None) -> None:
    """``copy_checksum_many(dsts, srcs, None)`` copies each block, with
    ordinary or streaming stores alike, and writes nothing past it; its
    pairs are checked as with sums."""
    nat = cks._native
    assert nat is not None
    srcs = _blocks(4, 3 * 1024 + 77, 5)
    raw = [np.zeros(s.size + 64, np.uint8) for s in srcs]
    dsts = [r[32 : 32 + s.size] for r, s in zip(raw, srcs)]
    assert nat.copy_checksum_many(dsts, srcs, None, nat.NONTEMPORAL_MIN if batch_bytes is None else batch_bytes) is None
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    assert not any(r[:32].any() or r[32 + s.size :].any() for r, s in zip(raw, srcs))
    with pytest.raises(ValueError, match="same length"):
        nat.copy_checksum_many([dsts[0][1:]], [srcs[0]], None)
    with pytest.raises(ValueError, match="1 dsts, 2 srcs"):
        nat.copy_checksum_many(dsts[:1], srcs[:2], None)
    with pytest.raises(TypeError, match="writable"):
        nat.copy_checksum_many([srcs[0].tobytes()], [srcs[0]], None)


# --------------------------------------------------------------------------
# batches: copy_many, checksum_many, verify_many
# --------------------------------------------------------------------------
