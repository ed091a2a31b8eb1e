"""kvstore as vLLM's external KV cache, end to end: real vLLM processes
(tests/vllm/phase.py, run with .venv-vllm's python) on a tiny Llama, one
real daemon started here.

- A (cold): generates for a 1,000-token prompt P; the connector saves its 7
  full blocks (block size 128). A also computes the cold references of Q
  (shares P's first 400 tokens) and R (unrelated) with loads and saves off,
  and vLLM's own prefix cache off.
- B (fresh process, blocks as inline gRPC bytes instead of the slab): Q
  first: only the shared prefix (3 blocks) hits; then P: its cached tokens
  are external hits and the greedy tokens equal A's.
  The blocks B's connector stored reach vLLM's KV event stream (medium
  "kvstore"); a PrefixRouter fed by the daemon's WatchEvents after A knows
  where P's and Q's prefixes are.
- the test flips a bit in P's block 4 in the daemon's DRAM slot
  (``corrupt_for_test``, as tests/faults does);
- C (fresh process): P again: blocks 0-3 load, block 4 fails its checksum,
  so blocks 4-6 are reported as load errors and recomputed: same tokens as
  the cold run. Then the daemon is stopped and C runs R: no external hit,
  the request still completes with R's cold tokens.
"""

from __future__ import annotations

import json
import os
import random
import threading

import pytest

from engine_adapter.router import PrefixRouter
from kvstore.client import Client
from kvstore.keys import Namespace
from kvstore.results import EventKind
from tests.integration.conftest import DaemonThread, wait_healthy, wait_until
from tests.vllm.conftest import require_vllm, run_phase

pytestmark = pytest.mark.timeout(1500)

BLOCK = 128
rng = random.Random(7)
P = [rng.randrange(3, 1024) for _ in range(1000)]
Q = P[:400] + [rng.randrange(3, 1024) for _ in range(600)]
R = [rng.randrange(3, 1024) for _ in range(700)]
NEW = 16
T = [rng.randrange(3, 1024) for _ in range(300)]  # multi-turn chat: turn 1's prompt
GEN = 85  # T + 85 generated: 384 tokens with KV (the last sampled has none): block 2 = 44 prompt + 84 generated


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _chain_keys(d: DaemonThread) -> list[bytes]:
    """The keys of the first chain the daemon stored (P's), in order, read
    from its own event stream (WatchEvents replays from sequence 0)."""
    keys: list[bytes] = []
    with Client(d.target) as c:
        for ev in c.watch_events(after_seq=0, timeout=1.0):
            if ev.kind is not EventKind.STORED:
                continue
            if not keys or ev.parent == keys[-1]:
                keys += list(ev.keys)
    return keys


@pytest.fixture(scope="module")
def runs(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_vllm()
    work = str(tmp_path_factory.mktemp("vllm-runs"))
    d = DaemonThread({"dram.capacity": "64MiB"})
    out: dict = {"work": work}
    try:
        wait_healthy(d.target)
        base = {"model": tiny_model, "target": d.target, "max_tokens": NEW, "dtype": "float32"}
        # in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): one vLLM
        # import per run instead of three; the connector's plan still goes
        # from its scheduler instance to its worker instance as metadata
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        out["A"] = run_phase({**base, "stats_path": f"{work}/a.jsonl", "prefix_caching": False, "prompts": [
            {"name": "P", "tokens": P},
            {"name": "T", "tokens": T, "max_tokens": GEN},
            {"name": "Q", "tokens": Q, "load": False, "save": False},
            {"name": "R", "tokens": R, "load": False, "save": False}]}, work, "A", **env)
        out["a_stats"] = _records(f"{work}/a.jsonl")
        out["keys"] = _chain_keys(d)
        router = PrefixRouter()
        with Client(d.target) as c:
            router.poll("node-a", c, 0.5)
        out["router_after_a"] = router
        # B moves blocks as inline gRPC bytes (use_shm false: the path of a
        # daemon on another host); A's saves and C's loads use the slab
        out["B"] = run_phase({**base, "stats_path": f"{work}/b.jsonl", "kv_events": f"ipc://{work}/kv-events",
                              "extra": {"use_shm": False},
                              "prompts": [
            {"name": "Q", "tokens": Q}, {"name": "P", "tokens": P}]}, work, "B", **env)
        out["b_stats"] = _records(f"{work}/b.jsonl")
        # tamper: one bit of P's block 4, in the daemon's DRAM slot
        key4 = out["keys"][4]

        def flip() -> None:
            st = d.store
            rows = st.index.used_rows()
            row = next(int(r) for r in rows.tolist() if st.index.key_of(int(r)) == key4)
            st.dram.corrupt_for_test(st.index.offset(row), 12345)

        d.call(flip)
        failures0 = d.call(lambda: d.store.counters.checksum_failures)
        barrier = f"{work}/daemon-stopped"

        def stop_daemon_when_ready() -> None:
            wait_until(lambda: os.path.exists(barrier + ".ready"), timeout=900, what="run C's first phase")
            out["checksum_failures"] = d.call(lambda: d.store.counters.checksum_failures) - failures0
            d.stop()
            open(barrier, "w").close()

        t = threading.Thread(target=stop_daemon_when_ready, daemon=True)
        t.start()
        # turn 2 of the chat: T + A's answer + a new question; then its cold reference
        t2 = T + _res(out["A"], "T")["tokens"] + [rng.randrange(3, 1024) for _ in range(10)]
        out["T2"] = t2
        out["C"] = run_phase({**base, "stats_path": f"{work}/c.jsonl", "prompts": [
            {"name": "T2", "tokens": t2}, {"name": "P", "tokens": P},
            {"name": "T2cold", "tokens": t2, "load": False, "save": False, "reset_prefix_cache": True},
            {"name": "R", "tokens": R, "wait_for": barrier}]}, work, "C", **env)
        t.join(30)
        out["c_stats"] = _records(f"{work}/c.jsonl")
        yield out
    finally:
        d.stop()


def _res(run: dict, name: str) -> dict:
    return next(r for r in run["results"] if r["name"] == name)


def _events(stats: list[dict], event: str) -> list[dict]:
    return [s for s in stats if s["event"] == event]


def test_cold_run_saves_the_prompt_blocks(runs) -> None:
    a = _res(runs["A"], "P")
    assert a["num_cached_tokens"] == 0 and len(a["tokens"]) == NEW
    saves = _events(runs["a_stats"], "save")
    # P's 7 prompt blocks + T's 3 (2 prompt-only, 1 holding generated tokens); Q and R opted out
    assert sum(s["stored_blocks"] for s in saves) == len(P) // BLOCK + (len(T) + GEN - 1) // BLOCK == 10
    # T's block 2 fills in its very last step: with async scheduling (vLLM's
    # default on GPU; the CPU platform turns it off) that token's id is
    # unknown when the step is planned, so the block goes as the finished
    # request's tail save (blocks kept until done); without it, in that step
    # each save step sent its Reserves before the forward and read the
    # answers after it, and gathered the blocks from the KV tensors straight
    # into the slots (the CPU layout is one the scatter layout knows); the
    # blocks a fresh process loads from them give the same tokens (below)
    steps = _events(runs["a_stats"], "save_step")
    assert steps and all(s["reserved_ahead"] and s["gathered"] for s in steps)
    assert sum(s["blocks"] for s in steps) == 10
    tails = _events(runs["a_stats"], "tail")
    if _events(runs["a_stats"], "init")[0]["async_scheduling"]:
        assert [(t["first"], t["blocks"]) for t in tails] == [(2, 1)]
        assert [s["stored_blocks"] for s in saves if s["req"] == tails[0]["req"]][-1] == 1
    else:
        assert tails == []
    assert len(runs["keys"]) == 7
    # the router, fed by the daemon's WatchEvents, knows node-a holds P's 7 blocks
    ns = Namespace.from_dict(_events(runs["a_stats"], "identity")[0]["namespace"])
    ranked = runs["router_after_a"].rank(ns, P)
    assert [(h.endpoint, h.blocks) for h in ranked] == [("node-a", 7)]
    assert [(h.endpoint, h.blocks) for h in runs["router_after_a"].rank(ns, Q)] == [("node-a", 3)]
    assert runs["router_after_a"].rank(ns, R) == []


def test_fresh_process_loads_the_prompt_and_generates_the_same_tokens(runs) -> None:
    b = _res(runs["B"], "P")
    assert b["tokens"] == _res(runs["A"], "P")["tokens"]
    assert b["num_cached_tokens"] == 7 * BLOCK
    lookups = {s["req"]: s for s in _events(runs["b_stats"], "lookup")}
    loads = _events(runs["b_stats"], "load")
    # Q went first and loaded the shared 3 blocks; P's other 4 came from kvstore too
    p_lookup = [s for s in lookups.values() if s["local_tokens"] == 3 * BLOCK]
    assert len(p_lookup) == 1 and p_lookup[0]["hit_blocks"] == 7 and p_lookup[0]["external_tokens"] == 4 * BLOCK
    assert sorted((s["planned_blocks"], s["loaded_blocks"]) for s in loads) == [(3, 3), (4, 4)]


def test_prompt_sharing_only_a_prefix_hits_only_that_prefix(runs) -> None:
    q = _res(runs["B"], "Q")
    assert q["num_cached_tokens"] == 3 * BLOCK  # 400 shared tokens = 3 full blocks
    first = _events(runs["b_stats"], "lookup")[0]
    assert (first["local_tokens"], first["hit_blocks"], first["external_tokens"]) == (0, 3, 3 * BLOCK)
    assert q["tokens"] == _res(runs["A"], "Q")["tokens"]


def test_saved_blocks_are_forwarded_as_vllm_kv_events(runs) -> None:
    # B's Q stored its blocks 3-6 (0-2 were loaded): one BlockStored with
    # medium "kvstore" named by vLLM's own block hashes, parent = block 2
    ours = [e for e in runs["B"]["kv_events"] if e["medium"] == "kvstore"]
    assert [(e["type"], e["blocks"], e["tokens"], e["has_parent"]) for e in ours] == \
        [("BlockStored", 4, 4 * BLOCK, True)]
    assert any(e["medium"] != "kvstore" for e in runs["B"]["kv_events"])  # vLLM's own events flow beside


def test_tampered_block_is_a_miss_and_recomputed(runs) -> None:
    c = _res(runs["C"], "P")
    assert c["tokens"] == _res(runs["A"], "P")["tokens"]
    loads = _events(runs["c_stats"], "load")
    assert [(s["planned_blocks"], s["loaded_blocks"]) for s in loads] == [(3, 3), (7, 4)]  # T2 first, then P
    assert runs["checksum_failures"] >= 1
    # after vLLM recomputed blocks 4-6 the connector stored the dropped block again
    saves = _events(runs["c_stats"], "save")
    assert sum(s["stored_blocks"] for s in saves) >= 1


def test_daemon_down_is_no_hit_not_a_failed_request(runs) -> None:
    r = _res(runs["C"], "R")
    assert r["finish_reason"] == "length" and r["tokens"] == _res(runs["A"], "R")["tokens"]
    assert r["num_cached_tokens"] == 0
    assert _events(runs["c_stats"], "fault")


def test_next_chat_turn_hits_the_blocks_of_the_previous_answer(runs) -> None:
    # A saved T's block 2 (44 prompt + 84 generated tokens);
    # C (fresh process) sends T + A's answer + 10 new tokens: all 3 full
    # blocks come from kvstore, the third covering generated tokens
    assert len(_res(runs["A"], "T")["tokens"]) == GEN
    t2 = _res(runs["C"], "T2")
    assert len(runs["T2"]) == len(T) + GEN + 10
    first = _events(runs["c_stats"], "lookup")[0]
    assert (first["prompt_blocks"], first["hit_blocks"], first["external_tokens"]) == (3, 3, 3 * BLOCK)
    assert t2["num_cached_tokens"] == 3 * BLOCK > len(T)
    cold = _res(runs["C"], "T2cold")
    assert cold["num_cached_tokens"] == 0
    assert t2["tokens"] == cold["tokens"] and len(t2["tokens"]) == NEW
