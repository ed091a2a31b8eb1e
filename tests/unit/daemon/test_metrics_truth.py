"""The operator's numbers against what happened: scripted scenarios on a real
store or a real daemon whose ground truth is known exactly, then /metrics,
the Stats RPC and the docs checked against it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.core.namespaces import QUERY_NAMESPACES
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.daemon.metrics import OTHER_TENANT, Metrics
from kvstore.keys import Namespace
from kvstore.results import DropReason
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tests.support.daemon import DaemonThread
from tests.support.keys import ACME, chain_keys, payload_for
from tiers.base import TierKind

ROOT = Path(__file__).resolve().parents[3]
BLOCK = 4096


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value in exposition text (0 when absent: a counter not yet counted)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and ",".join(sorted(re.findall(r'\w+="[^"]*"', m.group(2) or ""))) == want:
            return float(m.group(3))
    return 0.0


@pytest.fixture
def daemon() -> Iterator[DaemonThread]:
    d = DaemonThread({"dram.capacity": "64KiB", "dram.page_size": "64KiB"})
    try:
        yield d
    finally:
        d.stop()


def test_stats_tier_evictions_count_only_blocks_that_left_for_room(daemon: DaemonThread) -> None:
    """``TierStats.evictions`` (the Stats RPC, ``kvstore stats``' EVICTIONS
    column, what an operator sizes tiers by) is "blocks evicted from this
    tier": an aborted reservation, a Remove and a Clear are not evictions."""
    with Client(daemon.target, fast_lookup=False) as c:
        keys = chain_keys(1, 4)
        assert all(s.name == "OK" for s in c.put(ACME, keys, [payload_for(b"a", k, BLOCK) for k in keys]))
        c.abort(c.reserve(ACME, chain_keys(2, 2), BLOCK))  # 2 blocks aborted
        c.remove(ACME, keys[3:])  # 1 removed
        c.clear(ACME)  # 3 cleared
        dram = c.stats().tier(TierKind.DRAM)
        assert dram is not None and dram.blocks == 0
        assert dram.evictions == 0
        # 16 slots of 4 KiB: 20 one-block prompts (a chain never evicts its own parents) evict 4
        for i in range(20):
            k = chain_keys(100 + i, 1)
            c.put(ACME, k, [payload_for(b"a", k[0], BLOCK)])
        text = daemon.daemon.metrics.render().decode()
        evicted = sample(text, "kvstore_evictions_total", tier="dram", reason="evicted")
        assert evicted == 4
        assert c.stats().tier(TierKind.DRAM).evictions == evicted  # type: ignore[union-attr]


def test_every_eviction_reason_the_code_counts_is_documented() -> None:
    """``kvstore_evictions_total{reason}``: every reason the store counts
    (``DropReason`` but the event-only NONE and MOVED) is named in the docs'
    metric table and in the metric's help."""
    counted = {r.value for r in DropReason} - {"", DropReason.MOVED.value}
    row = next(line for line in (ROOT / "docs" / "operations.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("| `kvstore_evictions_total`"))
    assert {r for r in counted if f"`{r}`" not in row} == set()
    store = TieredStore(StoreConfig(dram_bytes=1 << 20, dram_page_bytes=1 << 20))
    try:
        text = Metrics(store.stats).render().decode()
    finally:
        store.close()
    help_line = next(line for line in text.splitlines() if line.startswith("# HELP kvstore_evictions_total"))
    assert {r for r in counted if r not in help_line} == set()


def test_a_failed_get_is_timed_like_every_other_call(daemon: DaemonThread) -> None:
    """``kvstore_op_seconds`` times every call, failures included (the docs):
    the streaming Get was observed only when it succeeded, so its count was
    not the number of calls."""
    m = daemon.daemon.metrics
    ns = pb.Namespace(tenant="acme", model_id="llama", block_size=16)
    with grpc.insecure_channel(daemon.target) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Get(pb.GetRequest(ns=ns, keys=[b"short"]), timeout=30))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        list(stub.Get(pb.GetRequest(ns=ns, keys=[bytes(16)]), timeout=30))  # a miss: OK
    text = m.render().decode()
    assert sample(text, "kvstore_rpc_rejected_total", method="Get", code="INVALID_ARGUMENT") == 1
    assert sample(text, "kvstore_op_seconds_count", op="Get") == 2


def test_namespace_series_sum_to_the_totals_past_the_registered_namespaces() -> None:
    """The docs: the per-namespace series sum to ``kvstore_lookup_blocks_total``.
    Lookups in a namespace the store does not register (past
    ``QUERY_NAMESPACES`` known ones) counted in the total and in no series."""
    store = TieredStore(StoreConfig(dram_bytes=1 << 20, dram_page_bytes=1 << 20))
    try:
        m = Metrics(store.stats, namespace_series=4)
        keys = [bytes([1, i]) * 8 for i in range(3)]
        store.put(Namespace(tenant="acme", model_id="m0"), keys[:1], [np.zeros(BLOCK, np.uint8)])
        for i in range(QUERY_NAMESPACES + 5):  # the last lookups find no namespace id to count in
            store.lookup(Namespace(tenant="acme", model_id=f"m{i}"), keys)
        text = m.render().decode()
        series = {k: float(v) for k, v in re.findall(
            r'^kvstore_namespace_lookup_blocks_total\{namespace="([^"]*)"\} (\S+)$', text, re.M)}
        hits = {k: float(v) for k, v in re.findall(
            r'^kvstore_namespace_lookup_hit_blocks_total\{namespace="([^"]*)"\} (\S+)$', text, re.M)}
        assert OTHER_TENANT in series
        assert sum(series.values()) == sample(text, "kvstore_lookup_blocks_total") == 3 * (QUERY_NAMESPACES + 5)
        assert sum(hits.values()) == sample(text, "kvstore_lookup_hit_blocks_total") == 1
    finally:
        store.close()
