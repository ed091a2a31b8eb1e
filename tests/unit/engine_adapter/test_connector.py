"""Engine connector without a daemon: layout declarations, bad input caught
before any data moves, the plan encoding, gather/scatter, and a daemon that
is down degrading to a miss."""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest
import torch

from prometheus_client import REGISTRY

from engine_adapter.connector import KVConnector
from engine_adapter.layout import PagedKVLayout, StagingPool, kv_dtype_of, torch_dtype_of
from engine_adapter.tp import LocalGroup, Plan, head_slice, shard_heads
from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.keys import KVDtype, KVLayout, Namespace

L, P, S, H, D = 3, 12, 4, 2, 8


def layout(kind: KVLayout = KVLayout.LAYER_KV_PAGE, **kw) -> PagedKVLayout:
    args = dict(kind=kind, num_layers=L, num_pages=P, page_size=S, kv_heads=H, head_dim=D, dtype=torch.float32)
    args.update(kw)
    return PagedKVLayout(**args)


def ns(**kw) -> Namespace:
    args = dict(tenant="t", model_id="m", kv_dtype="float32", layout="layer_kv_page", block_size=S)
    args.update(kw)
    return Namespace(**args)


def kv_for(lay: PagedKVLayout, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if lay.kind is KVLayout.LAYER_KV_PAGE:
        return torch.randn(lay.tensor_shape, generator=g)
    return [torch.randn(lay.tensor_shape, generator=g) for _ in range(lay.num_layers)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_connector(**kw) -> KVConnector:
    """A connector whose daemon address has nothing listening."""
    return KVConnector(ns(), layout(), target=f"127.0.0.1:{free_port()}", timeout=2.0, retry_interval=0.0, **kw)


# ------------------------------------------------------------ declarations
def test_layout_shapes_and_shard_bytes():
    lay = layout()
    assert lay.tensor_shape == (L, 2, P, S, H, D)
    assert lay.shard_shape == (L, 2, S, H, D)
    assert lay.shard_bytes == L * 2 * S * H * D * 4
    per = layout(KVLayout.PER_LAYER_KV_PAGE)
    assert per.tensor_shape == (2, P, S, H, D) and per.shard_bytes == lay.shard_bytes
    assert "per_layer_kv_page" in per.describe()


@pytest.mark.parametrize("bad, match", [
    (dict(kind="opaque"), "layer_kv_page or per_layer_kv_page"),
    (dict(kind="nonsense"), "not one of"),
    (dict(num_pages=0), "num_pages"),
    (dict(head_dim=2.0), "head_dim"),
    (dict(dtype=torch.complex64), "not storable"),
    (dict(dtype="float32"), "torch.dtype"),
])
def test_layout_declaration_is_validated(bad, match):
    with pytest.raises(InvalidArgument, match=match):
        layout(**bad)


def test_dtype_mapping_round_trips():
    for d in KVDtype:
        assert kv_dtype_of(torch_dtype_of(d)) is d
    assert torch_dtype_of("bfloat16") is torch.bfloat16


@pytest.mark.parametrize("kind", list(KVLayout)[1:], ids=lambda k: k.value)
def test_tensors_must_match_the_declared_layout(kind):
    lay = layout(kind)
    good = kv_for(lay)
    assert len(lay.page_major(good)) == (1 if kind is KVLayout.LAYER_KV_PAGE else L)
    if kind is KVLayout.LAYER_KV_PAGE:
        with pytest.raises(InvalidArgument, match=r"shape \(3, 2, 11"):
            lay.page_major(torch.zeros(L, 2, P - 1, S, H, D))
        with pytest.raises(InvalidArgument, match="dtype torch.float16"):
            lay.page_major(good.half())
        with pytest.raises(InvalidArgument, match="expects one tensor"):
            lay.page_major([good])
        with pytest.raises(InvalidArgument, match=r"heads"):
            lay.page_major(torch.zeros(L, 2, P, S, D, H))  # heads and head_dim swapped
    else:
        with pytest.raises(InvalidArgument, match="expects 3 layer tensors, got 2"):
            lay.page_major(good[:2])
        with pytest.raises(InvalidArgument, match="one tensor of shape"):
            lay.page_major(torch.zeros(L, 2, P, S, H, D))
        with pytest.raises(InvalidArgument, match=r"kv\[1\] has shape"):
            lay.page_major([good[0], good[1][:, :3], good[2]])


# --------------------------------------------------------- gather/scatter
@pytest.mark.parametrize("kind", list(KVLayout)[1:], ids=lambda k: k.value)
def test_gather_then_scatter_moves_exactly_the_named_pages(kind):
    lay = layout(kind)
    src = kv_for(lay, 1)
    pages = torch.tensor([7, 2, 9, 0])
    out, raw = StagingPool(lay).get(4)
    lay.gather(lay.page_major(src), pages, out)
    # block b's shard is [layers, 2, page_size, heads, dim] of page pages[b]
    full = src if kind is KVLayout.LAYER_KV_PAGE else torch.stack(src)
    for b, p in enumerate(pages.tolist()):
        assert torch.equal(out[b], full[:, :, p])
    assert raw.shape == (4, lay.shard_bytes)
    dst = [torch.zeros_like(t) for t in src] if isinstance(src, list) else torch.zeros_like(src)
    lay.scatter(lay.page_major(dst), torch.tensor([1, 3, 5, 11]), out)
    dfull = dst if kind is KVLayout.LAYER_KV_PAGE else torch.stack(dst)
    for b, p in enumerate([1, 3, 5, 11]):
        assert torch.equal(dfull[:, :, p], full[:, :, pages[b]])
    untouched = [p for p in range(P) if p not in (1, 3, 5, 11)]
    assert not dfull[:, :, untouched].any()


def test_staging_pool_is_reused_and_grows():
    pool = StagingPool(layout())
    a, _ = pool.get(2)
    b, _ = pool.get(1)
    assert a.data_ptr() == b.data_ptr()
    c, raw = pool.get(50)
    assert c.shape == (50, L, 2, S, H, D) and raw.shape == (50, layout().shard_bytes)


# ------------------------------------------------------------------- plan
def test_plan_round_trips_through_one_int32_tensor():
    offs = np.array([0, 2**31 + 12345, 2**40 + 7, 4096], np.int64)
    plan = Plan(1, 3, -(2**62) + 5, offs, np.array([1, 0, 1, 1], np.int64))
    t = plan.encode()
    assert t.dtype == torch.int32 and t.numel() == Plan.size_for(4)
    back = Plan.decode(t.clone())
    assert (back.status, back.count, back.slab) == (1, 3, -(2**62) + 5)
    assert back.offsets.tolist() == offs.tolist() and back.write.tolist() == [1, 0, 1, 1]
    assert Plan.empty(3).share(LocalGroup(), 3).count == 0


def test_heads_split_evenly_or_not_at_all():
    assert shard_heads(8, 4) == 2 and head_slice(8, 4, 3) == slice(6, 8)
    with pytest.raises(InvalidArgument, match="6 heads cannot be split evenly over 4"):
        shard_heads(6, 4)


def test_model_heads_not_divisible_by_tp():
    pytest.importorskip("transformers")
    from engine_adapter.hf import check_tp, llama_config

    check_tp(llama_config(num_attention_heads=4, num_key_value_heads=2), 2)
    with pytest.raises(InvalidArgument, match="KV heads: 2 heads cannot be split evenly over 4"):
        check_tp(llama_config(num_attention_heads=4, num_key_value_heads=2), 4)
    with pytest.raises(InvalidArgument, match="attention heads: 4 heads .* over 3"):
        check_tp(llama_config(num_attention_heads=4, num_key_value_heads=2), 3)


# ----------------------------------------------- bad input, before any I/O
class _Group:
    """A stand-in group of another size (only its size is read here)."""

    def __init__(self, size: int) -> None:
        self.rank, self.size = 0, size


@pytest.mark.parametrize("kw, match", [
    (dict(namespace=dict(block_size=8)), "block_size is 8 tokens but the engine's page_size is 4"),
    (dict(namespace=dict(kv_dtype="bfloat16")), "kv_dtype is bfloat16"),
    (dict(namespace=dict(layout="per_layer_kv_page")), "layout is per_layer_kv_page"),
    (dict(namespace=dict(tp_size=2)), "tp_size is 2 but the TP group has 1"),
    (dict(group=_Group(2)), "tp_size is 1 but the TP group has 2"),
])
def test_connector_rejects_a_namespace_that_does_not_fit(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        KVConnector(ns(**kw.get("namespace", {})), layout(), target="127.0.0.1:1", group=kw.get("group"))


@pytest.mark.parametrize("op", ["load", "save"])
def test_bad_page_table_or_tensors_raise_before_the_daemon_is_called(op):
    c = dead_connector()
    kv = kv_for(layout())
    toks = list(range(4 * S + 2))  # 4 full blocks + 2 tokens: needs 5 pages
    fn = getattr(c, op)
    with pytest.raises(InvalidArgument, match="page table has 4 pages but 18 tokens need 5"):
        fn(toks, torch.arange(4), kv)
    with pytest.raises(InvalidArgument, match=r"ids must be in \[0, 12\)"):
        fn(toks, torch.tensor([0, 1, 2, 12, 3]), kv)
    with pytest.raises(InvalidArgument, match="same page"):
        fn(toks, torch.tensor([0, 1, 1, 2, 3]), kv)
    with pytest.raises(InvalidArgument, match="1-D integer"):
        fn(toks, torch.arange(5.0), kv)
    with pytest.raises(InvalidArgument, match="shape"):
        fn(toks, torch.arange(5), kv[:, :, :5])
    with pytest.raises(InvalidArgument, match="token"):
        fn([-1] * 8, torch.arange(5), kv)
    # nothing was attempted against the (dead) daemon
    assert c.stats.faults == 0 and c._client is None


# ----------------------------------------------------------- daemon down
def test_daemon_down_is_a_miss_with_a_warning_and_a_metric(caplog):
    c = dead_connector()
    kv = kv_for(layout())
    def faults() -> float:
        return REGISTRY.get_sample_value("kvstore_engine_store_faults_total", {"op": "connect"}) or 0.0

    before = faults()
    toks = list(range(3 * S))
    with caplog.at_level(logging.WARNING, logger="kvstore.engine"):
        res = c.load(toks, torch.arange(3), kv)
    assert res.loaded_blocks == 0 and res.failed_blocks == (0, 1, 2)
    assert res.statuses == (KeyStatus.MISS,) * 3 and res.fault
    assert c.stats.faults == 1 and "connect" in c.stats.last_fault
    assert faults() == before + 1
    assert any("serving it as a miss" in r.getMessage() for r in caplog.records)
    snapshot = kv.clone()
    saved = c.save(toks, torch.arange(3), kv)
    assert saved.statuses == (KeyStatus.MISS,) * 3 and saved.fault and saved.stored_blocks == 0
    look = c.lookup(toks)
    assert look.hit_blocks == 0 and look.fault
    assert torch.equal(kv, snapshot)
    assert c.stats.faults == 3


def test_retry_interval_spaces_out_reconnects():
    c = KVConnector(ns(), layout(), target=f"127.0.0.1:{free_port()}", timeout=2.0, retry_interval=3600.0)
    kv = kv_for(layout())
    for _ in range(3):
        assert c.load(list(range(2 * S)), torch.arange(2), kv).loaded_blocks == 0
    assert c.stats.faults == 1  # one failed connect; later calls did not retry yet


def test_empty_requests_do_nothing():
    c = dead_connector()
    kv = kv_for(layout())
    assert c.load([1, 2, 3], torch.arange(1), kv).requested_blocks == 0
    assert c.save([1, 2, 3], torch.arange(1), kv).statuses == ()
    assert c.load(list(range(2 * S)), torch.arange(2), kv, max_blocks=0).requested_blocks == 0
    assert c.stats.faults == 0
