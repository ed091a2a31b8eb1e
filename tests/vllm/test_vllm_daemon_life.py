"""vLLM keeps serving across its daemon's life: one vLLM process
(tests/vllm/phase.py, engine core in-process) and one real ``kvstore serve``
(Unix socket, SSD in write-back:
a clean stop writes DRAM's blocks to SSD) that the test stops, restarts, pauses
and kills between (or during) vLLM's requests:

- stopped (SIGTERM): a request completes as a miss; restarted on the same
  socket and SSD directory: within a few requests the connector hits P's
  blocks again (from SSD) and saves a new prompt S (S then hits);
- paused (SIGSTOP): a request completes, bounded by the connector's
  timeout; after SIGCONT the connector hits again;
- SIGKILL while a request loads: it completes with the right tokens; the
  daemon restarted, the connector hits again;
- restarted while vLLM is idle (its clients still hold the old run's
  session, socket and shared-memory mappings): hits again within a few
  requests.

Every request's tokens equal its cold run's (float32), and vLLM's log holds
no traceback.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time

import pytest

from kvstore.client import Client
from tests.faults.faultlib import Serve
from tests.support.vllm_servers import VLLM_PY, vllm_env
from tests.vllm.conftest import HERE, require_vllm

pytestmark = pytest.mark.timeout(1500)

BLOCK = 128
rng = random.Random(19)
P = [rng.randrange(3, 1024) for _ in range(1000)]  # 7 full blocks
R = [rng.randrange(3, 1024) for _ in range(700)]
S = [rng.randrange(3, 1024) for _ in range(600)]  # 4 full blocks
U = [rng.randrange(3, 1024) for _ in range(800)]  # 6 full blocks
TIMEOUT = 2.0
RETRY_INTERVAL = 0.5
"""The connector's ``retry_interval``: how long a client that failed waits before it connects again."""
AFTER_RESTART = 4
"""Requests of P after a restart; the last must hit (the connector noticed the new daemon)."""


def _again(name: str, tokens: list[int], n: int, barrier: str = "") -> list[dict]:
    out = [{"name": f"{name}{i}", "tokens": tokens, "reset_prefix_cache": True} for i in range(n)]
    if barrier:
        out[0]["wait_for"] = barrier
    return out


@pytest.fixture(scope="module")
def life(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_vllm()
    work = str(tmp_path_factory.mktemp("vllm-life"))
    sock, ssd = f"{work}/kv.sock", f"{work}/ssd"
    flags = ("--dram", "64MiB", "--ssd", "256MiB", "--ssd-path", ssd)
    env = {"KVSTORE_SSD_ADMIT_MIN_HITS": "0"}
    daemons = [Serve(sock, *flags, env=env).wait_healthy()]
    names = ("down", "up", "stop", "cont", "resume", "kill", "up2", "bounce", "resave")
    bar = {k: f"{work}/{k}" for k in names}
    notes: dict = {}

    def ssd_blocks() -> int:
        with Client(daemons[-1].target) as c:
            return sum(t.blocks for t in c.stats().tiers if t.tier.label == "ssd")

    def at(name: str) -> None:
        deadline = time.monotonic() + 900
        while not os.path.exists(bar[name] + ".ready"):
            if time.monotonic() > deadline:
                raise TimeoutError(name)
            time.sleep(0.02)

    def go(name: str) -> None:
        open(bar[name], "w").close()

    def harness() -> None:
        try:
            at("down")
            daemons[-1].terminate()  # write-back: a clean stop writes the DRAM blocks to SSD first
            go("down")
            at("up")
            time.sleep(2 * RETRY_INTERVAL)  # (R_down's failed calls set the worker's retry interval: see "resave")
            daemons.append(Serve(sock, *flags, env=env).wait_healthy())
            notes["ssd_after_restart"] = ssd_blocks()
            go("up")
            at("stop")
            os.kill(daemons[-1].pid, signal.SIGSTOP)
            go("stop")
            at("cont")
            os.kill(daemons[-1].pid, signal.SIGCONT)
            go("cont")
            at("resume")  # (as at "resave" below: the save that timed out set the worker's retry interval)
            time.sleep(2 * RETRY_INTERVAL)
            go("resume")
            at("kill")
            go("kill")
            time.sleep(0.02)  # the request after the barrier is looking up / loading P's blocks now
            daemons[-1].kill()
            at("up2")
            daemons.append(Serve(sock, *flags, env=env).wait_healthy())
            go("up2")
            at("bounce")  # restarted while vLLM is idle: its clients hold the old run's session and mappings
            daemons[-1].terminate()
            daemons.append(Serve(sock, *flags, env=env).wait_healthy())
            go("bounce")
            # P's requests after the bounce are done: the worker's calls that failed on the old
            # daemon did so before this point, and it connects again only after its retry interval
            # (0.5 s). S's save must come after that however fast those requests ran.
            at("resave")
            time.sleep(2 * RETRY_INTERVAL)
            go("resave")
        except BaseException as e:  # noqa: BLE001 - reported by the test
            notes["harness_error"] = repr(e)
            for b in bar.values():
                open(b, "w").close()

    prompts = [{"name": "P_cold", "tokens": P},
               {"name": "R_cold", "tokens": R, "load": False, "save": False},
               {"name": "S_cold", "tokens": S, "load": False, "save": False},
               {"name": "R_down", "tokens": R, "wait_for": bar["down"], "reset_prefix_cache": True},
               *_again("P_up", P, AFTER_RESTART, bar["up"]),
               {"name": "S_save", "tokens": S, "reset_prefix_cache": True},
               {"name": "S_hit", "tokens": S, "reset_prefix_cache": True},
               {"name": "U_cold", "tokens": U, "load": False, "save": False},
               {"name": "P_stopped", "tokens": P, "wait_for": bar["stop"], "reset_prefix_cache": True},
               {"name": "U_stopped", "tokens": U, "reset_prefix_cache": True},
               *_again("P_cont", P, AFTER_RESTART, bar["cont"]),
               *_again("U_cont", U, 2, bar["resume"]),
               {"name": "P_killed", "tokens": P, "wait_for": bar["kill"], "reset_prefix_cache": True},
               *_again("P_up2_", P, AFTER_RESTART, bar["up2"]),
               *_again("P_bounce", P, AFTER_RESTART, bar["bounce"]),
               *_again("S_bounce", S, 2, bar["resave"])]
    spec = {"model": tiny_model, "target": daemons[0].target, "max_tokens": 16, "dtype": "float32",
            "stats_path": f"{work}/life.jsonl", "extra": {"timeout": TIMEOUT, "retry_interval": RETRY_INTERVAL},
            "prompts": prompts}
    spec_path, out_path = f"{work}/life.spec.json", f"{work}/life.out.json"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    t = threading.Thread(target=harness, daemon=True)
    t.start()
    try:
        p = subprocess.run([VLLM_PY, os.path.join(HERE, "phase.py"), spec_path, out_path],
                           env=vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), capture_output=True, text=True,
                           timeout=1200)
    finally:
        t.join(120)
        for d in daemons:
            try:
                os.kill(d.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            d.kill()
    assert p.returncode == 0 and os.path.exists(out_path), f"vLLM failed (rc {p.returncode}):\n{p.stderr[-6000:]}"
    with open(out_path) as f:
        out = json.load(f)
    res = {r["name"]: r for r in out["results"]}
    with open(f"{work}/life.jsonl") as f:
        stats = [json.loads(line) for line in f if line.strip()]
    return {"res": res, "stats": stats, "log": p.stderr, "notes": notes}


def _faults(life: dict) -> set[str]:
    return {s["op"] for s in life["stats"] if s["event"] == "fault"}


def _hit(r: dict, blocks: int) -> bool:
    return r["num_cached_tokens"] == blocks * BLOCK


def test_every_request_completes_with_its_cold_tokens_and_no_traceback(life) -> None:
    assert "harness_error" not in life["notes"], life["notes"]
    res = life["res"]
    cold = {k: res[f"{k}_cold"]["tokens"] for k in "PRSU"}
    for name, r in res.items():
        assert r["finish_reason"] == "length" and r["tokens"] == cold[name[0]], name
    assert "Traceback" not in life["log"], life["log"][-6000:]
    # the faults were served as misses, counted and logged: the down daemon's lookups and saves
    assert {"lookup", "save"} <= _faults(life)


def test_a_stopped_daemon_is_a_miss_and_a_restarted_one_is_found_again(life) -> None:
    res = life["res"]
    assert life["notes"]["ssd_after_restart"] >= 7
    assert res["R_down"]["num_cached_tokens"] == 0
    # after the restart: P's blocks (from the SSD directory) hit again within a few requests
    assert _hit(res[f"P_up{AFTER_RESTART - 1}"], 7), [res[f"P_up{i}"]["num_cached_tokens"]
                                                       for i in range(AFTER_RESTART)]
    # and new prompts are saved again: S, saved once, hits from the store
    assert _hit(res["S_hit"], 4)


def test_a_paused_daemon_does_not_stall_vllm_and_is_used_again_after(life) -> None:
    res = life["res"]
    # the paused request is bounded by the connector's timeout (a hang guard, not a speed check)
    assert res["P_stopped"]["seconds"] < 20 * TIMEOUT
    assert res["U_stopped"]["seconds"] < 20 * TIMEOUT
    assert _hit(res["U_cont1"], 6)  # saved again once the daemon answers
    assert _hit(res[f"P_cont{AFTER_RESTART - 1}"], 7), [res[f"P_cont{i}"]["num_cached_tokens"]
                                                         for i in range(AFTER_RESTART)]


def test_a_daemon_killed_during_a_load_is_a_miss_and_found_again_after_restart(life) -> None:
    res = life["res"]
    assert _hit(res[f"P_up2_{AFTER_RESTART - 1}"], 7), [res[f"P_up2_{i}"]["num_cached_tokens"]
                                                         for i in range(AFTER_RESTART)]


def test_a_restart_while_vllm_is_idle_is_noticed(life) -> None:
    res = life["res"]
    assert _hit(res[f"P_bounce{AFTER_RESTART - 1}"], 7), [res[f"P_bounce{i}"]["num_cached_tokens"]
                                                           for i in range(AFTER_RESTART)]
    # S lived only in the killed daemon's DRAM (write-back): lost, a miss; saved again, then a hit
    assert res["S_bounce0"]["num_cached_tokens"] == 0 and _hit(res["S_bounce1"], 4)
