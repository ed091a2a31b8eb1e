"""Eviction racing lookup -> acquire: a hypothesis rule-based state machine
drives several real clients (each its own channel and session) against one
daemon whose DRAM tier holds a fraction of the key space, while a
background client keeps writing (so blocks are evicted between every
lookup and acquire). Every block any client reads is exactly the bytes put
for its namespace and key, or a miss; a leased block is never overwritten
while the lease is held."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvstore.client import Client
from kvstore.errors import KeyStatus, KVStoreError
from kvstore.keys import Namespace
from tests.conftest import chain, payload_for
from tests.faults.faultlib import isetting, record

BS = 16 * 1024
NSS = [Namespace(tenant="t", model_id="m1", block_size=16), Namespace(tenant="t", model_id="m2", block_size=16)]
BASE = chain(b"race", 6)
# chains sharing prefixes with BASE, and independent ones: ~150 blocks per
# namespace through a 64-slot DRAM tier
CHAINS = [BASE] + [BASE[:s] + chain(bytes([c]), 6 - s, parent=BASE[s - 1] if s else b"")
                   for c, s in [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]] + [chain(bytes([40 + c]), 6) for c in range(20)]


def P(n: int, key: bytes) -> bytes:
    return payload_for(bytes([n]), key, BS)


class Shared:
    """State kept across the machine's examples (one daemon for them all)."""

    daemon: Any = None
    clients: list[Client] = []
    inline: Client | None = None
    violations: list[str] = []
    counts = {"reads": 0, "hits": 0, "leases": 0, "lease_shrunk": 0, "steps": 0, "bursts": 0}


def _check(n: int, keys: list[bytes], got: list[Any], where: str) -> None:
    for k, g in zip(keys, got):
        Shared.counts["reads"] += 1
        if g is None:
            continue
        Shared.counts["hits"] += 1
        b = g.tobytes() if hasattr(g, "tobytes") else bytes(g)
        if b != P(n, k):
            Shared.violations.append(f"{where}: wrong bytes for ns {n} key {k.hex()}")


def _pressure(client: Client, rounds: int, seed: int) -> None:
    """Puts that force evictions, and reads that check what they get."""
    rng = random.Random(seed)
    for _ in range(rounds):
        n = rng.randrange(len(NSS))
        keys = CHAINS[rng.randrange(len(CHAINS))]
        try:
            client.put(NSS[n], keys, [P(n, k) for k in keys])
            _check(n, keys, client.get(NSS[n], keys), "pressure get")
        except KVStoreError:
            pass


class RaceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        Shared.counts["steps"] += 0

    @rule(c=st.integers(0, 2), n=st.integers(0, 1), ch=st.integers(0, len(CHAINS) - 1),
          lo=st.integers(0, 5), hi=st.integers(1, 6))
    def put(self, c: int, n: int, ch: int, lo: int, hi: int) -> None:
        lo = min(lo, hi - 1)
        keys = CHAINS[ch][lo:hi]
        parent = CHAINS[ch][lo - 1] if lo else None
        st_ = Shared.clients[c].put(NSS[n], keys, [P(n, k) for k in keys], parent=parent)
        assert len(st_) == len(keys)
        Shared.counts["steps"] += 1

    @rule(c=st.integers(0, 2), n=st.integers(0, 1), ch=st.integers(0, len(CHAINS) - 1),
          burst=st.integers(0, 8), seed=st.integers(0, 2**16))
    def lookup_then_acquire(self, c: int, n: int, ch: int, burst: int, seed: int) -> None:
        """Lookup, then acquire (blocks may go in between); while the lease is
        held another client writes enough to evict everything unpinned; the
        leased bytes stay exact."""
        client, keys = Shared.clients[c], CHAINS[ch]
        look = client.lookup(NSS[n], keys)
        lease = client.acquire(NSS[n], keys)
        Shared.counts["leases"] += 1
        Shared.counts["lease_shrunk"] += lease.hit_blocks < look.hit_blocks
        try:
            _check(n, keys[: lease.hit_blocks], lease.views[: lease.hit_blocks], "lease (before pressure)")
            if burst:
                _pressure(Shared.clients[(c + 1) % 3], burst, seed)
            _check(n, keys[: lease.hit_blocks], lease.views[: lease.hit_blocks], "lease (after pressure)")
        finally:
            lease.release()
        Shared.counts["steps"] += 1

    @rule(c=st.integers(0, 2), n=st.integers(0, 1), ch=st.integers(0, len(CHAINS) - 1))
    def get_into(self, c: int, n: int, ch: int) -> None:
        keys = CHAINS[ch]
        outs = [np.zeros(BS, np.uint8) for _ in keys]
        sts = Shared.clients[c].get_into(NSS[n], keys, outs)
        _check(n, keys, [o if s is KeyStatus.OK else None for o, s in zip(outs, sts)], "get_into")
        Shared.counts["steps"] += 1

    @rule(n=st.integers(0, 1), ch=st.integers(0, len(CHAINS) - 1))
    def inline_get(self, n: int, ch: int) -> None:
        assert Shared.inline is not None
        keys = CHAINS[ch]
        _check(n, keys, Shared.inline.get(NSS[n], keys), "inline get")
        Shared.counts["steps"] += 1

    @rule(c=st.integers(0, 2), n=st.integers(0, 1), ch=st.integers(0, len(CHAINS) - 1), i=st.integers(0, 5))
    def remove(self, c: int, n: int, ch: int, i: int) -> None:
        Shared.clients[c].remove(NSS[n], CHAINS[ch][i:i + 1])
        Shared.counts["steps"] += 1

    @rule(seed=st.integers(0, 2**16))
    def concurrent_burst(self, seed: int) -> None:
        """All three clients at once: lookup -> acquire -> read -> release,
        interleaved with puts, on threads."""
        errors: list[BaseException] = []

        def worker(c: int) -> None:
            rng = random.Random(seed * 7 + c)
            try:
                for _ in range(6):
                    n, keys = rng.randrange(2), CHAINS[rng.randrange(len(CHAINS))]
                    if rng.random() < 0.5:
                        Shared.clients[c].put(NSS[n], keys, [P(n, k) for k in keys])
                    Shared.clients[c].lookup(NSS[n], keys)
                    with Shared.clients[c].acquire(NSS[n], keys) as lease:
                        _check(n, keys[: lease.hit_blocks], lease.views[: lease.hit_blocks], "burst lease")
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(c,)) for c in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        Shared.counts["bursts"] += 1

    @invariant()
    def never_other_bytes(self) -> None:
        assert not Shared.violations, Shared.violations[:5]

    @invariant()
    def index_consistent(self) -> None:
        d = Shared.daemon
        d.call(d.store.index.check_invariants)


@pytest.fixture
def race_daemon(make_daemon):
    d = make_daemon(dram__capacity="1MiB", dram__page_size="256KiB")
    Shared.daemon = d
    Shared.clients = [Client(d.target) for _ in range(3)]
    Shared.inline = Client(d.target, use_shm=False)
    Shared.violations = []
    yield d
    for c in Shared.clients + [Shared.inline]:
        c.close()


def test_eviction_racing_lookup_acquire(race_daemon) -> None:
    d = race_daemon
    stop = threading.Event()
    bg_reads = {"n": 0}

    def background() -> None:  # a fourth client writing all the time
        with Client(d.target) as c:
            i = 0
            while not stop.is_set():
                _pressure(c, 1, i)
                bg_reads["n"] += 1
                i += 1

    t = threading.Thread(target=background, daemon=True)
    t.start()
    try:
        run_state_machine_as_test(RaceMachine, settings=settings(
            max_examples=isetting("race_examples", 15), stateful_step_count=isetting("race_steps", 20),
            deadline=None, database=None, suppress_health_check=list(HealthCheck)))
    finally:
        stop.set()
        t.join(60)
    evictions = d.call(lambda: sum(v for (_, r), v in d.store.counters.evictions.items() if r == "evicted"))
    leftovers = d.call(lambda: d.store.hold_counts())
    c = Shared.counts
    record("eviction_race", steps=c["steps"], concurrent_bursts=c["bursts"], leases=c["leases"],
           leases_shorter_than_lookup=c["lease_shrunk"], blocks_read=c["reads"], blocks_hit=c["hits"],
           background_rounds=bg_reads["n"], evictions=evictions, wrong_bytes=len(Shared.violations))
    assert not Shared.violations
    assert evictions > 0 and c["hits"] > 0
    assert leftovers == (0, 0)
