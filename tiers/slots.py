"""Slot allocation shared by the slab tiers (DRAM, HBM): pages carved into
slots by size class, memcached-style, O(1).

The slab is cut into pages of ``page_bytes``; a page is given to one size
class on demand and carved into slots of that class's size; a page whose
slots are all free goes back to the free-page pool, so memory moves between
size classes as the workload changes. Slot sizes are the payload size
rounded up to ``slot_align``, so a namespace's blocks (all the same size)
waste at most one alignment unit. Locations are byte offsets into the slab.

This class only does the bookkeeping; the tier that inherits it owns the
memory (``tiers.dram``: a shared-memory file; ``tiers.hbm``: a device
tensor).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.errors import CapacityError, InvalidArgument

SLOT_ALIGN = 4096
SLAB_LIMIT = 1 << 43
"""The largest slab tier, 8 TiB: the block index keeps a slot's offset as
its number of ``SLOT_ALIGN`` units in 32 bits (kvstore/core/index.py,
``loc``), so a larger slab is refused when it is made or resized."""
SLAB_LIMIT_TEXT = "8 TiB"
_NEGATIVE = -(1 << 62)
"""Bits set in a negative offset (and in none from 0 to 2^62)."""


def check_slab_size(label: str, capacity_bytes: int) -> None:
    """InvalidArgument for a slab tier larger than ``SLAB_LIMIT``."""
    if int(capacity_bytes) > SLAB_LIMIT:
        raise InvalidArgument(f"{label} capacity {int(capacity_bytes)} bytes is beyond the largest slab "
                              f"tier ({SLAB_LIMIT_TEXT}, {SLAB_LIMIT} bytes: the index keeps a slot's "
                              f"location in 32 bits of {SLOT_ALIGN}-byte units)")


class _Page:
    __slots__ = ("cls", "free", "used")

    def __init__(self) -> None:
        self.cls = -1
        self.free: list[int] = []
        self.used = 0


class PagedSlots:
    """Paged size-class slot allocator over ``capacity_bytes`` of offsets."""

    label = "slab"
    """Tier name used in error messages."""

    def _init_slots(self, capacity_bytes: int, page_bytes: int, slot_align: int,
                    slot_sizes: Sequence[int]) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(f"{self.label} capacity must be > 0 bytes, got {capacity_bytes}")
        if slot_align < SLOT_ALIGN or slot_align & (slot_align - 1):
            raise InvalidArgument(f"slot_align must be a power of two of at least {SLOT_ALIGN}, got {slot_align}")
        check_slab_size(self.label, capacity_bytes)
        page_bytes = min(int(page_bytes), int(capacity_bytes))
        page_bytes -= page_bytes % slot_align
        if page_bytes <= 0:
            raise InvalidArgument(f"{self.label} capacity {capacity_bytes} is smaller than one slot "
                                  f"({slot_align} bytes)")
        self.page_bytes = page_bytes
        self.slot_align = slot_align
        self.slot_sizes = sorted(-(-int(x) // slot_align) * slot_align for x in slot_sizes)
        self._npages = int(capacity_bytes) // page_bytes
        self._capacity = self._npages * page_bytes
        self._pages = [_Page() for _ in range(self._npages)]
        self._free_pages = list(range(self._npages - 1, -1, -1))  # pop() gives page 0 first
        self._class_size: list[int] = []  # class id -> slot size
        self._class_of_size: dict[int, int] = {}
        self._partial: list[dict[int, None]] = []  # class id -> pages with a free slot (ordered set)
        self._used = 0
        self._retired: set[int] = set()
        self._shift = slot_align.bit_length() - 1
        self._not_slot = (slot_align - 1) | _NEGATIVE
        """Bits an offset that starts a slot has none of (a slot starts on ``slot_align``, never below 0)."""
        self._held = bytearray(self._capacity >> self._shift)
        """1 per ``slot_align`` unit where a slot handed out starts: ``free`` refuses any other offset."""

    # ----------------------------------------------------------- properties
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def footprint(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise InvalidArgument(f"payload must be at least 1 byte, got {nbytes}")
        slot = -(-int(nbytes) // self.slot_align) * self.slot_align
        if self.slot_sizes:
            fits = [c for c in self.slot_sizes if c >= slot]
            if not fits:
                raise InvalidArgument(f"payload of {nbytes} bytes is larger than the largest {self.label} slot size "
                                      f"({self.slot_sizes[-1]} bytes)")
            slot = fits[0]
        if slot > self.page_bytes:
            raise InvalidArgument(
                f"payload of {nbytes} bytes is larger than the {self.label} tier can hold in one slot "
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

    def pages(self) -> list[tuple[int, int, int]]:
        """(size class or -1 when unassigned, used slots, free slots) of each page."""
        return [(p.cls, p.used, len(p.free)) for p in self._pages]

    @property
    def free_pages(self) -> int:
        """Pages no size class owns (retired ones excluded)."""
        return len(self._free_pages)

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
            free, held, shift = page.free, self._held, self._shift
            take = min(count - got, len(free))
            for _ in range(take):
                off = free.pop()
                out[got] = off
                held[off >> shift] = 1
                got += 1
            page.used += take
            self._used += take * slot
            if not page.free:
                del partial[pno]
        return out[:got]

    def free(self, locs: np.ndarray) -> None:
        """Give slots back. An offset that is not a slot handed out (freed
        already, inside a slot, outside the slab) is refused with an
        AssertionError (the caller's bug) before it is touched: the slots
        before it in ``locs`` are freed, none is ever handed out twice."""
        pages, partial, retired, held = self._pages, self._partial, self._retired, self._held
        pb, shift, not_slot = self.page_bytes, self._shift, self._not_slot
        freed = 0
        try:
            for off in np.asarray(locs, dtype=np.int64).tolist():
                i = off >> shift
                if off & not_slot or not held[i]:
                    raise IndexError
                held[i] = 0
                pno = off // pb
                page = pages[pno]
                cid = page.cls
                slot = self._class_size[cid]
                page.free.append(off)
                page.used -= 1
                freed += slot
                if page.used == 0:
                    page.free = []
                    page.cls = -1
                    partial[cid].pop(pno, None)
                    if pno not in retired:
                        self._free_pages.append(pno)
                elif len(page.free) == 1 and pno not in retired:
                    partial[cid][pno] = None
        except IndexError:
            raise AssertionError(f"free of {self.label} offset {off}: not an allocated slot") from None
        finally:
            self._used -= freed

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

    def _resize_pages(self, capacity_bytes: int) -> int:
        """Bookkeeping of a resize: returns the old page count (the caller
        then resizes its memory). Shrinking requires the pages above the new
        size to be empty (CapacityError otherwise)."""
        new_pages = int(capacity_bytes) // self.page_bytes
        if new_pages < 1:
            raise InvalidArgument(
                f"{self.label} capacity {capacity_bytes} is smaller than one page ({self.page_bytes} bytes)")
        old = self._npages
        if new_pages < old:
            busy = [p for p in range(new_pages, old) if self._pages[p].cls >= 0]
            if busy:
                raise CapacityError(f"{len(busy)} pages above the new size still hold blocks")
            retired = set(range(new_pages, old))
            self._free_pages = [p for p in self._free_pages if p not in retired]
            self._retired = set()
            del self._pages[new_pages:]
            del self._held[(new_pages * self.page_bytes) >> self._shift :]
        elif new_pages > old:
            self._pages.extend(_Page() for _ in range(new_pages - old))
            self._held.extend(bytes(((new_pages - old) * self.page_bytes) >> self._shift))
            self._free_pages = list(range(new_pages - 1, old - 1, -1)) + self._free_pages
        self._npages = new_pages
        self._capacity = new_pages * self.page_bytes
        return old
