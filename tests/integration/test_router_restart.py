"""The router's view of a backend (``router.cache_view.CacheView``) follows
a real ``kvstore serve`` across a restart on the same port: the old run's
blocks are forgotten and the new run's are all there, whatever the two
runs' sequence numbers. No timing: bounded waits on conditions only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

from kvstore.client import Client
from kvstore.errors import Unavailable
from kvstore.keys import Namespace, block_keys
from router.cache_view import CacheView
from tests.faults.faultlib import free_port
from tests.support.waits import wait_healthy, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NS = Namespace(tenant="default", model_id="m", block_size=4)


def serve(port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update({"KVSTORE_SERVER_PORT": str(port), "KVSTORE_METRICS_PORT": "0", "KVSTORE_DRAM_CAPACITY": "16MiB"})
    log = tempfile.TemporaryFile()
    p = subprocess.Popen([sys.executable, "-m", "kvstore", "serve"], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=log)
    wait_healthy(f"127.0.0.1:{port}", 60)
    return p


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def put_chains(target: str, seed: int, n: int) -> list[list[bytes]]:
    """``n`` one-block puts (``n`` events), each a chain of its own."""
    chains = [block_keys(NS, np.arange(4, dtype=np.int64) + 10_000 * seed + 4 * i) for i in range(n)]
    with Client(target, use_shm=False, session=False) as c:
        # (a channel to a port that just came back may still be backing off from the refused connects)
        wait_until(lambda: answers(c), 30, "the daemon takes calls")
        for keys in chains:
            c.put(NS, keys, [b"x" * 64])
    return chains


def answers(c: Client) -> bool:
    try:
        c.lookup(NS, [])
        return True
    except Unavailable:
        return False


def held(view: CacheView, chains: list[list[bytes]]) -> int:
    return sum(int(view.chain_tiers(keys).size) for keys in chains)


def test_a_restarted_daemon_replaces_the_routers_view_of_it() -> None:
    """The router follows a daemon; blocks are put; the daemon restarts with
    other contents. The view drops every block of the old run and holds all
    of the new run's: also when the view saw the new run's Gap before the
    new run had as many events as the old one (before: it resumed from the
    old run's sequence in the new run and skipped the new run's first
    events)."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    p = serve(port)
    view = CacheView("e", target)
    try:
        old = put_chains(target, 1, 30)
        with Client(target, use_shm=False, session=False) as c:
            wait_until(lambda: view.poll(c, 0.2) >= 0 and held(view, old) == 30, 30, "the view holds run 1")
        first_run = view.run_id
        stop(p)
        p = serve(port)  # a new run on the same port, empty
        with Client(target, use_shm=False, session=False) as c:
            wait_until(lambda: view.poll(c, 0.2) >= 0 and view.run_id != first_run, 30, "the view sees run 2")
            assert held(view, old) == 0  # the old run's blocks are gone at once
            new = put_chains(target, 2, 40)  # more events than run 1 had when the view last resumed
            wait_until(lambda: view.poll(c, 0.2) >= 0 and view.seq >= 40, 30, "the view caught up")
            assert held(view, old) == 0
            assert held(view, new) == 40, held(view, new)
            assert view.held_blocks() == 40
    finally:
        view.stop()
        stop(p)


def test_the_routers_follower_thread_tracks_a_restart() -> None:
    """The same through the router's own follower thread (``start``)."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    p = serve(port)
    view = CacheView("e", target)
    view.start()
    try:
        old = put_chains(target, 3, 5)
        wait_until(lambda: held(view, old) == 5, 30, "the view holds run 1")
        first_run = view.run_id
        stop(p)
        p = serve(port)
        new = put_chains(target, 4, 3)
        wait_until(lambda: view.run_id != first_run and held(view, new) == 3, 30, "the view follows run 2")
        assert held(view, old) == 0 and view.held_blocks() == 3
    finally:
        view.stop()
        stop(p)


def test_the_engine_side_prefix_router_resumes_a_new_run_from_its_start() -> None:
    """``engine_adapter.router.PrefixRouter`` follows the same numbers: after
    a restart it holds all of the new run's blocks, none of the old's."""
    from engine_adapter.router import PrefixRouter

    port = free_port()
    target = f"127.0.0.1:{port}"
    p = serve(port)
    r = PrefixRouter()
    try:
        put_chains(target, 5, 30)
        with Client(target, use_shm=False, session=False) as c:
            wait_until(lambda: r.poll("e", c, 0.2) >= 0 and r.known_blocks("e") == 30, 30, "the router holds run 1")
        first_run = r.run_ids["e"]
        stop(p)
        p = serve(port)
        with Client(target, use_shm=False, session=False) as c:
            wait_until(lambda: r.poll("e", c, 0.2) >= 0 and r.run_ids["e"] != first_run, 30, "run 2 seen")
            assert r.known_blocks("e") == 0
            put_chains(target, 6, 40)
            wait_until(lambda: r.poll("e", c, 0.2) >= 0 and r.seq["e"] >= 40, 30, "the router caught up")
            assert r.known_blocks("e") == 40  # (before: 10, the events after run 1's last number)
    finally:
        stop(p)
