"""The index rebuilt from the SSD tier at start (kvstore/core/ssd_restore.py):
blocks of persisted namespaces come back as one tree per chain, in the
tier's order; blocks of an unknown namespace, or under a parent the tier
lost, are dropped and their SSD space freed."""

from __future__ import annotations

import json

import numpy as np

from kvstore.core.index import keys_to_array
from kvstore.core.ssd_mover import SsdSpec
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.keys import Namespace
from tests.conftest import chain, payload_for
from tiers.base import BlockMeta, TierKind
from tiers.ssd import SsdTier

BS = 4096


def metas(digest: bytes, keys: list[bytes], first_parent: bytes = b"") -> list[BlockMeta]:
    return [BlockMeta(digest, k, keys[i - 1] if i else first_parent) for i, k in enumerate(keys)]


def test_restore_keeps_rooted_chains_of_known_namespaces(tmp_path):
    path = str(tmp_path / "ssd")
    known = Namespace(tenant="t", model_id="restore", block_size=16)
    other = Namespace(tenant="t", model_id="never-persisted", block_size=16)
    a, b = chain(b"a", 40), chain(b"b", 7)  # two chains, b forks off a[9]
    lost = chain(b"l", 5)  # its parent was never written
    stray = chain(b"s", 3)  # a namespace without a descriptor
    groups = [metas(known.digest, a), metas(known.digest, b, a[9]), metas(known.digest, lost, b"\x01" * 16),
              metas(other.digest, stray)]
    with SsdTier(path, 1 << 24, sync=False) as tier:
        tier.put_namespace(known.digest, json.dumps({"namespace": known.to_dict(), "block_bytes": BS},
                                                    sort_keys=True).encode())
        for own in groups[::-1]:  # children's records before their parents'
            locs = tier.allocate(BS, len(own))
            tier.write(locs, [np.frombuffer(payload_for(o.ns_digest, o.key, BS), np.uint8) for o in own], own)
    spec = SsdSpec(path=path, capacity_bytes=1 << 24, sync=False, admit_min_hits=0)
    with TieredStore(StoreConfig(dram_bytes=1 << 20, ssd=spec)) as st:
        assert st.recovery is not None
        assert (st.recovery.blocks, st.recovery.dropped) == (47, 8)
        assert st.recovery.bytes == 47 * BS
        st.index.check_invariants()
        look = st.lookup(known, a)
        assert look.hit_blocks == 40 and look.tiers == [TierKind.SSD] * 40
        assert st.lookup(known, a[:10] + b).hit_blocks == 17
        assert st.lookup(known, lost).hit_blocks == 0 and st.lookup(other, stray).hit_blocks == 0
        idx, nid = st.index, st.place.nsid(known, persist=False, create=False)
        ra, rb = idx.find(nid, keys_to_array(a)), idx.find(nid, keys_to_array(b))
        dep = idx.levels(idx.used_rows())
        assert dep[np.searchsorted(idx.used_rows(), ra)].tolist() == list(range(40))
        assert dep[np.searchsorted(idx.used_rows(), rb)].tolist() == list(range(10, 17))
        assert idx.parent[rb[0]] == ra[9] and idx.nchild[ra[9]] == 2
        assert np.all(np.diff(idx.last[ra].astype(np.int64)) > 0)  # ticks in the tier's order: parents first
        got = st.get(known, a[:10] + b)
        assert [g.tobytes() for g in got.payloads] == [payload_for(known.digest, k, BS) for k in a[:10] + b]
    with SsdTier(path, 1 << 24, sync=False) as tier:  # the dropped blocks' space was freed
        assert len(tier.recover()) == 47
