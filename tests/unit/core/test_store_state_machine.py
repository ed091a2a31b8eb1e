"""Model-based test of the store: whatever the interleaving of put, get,
lookup, pin, unpin, remove, reserve/commit/abort and eviction pressure:

- a get returns exactly the bytes put for that key in that namespace, or a miss;
- pinned blocks survive any pressure;
- free + used slots always equal capacity (page accounting is exact);
- a lookup never reports a block whose parent is missing.
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import KeyStatus
from kvstore.core.index import BlockState, keys_to_array
from kvstore.keys import Namespace
from kvstore.core.store import StoreConfig, TieredStore
from tests.conftest import chain, payload_for

BS = 4096
NAMESPACES = [Namespace(tenant="a", model_id="m", block_size=4),
              Namespace(tenant="b", model_id="m", block_size=4)]
# a few chains that share prefixes: chain c's first `share` blocks are chain 0's
BASE = chain(b"base", 6)
CHAINS = [BASE] + [BASE[:s] + chain(bytes([c]), 6 - s, parent=BASE[s - 1] if s else b"")
                   for c, s in [(1, 2), (2, 4), (3, 0), (4, 1)]]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = TieredStore(StoreConfig(dram_bytes=10 * BS, dram_page_bytes=2 * BS))
        self.pins: dict[tuple[int, bytes], int] = {}
        self.resv: list[tuple[str, int, list[bytes]]] = []
        for n, ns in enumerate(NAMESPACES):  # fix each namespace's block size
            seed = chain(b"seed", 1)[0]
            assert self.store.put(ns, [seed], [self.expected(n, seed)]).statuses == [KeyStatus.OK]

    def teardown(self) -> None:
        self.store.close()

    def expected(self, n: int, key: bytes) -> bytes:
        return payload_for(bytes([n]), key, BS)

    @rule(n=st.integers(0, 1), c=st.integers(0, len(CHAINS) - 1), lo=st.integers(0, 5),
          hi=st.integers(1, 6))
    def put(self, n, c, lo, hi):
        lo, hi = min(lo, hi - 1), hi
        keys = CHAINS[c][lo:hi]
        parent = CHAINS[c][lo - 1] if lo else None
        res = self.store.put(NAMESPACES[n], keys, [self.expected(n, k) for k in keys], parent=parent)
        assert len(res.statuses) == len(keys)

    @rule(n=st.integers(0, 1), c=st.integers(0, len(CHAINS) - 1), big=st.booleans())
    def put_big_or_wrong(self, n, c, big):
        # bad input never disturbs what is stored
        keys = CHAINS[c][:1]
        size = 64 * BS if big else 100
        res = self.store.put(NAMESPACES[n], keys, [b"z" * size])
        assert res.statuses[0] in (KeyStatus.INVALID, KeyStatus.EXISTS, KeyStatus.BUSY)

    @rule(n=st.integers(0, 1), c=st.integers(0, len(CHAINS) - 1))
    def get(self, n, c):
        keys = CHAINS[c]
        res = self.store.get(NAMESPACES[n], keys)
        for k, s, p in zip(keys, res.statuses, res.payloads):
            if s is KeyStatus.OK:
                assert p.tobytes() == self.expected(n, k)
            else:
                assert s is KeyStatus.MISS and p is None

    @rule(n=st.integers(0, 1), c=st.integers(0, len(CHAINS) - 1))
    def lookup(self, n, c):
        keys = CHAINS[c]
        look = self.store.lookup(NAMESPACES[n], keys)
        for k in keys[: look.hit_blocks]:
            assert self.store.get(NAMESPACES[n], [k]).payloads[0].tobytes() == self.expected(n, k)

    @rule(n=st.integers(0, 1), c=st.integers(0, len(CHAINS) - 1), i=st.integers(0, 5))
    def pin(self, n, c, i):
        k = CHAINS[c][i]
        if self.store.pin(NAMESPACES[n], [k]).statuses[0] is KeyStatus.OK:
            self.pins[(n, k)] = self.pins.get((n, k), 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        n, k = data.draw(st.sampled_from(sorted(self.pins)))
        assert self.store.unpin(NAMESPACES[n], [k]).statuses[0] is KeyStatus.OK
        self.pins[(n, k)] -= 1
        if not self.pins[(n, k)]:
            del self.pins[(n, k)]

    @rule(n=st.integers(0, 1), c=st.integers(0, len(CHAINS) - 1), i=st.integers(0, 5))
    def remove(self, n, c, i):
        self.store.remove(NAMESPACES[n], [CHAINS[c][i]])

    @rule(n=st.integers(0, 1), c=st.integers(0, len(CHAINS) - 1), lo=st.integers(0, 5))
    def reserve(self, n, c, lo):
        keys = CHAINS[c][lo:]
        parent = CHAINS[c][lo - 1] if lo else None
        r = self.store.reserve(NAMESPACES[n], keys, BS, owner="w", parent=parent)
        written = []
        for k, s in zip(keys, r.slots):
            if s is not None:
                self.store.dram.buf[s.offset : s.offset + BS] = np.frombuffer(self.expected(n, k), np.uint8)
                written.append(k)
        if r.handle:
            self.resv.append((r.handle, n, written))

    @precondition(lambda self: self.resv)
    @rule(commit=st.booleans())
    def finish(self, commit):
        handle, n, keys = self.resv.pop(0)
        if commit:
            self.store.commit(handle, "w")
        else:
            self.store.abort(handle, "w")

    @rule(n=st.integers(0, 1), c=st.integers(0, len(CHAINS) - 1), i=st.integers(0, 5), bit=st.integers(0, 8 * BS - 1))
    def bitflip(self, n, c, i, bit):
        rows = self.store.index.find_committed(n, keys_to_array([CHAINS[c][i]]))
        idx = self.store.index
        if rows[0] >= 0 and idx.pins[rows[0]] == 0 and idx.tier[rows[0]] == 1:  # a DRAM slot
            self.store.dram.corrupt_for_test(self.store.index.offset(rows[0]), bit)
            res = self.store.get(NAMESPACES[n], [CHAINS[c][i]])
            assert res.statuses == [KeyStatus.CORRUPT]

    @rule(policy=st.sampled_from(["lru", "lfu", "cost"]))
    def switch_policy(self, policy):
        self.store.set_policy(policy)

    @invariant()
    def pinned_blocks_survive(self):
        # a pinned block's slot is never reclaimed: it stays in the index
        # (committed, or doomed-but-held if an ancestor failed its checksum)
        idx = self.store.index
        for (n, k) in self.pins:
            r = idx.find(n, keys_to_array([k]))[0]
            assert r >= 0 and idx.state[r] in (BlockState.COMMITTED, BlockState.DOOMED)

    @invariant()
    def accounting_is_exact(self):
        st_ = self.store
        st_.index.check_invariants()
        rows = st_.index.used_rows()
        assert st_.dram.used_bytes == len(rows) * BS
        t = st_.dram
        per_page = {}
        for off in st_.index.offsets(rows).tolist():
            per_page[off // t.page_bytes] = per_page.get(off // t.page_bytes, 0) + 1
        free_slots = 0
        for pno, (cls, used, free) in enumerate(t.pages()):
            assert used == per_page.get(pno, 0)
            if cls >= 0:
                free_slots += free
                assert used + free == t.page_bytes // BS
        free_slots += t.free_pages * (t.page_bytes // BS)
        assert free_slots + len(rows) == t.capacity_bytes // BS

    @invariant()
    def lookups_never_skip_a_parent(self):
        idx = self.store.index
        rows = idx.used_rows()
        committed = rows[idx.state[rows] == BlockState.COMMITTED]
        par = idx.parent[committed]
        assert np.all((par < 0) | (idx.state[np.maximum(par, 0)] == BlockState.COMMITTED))


StoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVSTORE_HYPOTHESIS_EXAMPLES", "150")), stateful_step_count=50, deadline=None)
TestStoreMachine = StoreMachine.TestCase


class TieredStoreMachine(StoreMachine):
    """The same rules and invariants with an SSD tier below DRAM, plus
    background movement, prefetch and restarts (DRAM is lost; SSD stays)."""

    def __init__(self) -> None:
        import tempfile

        from kvstore.core.ssd_mover import SsdSpec

        self._dir = tempfile.mkdtemp(prefix="kvssd-")
        self._spec = SsdSpec(path=self._dir, capacity_bytes=12 * (BS + 88), admit_min_hits=1, sync=False,
                             segment_bytes=64 * 1024, write_mode="through")
        RuleBasedStateMachine.__init__(self)
        self.store = self._open()
        self.pins = {}
        self.resv = []
        for n, ns in enumerate(NAMESPACES):
            seed = chain(b"seed", 1)[0]
            self.store.put(ns, [seed], [self.expected(n, seed)])

    def _open(self) -> TieredStore:
        return TieredStore(StoreConfig(dram_bytes=10 * BS, dram_page_bytes=2 * BS, ssd=self._spec))

    def teardown(self) -> None:
        import shutil

        self.store.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    @rule(steps=st.integers(1, 20))
    def background(self, steps):
        for _ in range(steps):
            if not self.store.background():
                break

    @rule(n=st.integers(0, 1), c=st.integers(0, len(CHAINS) - 1))
    def prefetch(self, n, c):
        hit, in_dram, queued = self.store.prefetch(NAMESPACES[n], CHAINS[c])
        assert in_dram + queued <= hit

    @rule()
    def restart(self):
        self.store.close()
        self.store = self._open()
        self.pins = {}
        self.resv = []

    @invariant()
    def accounting_is_exact(self):
        # DRAM pages as in the parent machine, for the DRAM-resident rows
        st_ = self.store
        st_.index.check_invariants()
        rows = st_.index.used_rows()
        dram_rows = rows[st_.index.tier[rows] == 1]
        assert st_.dram.used_bytes == len(dram_rows) * BS
        ssd_ids = np.concatenate([st_.index.loc[rows[st_.index.tier[rows] == 2]],
                                  st_.index.ssd_loc[rows][st_.index.ssd_loc[rows] >= 0]])
        assert len(set(ssd_ids.tolist())) == ssd_ids.size  # no SSD id is shared
        assert st_.ssd.tier.used_bytes == ssd_ids.size * (BS + 88)


TieredStoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVSTORE_HYPOTHESIS_EXAMPLES", "150")) // 2, stateful_step_count=50,
    deadline=None)
TestTieredStoreMachine = TieredStoreMachine.TestCase


def test_a_demoted_block_keeps_the_ssd_copy_it_leaves_dram_for():
    """Found by the machine above: making SSD room for one DRAM victim
    dropped the SSD copy of another victim about to move there on it,
    leaving an SSD row with no SSD id (ssd_mover._ssd_room now spares it)."""
    m = TieredStoreMachine()
    try:
        for _ in range(7):
            m.background(steps=1)
        for step in ((0, 4, 0), (3, 5, 0), None, (0, 3, 1), (0, 6, 0), None, (3, 5, 1)):
            if step is None:
                m.background(steps=1)
            else:
                m.put(c=step[0], hi=step[1], lo=0, n=step[2])
            m.accounting_is_exact()
            m.lookups_never_skip_a_parent()
    finally:
        m.teardown()
