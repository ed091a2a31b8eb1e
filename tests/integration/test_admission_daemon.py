"""Admit/Report through the daemon, the retry-after trailer of a full QoS
queue, and tenant shares in eviction."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from kvstore.client import Client, ns_pb
from kvstore.errors import KeyStatus
from kvstore.keys import Namespace, block_keys
from kvstore.core.store import StoreConfig, TieredStore
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tests.conftest import chain, payload_for

NS = Namespace(tenant="acme", model_id="llama", block_size=16)


def test_admit_predicts_rejects_and_calibrates(make_daemon):
    d = make_daemon(admission__prefill_tokens_per_s=10000)
    keys = block_keys(NS, np.arange(64 * 16) % 1000)
    with Client(d.target) as c:
        c.put(NS, keys[:48], [np.zeros(4096, np.uint8)] * 48)
        stub = c.stub
        # the engine reports its queue wait (else the daemon models the queue from
        # what it admitted, and a tight loop of admits would fill that model)
        req = pb.AdmitRequest(ns=ns_pb(NS), keys_packed=b"".join(keys), n_tokens=64 * 16, ttft_target_s=1.0,
                              queue_wait_s=0.001)
        r = stub.Admit(req, metadata=c._md(), timeout=10)
        assert r.kind == pb.ADMIT_KIND_ADMIT and r.hit_blocks == 48
        assert r.predicted.uncached_tokens == 16 * 16 and r.predicted.total_s < 1.0
        # the same request with a target it cannot meet without the cache: reject early
        tight = pb.AdmitRequest(ns=ns_pb(NS), keys_packed=b"".join(keys[:1]) + b"\x00" * 16 * 63,
                                n_tokens=64 * 16, ttft_target_s=0.01)
        assert stub.Admit(tight, metadata=c._md(), timeout=10).kind == pb.ADMIT_KIND_REJECT
        # engines report slower prefills than modelled: the model follows
        before = stub.Stats(pb.StatsRequest(), metadata=c._md(), timeout=10).prefill_tokens_per_s
        for _ in range(40):
            r = stub.Admit(req, metadata=c._md(), timeout=10)
            rep = stub.Report(pb.ReportRequest(decision_id=r.decision_id, actual_ttft_s=r.predicted.total_s * 2),
                              metadata=c._md(), timeout=10)
            assert rep.matched and rep.error_s > 0
        st = stub.Stats(pb.StatsRequest(), metadata=c._md(), timeout=10)
        assert st.prefill_tokens_per_s < before and st.admitted >= 41 and st.rejected >= 1
        with pytest.raises(grpc.RpcError) as ei:
            stub.Admit(pb.AdmitRequest(ns=ns_pb(NS), keys_packed=b"".join(keys), n_tokens=64 * 16,
                                       ttft_target_s=0), metadata=c._md(), timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as ei:
            stub.Admit(pb.AdmitRequest(ns=ns_pb(NS), keys_packed=b"".join(keys), n_tokens=10,
                                       ttft_target_s=1), metadata=c._md(), timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert b"kvstore_admission_decisions_total" in d.daemon.metrics.render()


def test_full_qos_queue_fails_fast_with_retry_after(make_daemon):
    d = make_daemon(admission__qos_max_concurrency=1, admission__qos_queue_limit=1)

    async def hold_and_flood() -> list[tuple[grpc.StatusCode, tuple]]:
        # occupy the only slot from inside the daemon, then flood Lookups
        gate = d.daemon.qos
        from admission.qos import QosClass

        ticket = gate.try_enter(QosClass.WRITE)
        assert not hasattr(ticket, "retry_after_s") or ticket is not None
        out = []
        async with grpc.aio.insecure_channel(d.target) as ch:
            stub = pb_grpc.KVStoreStub(ch)
            calls = [stub.Lookup(pb.LookupRequest(ns=ns_pb(NS), keys=[b"k" * 16]), timeout=5) for _ in range(4)]
            await asyncio.sleep(0.2)
            d.loop.call_soon_threadsafe(gate.release, ticket)
            for call in calls:
                try:
                    await call
                    out.append((grpc.StatusCode.OK, ()))
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), tuple(e.trailing_metadata() or ())))
        return out

    res = asyncio.run(hold_and_flood())
    codes = [c for c, _ in res]
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
    trailers = [md for c, md in res if c == grpc.StatusCode.RESOURCE_EXHAUSTED][0]
    assert any(k == "retry-after-ms" and int(v) > 0 for k, v in trailers)


def test_tenant_over_its_share_is_evicted_first(ns):
    a = Namespace(tenant="a", model_id="m", block_size=4)
    b = Namespace(tenant="b", model_id="m", block_size=4)
    st = TieredStore(StoreConfig(dram_bytes=8 * 4096, dram_page_bytes=8 * 4096, tenant_shares=(("a", 0.5), ("b", 0.5))))
    with st:
        ka = [chain(bytes([i]), 1)[0] for i in range(4)]
        for k in ka:  # A fills its half first (these are the oldest blocks)
            st.put(a, [k], [payload_for(b"a", k, 4096)])
        for i in range(12):  # B bursts: 12 blocks into the other half
            k = chain(bytes([100 + i]), 1)[0]
            assert st.put(b, [k], [payload_for(b"b", k, 4096)]).statuses == [KeyStatus.OK]
        # LRU alone would have evicted A's older blocks; B's burst evicted B's own
        assert [st.lookup(a, [k]).hit_blocks for k in ka] == [1, 1, 1, 1]
