"""The worker accepts the KV tensors vLLM allocates for each cache dtype.

vLLM allocates an fp8 KV cache (``--kv-cache-dtype fp8``, ``fp8_e4m3``,
``fp8_e5m2``) as ``torch.uint8`` tensors holding the fp8 bytes
(``vllm.utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE``); the namespace names
the fp8 type. The worker must register them (the bytes move as they are),
and still refuse tensors whose dtype does not match the namespace. No
engine: the worker half is built over a stand-in config in the vLLM
environment's python (``WorkerSide.register_kv_caches``), every case in
one process (one torch and vLLM import, the cost of each probe).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.vllm_servers import VLLM_PY, vllm_env
from tests.vllm.conftest import require_vllm

PROBE = r"""
import json, sys
from types import SimpleNamespace as NS
import torch
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from engine_adapter.vllm_common import kv_dtype
from engine_adapter.vllm_worker import WorkerSide

def probe(cache_dtype, tensor_dtype):
    layers, kv_heads, head, bs, blocks = 2, 2, 8, 4, 6
    mc = NS(dtype=torch.bfloat16, get_num_layers=lambda pc: layers, get_num_kv_heads=lambda pc: kv_heads,
            get_head_size=lambda: head)
    vc = NS(model_config=mc, parallel_config=NS(tensor_parallel_size=1),
            cache_config=NS(block_size=bs, cache_dtype=cache_dtype), kv_transfer_config=None)
    ident = NS(kv_dtype=kv_dtype(vc))
    w = WorkerSide(ident, NS(prefault=False), vc, NS(num_blocks=blocks))
    dt = STR_DTYPE_TO_TORCH_DTYPE[cache_dtype] if tensor_dtype == "vllm" else getattr(torch, tensor_dtype)
    caches = {f"l{i}": torch.zeros(2, blocks, bs, kv_heads, head, dtype=dt) for i in range(layers)}
    try:
        w.register_kv_caches(caches)
        return {"ok": True, "dtype": str(dt), "block_bytes": w.block_bytes}
    except ValueError as e:
        return {"ok": False, "dtype": str(dt), "error": str(e)}

print(json.dumps({f"{c}/{t}": probe(c, t) for c, t in (a.split("/") for a in sys.argv[1:])}))
"""

CASES = [(c, "vllm") for c in ("fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16")] + [("bfloat16", "uint8"),
                                                                              ("fp8", "float16")]
"""(cache dtype, tensor dtype; "vllm": the dtype vLLM allocates for it) of every test here."""


@pytest.fixture(scope="module")
def probed() -> dict:
    """Every case of ``CASES`` probed in one vLLM-environment process."""
    require_vllm()
    p = subprocess.run([VLLM_PY, "-c", PROBE, *(f"{c}/{t}" for c, t in CASES)], env=vllm_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def probe(probed: dict):
    return lambda cache_dtype, tensor_dtype="vllm": probed[f"{cache_dtype}/{tensor_dtype}"]


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_kv_cache_allocated_as_uint8_registers(cache_dtype: str, probe) -> None:
    got = probe(cache_dtype)
    assert got["dtype"] == "torch.uint8"
    assert got["ok"], got
    assert got["block_bytes"] == 2 * 2 * 4 * 2 * 8  # layers x K/V x tokens x heads x head size, 1 byte each


def test_tensors_of_another_dtype_than_the_namespace_are_refused(probe) -> None:
    assert probe("bfloat16", "uint8")["ok"] is False
    assert probe("fp8", "float16")["ok"] is False
    assert probe("bfloat16")["ok"] is True
