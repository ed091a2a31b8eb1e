"""Sizes and counts from the wire cannot take the daemon or the cache down
(issue 19, items 1 and 2): a resize the host cannot back is refused before
anything is allocated, a failed resize leaves the tier exactly as it was,
and one tenant's oversized Reserve evicts nothing of another tenant."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.errors import CapacityError, InvalidArgument, KeyStatus
from kvstore.keys import Namespace
from tests.conftest import payload_for
from tests.faults.faultlib import record
from tests.support.keys import chain_keys

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BS = 64 * 1024


def P(k: bytes, n: int = BS) -> bytes:
    return payload_for(b"lim", k, n)


def _dram(c: Client) -> tuple[int, int, int]:
    t = next(t for t in c.stats().tiers if t.tier.label == "dram")
    return t.capacity_bytes, t.used_bytes, t.blocks


def _put_get_ok(c: Client, seed: int) -> bool:
    keys = chain_keys(seed, 4)
    if c.put(NS, keys, [P(k) for k in keys]) != [KeyStatus.OK] * 4:
        return False
    return [g.tobytes() if g is not None else None for g in c.get(NS, keys)] == [P(k) for k in keys]


class _FailingMmap:
    """Stands in for the ``mmap`` module inside ``tiers.dram``: every new
    mapping fails, as a remap beyond what the host allows does."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls = 0

    def mmap(self, *a: Any, **kw: Any) -> Any:
        self.calls += 1
        raise OSError(12, "Cannot allocate memory")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_resize_beyond_the_host_is_refused_and_a_failed_resize_changes_nothing(make_daemon, monkeypatch) -> None:
    import tiers.dram as dram_mod

    d = make_daemon(dram__capacity="16MiB", dram__page_size="1MiB")
    shm = os.statvfs(os.path.dirname(d.store.dram.path))
    host = int(shm.f_bavail) * int(shm.f_frsize)
    with Client(d.target) as c:
        keys = chain_keys(1, 8)
        assert c.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 8
        before = _dram(c)
        refused = []
        # more than /dev/shm can back (the old daemon accepted it: a sparse
        # file and a lazy mapping, then SIGBUS or ValueErrors on later puts),
        # then the largest number the wire can carry (the old daemon built
        # 2^40 Python page objects and was OOM-killed)
        for ask in (host + (64 << 30), 2**64 - 1):
            with pytest.raises((CapacityError, InvalidArgument)) as e:
                c.admin_resize("dram", ask)
            msg = str(e.value)
            assert str(ask) in msg, msg  # names what was asked ...
            refused.append(msg)
            assert _dram(c) == before  # ... and nothing changed
            assert _put_get_ok(c, 10 + len(refused))
            before = _dram(c)
        assert any(str(host) in m or "held now" in m or "in use now" in m for m in refused)  # ... and the limit
        # a resize that the host allows but whose remap fails: atomic
        fake = _FailingMmap(dram_mod.mmap)
        monkeypatch.setattr(dram_mod, "mmap", fake)
        with pytest.raises(CapacityError) as e:
            c.admin_resize("dram", 32 << 20)
        assert fake.calls == 1 and "16777216" in str(e.value)
        monkeypatch.setattr(dram_mod, "mmap", fake.real)
        assert _dram(c) == before
        assert os.path.getsize(d.store.dram.path) == 16 << 20
        assert _put_get_ok(c, 20)
        got = c.get(NS, keys)
        assert [g.tobytes() for g in got] == [P(k) for k in keys]
        # and a resize the host can back still works
        r = c.admin_resize("dram", 32 << 20)
        assert r.new_capacity_bytes == 32 << 20
        assert _put_get_ok(c, 30)
    record("resize_limits", refused=len(refused), shm_free_bytes=host, failed_remap_left_tier_unchanged=1)


BETA = Namespace(tenant="beta", model_id="llama", block_size=16)


def test_an_oversized_reserve_leaves_another_tenants_hits_intact(make_daemon) -> None:
    """200,000 keys x 1 MiB against a 16 MiB DRAM tier: the request can never
    fit, so it is given the free slots only and evicts nothing (the old
    daemon granted the slots it could make by evicting every block on the
    way, so the other tenant's prompt hit 0 blocks afterwards)."""
    d = make_daemon(dram__capacity="16MiB", dram__page_size="1MiB")
    with Client(d.target) as c:
        prompts = [chain_keys(500 + i, 8) for i in range(4)]
        for keys in prompts:
            assert c.put(BETA, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 8
        before = [c.lookup(BETA, keys).hit_blocks for keys in prompts]
        big = chain_keys(7, 200_000)
        r = c.reserve(NS, big, 1 << 20)
        granted = sum(s == KeyStatus.OK for s in r.statuses)
        assert granted < len(big) and all(s == KeyStatus.CAPACITY for s in r.statuses[granted:])
        after = [c.lookup(BETA, keys).hit_blocks for keys in prompts]
        evictions = sum(t.evictions for t in c.stats().tiers)
        if r.reservation_id:
            c.abort(r)
        assert after == before == [8] * 4
        assert evictions == 0
        for keys in prompts:
            assert [g.tobytes() for g in c.get(BETA, keys)] == [P(k) for k in keys]
    record("oversized_reserve", keys=len(big), block_bytes=1 << 20, granted=granted,
           other_tenant_hits_before=sum(before), other_tenant_hits_after=sum(after), evicted=evictions)


def test_a_request_over_its_tenants_share_evicts_nothing_of_another_tenant() -> None:
    """With tenant shares (acme 0.5, beta 0.5 of an 8 MiB DRAM tier): beta
    holds 3 MiB, under its share; acme asks for 6 MiB, more than its share:
    acme gets the 5 MiB that are free, and beta keeps every block."""
    from kvstore.core.store import StoreConfig, TieredStore

    cfg = StoreConfig(dram_bytes=8 << 20, dram_page_bytes=1 << 20,
                      tenant_shares=(("acme", 0.5), ("beta", 0.5)), default_tenant_share=0.0)
    with TieredStore(cfg) as s:
        prompts = [chain_keys(600 + i, 16) for i in range(3)]
        for keys in prompts:
            assert s.put(BETA, keys, [P(k) for k in keys]).statuses == [KeyStatus.OK] * 16
        before = [s.lookup(BETA, keys).hit_blocks for keys in prompts]
        big = chain_keys(8, 96)  # 6 MiB of 64 KiB blocks
        res = s.reserve(NS, big, BS, owner="acme-client")
        granted = sum(x == KeyStatus.OK for x in res.statuses)
        after = [s.lookup(BETA, keys).hit_blocks for keys in prompts]
        s.abort(res.handle, "acme-client")
        assert granted == 80  # the free 5 MiB, nothing evicted for the rest
        assert after == before == [16] * 3
        # within its share, acme makes room from over-share blocks (its own) first
        assert s.put(NS, big[:64], [P(k) for k in big[:64]]).statuses == [KeyStatus.OK] * 64
        assert [s.lookup(BETA, keys).hit_blocks for keys in prompts] == [16] * 3
