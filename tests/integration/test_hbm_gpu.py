"""HBM tier on a real GPU (marked gpu: skipped without CUDA). Run by
bench/gpu_check.sh on a device machine."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.errors import CapacityError
from tests.integration.conftest import DaemonThread

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BS = 1 << 20

ENGINE = r"""
import sys
import numpy as np
import torch
from kvstore.client import Client
from kvstore.keys import Namespace, block_keys
ns = Namespace(tenant="t", model_id="m", block_size=16)
keys = block_keys(ns, np.arange(4 * 16, dtype=np.int64))
c = Client(sys.argv[1], timeout=60)
reg = c.hbm_regions[0]
assert reg.ipc and len(reg.ipc_handle) == 64, reg
m = c.map_hbm()
assert c.map_hbm() is m  # once per process
src = torch.randint(0, 255, (4, BS), dtype=torch.uint8, device=f"cuda:{reg.device}")
r = c.reserve(ns, keys, BS, tier="hbm")
assert [t.label for t in r.tiers] == ["hbm"] * 4, r.tiers
for i, off in enumerate(r.offsets):
    c.hbm_view(off, BS).copy_(src[i])       # device-to-device into the daemon's slab
torch.cuda.synchronize()
assert all(s.name == "OK" for s in c.commit(r))
with c.acquire(ns, keys, tier="hbm") as lease:
    assert [t.label for t in lease.tiers] == ["hbm"] * 4
    for i, v in enumerate(lease.views):
        assert v.is_cuda and torch.equal(v, src[i])
host = c.get(ns, keys)                      # moved down to DRAM for a shm reader: same bytes
for i, h in enumerate(host):
    assert np.array_equal(h, src[i].cpu().numpy())
print("ENGINE OK", flush=True)
""".replace("BS", str(BS))


@pytest.fixture
def gpu_daemon():
    d = DaemonThread({"server.port": 0, "metrics.port": 0, "dram.capacity": "64MiB", "hbm.capacity": "64MiB"})
    try:
        from tests.integration.conftest import wait_healthy

        wait_healthy(d.target)
        yield d
    finally:
        d.stop()


def test_engine_process_maps_slab_through_ipc(gpu_daemon):
    d = gpu_daemon
    assert d.store.hbm is not None and d.store.hbm.tier.is_cuda
    assert d.store.hbm.pinned_dram  # the DRAM slab is registered as pinned memory
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", ENGINE, d.target], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=240)
    assert r.returncode == 0 and "ENGINE OK" in r.stdout, r.stderr[-3000:]


def test_hbm_larger_than_free_device_memory_refuses_to_start():
    import torch

    free, _ = torch.cuda.mem_get_info(0)
    with pytest.raises(CapacityError) as e:
        DaemonThread({"server.port": 0, "metrics.port": 0, "dram.capacity": "16MiB",
                      "hbm.capacity": str(free + (1 << 30))})
    assert "free" in str(e.value) and str(free + (1 << 30)) in str(e.value)


def test_tier_streams_demotion_roundtrip_on_device():
    from kvstore.core.hbm_mover import HbmSpec
    from kvstore.keys import Namespace
    from kvstore.core.store import StoreConfig, TieredStore
    from tests.conftest import chain, payload_for
    from tiers.base import TierKind

    ns = Namespace(tenant="t", model_id="m", block_size=4)
    with TieredStore(StoreConfig(dram_bytes=32 * BS, dram_page_bytes=BS,
                                 hbm=HbmSpec(4 * BS, "cuda:0", admit="all", page_bytes=BS))) as st:
        keys = chain(b"g", 8)
        for i in range(0, 8, 2):
            st.put(ns, keys[i:i + 2], [payload_for(b"g", k, BS) for k in keys[i:i + 2]],
                   parent=keys[i - 1] if i else None)
        assert set(st.lookup(ns, keys).tiers) == {TierKind.HBM, TierKind.DRAM}
        got = st.get(ns, keys)
        assert all(bytes(p) == payload_for(b"g", k, BS) for k, p in zip(keys, got.payloads))
        assert st.hbm.demoted >= 4 and st.hbm.tier.copy_errors == 0
        assert np.all(st.index.pins[st.index.used_rows()] == 0)
