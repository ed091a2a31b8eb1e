"""The SSD tier through the daemon: restart recovery, prefetch, SIGKILL
during heavy writes (every block returned afterwards is byte-exact), and a
data directory of an unknown schema refused at start."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time


from kvstore.client import Client
from kvstore.errors import KeyStatus, KVStoreError
from kvstore.keys import Namespace
from tiers.base import TierKind
from proto import kvstore_pb2 as pb
from tests.conftest import payload_for
from tests.integration.conftest import wait_healthy, wait_until
from tests.support.keys import chain_keys

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BS = 64 * 1024


def P(k: bytes) -> bytes:
    return payload_for(b"ssd", k, BS)


def test_restart_recovers_blocks_on_ssd_and_prefetch_stages_them(make_daemon, tmp_path):
    over = dict(dram__capacity="4MiB", dram__page_size="1MiB", ssd__capacity="64MiB",
                ssd__path=str(tmp_path / "ssd"), ssd__write_mode="through", ssd__admit_min_hits=0)
    d = make_daemon(**over)
    keys = chain_keys(1, 12)
    with Client(d.target) as c:
        assert c.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 12
    wait_until(lambda: d.call(lambda: int((d.store.index.ssd_loc[d.store.index.used_rows()] >= 0).sum())) == 12,
               what="write-through copies")
    d.stop()
    d2 = make_daemon(**over)
    assert d2.store.recovery.blocks == 12
    with Client(d2.target) as c:
        look = c.lookup(NS, keys)
        assert look.hit_blocks == 12 and look.tiers == [TierKind.SSD] * 12
        r = c._call(c.stub.Prefetch, pb.PrefetchRequest(ns=__import__("kvstore.client").client.ns_pb(NS),
                                                         keys=keys[:6]))
        assert (r.hit_blocks, r.in_dram, r.queued) == (6, 0, 6)
        wait_until(lambda: c.lookup(NS, keys[:6]).tiers == [TierKind.DRAM] * 6, what="prefetch")
        got = c.get(NS, keys)  # the rest is promoted by Acquire
        assert [g.tobytes() for g in got] == [P(k) for k in keys]
        st = c.stats()
        tiers = {t.tier: t.blocks for t in st.tiers}
        assert tiers == {TierKind.DRAM: 12, TierKind.SSD: 0}  # promoted (their SSD copies kept)
        # what the SSD tier takes on disk reaches the client (it was always 0 there: no field on the wire)
        ssd = st.tier(TierKind.SSD)
        assert ssd is not None and ssd.used_bytes >= 12 * BS
        assert ssd.disk_bytes == d2.call(lambda: d2.store.ssd.tier.disk_bytes) >= ssd.used_bytes
        assert st.tier(TierKind.DRAM).disk_bytes == st.tier(TierKind.DRAM).used_bytes  # type: ignore[union-attr]


def _serve(repo_root: str, sock: str, ssd_dir: str) -> subprocess.Popen[str]:
    env = dict(os.environ, KVSTORE_SSD_WRITE_MODE="back", KVSTORE_SSD_ADMIT_MIN_HITS="0",
               KVSTORE_DRAM_PAGE_SIZE="1MiB")
    # the daemon's log goes to a file (a pipe nobody reads would block it once full)
    log = open(sock + ".log", "a")
    try:
        return subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--host", "", "--unix-socket", sock,
                                 "--metrics-port", "0", "--dram", "4MiB", "--ssd", "48MiB", "--ssd-path", ssd_dir],
                                cwd=repo_root, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    finally:
        log.close()


def _wait_healthy(p: subprocess.Popen[str], sock: str) -> None:
    """Wait for the daemon; if it never gets there, fail with its log."""
    try:
        wait_healthy(f"unix:{sock}", timeout=120)
    except BaseException:
        with open(sock + ".log") as f:
            tail = f.read()[-4000:]
        raise AssertionError(f"daemon not healthy (exit code {p.poll()}); its log ends:\n{tail}") from None


def test_sigkill_during_heavy_writes_never_returns_wrong_bytes(tmp_path, repo_root):
    rounds = int(os.environ.get("KVSTORE_KILL_ROUNDS", "20"))
    sock = str(tmp_path / "kv.sock")
    ssd_dir = str(tmp_path / "ssd")
    rng = random.Random(7)
    written: list[list[bytes]] = []
    recovered_total = 0
    for rnd in range(rounds):
        p = _serve(repo_root, sock, ssd_dir)
        try:
            _wait_healthy(p, sock)
            with Client(f"unix:{sock}", timeout=10) as c:
                # everything written before, whatever survived, is exact or a miss
                for keys in written:
                    for k, g in zip(keys, c.get(NS, keys)):
                        assert g is None or g.tobytes() == P(k), f"round {rnd}: wrong bytes"
                recovered_total += c.lookup(NS, written[0]).hit_blocks if written else 0
                stop = threading.Event()

                def writer(seed: int) -> None:
                    i = 0
                    while not stop.is_set():
                        keys = chain_keys(seed * 1000 + i, 8)
                        written.append(keys)
                        try:
                            c.put(NS, keys, [P(k) for k in keys])
                        except KVStoreError:
                            return  # the daemon is gone
                        i += 1

                t = threading.Thread(target=writer, args=(rnd,), daemon=True)
                t.start()
                time.sleep(rng.uniform(0.05, 0.6))  # a random moment during the writes
                p.send_signal(signal.SIGKILL)
                p.wait(30)
                stop.set()
                t.join(30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    # a final check on a clean start
    p = _serve(repo_root, sock, ssd_dir)
    try:
        _wait_healthy(p, sock)
        hits = 0
        with Client(f"unix:{sock}") as c:
            for keys in written:
                for k, g in zip(keys, c.get(NS, keys)):
                    assert g is None or g.tobytes() == P(k)
                    hits += g is not None
        assert hits > 0  # the tier did keep blocks across kills
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0


def test_unknown_schema_refuses_to_start(tmp_path, repo_root):
    ssd_dir = tmp_path / "ssd"
    ssd_dir.mkdir(mode=0o700)
    (ssd_dir / "SCHEMA").write_text("kvstore-ssd-tier\nschema 99\n")
    sock = str(tmp_path / "kv.sock")
    p = _serve(repo_root, sock, str(ssd_dir))
    try:
        assert p.wait(60) != 0
        with open(sock + ".log") as f:
            err = f.read()
        assert "schema" in err.lower()
        assert "Traceback" not in err
    finally:
        if p.poll() is None:
            p.kill()
