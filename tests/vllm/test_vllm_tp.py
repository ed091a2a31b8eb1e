"""kvstore as vLLM's external KV cache under tensor parallelism (issue 16).

Connector level (tests/vllm/tp_check.py, no engine): rank 0 of a 2-rank
group writes its shard of 3 blocks while rank 1 never writes: whether rank 1
reports a failure, its process dies inside the collective, or rank 0's own
process is killed mid-save, no block becomes visible and the daemon holds no
reservation afterwards. When the peer agrees, the slot holds rank 0's shard
in its first half (the layout: shard r at ``[r * shard, (r + 1) * shard)``,
then the seal), and rank 0 loads it back, scattered or staged.

Real vLLM (tests/vllm/phase.py, float32, in-process engine core, the tiny
Llama with 2 KV heads, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``), one daemon:

- A, TP=2 (cold): generates for a 1,000-token prompt P; rank 0 reserves,
  both ranks write their shard (one KV head each), rank 0 commits 7 blocks.
- D, TP=1: P finds none of A's blocks (the namespace carries ``tp_size``),
  computes, saves its own 7 blocks, and after vLLM's prefix cache is reset
  loads them back: both sizes work on one daemon and never share blocks.
  Its greedy tokens equal the TP=2 run's.
- B, TP=2 (fresh process): P hits all 7 blocks on both ranks; same tokens
  as A. Then the test flips one bit in rank 1's shard of block 3 (in the
  daemon's DRAM slot); after vLLM's prefix cache is reset, P again: rank 1
  loads blocks 0-2 and reports 3-6 as load errors (each rank checks only
  its shard, against the block's seal), vLLM merges the ranks' reports and
  recomputes 3-6 on both: the same tokens again.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading

import pytest

from bench.vllm import group_steps
from kvstore.client import Client
from kvstore.client.shards import seal_bytes
from kvstore.keys import Namespace, block_keys
from tests.integration.conftest import DaemonThread, wait_healthy, wait_until
from tests.vllm.conftest import HERE, VLLM_PY, require_vllm, run_phase, vllm_env

pytestmark = pytest.mark.timeout(1800)

BLOCK = 128
NEW = 16
rng = random.Random(16)
P = [rng.randrange(3, 1024) for _ in range(1000)]  # 7 full blocks
TP2 = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
TP1 = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _res(run: dict, name: str) -> list[dict]:
    return [r for r in run["results"] if r["name"] == name]


def _events(stats: list[dict], event: str, **match: object) -> list[dict]:
    return [s for s in stats if s["event"] == event and all(s.get(k) == v for k, v in match.items())]


def _ns(stats: list[dict]) -> Namespace:
    found = {json.dumps(s["namespace"], sort_keys=True) for s in stats if s["event"] == "identity"}
    assert len(found) == 1, found  # the scheduler and every worker rank name the same namespace
    return Namespace.from_dict(json.loads(found.pop()))


# ------------------------------------------------------------ connector level
def test_a_rank_that_never_writes_its_shard_leaves_no_block(tmp_path) -> None:
    require_vllm()
    d = DaemonThread({"dram.capacity": "16MiB"})
    try:
        wait_healthy(d.target)
        out = tmp_path / "tp.json"
        # one process (one vLLM import) for every mode; ``exit`` kills it last
        p = subprocess.run([VLLM_PY, os.path.join(HERE, "tp_check.py"), d.target, "fail,raise,agree,staged,exit",
                            str(out)],
                           env=vllm_env(), capture_output=True, text=True, timeout=600)
        assert p.returncode == 17, p.stderr[-4000:]
        res = json.loads(out.read_text())
        assert res["fail"]["raised"] is None and res["fail"]["reduced"] == 1
        assert "rank 1 died" in res["raise"]["raised"] and res["raise"]["reduced"] == 1
        with Client(d.target) as c:
            # aborted (fail, raise) or reclaimed with the killed process's session (exit)
            wait_until(lambda: c.stats(False).active_reservations == 0, timeout=60, what="the reservations to go")
            for mode in ("fail", "raise", "exit"):
                r = res[mode]
                ns, keys = Namespace.from_dict(r["ns"]), [bytes.fromhex(k) for k in r["keys"]]
                assert ns.tp_size == 2 and r["block_bytes"] == 2 * r["shard_bytes"] + seal_bytes(2)
                assert c.lookup(ns, keys).hit_blocks == 0, mode
            # the peer agrees: the block is stored, rank 0's shard in the first half of the slot; rank 0
            # loads it back (straight into its pages, or staged) from its shard and its entry in the
            # seal, though rank 1 never wrote its shard
            for mode in ("agree", "staged"):
                r = res[mode]
                ns, keys = Namespace.from_dict(r["ns"]), [bytes.fromhex(k) for k in r["keys"]]
                assert r["raised"] is None and r["stats"]["saved_blocks"] == 3, mode
                assert c.lookup(ns, keys).hit_blocks == 3
                got = c.get(ns, keys)
                assert [len(g) for g in got] == [r["block_bytes"]] * 3
                assert b"".join(bytes(g[:r["shard_bytes"]]) for g in got) == bytes.fromhex(r["shard"]), mode
                assert r["load_errors"] == [] and r["stats"]["loaded_blocks"] == 3, mode
                assert r["loaded"] == r["shard"], mode
    finally:
        d.stop()


# ------------------------------------------------------------------ real vLLM
@pytest.fixture(scope="module")
def runs(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_vllm()
    work = str(tmp_path_factory.mktemp("vllm-tp"))
    d = DaemonThread({"dram.capacity": "64MiB"})
    out: dict = {"work": work}
    try:
        wait_healthy(d.target)
        base = {"model": tiny_model, "target": d.target, "max_tokens": NEW, "dtype": "float32"}
        out["A"] = run_phase({**base, "stats_path": f"{work}/a.jsonl", "prefix_caching": False,
                              "llm_kwargs": {"tensor_parallel_size": 2},
                              "prompts": [{"name": "P", "tokens": P}]}, work, "A", **TP2)
        out["a_stats"] = _records(f"{work}/a.jsonl")
        out["D"] = run_phase({**base, "stats_path": f"{work}/d.jsonl", "prompts": [
            {"name": "P", "tokens": P}, {"name": "P", "tokens": P, "reset_prefix_cache": True}]}, work, "D", **TP1)
        out["d_stats"] = _records(f"{work}/d.jsonl")
        ns2 = _ns(out["a_stats"])
        key3 = block_keys(ns2, P)[3]
        failures0 = d.call(lambda: d.store.counters.checksum_failures)
        barrier = f"{work}/flipped"

        def flip_when_ready() -> None:
            wait_until(lambda: os.path.exists(barrier + ".ready"), timeout=1200, what="run B's first phase")
            with Client(d.target) as c:
                lease = c.acquire(ns2, [key3])
                length = int(lease.lengths[0])
                lease.release()

            def flip() -> None:  # one bit of rank 1's shard (the slot's second half) of block 3
                st = d.store
                row = next(int(r) for r in st.index.used_rows().tolist() if st.index.key_of(int(r)) == key3)
                st.dram.corrupt_for_test(st.index.offset(row), (length // 2 + 12345) * 8 + 3)

            d.call(flip)
            out["block_bytes"] = length
            open(barrier, "w").close()

        t = threading.Thread(target=flip_when_ready, daemon=True)
        t.start()
        out["B"] = run_phase({**base, "stats_path": f"{work}/b.jsonl", "llm_kwargs": {"tensor_parallel_size": 2},
                              "prompts": [{"name": "P", "tokens": P},
                                          {"name": "P", "tokens": P, "wait_for": barrier,
                                           "reset_prefix_cache": True}]}, work, "B", **TP2)
        t.join(30)
        out["b_stats"] = _records(f"{work}/b.jsonl")
        out["checksum_failures"] = d.call(lambda: d.store.counters.checksum_failures) - failures0
        yield out
    finally:
        d.stop()


def test_tp2_saves_one_slot_per_block_with_both_shards(runs) -> None:
    a = _res(runs["A"], "P")[0]
    assert a["num_cached_tokens"] == 0 and len(a["tokens"]) == NEW
    ns = _ns(runs["a_stats"])
    assert ns.tp_size == 2
    # rank 0 committed the 7 blocks once both ranks had written their shards
    saves = _events(runs["a_stats"], "save")
    assert {s["rank"] for s in saves} == {0}
    assert sum(s["stored_blocks"] for s in saves) == len(P) // BLOCK == 7
    shards = _events(runs["a_stats"], "save_shards")
    assert {s["rank"] for s in shards} == {0, 1} and {s["blocks"] for s in shards} == {7}
    # rank 0 sent the Reserve before the forward (reserve_ahead) and read its answer after
    assert all(s["reserved_ahead"] for s in shards if s["rank"] == 0)


def test_fresh_tp2_process_loads_every_shard_and_generates_the_same_tokens(runs) -> None:
    b = _res(runs["B"], "P")[0]
    assert b["num_cached_tokens"] == 7 * BLOCK
    assert b["tokens"] == _res(runs["A"], "P")[0]["tokens"]
    lookups = _events(runs["b_stats"], "lookup")
    assert lookups[0]["hit_blocks"] == 7  # one lookup per prompt, for both ranks (the scheduler's)
    first = [(s["rank"], s["planned_blocks"], s["loaded_blocks"]) for s in _events(runs["b_stats"], "load")][:2]
    assert sorted(first) == [(0, 7, 7), (1, 7, 7)]
    # each rank's load_step carries its start on the system-wide clock, so bench/vllm.py lines the
    # ranks' steps up: the first group is both ranks' 7 shards
    steps = [s for s in _events(runs["b_stats"], "load_step") if s["loaded_blocks"] == 7][:2]
    assert sorted(s["rank"] for s in steps) == [0, 1] and all(s["at"] > 0 for s in steps)
    group = group_steps(runs["b_stats"], 2, within_s=5.0)[0]
    assert group[0] == sum(s["bytes"] for s in steps) and group[1] >= max(s["ms"] for s in steps) / 1000 - 1e-9


def test_tp2_tokens_equal_tp1_tokens_in_float32(runs) -> None:
    d = _res(runs["D"], "P")
    assert d[0]["tokens"] == _res(runs["A"], "P")[0]["tokens"] == d[1]["tokens"]


def test_one_damaged_shard_is_recomputed_on_both_ranks(runs) -> None:
    again = _res(runs["B"], "P")[1]
    assert again["tokens"] == _res(runs["A"], "P")[0]["tokens"]
    loads = [(s["rank"], s["planned_blocks"], s["loaded_blocks"]) for s in _events(runs["b_stats"], "load")]
    # rank 1 fails block 3 (its shard's checksum in the seal) and reports it; rank 0 checks only its
    # own shard, so it loads all 7 unless rank 1's report made the daemon drop block 3 first. vLLM
    # merges the ranks' errors and recomputes blocks 3-6 on both ranks either way (same tokens above)
    assert sorted(loads[2:4]) in ([(0, 7, 7), (1, 7, 3)], [(0, 7, 3), (1, 7, 3)])
    assert runs["checksum_failures"] >= 1
    # after vLLM recomputed them the connector stored the dropped block 3 again
    assert sum(s["stored_blocks"] for s in _events(runs["b_stats"], "save")) >= 1


def test_tp1_and_tp2_never_share_blocks_and_both_work(runs) -> None:
    ns1, ns2 = _ns(runs["d_stats"]), _ns(runs["a_stats"])
    assert (ns1.tp_size, ns2.tp_size) == (1, 2) and ns1 != ns2
    assert block_keys(ns1, P) != block_keys(ns2, P)
    lookups = _events(runs["d_stats"], "lookup")
    assert lookups[0]["hit_blocks"] == 0  # A's TP=2 blocks are not the TP=1 process's
    assert sum(s["stored_blocks"] for s in _events(runs["d_stats"], "save")) == 7
    d = _res(runs["D"], "P")
    assert d[0]["num_cached_tokens"] == 0 and d[1]["num_cached_tokens"] == 7 * BLOCK  # its own blocks back
    assert [(s["planned_blocks"], s["loaded_blocks"]) for s in _events(runs["d_stats"], "load")] == [(7, 7)]
    # and B (TP=2, after D) hit A's TP=2 blocks, not D's
    assert _events(runs["b_stats"], "lookup")[0]["hit_blocks"] == 7
