"""The SSD tier's location table (tiers/ssd_table.py): 70-byte rows that
give back the 80-byte identities the record headers hold."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from tests.conftest import chain
from tests.unit.tiers.test_ssd import KIB, MIB, get, metas, put
from tiers.ssd import SsdTier
from tiers.ssd_format import IDENT, RECORD_MAGIC, RECORD_VERSION
from tiers.ssd_table import ROW, Digests, LocationTable


def identities(rng: np.random.Generator, n: int, namespaces: np.ndarray) -> np.ndarray:
    idn = np.zeros(n, dtype=IDENT)
    idn["magic"], idn["version"] = RECORD_MAGIC, RECORD_VERSION
    idn["plen"] = rng.choice([0, 16], size=n)
    idn["size"] = rng.integers(1, (1 << 32) - 89, size=n)
    idn["seq"] = rng.integers(0, 2**63, size=n)
    idn["csum"] = rng.integers(0, 2**63, size=n).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    idn["ns"] = namespaces[rng.integers(0, len(namespaces), size=n)]
    idn["key"] = rng.integers(0, 256, size=(n, 16))
    idn["parent"] = np.where(idn["plen"][:, None] == 16, rng.integers(0, 256, size=(n, 16)), 0)
    return idn


@pytest.mark.parametrize("kinds", [1, 3, 40])
def test_rows_give_back_the_identities_they_were_given(kinds: int) -> None:
    rng = np.random.default_rng(kinds)
    namespaces = rng.integers(0, 256, size=(kinds, 16), dtype=np.uint8)
    table = LocationTable(16)
    idn = identities(rng, 500, namespaces)
    locs = rng.permutation(2000)[:500]
    table.grow(2000)
    table.set_ident(locs[:200], idn[:200])  # two batches: the digests carry over
    table.set_ident(locs[200:], idn[200:])
    got = table.ident(locs)
    assert got.dtype == IDENT and got.tobytes() == idn.tobytes()
    assert len(table.digests.ids) == len({bytes(r) for r in idn["ns"]}) <= kinds
    assert ROW.itemsize == 70 and table.rows.nbytes == 2000 * 70


def test_digests_are_dense_ids_in_any_order() -> None:
    d = Digests()
    a, b, c = (np.full(16, x, np.uint8) for x in (3, 1, 2))
    ids = d.intern(np.stack([a, b, a, c, b, a]))
    assert ids.tolist() == [ids[0], ids[1], ids[0], ids[3], ids[1], ids[0]] and len(set(ids.tolist())) == 3
    assert d.intern(np.stack([c, c])).tolist() == [ids[3]] * 2  # the one-namespace path agrees
    assert sorted(set(ids.tolist())) == [0, 1, 2]  # dense
    for i, x in zip(ids.tolist(), (a, b, a, c, b, a)):
        assert bytes(d.table[i]) == bytes(x)
    many = np.random.default_rng(0).integers(0, 256, size=(100, 16), dtype=np.uint8)
    got = d.intern(many)  # past the table's first 16 rows
    assert np.array_equal(d.table[got], many)
    assert d.intern(np.zeros((0, 16), np.uint8)).size == 0


def test_sizes_and_segments_stay_in_32_bits(tmp_path: Any) -> None:
    with pytest.raises(InvalidArgument, match="4 GiB"):
        SsdTier(str(tmp_path / "a"), 64 * MIB, segment_bytes=1 << 32)
    with SsdTier(str(tmp_path / "b"), 1 << 40, sync=False) as t:  # a budget far past 4 GiB
        with pytest.raises(InvalidArgument, match="4 GiB"):
            t.footprint((1 << 32) - 88)
        assert t.footprint((1 << 32) - 89) == (1 << 32) - 1


def test_blocks_of_many_namespaces_survive_restart_and_reclaim(tmp_path: Any) -> None:
    """The identities the tier checks reads, reclaim and restart against
    come from the compact rows: blocks of several namespaces, some freed
    (reclaim moves the rest), read back after a clean close and after one
    with the snapshot gone (RocksDB read back)."""
    import os

    from tiers.ssd_recover import SNAPSHOT_FILE

    path = str(tmp_path / "ssd")
    size = 4 * KIB
    nss = [bytes([i]) * 16 for i in range(1, 6)]
    owners = [o for i, ns in enumerate(nss) for o in metas(ns, chain(b"m%d" % i, 40))]
    with SsdTier(path, 64 * MIB, segment_bytes=256 * KIB, auto_reclaim=False) as t:
        locs, csums = put(t, owners, size)
        drop = np.arange(len(owners)) % 3 == 1
        t.free(locs[drop])
        assert t.reclaim() > 0
        keep = ~drop
        assert get(t, locs[keep], [o for o, k in zip(owners, keep) if k], size, csums[keep])[0].all()
        assert len(t.table.digests.ids) == 5
    for gone in (False, True):
        if gone:
            os.unlink(os.path.join(path, SNAPSHOT_FILE))
        with SsdTier(path, 64 * MIB, segment_bytes=256 * KIB) as t:
            rec = t.recover()
            assert sorted(r[0] for r in rec) == sorted(locs[keep].tolist())
            assert {(m.ns_digest, m.key, m.parent) for _, m, _, _ in rec} == \
                {(o.ns_digest, o.key, o.parent) for o, k in zip(owners, keep) if k}
            assert get(t, np.array([r[0] for r in rec]), [r[1] for r in rec], size,
                       np.array([r[3] for r in rec], np.uint64))[0].all()
