"""tiers/hbm.py on the CPU device: slots, copies, checksums, fences, faults."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.checksum import checksum  # noqa: E402
from kvstore.errors import CapacityError, InvalidArgument, Unavailable  # noqa: E402
from tiers.base import Tier, TierKind  # noqa: E402
from tiers.hbm import FenceTable, HbmTier  # noqa: E402

KIB = 1024
MIB = 1 << 20


class FakeEvent:
    """A copy's event whose completion the test decides."""

    def __init__(self) -> None:
        self.done = False
        self.synced = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced += 1


def blobs(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def test_is_a_tier_and_roundtrips_bytes():
    t = HbmTier(1 * MIB, device="cpu", page_bytes=256 * KIB)
    assert isinstance(t, Tier) and t.kind is TierKind.HBM
    assert t.device.type == "cpu" and t.load_stream is None and t.store_stream is None
    data = blobs(10, 5000)
    locs = t.allocate(5000, 10)
    assert locs.size == 10 and len(set(locs.tolist())) == 10
    assert all(o % 4096 == 0 for o in locs.tolist())
    csums = t.write(locs, data)
    assert csums.tolist() == [checksum(d) for d in data]
    assert t.used_bytes == 10 * 8192
    outs = [np.zeros(5000, np.uint8) for _ in data]
    ok = t.read_into(locs, np.full(10, 5000), csums, outs)
    assert ok.all() and all(np.array_equal(a, b) for a, b in zip(outs, data))
    t.free(locs)
    assert t.used_bytes == 0
    t.close()


def test_corrupt_slot_reads_false():
    t = HbmTier(1 * MIB, device="cpu", page_bytes=256 * KIB)
    data = blobs(3, 4096, 1)
    locs = t.allocate(4096, 3)
    csums = t.write(locs, data)
    t.corrupt_for_test(int(locs[1]), bit=77)
    outs = [np.zeros(4096, np.uint8) for _ in data]
    assert t.read_into(locs, np.full(3, 4096), csums, outs).tolist() == [True, False, True]


def test_footprint_and_full():
    t = HbmTier(512 * KIB, device="cpu", page_bytes=256 * KIB)
    with pytest.raises(InvalidArgument, match="hbm"):
        t.footprint(300 * KIB)
    assert t.allocate(128 * KIB, 10).size == 4  # two pages of two slots
    assert t.allocate(128 * KIB, 1).size == 0


def test_refuses_more_than_free_device_memory_naming_both():
    probe = lambda dev: (3 * MIB, 8 * MIB)  # noqa: E731
    with pytest.raises(CapacityError) as e:
        HbmTier(4 * MIB, device="cpu", page_bytes=1 * MIB, mem_get_info=probe)
    msg = str(e.value)
    assert str(4 * MIB) in msg and str(3 * MIB) in msg and "free" in msg
    HbmTier(2 * MIB, device="cpu", page_bytes=1 * MIB, mem_get_info=probe).close()  # fits


def test_resize_within_the_start_allocation():
    t = HbmTier(1 * MIB, device="cpu", page_bytes=256 * KIB)
    t.resize(512 * KIB)
    assert t.capacity_bytes == 512 * KIB and t.size == 1 * MIB
    t.resize(1 * MIB)
    assert t.capacity_bytes == 1 * MIB
    with pytest.raises(InvalidArgument, match="cannot grow"):
        t.resize(2 * MIB)
    locs = t.allocate(256 * KIB, 4)
    t.free(locs[:3])
    with pytest.raises(CapacityError):
        t.resize(512 * KIB)  # the last page still holds a block


def test_cpu_has_no_ipc_and_no_pinning():
    t = HbmTier(256 * KIB, device="cpu", page_bytes=256 * KIB)
    with pytest.raises(Unavailable, match="IPC"):
        t.ipc_export()
    assert t.register_host(np.zeros(4096, np.uint8)) is False


def test_fence_table_bookkeeping():
    f = FenceTable()
    e1, e2 = FakeEvent(), FakeEvent()
    f.fence([0, 4096], e1)
    f.fence([4096], e2)
    f.fence([8192], None)  # CPU: complete already, nothing recorded
    assert f.pending == 3
    now = f.split_free(np.asarray([0, 4096, 8192]))
    assert now.tolist() == [8192] and sorted(f.deferred) == [0, 4096]
    assert f.reap().size == 0
    e1.done = True
    assert f.reap().tolist() == [0]  # 4096 still waits for e2
    e2.done = True
    assert f.reap().tolist() == [4096] and f.deferred == [] and f.pending == 0
    f.fence([0], e1 := FakeEvent())
    f.wait()
    assert e1.synced == 1 and f.pending == 0


def test_slot_read_by_an_unfinished_copy_is_not_reused():
    """The event of the copy reading a slot gates its reuse: same code as on
    CUDA, with a fake event standing in for torch.cuda.Event."""
    t = HbmTier(256 * KIB, device="cpu", page_bytes=256 * KIB)
    ev = FakeEvent()
    t._event = lambda stream: ev  # type: ignore[method-assign]
    data = blobs(64, 4096, 2)
    locs = t.allocate(4096, 64)  # the whole slab
    csums = t.write(locs, data)
    outs = [np.zeros(4096, np.uint8)]
    assert t.read_into(locs[:1], np.asarray([4096]), csums[:1], outs).all()
    assert ev.synced >= 1
    t.free(locs[:1])
    assert t.allocate(4096, 1).size == 0  # in flight: not handed out again
    ev.done = True
    again = t.allocate(4096, 1)
    assert again.tolist() == [int(locs[0])]


def test_failing_copy_is_a_miss_and_logged_with_device_and_stream(caplog):
    calls = []

    def flaky(dst, src, stream):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        dst.copy_(src)

    t = HbmTier(256 * KIB, device="cpu", page_bytes=256 * KIB, copy_fn=flaky)
    data = blobs(3, 4096, 3)
    locs = t.allocate(4096, 3)
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.hbm"):
        csums, ok = t.write_masked(locs, data)
    assert ok.tolist() == [True, False, True]
    rec = [r.getMessage() for r in caplog.records]
    assert any("cpu" in m and "load stream" in m and "illegal memory access" in m for m in rec)
    assert t.copy_errors == 1
    outs = [np.zeros(4096, np.uint8) for _ in data]
    good = t.read_into(locs, np.full(3, 4096), csums, outs)
    assert good.tolist() == [True, False, True]  # never written: its bytes do not match


@pytest.mark.gpu
def test_cuda_slab_streams_and_ipc_export():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = HbmTier(64 * MIB, device="cuda:0", page_bytes=16 * MIB)
    lo, hi = torch.cuda.Stream.priority_range()
    assert t.load_stream.priority == hi and t.store_stream.priority == lo and hi <= lo
    data = blobs(8, 1 * MIB, 4)
    locs = t.allocate(1 * MIB, 8)
    csums = t.write(locs, data)
    outs = [np.zeros(1 * MIB, np.uint8) for _ in data]
    assert t.read_into(locs, np.full(8, 1 * MIB), csums, outs).all()
    assert all(np.array_equal(a, b) for a, b in zip(outs, data))
    exp = t.ipc_export()
    assert len(exp.handle) == 64 and exp.size == t.size and exp.device == 0
    host = np.zeros(4 * MIB, np.uint8)
    assert t.register_host(host) is True
    t.close()
