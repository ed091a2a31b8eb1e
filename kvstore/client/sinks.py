"""Where a verified read puts the blocks it reads (issue 18, goal 4).

``Client.get_into`` copies each block out of the slab and checks its
XXH3-64 on the way. By default the blocks land in the caller's buffers
(``BufferSink``). An engine whose KV cache is split per layer would then
copy each block a second time, from those buffers into its layers. A
``ScatterSink`` puts the checked bytes there directly: each block is copied
straight to its places in the engine's arrays and hashed there, 1 KiB at a
time while the bytes are in L1 (``kvstore.checksum.verify_scatter_many``
with no scratch): one pass over memory, as ``BufferSink``'s copy is. As
with ``BufferSink``, a block that fails has written its places, and the
engine must treat them as not loaded (vLLM recomputes them). A layout made
with ``staged=True`` copies (and hashes) each block into a small private
scratch buffer first and places its pieces only when the checksum matches:
a block that fails then leaves the engine's arrays untouched, for one more
copy (measured in docs/performance.md: 0.77 against 0.51 ms for 15 blocks
of 256 KiB in 4 pieces, source and destination not in cache).

Under tensor parallelism a ``ShardScatter`` places one rank's shard of
*sealed* blocks (``kvstore.client.shards``): its ``ShardSink`` reads and
hashes only that shard and the seal, and checks the shard against its own
checksum in the seal rather than the whole block against the daemon's.

A sink answers two questions: the size block ``i`` must have
(``size_of``), and "copy and check these blocks" (``write``: one bool per
block, False for a checksum mismatch).
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

import numpy as np

from kvstore.buffers import KEY_BYTES, as_u8_writable, keys_at, pack_keys
from kvstore.checksum import (HAVE_NATIVE, PIECE_FIELDS, copy_blocks, gather_many, run_split, scatter_slots, splits,
                              verify_many, verify_scatter_many)
from kvstore.client.shards import own_sums, seal_bytes, u8_views, write_seals
from kvstore.errors import InvalidArgument
from tiers.base import Buffer

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["BlockSink", "BufferSink", "LayerScatter", "ScatterSink", "ShardScatter", "ShardSink", "as_sink", "is_sink",
           "read_slots", "scatter_parts", "sizes_of", "write_with"]


ROW_BYTES = 32
"""One row of the shared index's answer for a read (``read_slots``): four int64."""


@runtime_checkable
class BlockSink(Protocol):
    """Where a verified read of ``len(sink)`` blocks puts them."""

    def __len__(self) -> int: ...

    def size_of(self, i: int) -> int:
        """The byte size block ``i`` must have (a block of another size is not read)."""
        ...

    def write(self, idx: Sequence[int], srcs: Sequence[Any], expected: Sequence[int]) -> np.ndarray:
        """Copy ``srcs[j]`` (block ``idx[j]``) to its place, checking its
        XXH3-64 against ``expected[j]``; a bool per block (False: mismatch).
        (kvstore's own sinks also take ``threads``: at most that many
        threads for this write, see ``write_with``.)"""
        ...


class BufferSink:
    """One caller buffer per block (``get_into``'s ``outs``)."""

    def __init__(self, outs: Sequence[Buffer], threads: int = 2) -> None:
        self.outs = outs
        self.threads = threads
        self._views: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.outs)

    def views(self) -> list[np.ndarray]:
        """A flat uint8 view of every buffer (made once, at the first use)."""
        if self._views is None:
            self._views = [as_u8_writable(o) for o in self.outs]
        return self._views

    def size_of(self, i: int) -> int:
        return int(self.views()[i].size)

    def sizes(self, n: int) -> list[int]:
        """``size_of`` of the first ``n`` blocks."""
        return [v.size for v in self.views()[:n]]

    def write(self, idx: Sequence[int], srcs: Sequence[Any], expected: Sequence[int],
              threads: int | None = None) -> np.ndarray:
        views = self.views()
        dsts = views[: len(idx)] if isinstance(idx, range) and idx.start == 0 and idx.step == 1 else \
            [views[i] for i in idx]
        return verify_many(dsts, srcs, expected, threads or self.threads)

    def copy(self, a: int, b: int, srcs: Sequence[Any], threads: int | None = None) -> None:
        """Blocks ``a..b-1`` from ``srcs`` with no checksum (bytes that need
        none: a client's own staged put, ``SharedPath.read``)."""
        copy_blocks(self.views()[a:b], srcs, threads or self.threads)


class LayerScatter:
    """How a whole stored block maps onto an engine's arrays, set up once.

    ``pieces`` (int64, ``(n, 5)``): rows ``(offset in the block, length,
    destination, base, stride)``: block bytes ``[offset, offset + length)``
    go to ``dsts[destination]`` at byte ``base + slot * stride``, where
    ``slot`` is the engine's block id. ``dsts``: writable byte buffers (a
    layer's whole KV tensor each). Bytes of the block no piece names (another
    rank's shard) are still hashed: the checksum covers the whole block.
    ``staged``: see the module docstring (forced on when two pieces overlap
    in the block, which only a staged copy can place)."""

    def __init__(self, block_bytes: int, pieces: Any, dsts: Sequence[Any], threads: int = 2,
                 staged: bool = False) -> None:
        rows = np.ascontiguousarray(pieces, dtype=np.int64).reshape(-1, PIECE_FIELDS)
        if block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be > 0, got {block_bytes}")
        if rows.size and (int(rows.min()) < 0 or int((rows[:, 0] + rows[:, 1]).max()) > block_bytes
                          or int(rows[:, 2].max()) >= len(dsts)):
            raise InvalidArgument("a piece lies outside the block or names no destination")
        self.block_bytes = int(block_bytes)
        self.pieces = rows
        self.dsts = tuple(dsts)
        self.threads = max(1, int(threads))
        live = rows[rows[:, 1] > 0]
        live = live[np.argsort(live[:, 0], kind="stable")]
        overlap = bool(live.shape[0] > 1 and ((live[:-1, 0] + live[:-1, 1]) > live[1:, 0]).any())
        self.staged = bool(staged) or overlap
        """Blocks pass through scratch and are placed only once checked."""
        self._scratch: list[np.ndarray] = []
        """Free scratch buffers (one per thread that copies at once): reused, so they stay mapped and cached."""

    def sink(self, slots: Sequence[int], keys: Sequence[bytes] | bytes | None = None) -> "ScatterSink":
        """A sink for a read of ``len(slots)`` blocks: block ``i`` goes to
        engine block ``slots[i]``. (``keys``: unused; a whole block is
        checked against the daemon's checksum. ``ShardScatter.sink`` needs
        them.)"""
        return ScatterSink(self, slots)

    def gather(self, dsts: Sequence[Any], slots: Sequence[int] | np.ndarray, checksums: bool = True,
               threads: int | None = None) -> np.ndarray | None:
        """The other way, for saves: engine block ``slots[i]`` gathered from
        the arrays straight into ``dsts[i]`` (a reserved slot: the whole
        stored block), with no staging copy
        (``kvstore.checksum.gather_many``). ``checksums``: the pieces must
        cover the whole block (TP = 1), and its XXH3-64s are returned, hashed
        on the way; else only this layout's pieces of each slot are written
        (one rank's shard) and None is returned. ValueError for overlapping
        pieces (``staged`` layouts: stage the blocks instead)."""
        n = len(dsts)
        ids = np.asarray(slots, dtype=np.int64).reshape(n)
        out = np.zeros(n, dtype=np.uint64) if checksums else None

        def run(a: int, b: int) -> None:
            got = gather_many(dsts[a:b], self.pieces, self.dsts, ids[a:b], checksums)
            if out is not None and got is not None:
                out[a:b] = got

        run_split(run, n, n * self.block_bytes, threads or self.threads)
        return out

    def take_scratch(self) -> np.ndarray:
        try:
            return self._scratch.pop()  # (list.pop/append are atomic: threads share the pool)
        except IndexError:
            return np.empty(self.block_bytes, dtype=np.uint8)

    def give_scratch(self, buf: np.ndarray) -> None:
        self._scratch.append(buf)


class ScatterSink:
    """One read's blocks, straight into the engine's arrays (``LayerScatter.sink``)."""

    def __init__(self, layout: LayerScatter, slots: Sequence[int] | np.ndarray) -> None:
        self.layout = layout
        if isinstance(slots, list):
            # the ids as engines hand them: checked and converted without a numpy reduction,
            # which costs ~20 us with cold caches, as a load step finds them (docs/performance.md)
            try:
                arr = array.array("q", slots)
            except (TypeError, OverflowError):
                raise InvalidArgument("engine block ids must be integers in int64") from None
            if arr and min(arr) < 0:
                raise InvalidArgument("engine block ids must be >= 0")
            self.ids = np.frombuffer(arr, dtype=np.int64)
            return
        ids = np.asarray(slots)
        if ids.size and ids.dtype.kind not in "iu":
            raise InvalidArgument(f"engine block ids must be integers, got {ids.dtype}")
        self.ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        """The engine block of each block of the read."""
        if self.ids.size and int(self.ids.min()) < 0:
            raise InvalidArgument("engine block ids must be >= 0")

    def __len__(self) -> int:
        return int(self.ids.size)

    def size_of(self, i: int) -> int:
        return self.layout.block_bytes

    def sizes(self, n: int) -> list[int]:
        return [self.layout.block_bytes] * n

    def write(self, idx: Sequence[int], srcs: Sequence[Any], expected: Sequence[int],
              threads: int | None = None) -> np.ndarray:
        lay = self.layout
        n = len(idx)
        ok = np.zeros(n, dtype=bool)
        exp = [int(x) for x in expected]
        slots = self.ids[np.asarray(idx, dtype=np.intp)]

        def run(a: int, b: int) -> None:
            # one native call per thread's part (one GIL release), not one per block
            if not lay.staged:
                ok[a:b] = verify_scatter_many(srcs[a:b], exp[a:b], None, lay.pieces, lay.dsts, slots[a:b])
                return
            scratch = lay.take_scratch()
            try:
                ok[a:b] = verify_scatter_many(srcs[a:b], exp[a:b], scratch, lay.pieces, lay.dsts, slots[a:b])
            finally:
                lay.give_scratch(scratch)

        run_split(run, n, n * lay.block_bytes, threads or lay.threads)
        return ok

    def read_slots(self, slab: Any, rows: bytes) -> int | None:
        """The same-host read's fast path: block ``i < len(rows) // 32``
        straight out of ``slab`` (``rows``: the shared index's answer as it
        wrote it, int64 ``(row, offset, length, checksum)`` each, see
        ``kvstore.checksum.scatter_slots``), one native call per thread and
        no Python object per block. -1: a slot of another size or outside the
        slab (nothing written); else how many leading blocks matched. None:
        not here (no native helper, or a staged layout): use ``write``."""
        lay = self.layout
        if lay.staged or not HAVE_NATIVE:
            return None
        return self.scatter_rows(slab, rows, lay.block_bytes, lay.block_bytes)

    def scatter_rows(self, slab: Any, rows: bytes, block_bytes: int, placed_bytes: int,
                     seal: tuple[bytes, int, int, int] | None = None) -> int:
        """``scatter_slots`` of ``rows`` (stored blocks of ``block_bytes``,
        ``placed_bytes`` of each placed; ``seal``: as ``scatter_slots`` takes
        it, with every block's key) into this sink's engine blocks: one call
        when the read is one part, nothing sliced; else one per thread."""
        lay = self.layout

        def part(a: int, b: int) -> int:
            s = None if seal is None else (seal[0][KEY_BYTES * a:KEY_BYTES * b], *seal[1:])
            return scatter_slots(slab, rows[ROW_BYTES * a:ROW_BYTES * b], block_bytes, lay.pieces, lay.dsts,
                                 self.ids[a:b], s)

        n = len(rows) // ROW_BYTES
        if not splits(n, n * placed_bytes, lay.threads):
            s = None if seal is None else (seal[0][:KEY_BYTES * n], *seal[1:])
            return scatter_slots(slab, rows, block_bytes, lay.pieces, lay.dsts, self.ids, s)
        return scatter_parts(n, placed_bytes, lay.threads, part)


def scatter_parts(n: int, placed_bytes: int, threads: int, run: Any) -> int:
    """``run(a, b)`` (a ``scatter_slots`` of rows ``[a, b)`` of ``n``) over up
    to ``threads`` threads; the answer for all the rows: -1 if any part found
    a slot that does not fit, else the leading blocks that matched."""
    got: dict[int, int] = {}

    def part(a: int, b: int) -> None:
        got[a] = run(a, b)

    run_split(part, n, n * placed_bytes, threads)
    done = 0
    for a in sorted(got):
        if got[a] < 0:
            return -1
        if done < a:  # an earlier part stopped at a block that failed
            return done
        done = a + got[a]
    return done


class ShardScatter:
    """Rank ``rank`` of ``tp``: its shard of sealed blocks
    (``kvstore.client.shards``) to and from the engine's arrays.

    ``shard``: how one shard (bytes ``[0, shard_bytes)``) maps onto the
    engine's arrays. A stored block is ``tp`` shards and a seal; this rank's
    shard is at ``rank * shard_bytes``. Reads (``sink``) check only this
    rank's shard, against its entry in the seal; saves (``gather``) write
    the shard and this rank's part of the seal."""

    def __init__(self, shard: LayerScatter, rank: int, tp: int) -> None:
        if not 0 <= rank < tp:
            raise InvalidArgument(f"rank {rank} outside a group of {tp}")
        self.shard = shard
        self.rank, self.tp = int(rank), int(tp)
        self.shard_bytes = shard.block_bytes
        self.block_bytes = self.tp * self.shard_bytes + seal_bytes(self.tp)
        """A stored (sealed) block."""
        self.staged = shard.staged

    def own(self, blocks: Sequence[Any]) -> list[np.ndarray]:
        """This rank's shard of each whole block (writable views)."""
        a = self.rank * self.shard_bytes
        return [as_u8_writable(b)[a:a + self.shard_bytes] for b in blocks]

    def sink(self, slots: Sequence[int], keys: Sequence[bytes] | bytes | None = None) -> "ShardSink":
        """A sink for a read of ``len(slots)`` sealed blocks, block ``i``
        (key ``keys[i]``; or packed, 16 bytes each) to engine block ``slots[i]``."""
        if keys is None:
            raise InvalidArgument("a sealed read needs one key per block")
        return ShardSink(ScatterSink(self.shard, slots), self.rank, self.tp, self.shard_bytes, keys)

    def gather(self, dsts: Sequence[Any], slots: Sequence[int] | np.ndarray, keys: Sequence[bytes] | bytes,
               threads: int | None = None) -> np.ndarray:
        """Engine block ``slots[i]``'s shard into ``dsts[i]`` (a reserved
        slot: the whole sealed block, key ``keys[i]``; or packed, 16 bytes
        each), hashed on the way, and this rank's part of its seal; returns
        the shard checksums."""
        sums = self.shard.gather(self.own(dsts), slots, True, threads)
        assert sums is not None
        write_seals(dsts, self.rank, self.tp, self.shard_bytes, keys, sums)
        return sums


class ShardSink:
    """One read's sealed blocks (``kvstore.client.shards``): rank ``rank``'s
    shard of each goes to ``inner``, a sink of ``shard_bytes`` blocks (a
    ``ScatterSink``, from ``ShardScatter.sink``, or a ``BufferSink`` of
    shard-sized buffers). ``write`` ignores ``expected`` (the daemon's
    checksum of the whole block): a shard is checked against the seal, whose
    key must be the block's; a block whose seal is wrong reaches ``inner``
    not at all."""

    def __init__(self, inner: BufferSink | ScatterSink, rank: int, tp: int, shard_bytes: int,
                 keys: Sequence[bytes] | bytes) -> None:
        if not 0 <= rank < tp:
            raise InvalidArgument(f"rank {rank} outside a group of {tp}")
        self.packed = pack_keys(keys, check=True)
        """The keys in one string (``keys``: 16-byte keys, or packed back to back)."""
        if len(self.packed) != KEY_BYTES * len(inner):
            raise InvalidArgument(f"a sealed read needs one key per block: {len(self.packed) // KEY_BYTES} keys, "
                                  f"{len(inner)} blocks")
        self.inner = inner
        self.rank, self.tp, self.shard_bytes = int(rank), int(tp), int(shard_bytes)
        self.block_bytes = self.tp * self.shard_bytes + seal_bytes(self.tp)

    def __len__(self) -> int:
        return len(self.inner)

    def size_of(self, i: int) -> int:
        return self.block_bytes

    def sizes(self, n: int) -> list[int]:
        return [self.block_bytes] * n

    def write(self, idx: Sequence[int], srcs: Sequence[Any], expected: Sequence[int],
              threads: int | None = None) -> np.ndarray:
        idx = list(idx)
        views = u8_views(srcs)
        sealed, sums = own_sums(views, self.tp, self.rank, self.shard_bytes, keys_at(self.packed, idx))
        a, b = self.rank * self.shard_bytes, (self.rank + 1) * self.shard_bytes
        ok = np.zeros(len(idx), dtype=bool)
        go = np.flatnonzero(sealed).tolist()
        if go:
            ok[go] = self.inner.write([idx[j] for j in go], [views[j][a:b] for j in go], sums[go].tolist(), threads)
        return ok

    def read_slots(self, slab: Any, rows: bytes) -> int | None:
        """``ScatterSink.read_slots`` of sealed blocks: this rank's shard of
        each, checked against its seal, which must name the block's key."""
        inner = self.inner
        if not isinstance(inner, ScatterSink) or inner.layout.staged or not HAVE_NATIVE:
            return None
        return inner.scatter_rows(slab, rows, self.block_bytes, self.shard_bytes,
                                  (self.packed, self.tp, self.rank, self.shard_bytes))


def read_slots(sink: BlockSink, slab: Any, rows: bytes) -> int | None:
    """``sink.read_slots`` for kvstore's own engine sinks; None for any
    other sink (it takes ``write``)."""
    if isinstance(sink, (ScatterSink, ShardSink)):
        return sink.read_slots(slab, rows)
    return None


def sizes_of(sink: BlockSink, n: int) -> list[int]:
    """``sink.size_of(i)`` for ``i < n`` (in one call for kvstore's own sinks)."""
    if isinstance(sink, (BufferSink, ScatterSink, ShardSink)):
        return sink.sizes(n)
    return [sink.size_of(i) for i in range(n)]


def write_with(sink: BlockSink, threads: int, idx: Sequence[int], srcs: Sequence[Any],
               expected: Sequence[int]) -> np.ndarray:
    """``sink.write`` on at most ``threads`` threads (kvstore's own sinks;
    another sink writes as it does)."""
    if isinstance(sink, (BufferSink, ScatterSink, ShardSink)):
        return sink.write(idx, srcs, expected, threads)
    return sink.write(idx, srcs, expected)


def is_sink(outs: object) -> TypeIs[BlockSink]:
    """Whether ``outs`` is a ``BlockSink``. A list or tuple (of buffers)
    never is, and is answered first, as kvstore's own sinks are: a runtime
    protocol's ``isinstance`` walks its members (~10 µs a call, measured on
    the get path)."""
    if isinstance(outs, (BufferSink, ScatterSink, ShardSink)):
        return True
    return not isinstance(outs, (list, tuple)) and isinstance(outs, BlockSink)


def as_sink(outs: Sequence[Buffer] | BlockSink, threads: int) -> BlockSink:
    """``outs`` as a sink: a sink as it is, buffers as a ``BufferSink``."""
    if is_sink(outs):
        return outs
    return BufferSink(outs, threads)
