"""Per-namespace counts behind a tenant's Stats that the daemon once kept
only whole: checksum failures counted outside the store (a peer fetch's
damaged transfers, ``count_checksum_failures``) and ``Namespaces.count_blocks``
over a batch of blocks of several namespaces (one bincount)."""

from __future__ import annotations

import numpy as np

from kvstore.core.namespaces import CHECKSUM_FAILURES, DEMOTIONS, Namespaces
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.keys import Namespace


def test_checksum_failures_outside_the_store_count_for_the_namespace_tenant(ns, ns2) -> None:
    with TieredStore(StoreConfig(dram_bytes=64 * 4096, dram_page_bytes=64 * 4096)) as st:
        st.namespace_id(ns)
        st.namespace_id(ns2)
        st.count_checksum_failures(2, ns)
        st.count_checksum_failures(5)  # no namespace: the daemon's alone
        st.count_checksum_failures(1, Namespace(tenant="t", model_id="never-seen", block_size=4))
        assert st.stats().counters.checksum_failures == 8
        assert st.stats(ns.tenant).counters.checksum_failures == 2
        assert st.stats(ns2.tenant).counters.checksum_failures == 0


def test_count_blocks_adds_each_block_to_its_namespace(ns, ns2) -> None:
    reg = Namespaces()
    a, _ = reg.id_of(ns)
    b, _ = reg.id_of(ns2)
    reg.count_blocks(np.asarray([b, a, b, b], dtype=np.uint32), DEMOTIONS + 1)
    reg.count_blocks(np.asarray([a, a], dtype=np.uint32), CHECKSUM_FAILURES)
    reg.count_blocks(np.zeros(0, dtype=np.uint32), CHECKSUM_FAILURES)
    assert (reg.counts[a][DEMOTIONS + 1], reg.counts[b][DEMOTIONS + 1]) == (1, 3)
    assert (reg.counts[a][CHECKSUM_FAILURES], reg.counts[b][CHECKSUM_FAILURES]) == (2, 0)
    assert reg.tenant_counts(ns.tenant)[CHECKSUM_FAILURES] == 2
