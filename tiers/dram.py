"""DRAM tier: one POSIX shared-memory slab carved into fixed-size slots.

The slab is a file in ``/dev/shm`` created with ``O_EXCL`` and mode 0600 (only
the daemon's user may map it) and mapped with ``mmap``; local clients map the
same file and read or write slots by byte offset, so a block is identified by
its *offset*, never by a Python object. We do not use
``multiprocessing.shared_memory``: a process that only attaches registers the
segment with the resource tracker, which unlinks it when that process exits.

Allocation (memcached-style, O(1), ``tiers.slots.PagedSlots``, shared with
the HBM tier): the slab is cut into pages of ``page_bytes``; a page is given
to one size class on demand and carved into slots of that class's size; a page
whose slots are all free goes back to the free-page pool. Slot sizes are the
payload size rounded up to ``slot_align`` (4 KiB).

Each copy in or out is fused with its xxh3_64 checksum (``kvstore.checksum``):
the data is read from memory once.

The file is sparse: tmpfs backs a page when it is first written, and that
first write costs a page fault, an allocation and a zeroing per 4 KiB. With
``populate`` (``dram.populate``) the whole slab is backed when it is created
(and the pages a resize adds, before they hold anything): the daemon takes
all of its memory at start, as an engine's pinned pool does, and no put pays
for the host's allocation later.

A shrink never makes the file shorter: a same-host client may be copying a
block out of a retired page that very moment (a read without a lease,
kvstore/client/shared.py), and reading past the end of a mapped file is a
SIGBUS that kills it. The retired pages' memory goes back to the host
(``MADV_REMOVE``) and reads there see zeros, which fail their checksum.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Sequence

import numpy as np

from kvstore.buffers import as_u8
from kvstore.checksum import copy_many, verify_many
from kvstore.errors import CapacityError
from kvstore.fs_room import free_bytes
from tiers.base import BlockMeta, Buffer, TierKind
from tiers.slots import SLOT_ALIGN, PagedSlots

SHM_DIR = "/dev/shm"


def default_shm_name() -> str:
    return f"kvstore-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"


class DramTier(PagedSlots):
    """Shared-memory slab with paged size classes. See the module docstring."""

    kind = TierKind.DRAM
    label = "dram"

    def __init__(self, capacity_bytes: int, *, name: str | None = None,
                 page_bytes: int = 16 << 20, slot_align: int = SLOT_ALIGN,
                 slot_sizes: Sequence[int] = (), copy_threads: int = 2,
                 populate: bool = False) -> None:
        self._init_slots(capacity_bytes, page_bytes, slot_align, slot_sizes)
        self.copy_threads = max(1, int(copy_threads))
        self.populate = bool(populate)
        self.name = name or default_shm_name()
        self.path = os.path.join(SHM_DIR, self.name)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(self._fd, 0o600)  # umask cannot widen it, but be explicit
            os.ftruncate(self._fd, self._capacity)
            self._file_bytes = self._capacity
            """The file's size: at least the capacity (a shrink keeps it, see the module docstring)."""
            if self.populate:
                self._back(0, self._capacity)
            self._map = self._mmap(self._capacity)
        except BaseException:
            os.close(self._fd)
            os.unlink(self.path)
            raise
        self.buf = np.frombuffer(self._map, dtype=np.uint8)
        self._closed = False

    def _back(self, start: int, end: int) -> None:
        """Have the host back bytes ``[start, end)`` of the slab file now
        (``populate``): ``fallocate`` on tmpfs allocates and zeroes the pages
        in one system call (and a full tmpfs is a clear error here, not a
        SIGBUS at some later write). Called only before the range can hold a
        block (at creation, or for the pages a resize adds, before they are
        handed out), so nothing stored is ever overwritten. CapacityError
        when the host cannot back it."""
        if end <= start:
            return
        try:
            os.posix_fallocate(self._fd, start, end - start)
        except OSError as e:
            raise CapacityError(f"dram.populate: the host cannot back the slab's bytes [{start}, {end}) "
                                f"({e.strerror or e}); free /dev/shm or lower dram.capacity") from None

    def _mmap(self, length: int) -> mmap.mmap:
        """The slab mapped read/write; with ``populate`` its page table is
        filled too (``MAP_POPULATE``), so the daemon's own writes into the
        slab (write-behind puts, promotions, peer fetches) take no fault."""
        populate = getattr(mmap, "MAP_POPULATE", 0) if self.populate else 0
        return mmap.mmap(self._fd, length, flags=mmap.MAP_SHARED | populate)

    # ----------------------------------------------------------- properties
    @property
    def size(self) -> int:
        """Bytes mapped (what a client maps)."""
        return self._capacity

    # ------------------------------------------------------------- data path
    def view(self, loc: int, nbytes: int) -> np.ndarray:
        """Zero-copy view of a slot's first ``nbytes`` bytes."""
        return self.buf[loc : loc + nbytes]

    def write(self, locs: np.ndarray, payloads: Sequence[Buffer],
              owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        buf = self.buf
        srcs = [as_u8(p) for p in payloads]
        dsts = [buf[off : off + src.size] for off, src in zip(np.asarray(locs).tolist(), srcs)]
        return copy_many(dsts, srcs, self.copy_threads)

    def read_into(self, locs: np.ndarray, sizes: np.ndarray, checksums: np.ndarray,
                  outs: Sequence[Buffer], owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        buf = self.buf
        srcs = [buf[off : off + n] for off, n in zip(np.asarray(locs).tolist(), np.asarray(sizes).tolist())]
        return verify_many([as_u8(d) for d in outs], srcs, np.asarray(checksums).tolist(), self.copy_threads)

    # ---------------------------------------------------------------- resize
    def host_room(self) -> tuple[int, int]:
        """(bytes of this slab the host backs now, bytes the shared-memory
        file system could still back): the most a slab can grow to is their
        sum (tmpfs backs a file's pages when they are first written)."""
        return int(os.fstat(self._fd).st_blocks) * 512, free_bytes(os.path.dirname(self.path))

    def resize(self, capacity_bytes: int) -> None:
        """Atomic: the file and the mapping are grown first; when either
        fails, the tier is left exactly as it was (CapacityError)."""
        new_pages = int(capacity_bytes) // self.page_bytes
        if new_pages > self._npages:
            new_cap = new_pages * self.page_bytes
            try:
                if new_cap > self._file_bytes:
                    os.ftruncate(self._fd, new_cap)
                if self.populate:
                    self._back(self._capacity, new_cap)
                new_map = self._mmap(new_cap)
            except (OSError, ValueError, OverflowError, CapacityError) as e:
                try:
                    os.ftruncate(self._fd, self._file_bytes)
                except OSError:
                    pass
                raise CapacityError(f"cannot grow the dram slab to {new_cap} bytes (now {self._capacity} "
                                    f"bytes): {e}") from None
            self._resize_pages(capacity_bytes)
            self._file_bytes = max(self._file_bytes, new_cap)
            # Outstanding views keep the old mapping alive; both map the same pages.
            self._map = new_map
            self.buf = np.frombuffer(self._map, dtype=np.uint8)
            return
        old = self._resize_pages(capacity_bytes)
        if self._npages == old:
            return
        try:  # (the file keeps its size: see the module docstring)
            self._map.madvise(mmap.MADV_REMOVE, self._capacity, (old - self._npages) * self.page_bytes)
        except (OSError, ValueError):
            pass  # (the pages stay backed until the slab is closed: no harm to a reader)
        # clients only touch offsets we hand out, all below the new size
        self.buf = self.buf[: self._capacity]

    def corrupt_for_test(self, loc: int, bit: int = 0) -> None:
        """Flip one bit of a slot (fault-injection hook for tests)."""
        self.buf[loc + bit // 8] ^= np.uint8(1 << (bit % 8))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.buf = np.zeros(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes when it does
        os.close(self._fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
