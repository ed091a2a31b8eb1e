"""The engine connector against the real daemon: paged save/load for both
layouts, partial failures (no half-written pages), mirrored TP shards
(ranks as threads over a fake TPGroup, real slab), timeouts."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine_adapter.connector import KVConnector
from engine_adapter.layout import PagedKVLayout
from kvstore.client import Client
from kvstore.errors import KeyStatus
from kvstore.keys import KVLayout, Namespace

L, P, S, H, D = 2, 16, 4, 2, 8
SENTINEL = -7.0


def stop_now(d) -> None:
    """Stop a fixture daemon mid-test (the fixture's teardown then skips it)."""
    d.stop()
    d.stop = lambda: None


def make_layout(kind: KVLayout = KVLayout.LAYER_KV_PAGE, heads: int = H) -> PagedKVLayout:
    return PagedKVLayout(kind, L, P, S, heads, D, torch.float32)


def make_ns(kind: KVLayout = KVLayout.LAYER_KV_PAGE, tp: int = 1) -> Namespace:
    return Namespace(tenant="t", model_id="m", kv_dtype="float32", layout=kind, block_size=S, tp_size=tp)


def make_kv(lay: PagedKVLayout, seed: int | None):
    def one(shape):
        if seed is None:
            return torch.full(shape, SENTINEL)
        return torch.randn(shape, generator=g)

    g = torch.Generator().manual_seed(seed or 0)
    if lay.kind is KVLayout.LAYER_KV_PAGE:
        return one(lay.tensor_shape)
    return [one(lay.tensor_shape) for _ in range(lay.num_layers)]


def pages_of(kv, page_ids) -> torch.Tensor:
    full = kv if isinstance(kv, torch.Tensor) else torch.stack(kv)
    return full[:, :, list(page_ids)]


def tokens(n_blocks: int, extra: int = 2, seed: int = 5) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30000, n_blocks * S + extra).tolist()


@pytest.mark.parametrize("kind", list(KVLayout)[1:], ids=lambda k: k.value)
def test_save_then_load_into_other_pages(daemon, kind):
    lay, ns = make_layout(kind), make_ns(kind)
    toks = tokens(6)
    src_pt = torch.tensor([3, 9, 1, 14, 0, 7, 2])
    dst_pt = torch.tensor([12, 4, 5, 6, 8, 10, 11])
    src = make_kv(lay, 1)
    with KVConnector(ns, lay, target=daemon.target) as c:
        saved = c.save(toks, src_pt, src)
        assert saved.statuses == (KeyStatus.OK,) * 6 and saved.fault is None
        assert c.lookup(toks).hit_blocks == 6
        assert c.save(toks, src_pt, src).statuses == (KeyStatus.EXISTS,) * 6
        dst = make_kv(lay, None)
        res = c.load(toks, dst_pt, dst)
        assert (res.requested_blocks, res.hit_blocks, res.loaded_blocks) == (6, 6, 6)
        assert res.loaded_tokens == 24 and res.failed_blocks == ()
        assert torch.equal(pages_of(dst, dst_pt[:6]), pages_of(src, src_pt[:6]))
        # the page of the partial 7th block was not touched
        assert (pages_of(dst, dst_pt[6:]) == SENTINEL).all()
        # max_blocks caps the load
        dst2 = make_kv(lay, None)
        assert c.load(toks, dst_pt, dst2, max_blocks=2).loaded_blocks == 2
        assert (pages_of(dst2, dst_pt[2:]) == SENTINEL).all()
    with Client(daemon.target) as cl:
        got = cl.get(ns, c.keys(toks)[:1])[0]
        assert got.size == lay.shard_bytes
        want = pages_of(src, src_pt[:1])[:, :, 0].contiguous()  # [layers, 2, S, H, D]
        assert np.array_equal(got.view(np.float32), want.numpy().reshape(-1))


def test_save_continues_a_chain_from_start_block(daemon):
    lay, ns = make_layout(), make_ns()
    toks = tokens(5)
    kv = make_kv(lay, 2)
    with KVConnector(ns, lay, target=daemon.target) as c:
        assert c.save(toks, torch.arange(6), kv, end_block=2).statuses == (KeyStatus.OK,) * 2
        r = c.save(toks, torch.arange(6), kv, start_block=2)
        assert r.start_block == 2 and r.statuses == (KeyStatus.OK,) * 3
        assert c.lookup(toks).hit_blocks == 5
        other = tokens(5, seed=6)
        assert c.save(other, torch.arange(6), kv, start_block=3).statuses == (KeyStatus.PARENT_MISSING,) * 2


def corrupt(target: str, ns: Namespace, key: bytes, at: int) -> None:
    with Client(target) as cl:
        with cl.acquire(ns, [key]) as lease:
            view = cl.view(lease.offsets[0], lease.lengths[0])
            view[at] ^= 0xFF


def test_a_corrupt_block_stops_the_load_and_leaves_later_pages_untouched(daemon):
    lay, ns = make_layout(), make_ns()
    toks = tokens(6)
    src = make_kv(lay, 3)
    with KVConnector(ns, lay, target=daemon.target, retry_interval=0) as c:
        c.save(toks, torch.arange(7), src)
        corrupt(daemon.target, ns, c.keys(toks)[3], 100)
        dst = make_kv(lay, None)
        res = c.load(toks, torch.arange(7), dst)
        assert res.hit_blocks == 6 and res.loaded_blocks == 3
        assert res.statuses == (KeyStatus.OK,) * 3 + (KeyStatus.CORRUPT,) + (KeyStatus.PARENT_MISSING,) * 2
        assert res.failed_blocks == (3, 4, 5)
        assert torch.equal(dst[:, :, :3], src[:, :, :3])
        assert (dst[:, :, 3:] == SENTINEL).all()  # nothing half-written past the failure
        assert c.stats.failed_blocks == 3
        # the bad block was dropped; saving again heals the chain
        assert c.lookup(toks).hit_blocks == 3
        again = c.save(toks, torch.arange(7), src)
        assert again.statuses[:3] == (KeyStatus.EXISTS,) * 3 and again.stored_blocks == 3
        dst = make_kv(lay, None)
        assert c.load(toks, torch.arange(7), dst).loaded_blocks == 6
        assert torch.equal(dst[:, :, :6], src[:, :, :6])


def test_inline_fallback_without_the_slab(daemon):
    lay, ns = make_layout(), make_ns()
    toks = tokens(4)
    src = make_kv(lay, 4)
    with KVConnector(ns, lay, target=daemon.target, use_shm=False) as c:
        assert c.save(toks, torch.arange(5), src).statuses == (KeyStatus.OK,) * 4
        dst = make_kv(lay, None)
        res = c.load(toks, torch.arange(5), dst)
        assert res.loaded_blocks == 4 and torch.equal(dst[:, :, :4], src[:, :, :4])


def test_a_daemon_that_stops_answering_is_a_miss(make_daemon):
    d = make_daemon()
    lay, ns = make_layout(), make_ns()
    toks = tokens(3)
    kv = make_kv(lay, 5)
    with KVConnector(ns, lay, target=d.target, timeout=0.5, retry_interval=0) as c:
        assert c.save(toks, torch.arange(4), kv).stored_blocks == 3
        blocked, resume = threading.Event(), threading.Event()

        def block_loop() -> None:  # the daemon's event loop hangs until the load has given up
            blocked.set()
            resume.wait(30)

        d.loop.call_soon_threadsafe(block_loop)
        assert blocked.wait(10)
        dst = make_kv(lay, None)
        try:
            res = c.load(toks, torch.arange(4), dst)
        finally:
            resume.set()
        assert res.loaded_blocks == 0 and res.fault and "Deadline" in res.fault
        assert (dst == SENTINEL).all() and c.stats.faults >= 1


def test_daemon_restart_is_survived(make_daemon):
    d = make_daemon()
    lay, ns = make_layout(), make_ns()
    toks = tokens(3)
    kv = make_kv(lay, 6)
    c = KVConnector(ns, lay, target=d.target, timeout=2.0, retry_interval=0)
    assert c.save(toks, torch.arange(4), kv).stored_blocks == 3
    stop_now(d)
    res = c.load(toks, torch.arange(4), make_kv(lay, None))
    assert res.loaded_blocks == 0 and res.fault
    c.close()


# ------------------------------------------------------ TP, ranks as threads
class ThreadGroup:
    """TPGroup over threads of one process (a fake of our own protocol)."""

    def __init__(self, shared: dict, rank: int) -> None:
        self.shared, self.rank, self.size = shared, rank, shared["size"]

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        sh = self.shared
        sh["slots"][self.rank] = t.clone()
        sh["barrier"].wait()
        got = list(sh["slots"])
        sh["barrier"].wait()
        return got

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        t.copy_(self._exchange(t)[src])
        return t

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        t.copy_(torch.stack(self._exchange(t)).min(0).values)
        return t

    def barrier(self) -> None:
        self.shared["barrier"].wait()


def run_ranks(tp: int, fn) -> list:
    shared = {"size": tp, "slots": [None] * tp, "barrier": threading.Barrier(tp, timeout=60)}
    out: list = [None] * tp
    errors: list = []

    def body(r: int) -> None:
        try:
            out[r] = fn(r, ThreadGroup(shared, r))
        except BaseException as e:  # surface in the test thread
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


TP = 2


def test_mirrored_shards_one_slot_per_block(daemon):
    ns = make_ns(tp=TP)
    lay = make_layout(heads=H // TP)
    toks = tokens(5)
    # rank r's KV holds its heads of one global KV
    full = make_kv(make_layout(), 7)
    shards = [full[:, :, :, :, r * (H // TP):(r + 1) * (H // TP)].contiguous() for r in range(TP)]

    def rank(r: int, group: ThreadGroup):
        with KVConnector(ns, lay, target=daemon.target, group=group) as c:
            saved = c.save(toks, torch.arange(6), shards[r])
            dst = make_kv(lay, None)
            res = c.load(toks, torch.arange(6), dst)
            return saved, res, dst, c.keys(toks)

    out = run_ranks(TP, rank)
    for r, (saved, res, dst, _) in enumerate(out):
        assert saved.statuses == (KeyStatus.OK,) * 5, r
        assert res.loaded_blocks == 5 and torch.equal(dst[:, :, :5], shards[r][:, :, :5]), r
    keys = out[0][3]
    with Client(daemon.target) as cl:
        assert cl.lookup(ns, keys).hit_blocks == 5
        block = cl.get(ns, keys[:1])[0]
    # one entry holds both shards back to back
    assert block.size == TP * lay.shard_bytes
    want = np.concatenate([shards[r][:, :, 0].contiguous().numpy().reshape(-1) for r in range(TP)])
    assert np.array_equal(block.view(np.float32), want)


def test_a_corrupt_shard_fails_the_block_on_every_rank(daemon):
    ns = make_ns(tp=TP)
    lay = make_layout(heads=H // TP)
    toks = tokens(4)
    shards = [make_kv(lay, 10 + r) for r in range(TP)]

    def save(r: int, group: ThreadGroup):
        with KVConnector(ns, lay, target=daemon.target, group=group) as c:
            return c.save(toks, torch.arange(5), shards[r]), c.keys(toks)

    keys = run_ranks(TP, save)[0][1]
    corrupt(daemon.target, ns, keys[2], lay.shard_bytes + 8)  # inside rank 1's shard

    def load(r: int, group: ThreadGroup):
        with KVConnector(ns, lay, target=daemon.target, group=group) as c:
            dst = make_kv(lay, None)
            return c.load(toks, torch.arange(5), dst), dst

    for r, (res, dst) in enumerate(run_ranks(TP, load)):
        assert res.loaded_blocks == 2 and res.statuses[2] is KeyStatus.CORRUPT, r
        assert torch.equal(dst[:, :, :2], shards[r][:, :, :2]) and (dst[:, :, 2:] == SENTINEL).all()


def test_a_rank_that_cannot_reach_the_slab_makes_every_rank_recompute(daemon):
    ns = make_ns(tp=TP)
    lay = make_layout(heads=H // TP)
    toks = tokens(3)
    shards = [make_kv(lay, 20 + r) for r in range(TP)]

    def rank(r: int, group: ThreadGroup):
        # rank 1 has no mapping of the slab (as if it ran in another container)
        with KVConnector(ns, lay, target=daemon.target, group=group, use_shm=(r == 0)) as c:
            saved = c.save(toks, torch.arange(4), shards[r])
            dst = make_kv(lay, None)
            return saved, c.load(toks, torch.arange(4), dst), dst

    for r, (saved, res, dst) in enumerate(run_ranks(TP, rank)):
        assert saved.stored_blocks == 0 and saved.fault, r  # aborted: not every shard was written
        assert res.loaded_blocks == 0 and (dst == SENTINEL).all(), r
    with Client(daemon.target) as cl:
        assert cl.stats().active_reservations == 0

    # with every rank mapped, the same blocks store and load
    def healthy(r: int, group: ThreadGroup):
        with KVConnector(ns, lay, target=daemon.target, group=group) as c:
            c.save(toks, torch.arange(4), shards[r])
            dst = make_kv(lay, None)
            return c.load(toks, torch.arange(4), dst), dst

    for r, (res, dst) in enumerate(run_ranks(TP, healthy)):
        assert res.loaded_blocks == 3 and torch.equal(dst[:, :, :3], shards[r][:, :, :3])
