"""The slots a cluster fetch writes into (kvstore/daemon/fetch_slots.py):
every change they make to the store goes through the store lock, which the
daemon's disk worker holds while it works on (and iterates) the store's
reservations."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.core.ssd_io import StoreLock
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.daemon.disk_worker import LockedStore
from kvstore.daemon.fetch_slots import FetchSlots
from kvstore.keys import Namespace, block_keys

NS = Namespace(tenant="t", model_id="m", block_size=16)
BS = 4096


def test_quarantine_changes_the_store_under_its_lock() -> None:
    raw = TieredStore(StoreConfig(dram_bytes=64 * BS, dram_page_bytes=64 * BS))
    lock = StoreLock()
    store: Any = LockedStore(raw, lock)
    keys = block_keys(NS, np.arange(3 * 16, dtype=np.uint32))
    slots = FetchSlots(store, NS, keys, None)
    assert all(d is not None for d in slots.alloc(np.full(3, BS, dtype=np.int64)))
    handle = slots.handle
    assert handle in raw.holds.reservations
    held: list[bool] = []
    real = raw.holds.quarantine

    def watched(h: str) -> bool:  # the disk worker iterates reservations while it holds the lock
        held.append(lock.held())
        return real(h)

    raw.holds.quarantine = watched  # type: ignore[method-assign]
    slots.quarantine()
    assert held == [True]
    assert handle not in raw.holds.reservations
    assert raw.hold_counts() == (0, 0)
    raw.close()


def test_a_failed_fetch_is_quarantined_on_the_transports_count_never_on_its_words() -> None:
    """Receives the transport could not confirm ended (``unconfirmed``) keep
    the slots reserved for good, whatever the error says; a failure with
    none frees them, even one whose words say "do not reuse"."""
    from tiers.base import TierKind
    from transport.ucx_wire import FetchFault, FetchResult

    raw = TieredStore(StoreConfig(dram_bytes=64 * BS, dram_page_bytes=64 * BS))
    store: Any = LockedStore(raw, StoreLock())

    def used() -> int:
        return next(t.used_bytes for t in raw.stats().tiers if t.tier is TierKind.DRAM)

    def failed(seed: int, msg: str, unconfirmed: int) -> None:
        keys = block_keys(NS, np.arange(3 * 16, dtype=np.uint32) + seed)
        slots = FetchSlots(store, NS, keys, None)
        assert all(d is not None for d in slots.alloc(np.full(3, BS, dtype=np.int64)))
        slots.failed(FetchResult(np.zeros(3, bool), np.zeros(3, np.int64), 0, 0.0, msg, fault=FetchFault.LINK,
                                 unconfirmed=unconfirmed))
        assert raw.hold_counts() == (0, 0)

    failed(1000, "fetch from p broke; 2 receives still posted", 2)
    assert used() == 3 * BS  # quarantined: never handed to another block
    failed(2000, "do not reuse (just words)", 0)
    assert used() == 3 * BS  # aborted: freed
    raw.close()


def test_unverified_blocks_are_kept_only_with_the_peers_checksums() -> None:
    """A fetch not hashed on arrival is committed with the peer's checksums,
    which the first reader checks: damaged bytes are then a miss. Without
    them the store would hash the bytes as they landed, damage and all, so
    nothing is kept."""
    from kvstore.checksum import checksum
    from kvstore.errors import KeyStatus

    raw = TieredStore(StoreConfig(dram_bytes=64 * BS, dram_page_bytes=64 * BS))
    store: Any = LockedStore(raw, StoreLock())
    keys = block_keys(NS, np.arange(2 * 16, dtype=np.uint32))
    good = [np.full(BS, 7, np.uint8), np.full(BS, 9, np.uint8)]
    sums = np.array([checksum(b) for b in good], dtype=np.uint64)

    def land(ks: list[bytes]) -> FetchSlots:
        slots = FetchSlots(store, NS, ks, None)
        dests = slots.alloc(np.full(2, BS, dtype=np.int64))
        for d, b in zip(dests, good):
            np.frombuffer(d, np.uint8)[:] = b  # type: ignore[arg-type]
        np.frombuffer(dests[1], np.uint8)[5] ^= 0xFF  # type: ignore[arg-type]  # damaged on the way
        return slots

    assert land(keys).commit(np.ones(2, bool), None, verified=False) == 0
    assert raw.lookup(NS, keys).hit_blocks == 0 and raw.hold_counts() == (0, 0)
    assert land(keys).commit(np.ones(2, bool), sums, verified=False) == 2
    outs = [np.zeros(BS, np.uint8) for _ in keys]
    assert raw.get_into(NS, keys, outs).statuses == [KeyStatus.OK, KeyStatus.CORRUPT]
    assert np.array_equal(outs[0], good[0])
    assert raw.lookup(NS, keys).hit_blocks == 1 and raw.stats().counters.checksum_failures == 1
    raw.close()
