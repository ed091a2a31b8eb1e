"""The shared index (issue 18, lookups): the columns of the daemon's block
index that a prefix lookup reads, in shared memory, so a same-host client
answers ``lookup`` itself instead of making a round trip.

A Lookup is the first call of every request an engine serves, and it is
advisory (a block found may be evicted before the engine's ``Acquire``;
``Acquire`` pins what it returns). Over the same-host socket it still costs
two Python processes a wake-up each (~140 µs on the 2-core box of
docs/performance.md, of which the index lookup itself is ~8 µs). So the
daemon keeps the key table and the ``k0``/``k1``/``ns``/``state``/``tier``
columns in files under ``/dev/shm`` (mode 0600, like its slab) and clients
of the same user probe them in C (``kvstore._native.shared_lookup``). The
``loc``/``size``/``csum`` columns let a client read DRAM blocks without a
lease (``SharedIndexReader.slots``, ``kvstore.client.sync.Client.get_into``):
copy out verifying the checksums, then look the slots up again and keep
the bytes only when the answer is the same.

Layout. A header file of ``HEADER_BYTES``::

    u64 seq      odd while the daemon changes the index (the store lock is held)
    u64 gen      bumped when an array moved to a new file (growth, rehash)
    u64 magic    MAGIC
    u64 closed   1 once the daemon stopped
    u64 layout   LAYOUT: a digest of everything the reader depends on
    ...          at NAMES_AT, one NAME_BYTES slot per array of ARRAYS:
                 the file's name in SHM_DIR (ASCII, NUL-padded)

and one file per array, exactly the array's bytes (dtypes in ``ARRAYS``).
A reader maps a header only when both ``magic`` and ``layout`` are this
version's: a daemon of another version (other columns, dtypes or order,
another header size or state/tier values) is refused at the first contact
and the client's lookups go to the daemon (docs/operations.md, Upgrades).
A reader takes ``seq``, checks ``gen`` against the files it mapped, probes,
and takes ``seq`` again; a lookup that raced a change is retried, and after
``RETRIES`` the client asks the daemon. A file the daemon replaced is
unlinked but stays valid for a reader that still maps it. Every row the
probe follows is bounds-checked against what the reader mapped: a torn read
can only make a lookup be retried, never crash the client.

Who may read it: the daemon's user (files 0600), the same processes that
may already map the slab. The daemon sends the header's path in its answer
to a same-host socket's hello; a client then asks the daemon, over that
socket, for the id of each namespace it looks up (``nsid`` frames: the
session's tenant is checked there as for any Lookup), and sends what it
counted (``tally`` frames) so the daemon's lookup counters, per-namespace
hit ratios and ``kvstore_tier_lookup_hit_blocks_total`` still see every lookup.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import time
from typing import Any

import numpy as np

from kvstore import checksum

SHM_DIR = "/dev/shm"
HEADER_BYTES = 4096
MAGIC = int.from_bytes(b"KVIDX001", "little")
NAMES_AT = 64
NAME_BYTES = 128
ARRAYS = (("table", "i4"), ("k0", "u8"), ("k1", "u8"), ("ns", "u4"), ("state", "u1"), ("tier", "u1"),
          ("loc", "i4"), ("size", "u4"), ("csum", "u8"))
"""The published arrays, in header order, with their dtypes (the key table
and the index columns ``kvstore.core.index.SHARED_COLUMNS``)."""
LOC_SHIFT = 12
"""A DRAM block's ``loc`` is its slab offset shifted right by this
(``kvstore.core.index.LOC_SHIFT``; a test keeps them equal): the native
probe shifts it back, and is used only where its own ``LOC_SHIFT`` agrees."""
COMMITTED_STATE = 2
"""``BlockState.COMMITTED`` (kvstore/core/index.py; a test keeps them equal)."""
DRAM_TIER = 1
"""``TierKind.DRAM`` (tiers/base.py; a test keeps them equal)."""
LAYOUT = checksum.checksum(repr((HEADER_BYTES, NAMES_AT, NAME_BYTES, ARRAYS, COMMITTED_STATE, DRAM_TIER,
                                 "tier byte = TierKind + 1", "offset = loc << LOC_SHIFT", LOC_SHIFT)).encode())
"""Header word 4: the digest of the layout above, so a reader of another
layout refuses the header even where the magic was not bumped."""
RETRIES = 4
"""Probes tried at least before a lookup goes to the daemon ..."""
SPIN_S = 100e-6
"""... and for how long they go on while the daemon holds its store lock
(a round trip to the daemon costs more, and waits for that lock too)."""
FILE_NAME = re.compile(r"kvstore-idx-[0-9]+-[0-9]+-[0-9a-f]+(\.hdr|\.[0-9]+)")
"""What the daemon names its files (anything else in a header is refused)."""
TALLY = struct.Struct("<IIQQQQQ")
"""One namespace's counts in a tally frame: nid, lookups, queried blocks,
hit blocks, and the hit blocks in HBM, DRAM and SSD."""


def load_native() -> Any:
    """The native helper when built with the probes (they are native only)
    for this layout's ``loc`` (an older build read it as int64), else None (``kvstore.checksum.load_native``: also None with ``NO_KVSTORE_NATIVE=1``)."""
    native = checksum.load_native()
    ok = native is not None and hasattr(native, "shared_slots") and getattr(native, "LOC_SHIFT", None) == LOC_SHIFT
    return native if ok else None


class SharedIndexReader:
    """A client's read-only view of the daemon's shared index."""

    def __init__(self, path: str) -> None:
        native = load_native()
        if native is None:
            raise OSError("kvstore._native is not built: no shared-index lookups")
        self._probe = native.shared_lookup
        self._slots = native.shared_slots
        if not FILE_NAME.fullmatch(os.path.basename(path)) or os.path.dirname(path) != SHM_DIR:
            raise OSError(f"{path!r} is not a shared-index header")
        fd = os.open(path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, HEADER_BYTES, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.hdr = np.frombuffer(self._map, dtype="<u8", count=HEADER_BYTES // 8)
        if int(self.hdr[2]) != MAGIC:
            raise OSError(f"{path!r} is not a shared-index header (magic)")
        if int(self.hdr[4]) != LAYOUT:
            raise OSError(f"{path!r} is a shared index of another layout (0x{int(self.hdr[4]):016x}, this client "
                          f"reads 0x{LAYOUT:016x}): a daemon of another version")
        self.path = path
        self._mapped: tuple[int, tuple[np.ndarray, ...]] | None = None
        self.probes = 0
        """Lookups answered here (a test and the benchmark read it)."""
        self.raced = 0
        """Probes given up after ``SPIN_S`` of racing the daemon's changes."""

    @property
    def closed(self) -> bool:
        return bool(self.hdr[3])

    def lookup(self, nid: int, packed_keys: bytes) -> tuple[int, bytes] | None:
        """(hit blocks, one wire Tier byte per hit) of the chain ``packed_keys``
        in namespace ``nid``, or None (ask the daemon)."""
        got = self._attempt(lambda hdr, gen, a: self._probe(hdr, gen, *a[:6], packed_keys, nid, COMMITTED_STATE))
        if got is not None:
            self.probes += 1
        return got

    def slots(self, nid: int, packed_keys: bytes) -> tuple[int, bool, np.ndarray] | None:
        """For a read: (hit, clean, slots) where ``slots`` is ``(hit, 4)``
        int64 (row, slab offset, size, checksum bits) of the leading keys
        committed in DRAM, and ``clean`` is False when the scan stopped at a
        block present elsewhere (HBM, SSD: only the daemon serves it). None:
        ask the daemon. The slots hold only while the index does not change
        under them: a reader copies, verifies the checksums, then asks
        ``slots`` again and keeps the bytes only if the answer is the same."""
        got = self.raw_slots(nid, packed_keys)
        if got is None:
            return None
        return got[0], got[1], np.frombuffer(got[2], dtype=np.int64).reshape(-1, 4)

    def raw_slots(self, nid: int, packed_keys: bytes) -> tuple[int, bool, bytes] | None:
        """``slots`` with the rows as the bytes the probe wrote (two answers
        compare as strings)."""
        got: tuple[int, bool, bytes] | None = self._attempt(
            lambda hdr, gen, a: self._slots(hdr, gen, *a, packed_keys, nid, COMMITTED_STATE, DRAM_TIER))
        return got

    def map(self) -> bool:
        """Map the current generation's arrays now, as a first probe would;
        whether they are (False: the daemon stopped)."""
        return self._attempt(lambda hdr, gen, a: True) is not None

    def _attempt(self, probe: Any) -> Any:
        """``probe(header, gen, arrays)`` on the current generation's arrays
        (mapped anew when it changed), again while it answers None (at least
        ``RETRIES`` times, then for ``SPIN_S``); None when the daemon
        stopped or every try raced."""
        hdr = self.hdr
        tries, until = 0, 0.0
        while True:
            if hdr[3]:
                return None
            gen = int(hdr[1])
            mapped = self._mapped
            if mapped is None or mapped[0] != gen:
                mapped = self._remap(gen)
            if mapped is not None:
                got = probe(hdr, gen, mapped[1])
                if got is not None:
                    return got
            tries += 1
            if tries >= RETRIES:
                now = time.perf_counter()
                if not until:
                    until = now + SPIN_S
                elif now >= until:
                    self.raced += 1
                    return None

    def _remap(self, gen: int) -> tuple[int, tuple[np.ndarray, ...]] | None:
        """Map the files of generation ``gen`` (None: it changed meanwhile, or
        a file is already gone: the caller tries again)."""
        hdr = self.hdr
        s1 = int(hdr[0])
        if s1 & 1:
            return None
        raw = self._map[NAMES_AT : NAMES_AT + NAME_BYTES * len(ARRAYS)]
        if int(hdr[0]) != s1 or int(hdr[1]) != gen:
            return None
        arrays = []
        for i, (_, dt) in enumerate(ARRAYS):
            name = raw[i * NAME_BYTES : (i + 1) * NAME_BYTES].rstrip(b"\0").decode("ascii", "replace")
            if not FILE_NAME.fullmatch(name):
                return None
            try:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
            except OSError:
                return None
            try:
                size = os.fstat(fd).st_size
                if size == 0 or size % np.dtype(dt).itemsize:
                    return None
                m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                return None
            finally:
                os.close(fd)
            arrays.append(np.frombuffer(m, dtype=dt))
        mapped = (gen, tuple(arrays))
        self._mapped = mapped
        return mapped

    def close(self) -> None:
        self._mapped = None
        self.hdr = np.zeros(HEADER_BYTES // 8, dtype="<u8")
        self.hdr[3] = 1
        try:
            self._map.close()
        except BufferError:
            pass  # a probe's view is still alive; unmapped when it goes
