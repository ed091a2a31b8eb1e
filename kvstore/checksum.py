"""XXH3-64 payload checksums, and copies that compute one on the way.

Every payload carries an XXH3-64 (seed 0) checksum, checked whenever it
crosses a tier or a node (DESIGN.md section 4).  :func:`copy_checksum` and
:func:`copy_verify` copy a block and hash it in one pass over memory when the
``kvstore._native`` extension is built; otherwise they fall back to
``np.copyto`` followed by ``xxhash.xxh3_64_intdigest`` of the destination.
Both paths return the same values (``xxhash.xxh3_64_intdigest`` of the
bytes), so checksums written by one are verified by the other.

Inputs are anything with a C-contiguous buffer (bytes, bytearray,
memoryview, numpy arrays of any dtype -- viewed as their raw bytes) and CPU
torch tensors (read through ``.numpy()`` or a uint8 view; torch itself is
never imported here).  Errors: ``TypeError`` for objects that are not
buffers or a read-only ``dst``; ``ValueError`` for non-contiguous buffers,
``dst``/``src`` of different byte lengths, or partly overlapping buffers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = ["HAVE_NATIVE", "READ_STREAM_MIN", "STREAM_MIN", "checksum", "copy_checksum", "copy_many", "copy_run",
           "copy_verify", "gather_many", "run_split", "scatter_slots", "verify_many", "verify_scatter",
           "verify_scatter_many"]


def load_native() -> ModuleType | None:
    """``kvstore._native`` if it is built and not disabled by
    ``NO_KVSTORE_NATIVE=1``; else None (pure-Python fallback)."""
    if os.environ.get("NO_KVSTORE_NATIVE", "") not in ("", "0"):
        return None
    try:
        from kvstore import _native
    except ImportError:
        return None
    return _native


_native: Final = load_native()
HAVE_NATIVE: Final[bool] = _native is not None
"""Whether copies and checksums run in the C extension (values are identical)."""

_BUFFER_TYPES: Final = (bytes, bytearray, memoryview, np.ndarray)
_MAX_U64: Final = 2**64 - 1


def _tensor_bytes(obj: Any, name: str) -> npt.NDArray[np.uint8]:
    """A CPU torch tensor's bytes as a 1-D uint8 numpy view (shares memory)."""
    device = getattr(obj, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise ValueError(f"{name} is on {device}; only CPU tensors can be copied here")
    if callable(getattr(obj, "is_contiguous", None)) and not obj.is_contiguous():
        raise ValueError(f"{name} must be a C-contiguous tensor")
    if callable(getattr(obj, "detach", None)):
        obj = obj.detach()
    try:
        arr = obj.numpy()
    except (TypeError, RuntimeError):
        # dtypes numpy lacks (bfloat16, float8): reinterpret as uint8 first;
        # a tensor exists, so torch is already in sys.modules
        torch = sys.modules.get("torch")
        if torch is None:
            raise
        arr = obj.view(torch.uint8).numpy()
    return _array_bytes(np.asarray(arr), name)


def _array_bytes(arr: np.ndarray[Any, Any], name: str) -> npt.NDArray[np.uint8]:
    """A C-contiguous numpy array of any dtype as a 1-D uint8 view."""
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous buffer")
    if arr.dtype.hasobject:
        raise TypeError(f"{name} holds Python objects, not bytes (dtype {arr.dtype})")
    flat = arr.reshape(-1)
    if flat.dtype != np.uint8:
        flat = flat.view(np.uint8)
    return flat


def _as_bytes(obj: Any, name: str) -> npt.NDArray[np.uint8]:
    """Any supported input as a 1-D uint8 numpy view over the same memory."""
    if isinstance(obj, np.ndarray):
        return _array_bytes(obj, name)
    if isinstance(obj, (bytes, bytearray)):
        return np.frombuffer(obj, dtype=np.uint8)
    if callable(getattr(obj, "numpy", None)):
        return _tensor_bytes(obj, name)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{name} must support the buffer protocol (bytes, bytearray, memoryview, "
            f"numpy array) or be a CPU tensor, not {type(obj).__name__}") from None
    if not view.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous buffer")
    return np.frombuffer(view, dtype=np.uint8)


def _native_arg(obj: Any, name: str) -> Any:
    """What to hand the C extension: buffers as they are, tensors as uint8 views."""
    if isinstance(obj, _BUFFER_TYPES):
        return obj
    if callable(getattr(obj, "numpy", None)):
        return _tensor_bytes(obj, name)
    return obj  # the extension raises TypeError for non-buffers


def _check_pair(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> None:
    """Fallback-path checks matching the extension's."""
    if not dst.flags.writeable:
        raise TypeError("dst must be writable, got a read-only buffer")
    if dst.nbytes != src.nbytes:
        raise ValueError(
            f"dst and src must have the same length in bytes, got dst={dst.nbytes} src={src.nbytes}")
    if dst.nbytes and np.may_share_memory(dst, src):
        d = dst.__array_interface__["data"][0]
        s = src.__array_interface__["data"][0]
        if d != s:
            raise ValueError("dst and src overlap (only identical or disjoint buffers are allowed)")


def checksum(buf: Any) -> int:
    """XXH3-64 (seed 0) of ``buf``'s bytes; equal to ``xxhash.xxh3_64_intdigest``."""
    if _native is not None:
        return int(_native.checksum(_native_arg(buf, "buf")))
    return xxhash.xxh3_64_intdigest(_as_bytes(buf, "buf").data)


def copy_checksum(dst: Any, src: Any) -> int:
    """Copy ``src`` into ``dst`` (same byte length; identical or disjoint
    memory) and return the XXH3-64 of the bytes written.

    Natively this is one pass over memory: each 1 KiB is hashed on its way
    from ``src`` to ``dst`` (copies of 1 MiB or more use non-temporal
    stores).  The checksum always describes the bytes in ``dst``, even if
    another process rewrites ``src`` during the copy.
    """
    if _native is not None:
        return int(_native.copy_checksum(_native_arg(dst, "dst"), _native_arg(src, "src")))
    d, s = _as_bytes(dst, "dst"), _as_bytes(src, "src")
    _check_pair(d, s)
    if d is not s:
        np.copyto(d, s)
    return xxhash.xxh3_64_intdigest(d.data)


def copy_verify(dst: Any, src: Any, expected: int) -> bool:
    """Copy ``src`` into ``dst`` like :func:`copy_checksum` and return
    whether the checksum equals ``expected``.  ``dst`` is written either way:
    on False the caller must treat the block as a miss."""
    if not isinstance(expected, (int, np.integer)):
        raise TypeError(f"expected must be an int checksum, not {type(expected).__name__}")
    expected = int(expected)
    if not 0 <= expected <= _MAX_U64:
        raise ValueError("expected must be an XXH3-64 checksum in [0, 2**64)")
    if _native is not None:
        return bool(_native.copy_verify(_native_arg(dst, "dst"), _native_arg(src, "src"), expected))
    return copy_checksum(dst, src) == expected


PIECE_FIELDS: Final = 5
"""Columns of a ``verify_scatter`` piece row: source offset, length,
destination (index into ``dsts``), base and stride in that destination."""


def verify_scatter(src: Any, expected: int, scratch: Any, pieces: Any, dsts: tuple[Any, ...], index: int) -> bool:
    """Copy block ``src`` into ``scratch`` (private, at least as long) with
    the fused copy of :func:`copy_verify`; only when its checksum equals
    ``expected``, copy pieces of those checked bytes to their places: row
    ``(off, length, d, base, stride)`` of ``pieces`` (int64, ``(n, 5)``)
    writes ``scratch[off : off + length]`` at byte ``base + index * stride``
    of ``dsts[d]``. Every place is checked first (ValueError); on a mismatch
    nothing but ``scratch`` is written and the result is False. The bytes
    placed are the bytes hashed, even if another process rewrites ``src``."""
    if not isinstance(expected, (int, np.integer)):
        raise TypeError(f"expected must be an int checksum, not {type(expected).__name__}")
    if _native is not None:  # (the native helper does batches: a batch of one)
        return bool(verify_scatter_many([src], [int(expected)], scratch, pieces, dsts, [int(index)])[0])
    s = _as_bytes(src, "src")
    scr = _as_bytes(scratch, "scratch")
    rows = np.asarray(pieces, dtype=np.int64).reshape(-1, PIECE_FIELDS)
    outs = [_as_bytes(d, "dsts[i]") for d in dsts]
    if index < 0:
        raise ValueError("index must be >= 0")
    if scr.nbytes < s.nbytes:
        raise ValueError(f"scratch of {scr.nbytes} bytes for a block of {s.nbytes}")
    _check_pieces(s.nbytes, rows, outs, index)
    if not copy_verify(scr[: s.nbytes], s, int(expected)):
        return False
    for off, length, d, base, stride in rows.tolist():
        at = base + index * stride
        outs[d][at : at + length] = scr[off : off + length]
    return True


def _check_pieces(nbytes: int, rows: np.ndarray, outs: Sequence[Any], index: int) -> None:
    """The fallback's bounds check of every place of one block (ValueError)."""
    for r, (off, length, d, base, stride) in enumerate(rows.tolist()):
        if (min(off, length, d, base, stride) < 0 or off + length > nbytes or d >= len(outs)
                or base + index * stride + length > outs[d].nbytes):
            raise ValueError(f"piece {r} does not fit its source or destination")


def verify_scatter_many(srcs: Sequence[Any], expected: Sequence[int], scratch: Any, pieces: Any,
                        dsts: tuple[Any, ...], indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """:func:`verify_scatter` of each ``srcs[i]`` (checksum ``expected[i]``)
    at engine block ``indices[i]``; a bool per block. With the native helper
    it is one call: every place of every block is checked before anything is
    written and the GIL is released once for the batch.

    ``scratch=None`` (native helper only; the fallback stages as before):
    no staging copy. Each block is copied straight to its places and hashed
    there, 1 KiB at a time while the bytes are in L1, so the bytes placed are
    still the bytes hashed; but a block that fails *has* written its places,
    which the caller must then treat as garbage (an engine recomputes them).
    Pieces must not overlap within the block (ValueError)."""
    n = len(srcs)
    if _native is None:
        if scratch is None:
            scratch = np.empty(max((_as_bytes(x, "srcs[i]").nbytes for x in srcs), default=0), dtype=np.uint8)
        rows = np.asarray(pieces, dtype=np.int64).reshape(-1, PIECE_FIELDS)
        outs = [_as_bytes(d, "dsts[i]") for d in dsts]
        for x, i in zip(srcs, indices):  # every block's places first, as the native helper does
            if int(i) < 0:
                raise ValueError("index must be >= 0")
            _check_pieces(_as_bytes(x, "srcs[i]").nbytes, rows, outs, int(i))
        return np.asarray([verify_scatter(x, int(e), scratch, pieces, dsts, int(i))
                           for x, e, i in zip(srcs, expected, indices)], dtype=bool).reshape(n)
    try:
        want = np.ascontiguousarray(np.asarray(expected, dtype=np.uint64))
    except OverflowError:
        raise ValueError("expected must be an XXH3-64 checksum in [0, 2**64)") from None
    ok = np.zeros(n, dtype=np.uint8)
    _native.verify_scatter_many([_native_arg(s, "srcs[i]") for s in srcs], want, scratch,
                                np.ascontiguousarray(pieces, dtype=np.int64), dsts,
                                np.ascontiguousarray(np.asarray(indices, dtype=np.int64)), ok)
    return ok.view(bool)


def scatter_slots(slab: Any, slots: Any, block_bytes: int, pieces: np.ndarray, dsts: tuple[Any, ...],
                  indices: np.ndarray, seal: tuple[bytes, int, int, int] | None = None) -> int:
    """A same-host read's whole copy in one native call (native helper only:
    check ``HAVE_NATIVE``): block ``i`` is ``slab`` bytes ``[offset, offset +
    length)`` of ``slots[i]`` (the shared index's int64 rows ``(row, offset,
    length, checksum)``: an ``(n, 4)`` array, or the bytes the probe wrote),
    placed at engine block ``indices[i]`` as
    :func:`verify_scatter_many`'s direct scatter places it, and hashed on
    the way against the slot's checksum; or, with ``seal = (keys, tp, rank,
    shard_bytes)``, only this rank's shard of each sealed block
    (``kvstore.client.shards``), checked against its entry in a seal that
    must name ``keys[16 i : 16 i + 16]``. Returns -1 (nothing written) when
    a slot is not ``block_bytes`` long or lies outside ``slab``; else how many
    leading blocks matched (a block that does not has written its places:
    garbage). No Python object per block; the GIL is released once."""
    if _native is None:
        raise RuntimeError("scatter_slots needs the native helper (kvstore._native)")
    return int(_native.scatter_slots(slab, slots, int(block_bytes), pieces, dsts, indices, seal))


def gather_many(dsts: Sequence[Any], pieces: Any, srcs: tuple[Any, ...], indices: Sequence[int] | np.ndarray,
                checksums: bool = True) -> np.ndarray | None:
    """The reverse of :func:`verify_scatter_many`, for saves: block ``i`` is
    gathered into ``dsts[i]`` (e.g. a reserved slot) from engine block
    ``indices[i]``: row ``(off, length, s, base, stride)`` of ``pieces``
    copies ``srcs[s]`` at byte ``base + indices[i] * stride`` to
    ``dsts[i][off : off + length]``. Pieces must not overlap in the block.

    ``checksums`` (the default): the pieces must cover every byte of every
    ``dsts[i]``, and the XXH3-64 of each block is returned (uint64, one per
    block). With the native helper each 1 KiB of the slot is hashed in L1
    right after it was gathered: one pass over memory, where staging the
    block first takes two. ``checksums=False``: copy only (one rank's
    shard of a slot); returns None. Every place is checked (ValueError)
    before anything is written."""
    n = len(dsts)
    rows = np.ascontiguousarray(pieces, dtype=np.int64).reshape(-1, PIECE_FIELDS)
    idx = np.ascontiguousarray(np.asarray(indices, dtype=np.int64).reshape(n))
    if _native is not None:
        out = np.zeros(n, dtype=np.uint64) if checksums else None
        _native.gather_many([_native_arg(d, "dsts[i]") for d in dsts], rows, tuple(_native_arg(s, "srcs[i]")
                            for s in srcs), idx, out)
        return out
    outs = [_as_bytes(d, "dsts[i]") for d in dsts]
    ins = [_as_bytes(s, "srcs[i]") for s in srcs]
    if (idx < 0).any():
        raise ValueError("indices must be >= 0")
    live = rows[rows[:, 1] > 0]
    live = live[np.argsort(live[:, 0], kind="stable")]
    starts = live[:, 0].tolist()
    ends = (live[:, 0] + live[:, 1]).tolist()
    end = ends[-1] if ends else 0
    if any(a < b for a, b in zip(starts[1:], ends)) or (checksums and (starts[:1] not in ([], [0]) or any(
            a != b for a, b in zip(starts[1:], ends)))):
        raise ValueError("the pieces must cover the block once, with no gap and no overlap" if checksums
                         else "pieces overlap in the block")
    lo, hi = (int(idx.min()), int(idx.max())) if n else (0, 0)
    for r, (off, length, s, base, stride) in enumerate(rows.tolist()):
        if (min(off, length, s, base, stride) < 0 or s >= len(ins)
                or base + hi * stride + length > ins[s].nbytes):
            raise ValueError(f"piece {r} does not fit its source")
    spans = [(ins[s].__array_interface__["data"][0] + base + lo * stride,
              ins[s].__array_interface__["data"][0] + base + hi * stride + length)
             for off, length, s, base, stride in live.tolist()]
    for i, d in enumerate(outs):
        if d.nbytes < end or (checksums and d.nbytes != end):
            raise ValueError(f"dsts[{i}] has {d.nbytes} bytes; the pieces {'cover' if checksums else 'reach'} {end}")
        a = d.__array_interface__["data"][0]
        if any(a < y and x < a + d.nbytes for x, y in spans):
            raise ValueError(f"dsts[{i}] overlaps a source")
    for d, at in zip(outs, idx.tolist()):
        for off, length, s, base, stride in live.tolist():
            d[off : off + length] = ins[s][base + at * stride : base + at * stride + length]
    if not checksums:
        return None
    return np.asarray([xxhash.xxh3_64_intdigest(d.data) for d in outs], dtype=np.uint64).reshape(n)


# ---------------------------------------------------------------- batches
_POOL: Any = None
_PARALLEL_MIN_BYTES: Final = 4 << 20
"""Batches smaller than this are copied on the calling thread."""

STREAM_MIN: Final[int] = int(_native.NONTEMPORAL_MIN) if _native is not None else 1 << 20
"""Batches of this many bytes or more are copied with non-temporal stores
(the native helper's ``NONTEMPORAL_MIN``: half the last-level cache this
CPU shares, at least 1 MiB): a batch that size leaves the cache whatever
its stores do."""

READ_STREAM_MIN: Final[int] = max(1 << 20, STREAM_MIN // 2)
"""Reads (``verify_many``: a copy out of the store into the reader's
buffers) stream their stores from half ``STREAM_MIN``: a quarter of the
last-level cache, where the bytes read and the bytes written together take
half of it. Such a destination is not read back by the store, and its
reader takes it from RAM about as fast as from a cache that the copy would
have had to fill first, read for ownership included. Measured on the
2-core AMD EPYC of docs/performance.md (32 MiB L3; get, then the caller
reading every byte): 8 x 1 MiB 1.13 -> 1.02 ms with the get in flight and
1.25 -> 1.19 ms after it, the get alone 20-30% faster; 6 x 1 MiB and 4 x
1 MiB were slower streamed once read back, so the threshold stays there.
Writes into the store keep ``STREAM_MIN``: the daemon reads a staged put
again as it lands it."""


def _pool() -> Any:
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="kvstore-copy")
    return _POOL


def _split(n: int, nbytes: int, threads: int) -> list[tuple[int, int]]:
    """Contiguous ranges of a batch of ``n`` blocks, one per thread (one
    range when the batch is small or ``threads`` is 1)."""
    if threads <= 1 or n < 2 or nbytes < _PARALLEL_MIN_BYTES:
        return [(0, n)]
    k = min(threads, n)
    step = -(-n // k)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def copy_many(dsts: Any, srcs: Any, threads: int = 2, stream_from: int | None = None) -> np.ndarray:
    """``copy_checksum`` over a batch of blocks, spread over up to ``threads``
    threads (the copies release the GIL); returns the checksums (uint64).
    One thread copies as fast as ``np.copyto`` only with a hash on top; two
    keep up with memory on a 2-core machine. A batch of the native helper's
    ``NONTEMPORAL_MIN`` bytes or more (or of ``stream_from`` bytes or more,
    when given) is copied with non-temporal stores, whichever thread copies
    each part."""
    out = np.empty(len(srcs), dtype=np.uint64)
    _copy_batch(dsts, srcs, threads, stream_from, out)
    return out


def copy_blocks(dsts: Any, srcs: Any, threads: int = 2) -> None:
    """``dsts[i] <- srcs[i]`` over a batch with no checksum, split as
    ``copy_many`` splits it, its stores streamed from ``READ_STREAM_MIN``
    bytes as a verified read's are. For bytes that need no check: a client
    reading back its own staged put (kvstore/client/shared.py,
    ``SharedPath.read``)."""
    _copy_batch(dsts, srcs, threads, READ_STREAM_MIN, None)


def copy_run(dsts: Sequence[Any], src: np.ndarray, at: int, size: int, threads: int = 2) -> bool:
    """``dsts[i] <- src[at + i * size : at + (i + 1) * size]`` with no
    checksum: ``copy_blocks`` (split and streamed as it is) for blocks that
    lie back to back in one array, with less Python around the native call:
    ``dsts`` go to it as they are (a client reading back its own staged put,
    kvstore/client/shared.py ``SharedPath.read_staged``). False when the
    native helper refuses a destination (not a writable C-contiguous buffer
    of ``size`` bytes: a tensor, say) or there is none; it checks every
    destination of a part before copying any, so the caller's other path
    writes them all again (and on two threads the other part, if written,
    holds these same bytes)."""
    if _native is None:
        return False
    n = len(dsts)
    nbytes = n * size
    srcs = [src[a : a + size] for a in range(at, at + nbytes, size)]
    batch_bytes = _streamed(nbytes, READ_STREAM_MIN)
    try:
        _run_parts(lambda a, b: _native.copy_checksum_many(dsts[a:b], srcs[a:b], None, batch_bytes),
                   _split(n, nbytes, threads))
    except (TypeError, ValueError, BufferError):
        return False
    return True


def _copy_batch(dsts: Any, srcs: Any, threads: int, stream_from: int | None, out: np.ndarray | None) -> None:
    """``copy_many`` (checksums into ``out``) or ``copy_blocks`` (``out`` None)."""
    n = len(srcs)
    nbytes = _batch_nbytes(srcs)
    batch_bytes = _streamed(nbytes, stream_from)

    def run(a: int, b: int) -> None:
        if _native is not None:  # one call, one GIL release, per part
            _native.copy_checksum_many([_native_arg(d, "dsts[i]") for d in dsts[a:b]],
                                       [_native_arg(s, "srcs[i]") for s in srcs[a:b]],
                                       None if out is None else out[a:b], batch_bytes)
            return
        for i in range(a, b):
            if out is not None:
                out[i] = copy_checksum(dsts[i], srcs[i])
                continue
            d, s = _as_bytes(dsts[i], "dsts[i]"), _as_bytes(srcs[i], "srcs[i]")
            _check_pair(d, s)
            np.copyto(d, s)

    _run_parts(run, _split(n, nbytes, threads))


def _streamed(nbytes: int, stream_from: int | None) -> int:
    """The ``batch_bytes`` to hand the native copy for a batch of ``nbytes``:
    at least ``STREAM_MIN`` (it streams a batch whose batch_bytes reach
    ``NONTEMPORAL_MIN``) from ``stream_from`` bytes on, else ``nbytes``."""
    return max(nbytes, STREAM_MIN) if stream_from is not None and nbytes >= stream_from else nbytes


def _batch_nbytes(bufs: Any) -> int:
    """A batch's bytes, estimated from its first four blocks (the batches here hold blocks of one size)."""
    n = len(bufs)
    return sum(int(getattr(s, "nbytes", len(s))) for s in bufs[: min(n, 4)]) * max(1, n // 4)


def checksum_many(bufs: Any, threads: int = 2) -> np.ndarray:
    """``checksum`` over a batch of blocks, spread over up to ``threads``
    threads (the hash releases the GIL); returns the checksums (uint64)."""
    n = len(bufs)
    out = np.empty(n, dtype=np.uint64)
    nbytes = _batch_nbytes(bufs)

    def run(a: int, b: int) -> None:
        for i in range(a, b):
            out[i] = checksum(bufs[i])

    _run_parts(run, _split(n, nbytes, threads))
    return out


def verify_many(dsts: Any, srcs: Any, expected: Any, threads: int = 2) -> np.ndarray:
    """``copy_verify`` over a batch; returns a bool mask (False: mismatch).
    A verifying copy is a read out of the store into its reader's buffers:
    from ``READ_STREAM_MIN`` bytes it streams its stores (see there)."""
    n = len(srcs)
    if _native is not None:
        try:
            want = np.asarray(expected, dtype=np.uint64)
        except OverflowError:
            raise ValueError("expected must be an XXH3-64 checksum in [0, 2**64)") from None
        if want.shape != (n,):
            raise ValueError(f"{want.size} checksums for {n} blocks")
        return copy_many(dsts, srcs, threads, READ_STREAM_MIN) == want
    exp = [int(x) for x in expected]
    ok = np.empty(n, dtype=bool)
    nbytes = _batch_nbytes(srcs)

    def run(a: int, b: int) -> None:
        for i in range(a, b):
            ok[i] = copy_verify(dsts[i], srcs[i], exp[i])

    _run_parts(run, _split(n, nbytes, threads))
    return ok


def splits(n: int, nbytes: int, threads: int) -> bool:
    """Whether ``run_split`` would run a batch of ``n`` blocks and ``nbytes``
    on more than one thread."""
    return len(_split(n, nbytes, threads)) > 1


def run_split(run: Any, n: int, nbytes: int, threads: int) -> None:
    """``run(a, b)`` over contiguous ranges of ``range(n)``, one range per
    thread when the batch of ``nbytes`` is large enough to pay (the batch
    helpers above split the same way); the calling thread runs the first."""
    _run_parts(run, _split(n, nbytes, threads))


def _run_parts(run: Any, parts: list[tuple[int, int]]) -> None:
    if len(parts) == 1:
        run(*parts[0])
        return
    futures = [_pool().submit(run, a, b) for a, b in parts[1:]]
    run(*parts[0])
    for f in futures:
        f.result()
