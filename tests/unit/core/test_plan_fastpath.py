"""``plan``'s all-new fast path answers exactly what its per-key loop
answers, on batches it takes and on ones it must leave to the loop."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import plan as plan_mod
from kvstore.errors import KeyStatus
from kvstore.core.index import keys_to_array
from kvstore.keys import Namespace
from kvstore.results import BatchResult
from kvstore.core.store import StoreConfig, TieredStore
from tests.conftest import chain

B = 4096
NS = Namespace(tenant="t", model_id="m", block_size=4)


def _plans(st: TieredStore, keys: list[bytes], sizes: list[int], parent: bytes | None,
           monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int], list[KeyStatus], dict[int, str]]]:
    nid = st.namespace_id(NS)
    out = []
    for fast in (True, False):
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(plan_mod, "all_new", lambda *a: False)
            res = BatchResult([KeyStatus.OK] * len(keys))
            prow = plan_mod.parent_row(st.index, nid, parent)
            todo, prefs = plan_mod.plan(st.index, nid, keys_to_array(keys), list(sizes), prow,
                                        st.block_bytes(NS), st.dram.footprint, res)
            out.append((todo, prefs, list(res.statuses), dict(res.messages)))
    return out


@pytest.mark.parametrize("case", ["new", "parent", "missing_parent", "repeat", "exists", "sizes", "empty",
                                  "huge", "one"])
def test_fast_plan_equals_the_loop(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with TieredStore(StoreConfig(dram_bytes=64 * B, dram_page_bytes=B)) as st:
        base = chain(b"base", 3)
        st.put(NS, base, [np.zeros(B, np.uint8)] * 3)
        keys, sizes, parent = chain(b"k", 6), [B] * 6, None
        if case == "parent":
            parent = base[-1]
        elif case == "missing_parent":
            parent = chain(b"nowhere", 1)[0]
        elif case == "repeat":
            keys[4] = keys[1]
        elif case == "exists":
            keys[2] = base[0]
        elif case == "sizes":
            sizes[3] = B // 2
        elif case == "empty":
            sizes = [0] * 6
        elif case == "huge":
            sizes = [1 << 40] * 6
        elif case == "one":
            keys, sizes = keys[:1], sizes[:1]
        fast, slow = _plans(st, keys, sizes, parent, monkeypatch)
        assert fast == slow
        if case in ("new", "parent", "one"):
            assert fast[0] == list(range(len(keys)))  # the fast path took it
