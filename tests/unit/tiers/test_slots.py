"""The paged size-class slot allocator (tiers/slots.py) that the DRAM and
HBM slabs share: footprints, allocation and free, page reuse across size
classes, retiring pages for a shrink, and resize bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import CapacityError, InvalidArgument
from tiers.slots import SLOT_ALIGN, PagedSlots

A = SLOT_ALIGN


class Slots(PagedSlots):
    """The allocator alone, over offsets (no memory behind them)."""

    label = "test"

    def __init__(self, capacity: int, page: int, sizes: tuple[int, ...] = ()) -> None:
        self._init_slots(capacity, page, A, sizes)

    def resize(self, capacity: int) -> int:
        return self._resize_pages(capacity)


def test_footprint_rounds_up_and_refuses_what_cannot_fit():
    s = Slots(8 * A, 4 * A)
    assert s.footprint(1) == A and s.footprint(A) == A and s.footprint(A + 1) == 2 * A
    assert s.footprint(4 * A) == 4 * A
    for bad in (0, -1, 4 * A + 1):
        with pytest.raises(InvalidArgument):
            s.footprint(bad)
    c = Slots(8 * A, 4 * A, sizes=(A, 3 * A))
    assert c.footprint(A + 1) == 3 * A  # the smallest class that fits
    with pytest.raises(InvalidArgument):
        c.footprint(3 * A + 1)


def test_bad_geometry_is_refused():
    with pytest.raises(InvalidArgument):
        Slots(0, A)
    with pytest.raises(InvalidArgument):
        Slots(A - 1, A)


def test_allocate_hands_out_distinct_aligned_slots_until_full():
    s = Slots(4 * A, 2 * A)
    got = s.allocate(100, 3)
    assert got.size == 3 and len(set(got.tolist())) == 3 and all(o % A == 0 for o in got.tolist())
    assert s.used_bytes == 3 * A and s.free_slots(100) == 1
    rest = s.allocate(100, 5)
    assert rest.size == 1 and s.free_slots(100) == 0  # fewer than asked: the slab is full
    assert s.allocate(100, 1).size == 0
    s.free(got[:1])
    assert s.used_bytes == 3 * A and s.free_slots(100) == 1
    assert s.allocate(100, 1).tolist() == got[:1].tolist()  # the freed slot is reused


def test_an_emptied_page_moves_to_another_size_class():
    s = Slots(4 * A, 2 * A)  # two pages of 2A bytes
    small = s.allocate(A, 4)  # both pages carved into A-byte slots
    assert small.size == 4 and s.allocate(2 * A, 1).size == 0
    assert set(s.classes_of_locs(small).tolist()) == {s.class_of(A)}
    s.free(small[:2])  # one page empty again
    big = s.allocate(2 * A, 1)
    assert big.size == 1 and int(s.classes_of_locs(big)[0]) == s.class_of(2 * A)
    assert s.used_bytes == 2 * A + 2 * A
    s.free(small[2:])
    s.free(big)
    assert s.used_bytes == 0
    with pytest.raises(AssertionError):
        s.free(np.asarray([int(small[0])]))  # a slot of a page no class owns


def test_retired_pages_are_not_handed_out_and_resize_checks_them():
    s = Slots(4 * A, A)
    first = s.allocate(A, 4)
    pages = s.pages_above(2 * A)
    assert list(pages) == [2, 3]
    inside = s.locs_in_pages(first, pages)
    assert inside.tolist() == [o >= 2 * A for o in first.tolist()]
    s.retire_pages(pages)
    s.free(first[inside])
    assert s.allocate(A, 2).size == 0  # the retired pages stay out of circulation
    assert s.resize(2 * A) == 4 and s.capacity_bytes == 2 * A
    full = Slots(2 * A, A)
    full.allocate(A, 2)
    with pytest.raises(CapacityError):
        full.resize(A)  # a page above the new size still holds a block
    assert s.resize(6 * A) == 2 and s.capacity_bytes == 6 * A
    assert s.allocate(A, 4).size == 4  # grown pages are handed out
    with pytest.raises(InvalidArgument):
        s.resize(A - 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_allocate_and_free_keep_every_slot_handed_out_once(seed):
    """Random batches across pages and two size classes, freed in shuffled
    batches: every offset live at most once, in its class's page, aligned;
    used bytes and free slots agree with a plain model at every step."""
    rng = np.random.default_rng(seed)
    s = Slots(32 * A, 4 * A)
    live: dict[int, int] = {}  # offset -> slot size
    for _ in range(300):
        if live and rng.random() < 0.45:
            offs = np.array(list(live), dtype=np.int64)
            gone = rng.choice(offs, size=int(rng.integers(1, offs.size + 1)), replace=False)
            s.free(gone)
            for o in gone.tolist():
                del live[o]
        else:
            nbytes = int(rng.choice([A, 2 * A]))
            got = s.allocate(nbytes, int(rng.integers(1, 12))).tolist()
            assert not set(got) & set(live) and len(set(got)) == len(got)
            for o in got:
                assert o % nbytes == 0 and 0 <= o < 32 * A
                assert s.classes_of_locs(np.array([o]))[0] == s.class_of(nbytes)
                live[o] = nbytes
        assert s.used_bytes == sum(live.values())
    s.free(np.array(list(live), dtype=np.int64))
    assert s.used_bytes == 0 and s.free_pages == 8  # every page back, whatever order the frees came in
    assert s.allocate(2 * A, 100).size == 16  # and all of it can be handed out again



def test_a_slot_freed_twice_or_never_allocated_is_refused_and_never_handed_out_twice():
    s = Slots(8 * A, 4 * A)
    a = s.allocate(A, 3)
    s.free(a[:1])
    with pytest.raises(AssertionError, match="not an allocated slot"):
        s.free(a[:1])  # a double free
    for bad in (a[2] + A, a[1] + 1, -A, 8 * A, 64 * A):  # never allocated, inside a slot, outside the slab
        with pytest.raises(AssertionError, match="not an allocated slot"):
            s.free(np.asarray([bad]))
    assert s.used_bytes == 2 * A and s.pages()[0] == (0, 2, 2)  # the refusals changed nothing
    again = s.allocate(A, 6)
    assert len(set(again.tolist()) | set(a[1:].tolist())) == 8  # no slot is held twice
    s.free(np.concatenate([again, a[1:]]))
    assert s.used_bytes == 0 and s.free_pages == 2
    s.resize(12 * A)
    b = s.allocate(4 * A, 3)  # the slots of pages a grow added are freed once too
    s.free(b)
    with pytest.raises(AssertionError, match="not an allocated slot"):
        s.free(b[2:])
