"""SSD restart in arrays (tiers/ssd_recover.py): the recovery order against
the dict-based one it replaced, the index snapshot a clean close leaves (used
only while its stamp matches RocksDB), and the store's index rebuilt from it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

import numpy as np
import pytest

from tests.conftest import payload_for
from tiers.base import BlockMeta
from tiers.ssd import SsdTier
from tiers.ssd_format import KEY, NS, NSKEY, PARENT, VALUE, as_void, ident_bytes
from tiers.ssd_recover import SNAPSHOT_FILE, newest_per_name, recovery_order

KIB = 1 << 10
IDENT = VALUE["ident"]


def reference_order(idn: np.ndarray, rows: np.ndarray) -> list[tuple[int, BlockMeta, int, int]]:
    """The former ``chain_order`` (a dict per name), kept as the reference."""
    n = rows.size
    ib = ident_bytes(idn)
    where = dict(zip(as_void(ib[:, NSKEY]).tolist(), range(n)))
    pnames = as_void(np.concatenate([ib[:, NS], ib[:, PARENT]], axis=1)).tolist()
    par = np.fromiter((where.get(p, -1) for p in pnames), dtype=np.int64, count=n)
    par[idn["plen"] == 0] = -1
    depth, anc = (par >= 0).astype(np.int64), par.copy()
    for _ in range(64):
        m = np.flatnonzero(anc >= 0)
        if not m.size:
            break
        up = anc[m]
        depth[m], anc[m] = depth[m] + depth[up], anc[up]
    order = np.lexsort((idn["seq"], depth)).tolist()
    ns, keys, parents = (as_void(ib[:, part]).tolist() for part in (NS, KEY, PARENT))
    plen, sizes, csums, locs = idn["plen"].tolist(), idn["size"].tolist(), idn["csum"].tolist(), rows.tolist()
    return [(locs[i], BlockMeta(ns[i], keys[i], parents[i] if plen[i] else b""), sizes[i], csums[i]) for i in order]


def forest(rng: np.random.Generator, n: int) -> np.ndarray:
    """Identities of a random forest over two namespaces, in a shuffled
    order, some parents missing (not among them)."""
    idn = np.zeros(n, dtype=IDENT)
    nss = rng.integers(0, 256, size=(2, 16), dtype=np.uint8)
    which = rng.integers(0, 2, size=n)
    idn["ns"] = nss[which]
    idn["key"] = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    for i in range(n):
        pick = rng.random()
        if pick < 0.2:
            continue  # a root
        idn["plen"][i] = 16
        if pick < 0.3:
            idn["parent"][i] = rng.integers(0, 256, size=16, dtype=np.uint8)  # missing parent
        else:
            same = np.flatnonzero(which[:i] == which[i])
            if same.size:
                idn["parent"][i] = idn["key"][int(rng.choice(same))]
            else:
                idn["plen"][i] = 0
    idn["seq"] = rng.permutation(n) + 1
    idn["size"] = rng.integers(1, 5000, size=n)
    idn["csum"] = rng.integers(0, 2**63, size=n)
    perm = rng.permutation(n)
    return idn[perm]


@pytest.mark.parametrize("seed", range(6))
def test_recovery_order_matches_the_dict_based_one(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    idn = forest(rng, n)
    rows = np.sort(rng.choice(10 * n, size=n, replace=False)).astype(np.int64)
    ident = np.zeros(10 * n, dtype=IDENT)
    ident[rows] = idn
    got = recovery_order(ident[rows], rows)
    assert got.as_list() == reference_order(idn, rows)
    # parent positions point at the parent's entry, earlier in the order; rooted = chain reaches a root
    pos = {(m.ns_digest, m.key): i for i, (_, m, _, _) in enumerate(got.as_list())}
    for i, (_, m, _, _) in enumerate(got.as_list()):
        want = pos.get((m.ns_digest, m.parent), -1) if m.parent else -1
        assert got.parent_pos[i] == want and want < i
        j, ok = i, True
        while True:
            if not got.has_parent[j]:
                break
            if got.parent_pos[j] < 0:
                ok = False
                break
            j = int(got.parent_pos[j])
        assert bool(got.rooted[i]) == ok


def test_newest_per_name_keeps_the_highest_sequence() -> None:
    rng = np.random.default_rng(3)
    idn = np.zeros(50, dtype=IDENT)
    idn["ns"] = 7
    idn["key"] = rng.integers(0, 4, size=(50, 1), dtype=np.uint8)  # few names: many duplicates
    idn["seq"] = rng.permutation(50) + 1
    cand = np.arange(0, 50, 2)  # only these count
    kept = newest_per_name(idn, cand)
    names = {}
    for c in cand.tolist():
        k = bytes(idn["key"][c])
        if k not in names or idn["seq"][c] > idn["seq"][names[k]]:
            names[k] = c
    assert sorted(kept.tolist()) == sorted(names.values())


def owners(ns: bytes, n: int, chain_len: int, salt: int) -> list[BlockMeta]:
    keys = [bytes([salt, i % 256, i // 256]) + bytes(13) for i in range(n)]
    return [BlockMeta(ns, k, keys[i - 1] if i % chain_len else b"") for i, k in enumerate(keys)]


def write(t: SsdTier, own: Sequence[BlockMeta], size: int = KIB) -> None:
    locs = t.allocate(size, len(own))
    t.write(locs, [np.frombuffer(payload_for(o.ns_digest, o.key, size), np.uint8) for o in own], own)


def opened_from_snapshot(path: str, monkeypatch: pytest.MonkeyPatch) -> SsdTier:
    """Open with RocksDB iteration forbidden: it fails, the tier rebuilds
    from segments and counts it, so ``index_rebuilds`` tells which path ran."""
    def forbidden(self: SsdTier) -> None:
        raise RuntimeError("read the index entry by entry")
    with monkeypatch.context() as m:
        m.setattr(SsdTier, "_read_index", forbidden)
        return SsdTier(path, 64 << 20, sync=False)


def test_clean_close_leaves_a_snapshot_the_next_open_uses(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "ssd")
    ns = b"\x33" * 16
    with SsdTier(path, 64 << 20, sync=False) as t:
        write(t, owners(ns, 300, 16, 1))
        t.free(np.arange(0, 300, 50))  # a few holes
        want = t.recover()
    assert os.path.exists(os.path.join(path, SNAPSHOT_FILE))
    t = opened_from_snapshot(path, monkeypatch)
    try:
        assert t.index_rebuilds == 0 and t.recover() == want
        assert not os.path.exists(os.path.join(path, SNAPSHOT_FILE))  # taken: a crash now reads RocksDB
        write(t, owners(ns, 5, 5, 2))
    finally:
        t.close()
    with SsdTier(path, 64 << 20, sync=False) as t:
        assert len(t.recover()) == len(want) + 5


def test_a_stale_or_damaged_snapshot_is_ignored(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "ssd")
    ns = b"\x44" * 16
    snap = os.path.join(path, SNAPSHOT_FILE)
    with SsdTier(path, 64 << 20, sync=False) as t:
        write(t, owners(ns, 40, 8, 1))
    shutil.copy(snap, str(tmp_path / "old"))
    with SsdTier(path, 64 << 20, sync=False) as t:
        write(t, owners(ns, 10, 10, 2))  # RocksDB moves on
    shutil.copy(str(tmp_path / "old"), snap)  # the old snapshot back: its stamp no longer matches
    with SsdTier(path, 64 << 20, sync=False) as t:
        assert t.index_rebuilds == 0 and len(t.recover()) == 50
    with open(snap, "r+b") as f:  # a snapshot with a flipped byte
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 1]))
    t = opened_from_snapshot(path, monkeypatch)  # damaged: not used (RocksDB is read: here, forbidden)
    try:
        assert t.index_rebuilds == 1 and len(t.recover()) == 50
    finally:
        t.close()
