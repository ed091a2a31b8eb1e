"""``TieredStore.remove`` of many keys at once equals removing them one
after another: the same statuses (OK, BUSY where the block's subtree holds a
pinned block, MISS where an earlier key's removal took it or it was given
twice) and the same blocks left, on random forests with random pins."""

from __future__ import annotations

import random

import pytest

from kvstore.core.store import StoreConfig, TieredStore
from kvstore.errors import KeyStatus
from tests.conftest import chain, payload_for

BS = 4096


def forest(st, ns, rng: random.Random) -> list[bytes]:
    """Chains and branches: each new chain hangs off a random stored key or is a root."""
    stored: list[bytes] = []
    for c in range(rng.randint(3, 12)):
        parent = rng.choice(stored) if stored and rng.random() < 0.7 else None
        keys = chain(b"F%d-%d" % (c, rng.randint(0, 1 << 30)), rng.randint(1, 6))
        res = st.put(ns, keys, [payload_for(b"t", k, BS) for k in keys], parent=parent)
        assert res.statuses == [KeyStatus.OK] * len(keys)
        stored += keys
    return stored


@pytest.mark.parametrize("seed", range(40))
def test_remove_of_a_batch_equals_one_key_after_another(ns, seed):
    rng = random.Random(seed)
    cfg = StoreConfig(dram_bytes=128 * BS, dram_page_bytes=128 * BS)
    with TieredStore(cfg) as one, TieredStore(cfg) as each:
        for st in (one, each):  # the same forest in both (same seed)
            stored = forest(st, ns, random.Random(seed))
        pinned = rng.sample(stored, rng.randint(0, 3))
        for st in (one, each):
            if pinned:
                st.pin(ns, pinned)
        asked = [rng.choice(stored) for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.5:
            asked.append(chain(b"absent", 1)[0])
        rng.shuffle(asked)
        batch = one.remove(ns, asked).statuses
        singly = [each.remove(ns, [k]).statuses[0] for k in asked]
        assert batch == singly
        left = [k for k in stored if each.lookup(ns, [k]).hit_blocks]
        assert [k for k in stored if one.lookup(ns, [k]).hit_blocks] == left
        assert one.dram.used_bytes == each.dram.used_bytes == len(left) * BS
        one.index.check_invariants()


def test_removing_a_whole_chain_reads_each_block_once(ns):
    """Every key of a chain given at once: all OK except those an earlier key took."""
    with TieredStore(StoreConfig(dram_bytes=64 * BS, dram_page_bytes=64 * BS)) as st:
        keys = chain(b"W", 16)
        st.put(ns, keys, [payload_for(b"t", k, BS) for k in keys])
        tail_first = keys[::-1]
        assert st.remove(ns, tail_first).statuses == [KeyStatus.OK] * 16
        st.put(ns, keys, [payload_for(b"t", k, BS) for k in keys])
        assert st.remove(ns, keys).statuses == [KeyStatus.OK] + [KeyStatus.MISS] * 15
        assert st.dram.used_bytes == 0
