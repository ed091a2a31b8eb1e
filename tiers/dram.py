"""DRAM tier: one POSIX shared-memory slab carved into fixed-size slots.

The slab is a file in ``/dev/shm`` created with ``O_EXCL`` and mode 0600 (only
the daemon's user may map it) and mapped with ``mmap``; local clients map the
same file and read or write slots by byte offset, so a block is identified by
its *offset*, never by a Python object. We do not use
``multiprocessing.shared_memory``: a process that only attaches registers the
segment with the resource tracker, which unlinks it when that process exits.

Allocation (memcached-style, O(1)): the slab is cut into pages of
``page_bytes``; a page is given to one size class on demand and carved into
slots of that class's size; a page whose slots are all free goes back to the
free-page pool, so memory moves between size classes as the workload changes.
Slot sizes are the payload size rounded up to ``slot_align`` (4 KiB), so a
namespace's blocks (all the same size) waste at most one alignment unit.

Each copy in or out is fused with its xxh3_64 checksum (``kvstore.checksum``):
the data is read from memory once.
"""

from __future__ import annotations

import mmap
import os
import secrets
from typing import Sequence

import numpy as np

from kvstore.checksum import copy_many, verify_many
from kvstore.errors import CapacityError, InvalidArgument
from tiers.base import BlockMeta, Buffer, TierKind

SHM_DIR = "/dev/shm"
_ALIGN = 4096


def _as_u8(buf: Buffer) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def default_shm_name() -> str:
    return f"kvstore-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"


class _Page:
    __slots__ = ("cls", "free", "used")

    def __init__(self) -> None:
        self.cls = -1
        self.free: list[int] = []
        self.used = 0


class DramTier:
    """Shared-memory slab with paged size classes. See the module docstring."""

    kind = TierKind.DRAM

    def __init__(self, capacity_bytes: int, *, name: str | None = None,
                 page_bytes: int = 16 << 20, slot_align: int = _ALIGN,
                 slot_sizes: Sequence[int] = (), copy_threads: int = 2) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(f"dram capacity must be > 0 bytes, got {capacity_bytes}")
        if slot_align <= 0 or slot_align & (slot_align - 1):
            raise InvalidArgument(f"slot_align must be a power of two, got {slot_align}")
        page_bytes = min(int(page_bytes), int(capacity_bytes))
        page_bytes -= page_bytes % slot_align
        if page_bytes <= 0:
            raise InvalidArgument(f"dram capacity {capacity_bytes} is smaller than one slot ({slot_align} bytes)")
        self.page_bytes = page_bytes
        self.slot_align = slot_align
        self.slot_sizes = sorted(-(-int(x) // slot_align) * slot_align for x in slot_sizes)
        self.copy_threads = max(1, int(copy_threads))
        self.name = name or default_shm_name()
        self.path = os.path.join(SHM_DIR, self.name)
        self._npages = int(capacity_bytes) // page_bytes
        self._capacity = self._npages * page_bytes
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.fchmod(self._fd, 0o600)  # umask cannot widen it, but be explicit
        os.ftruncate(self._fd, self._capacity)
        self._map = mmap.mmap(self._fd, self._capacity)
        self.buf = np.frombuffer(self._map, dtype=np.uint8)
        self._pages = [_Page() for _ in range(self._npages)]
        self._free_pages = list(range(self._npages - 1, -1, -1))  # pop() gives page 0 first
        self._class_size: list[int] = []  # class id -> slot size
        self._class_of_size: dict[int, int] = {}
        self._partial: list[dict[int, None]] = []  # class id -> pages with a free slot (ordered set)
        self._used = 0
        self._retired: set[int] = set()
        self._closed = False

    # ----------------------------------------------------------- properties
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def size(self) -> int:
        """Bytes mapped (what a client maps)."""
        return self._capacity

    def footprint(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise InvalidArgument(f"payload must be at least 1 byte, got {nbytes}")
        slot = -(-int(nbytes) // self.slot_align) * self.slot_align
        if self.slot_sizes:
            fits = [c for c in self.slot_sizes if c >= slot]
            if not fits:
                raise InvalidArgument(f"payload of {nbytes} bytes is larger than the largest dram slot size "
                                      f"({self.slot_sizes[-1]} bytes)")
            slot = fits[0]
        if slot > self.page_bytes:
            raise InvalidArgument(
                f"payload of {nbytes} bytes is larger than the dram tier can hold in one slot "
                f"(page {self.page_bytes} bytes, capacity {self._capacity} bytes)")
        return slot

    def class_of(self, nbytes: int) -> int:
        """Size class id for payloads of ``nbytes`` (created on first use)."""
        slot = self.footprint(nbytes)
        cid = self._class_of_size.get(slot)
        if cid is None:
            cid = len(self._class_size)
            self._class_size.append(slot)
            self._class_of_size[slot] = cid
            self._partial.append({})
        return cid

    def classes_of_locs(self, locs: np.ndarray) -> np.ndarray:
        """Size class of each location (vectorised)."""
        page_cls = np.fromiter((p.cls for p in self._pages), dtype=np.int32, count=self._npages)
        return page_cls[np.asarray(locs, dtype=np.int64) // self.page_bytes]

    def free_slots(self, nbytes: int) -> int:
        """Slots of this size that can be handed out without eviction."""
        cid = self.class_of(nbytes)
        per_page = self.page_bytes // self._class_size[cid]
        partial = sum(len(self._pages[p].free) for p in self._partial[cid])
        return partial + len(self._free_pages) * per_page

    # ----------------------------------------------------------- allocation
    def allocate(self, nbytes: int, count: int) -> np.ndarray:
        cid = self.class_of(nbytes)
        slot = self._class_size[cid]
        partial = self._partial[cid]
        out = np.empty(count, dtype=np.int64)
        got = 0
        while got < count:
            if not partial:
                if not self._free_pages:
                    break
                pno = self._free_pages.pop()
                page = self._pages[pno]
                page.cls = cid
                base = pno * self.page_bytes
                n = self.page_bytes // slot
                page.free = list(range(base + (n - 1) * slot, base - 1, -slot))
                partial[pno] = None
            pno = next(iter(partial))
            page = self._pages[pno]
            take = min(count - got, len(page.free))
            for _ in range(take):
                out[got] = page.free.pop()
                got += 1
            page.used += take
            self._used += take * slot
            if not page.free:
                del partial[pno]
        return out[:got]

    def free(self, locs: np.ndarray) -> None:
        for off in np.asarray(locs, dtype=np.int64).tolist():
            pno = off // self.page_bytes
            page = self._pages[pno]
            cid = page.cls
            if cid < 0:
                raise AssertionError(f"free of offset {off} in an unassigned page")
            slot = self._class_size[cid]
            page.free.append(off)
            page.used -= 1
            self._used -= slot
            if page.used == 0:
                page.free = []
                page.cls = -1
                self._partial[cid].pop(pno, None)
                if pno not in self._retired:
                    self._free_pages.append(pno)
            elif len(page.free) == 1 and pno not in self._retired:
                self._partial[cid][pno] = None

    # ------------------------------------------------------------- data path
    def view(self, loc: int, nbytes: int) -> np.ndarray:
        """Zero-copy view of a slot's first ``nbytes`` bytes."""
        return self.buf[loc : loc + nbytes]

    def write(self, locs: np.ndarray, payloads: Sequence[Buffer],
              owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        buf = self.buf
        srcs = [_as_u8(p) for p in payloads]
        dsts = [buf[off : off + src.size] for off, src in zip(np.asarray(locs).tolist(), srcs)]
        return copy_many(dsts, srcs, self.copy_threads)

    def read_into(self, locs: np.ndarray, sizes: np.ndarray, checksums: np.ndarray,
                  outs: Sequence[Buffer], owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        buf = self.buf
        srcs = [buf[off : off + n] for off, n in zip(np.asarray(locs).tolist(), np.asarray(sizes).tolist())]
        return verify_many([_as_u8(d) for d in outs], srcs, np.asarray(checksums).tolist(), self.copy_threads)

    # ---------------------------------------------------------------- resize
    def pages_above(self, capacity_bytes: int) -> range:
        """Page numbers that a shrink to ``capacity_bytes`` would retire."""
        keep = max(1, int(capacity_bytes) // self.page_bytes)
        return range(keep, self._npages)

    def locs_in_pages(self, locs: np.ndarray, pages: range) -> np.ndarray:
        """Mask of ``locs`` that fall inside ``pages``."""
        pno = np.asarray(locs, dtype=np.int64) // self.page_bytes
        return (pno >= pages.start) & (pno < pages.stop)

    def retire_pages(self, pages: range) -> None:
        """Stop handing out slots in ``pages`` (before a shrink moves their
        blocks away)."""
        self._retired = set(pages)
        self._free_pages = [p for p in self._free_pages if p not in self._retired]
        for part in self._partial:
            for p in [p for p in part if p in self._retired]:
                del part[p]

    def resize(self, capacity_bytes: int) -> None:
        new_pages = int(capacity_bytes) // self.page_bytes
        if new_pages < 1:
            raise InvalidArgument(
                f"dram capacity {capacity_bytes} is smaller than one page ({self.page_bytes} bytes)")
        if new_pages == self._npages:
            return
        if new_pages < self._npages:
            busy = [p for p in range(new_pages, self._npages) if self._pages[p].cls >= 0]
            if busy:
                raise CapacityError(f"{len(busy)} pages above the new size still hold blocks")
            retired = set(range(new_pages, self._npages))
            self._free_pages = [p for p in self._free_pages if p not in retired]
            self._retired = set()
            del self._pages[new_pages:]
            self._npages = new_pages
            self._capacity = new_pages * self.page_bytes
            # clients only touch offsets we hand out, all below the new size
            self.buf = self.buf[: self._capacity]
            os.ftruncate(self._fd, self._capacity)
            return
        old = self._npages
        self._npages = new_pages
        self._capacity = new_pages * self.page_bytes
        os.ftruncate(self._fd, self._capacity)
        # Outstanding views keep the old mapping alive; both map the same pages.
        self._map = mmap.mmap(self._fd, self._capacity)
        self.buf = np.frombuffer(self._map, dtype=np.uint8)
        self._pages.extend(_Page() for _ in range(new_pages - old))
        self._free_pages = list(range(new_pages - 1, old - 1, -1)) + self._free_pages

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
