"""Cache identity with real vLLM (issue 20): a block is served only to the
model that computed it. Four vLLM processes (tests/vllm/phase.py, in-process
engine core) on the tiny Llama, against one daemon with an SSD tier:

- A: weights A at path M: generates for prompt P; the connector saves P's
  7 blocks (block size 128). The daemon is then restarted from its SSD:
  A's blocks are still there.
- the weight file at M is overwritten in place with weights B (same
  architecture, same config, same served name);
- B: weights B at M: P finds no block (A's are not B's), and the output is
  B's own cold output (computed in the same process, loads off, vLLM's
  prefix cache reset); B saves its blocks;
- R: weights B at M with ``hf_overrides`` rope_scaling: again no hit, and
  the output is this configuration's cold output;
- E: the same weights and config copied to another path, under another
  served name: every block of P hits (B's), and the output is B's.

The namespace the connector used (its ``identity`` record) is also the one
:func:`kvstore.identity.engine_namespace` gives from outside vLLM for the
same model directory and settings: what the router computes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess

import pytest

from kvstore.client import Client
from kvstore.identity import engine_namespace, vllm_layout_tag
from kvstore.keys import Namespace, block_keys
from tests.integration.conftest import DaemonThread, wait_healthy, wait_until
from tests.vllm.conftest import HERE, VLLM_PY, require_vllm, run_phase, vllm_env
from tiers.base import TierKind

pytestmark = pytest.mark.timeout(1800)

BLOCK = 128
NEW = 16
rng = random.Random(20)
P = [rng.randrange(3, 1024) for _ in range(1000)]  # 7 full blocks
ROPE = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
SSD = {"ssd.capacity": "256MiB", "ssd.write_mode": "through", "ssd.admit_min_hits": 0, "ssd.sync": False}


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _res(run: dict, name: str) -> dict:
    return next(r for r in run["results"] if r["name"] == name)


def _ns(stats: list[dict]) -> Namespace:
    found = {json.dumps(s["namespace"], sort_keys=True) for s in stats if s["event"] == "identity"}
    assert len(found) == 1, found  # scheduler and worker agree
    return Namespace.from_dict(json.loads(found.pop()))


def _lookups(stats: list[dict]) -> list[int]:
    return [s["hit_blocks"] for s in stats if s["event"] == "lookup"]


def _ssd_daemon(path: str) -> DaemonThread:
    d = DaemonThread({"dram.capacity": "64MiB", "ssd.path": path, **SSD})
    if TierKind.SSD not in d.store.tiers:
        d.stop()
        pytest.skip("this daemon has no SSD tier")
    wait_healthy(d.target)
    return d


@pytest.fixture(scope="module")
def runs(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_vllm()
    work = str(tmp_path_factory.mktemp("vllm-identity"))
    m = shutil.copytree(tiny_model, os.path.join(work, "models", "m"))  # weights A (this test edits it)
    b_build = os.path.join(work, "build-b")
    subprocess.run([VLLM_PY, os.path.join(HERE, "tiny_model.py"), b_build, "1"], check=True, env=vllm_env(),
                   capture_output=True, timeout=600)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVSTORE_DIGEST_CACHE": os.path.join(work, "digests.json")}
    out: dict = {"work": work, "m": m}
    d = _ssd_daemon(os.path.join(work, "ssd"))
    try:
        base = {"model": m, "target": d.target, "max_tokens": NEW, "dtype": "float32"}
        cold = {"load": False, "save": False, "reset_prefix_cache": True}
        out["A"] = run_phase({**base, "stats_path": f"{work}/a.jsonl", "prompts": [{"name": "P", "tokens": P}]},
                             work, "A", **env)
        out["a_stats"] = _records(f"{work}/a.jsonl")
        ns_a = _ns(out["a_stats"])
        # every block of A on SSD, then a daemon restart from it
        wait_until(lambda: d.call(lambda: int((d.store.index.ssd_loc[d.store.index.used_rows()] >= 0).sum())) >= 7,
                   what="A's blocks written through to SSD")
        d.stop()
        # the weights update: same path, same file name, same config; overwritten in place
        weights = os.path.join(m, "model.safetensors")
        inode = os.stat(weights).st_ino
        shutil.copyfile(os.path.join(b_build, "model.safetensors"), weights)
        assert os.stat(weights).st_ino == inode
        d = _ssd_daemon(os.path.join(work, "ssd"))
        base["target"] = d.target
        with Client(d.target) as c:  # A's blocks survived the restart
            out["a_hit_after_restart"] = int(c.lookup(ns_a, block_keys(ns_a, P)).hit_blocks)
        out["B"] = run_phase({**base, "stats_path": f"{work}/b.jsonl", "prompts": [
            {"name": "P", "tokens": P}, {"name": "Pcold", "tokens": P, **cold}]}, work, "B", **env)
        out["b_stats"] = _records(f"{work}/b.jsonl")
        out["R"] = run_phase({**base, "stats_path": f"{work}/r.jsonl", "llm_kwargs": {"hf_overrides": ROPE},
                              "prompts": [{"name": "P", "tokens": P}, {"name": "Pcold", "tokens": P, **cold}]},
                             work, "R", **env)
        out["r_stats"] = _records(f"{work}/r.jsonl")
        elsewhere = shutil.copytree(m, os.path.join(work, "elsewhere", "copy-of-m"))
        out["elsewhere"] = elsewhere
        out["E"] = run_phase({**base, "model": elsewhere, "stats_path": f"{work}/e.jsonl",
                              "llm_kwargs": {"served_model_name": "tiny-b-renamed"},
                              "prompts": [{"name": "P", "tokens": P, "save": False}]}, work, "E", **env)
        out["e_stats"] = _records(f"{work}/e.jsonl")
        yield out
    finally:
        d.stop()


def test_weights_replaced_in_place_are_a_new_namespace(runs) -> None:
    a, b = _ns(runs["a_stats"]), _ns(runs["b_stats"])
    assert a.weights_digest != b.weights_digest and a.digest != b.digest
    assert a.model_id == b.model_id  # same architecture and config
    assert runs["m"] not in a.model_id


def test_no_block_of_the_old_weights_is_hit_even_after_a_daemon_restart(runs) -> None:
    assert runs["a_hit_after_restart"] == 7  # A's blocks are there (SSD), yet:
    p = _res(runs["B"], "P")
    assert p["num_cached_tokens"] == 0
    assert _lookups(runs["b_stats"])[0] == 0
    assert p["tokens"] == _res(runs["B"], "Pcold")["tokens"]  # B's own cold output
    assert p["tokens"] != _res(runs["A"], "P")["tokens"]  # (the weights do differ)


def test_changed_rope_scaling_override_is_a_new_namespace(runs) -> None:
    r, b = _ns(runs["r_stats"]), _ns(runs["b_stats"])
    assert r.weights_digest == b.weights_digest and r.model_id != b.model_id
    p = _res(runs["R"], "P")
    assert p["num_cached_tokens"] == 0 and _lookups(runs["r_stats"])[0] == 0
    assert p["tokens"] == _res(runs["R"], "Pcold")["tokens"]


def test_same_weights_and_config_elsewhere_under_another_name_share_blocks(runs) -> None:
    assert _ns(runs["e_stats"]) == _ns(runs["b_stats"])
    p = _res(runs["E"], "P")
    assert _lookups(runs["e_stats"])[0] == 7
    assert p["num_cached_tokens"] == 7 * BLOCK
    assert p["tokens"] == _res(runs["B"], "Pcold")["tokens"]


def test_the_router_computes_the_connectors_namespace_from_outside_vllm(runs, tmp_path) -> None:
    ident = next(s for s in runs["e_stats"] if s["event"] == "identity")
    # what an operator gives the router for this backend: block size, KV and
    # compute dtype, tenant, and the engine layout (device + vLLM's resolved
    # KV cache layout, as the connector logs it)
    assert ident["layout_tag"].startswith("vllm-v1|cpu|")
    # the layout names the engine's vLLM version (an upgrade may change the KV): the router learns it
    # from the backend's GET /version and computes the same tag
    assert ident["engine_version"] and ident["layout_tag"] == vllm_layout_tag(
        "cpu", ident["layout_tag"].split("|")[2], engine_version=ident["engine_version"])
    common = {"block_size": BLOCK, "kv_dtype": "float32", "tenant": "tests", "layout_tag": ident["layout_tag"],
              "compute_dtype": "float32", "digest_cache": str(tmp_path / "digests.json")}
    assert engine_namespace(runs["elsewhere"], **common) == _ns(runs["e_stats"])
    assert engine_namespace(runs["m"], hf_overrides=ROPE, **common) == _ns(runs["r_stats"])
    ns = engine_namespace(runs["m"], **common)
    assert block_keys(ns, P) == block_keys(_ns(runs["b_stats"]), P)
