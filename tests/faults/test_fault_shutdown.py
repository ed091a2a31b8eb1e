"""Clean shutdown and restarts (issue 19, items 4 and 5): in write-back mode
a SIGTERM flushes the blocks that live only in DRAM to SSD before the daemon
exits, so a restart finds every block; a SIGKILLed daemon's slab does not
outlive it once its successor starts."""

from __future__ import annotations

import os
import subprocess
import time

from kvstore.client import Client
from kvstore.errors import KeyStatus
from kvstore.keys import Namespace
from tests.conftest import payload_for
from tests.faults.faultlib import Serve, record
from tests.support.keys import chain_keys

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BS = 64 * 1024


def P(k: bytes) -> bytes:
    return payload_for(b"term", k, BS)


def _hits(c: Client, chains: list[list[bytes]]) -> tuple[int, int]:
    hits = wrong = 0
    for keys in chains:
        for k, g in zip(keys, c.get(NS, keys)):
            hits += g is not None
            wrong += g is not None and g.tobytes() != P(k)
    return hits, wrong


def test_sigterm_in_write_back_mode_keeps_every_block(tmp_path) -> None:
    """512 blocks of 64 KiB through a 16 MiB DRAM tier in write-back mode:
    about half are demoted (the leaves), half live only in DRAM (their
    parents). SIGTERM, restart: all 512 are hits with their bytes (the old
    daemon kept 256: the DRAM-only parents were lost, and their demoted
    children dropped as orphans at restart)."""
    sock = str(tmp_path / "kv.sock")
    ssd = str(tmp_path / "ssd")
    flags = ("--dram", "16MiB", "--ssd", "256MiB", "--ssd-path", ssd)
    env = {"KVSTORE_DRAM_PAGE_SIZE": "1MiB", "KVSTORE_SSD_WRITE_MODE": "back", "KVSTORE_SSD_ADMIT_MIN_HITS": "0",
           "KVSTORE_LOG_LEVEL": "info"}
    chains = [chain_keys(900 + i, 32) for i in range(16)]
    s = Serve(sock, *flags, env=env, stderr=subprocess.PIPE).wait_healthy()
    try:
        with Client(s.target) as c:
            for keys in chains:
                assert c.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 32
            tiers = {t.tier.label: t.blocks for t in c.stats().tiers}
        assert tiers["dram"] < 512  # some blocks live only in DRAM, the rest were demoted
        t0 = time.perf_counter()
        assert s.terminate() == 0
        stop_s = time.perf_counter() - t0
        err = s.proc.stderr.read() if s.proc.stderr else ""
    finally:
        s.kill()
    s2 = Serve(sock, *flags, env=env).wait_healthy()
    try:
        with Client(s2.target) as c:
            hits, wrong = _hits(c, chains)
    finally:
        s2.terminate()
    record("sigterm_write_back", blocks=512, dram_blocks_at_sigterm=tiers["dram"], survived=hits,
           wrong_bytes=wrong, stop_seconds=round(stop_s, 2))
    assert wrong == 0
    assert hits == 512
    assert "flushed" in err, err[-2000:]


def test_a_restart_removes_the_slab_of_a_killed_predecessor(tmp_path) -> None:
    """SIGKILL leaves the daemon's slab in /dev/shm; the next daemon with the
    same identity (its SSD directory) removes it when it starts, so a crash
    loop does not fill host memory (the old daemon left one slab per kill).
    The time to SERVING after the kill and the blocks found again (from SSD:
    the slab is removed, not adopted) are recorded."""
    from tests.faults.faultlib import slabs_of

    sock = str(tmp_path / "kv.sock")
    flags = ("--dram", "64MiB", "--ssd", "256MiB", "--ssd-path", str(tmp_path / "ssd"))
    env = {"KVSTORE_DRAM_PAGE_SIZE": "1MiB", "KVSTORE_SSD_WRITE_MODE": "through", "KVSTORE_SSD_ADMIT_MIN_HITS": "0"}
    chains = [chain_keys(1900 + i, 16) for i in range(8)]
    pids: list[int] = []
    recovered: list[int] = []
    serving_s: list[float] = []
    for rnd in range(3):
        t0 = time.perf_counter()
        s = Serve(sock, *flags, env=env).wait_healthy()
        serving_s.append(time.perf_counter() - t0)
        pids.append(s.pid)
        try:
            for old in pids[:-1]:
                assert not slabs_of(old), f"round {rnd}: the slab of killed daemon {old} is still in /dev/shm"
            assert len(slabs_of(s.pid)) == 1
            with Client(s.target) as c:
                if rnd:
                    recovered.append(_hits(c, chains)[0])
                for keys in chains:
                    c.put(NS, keys, [P(k) for k in keys])
        finally:
            s.kill()
        assert slabs_of(s.pid), "SIGKILL leaves the slab (the successor removes it)"
    s = Serve(sock, *flags, env=env).wait_healthy()
    try:
        left = sum(len(slabs_of(p)) for p in pids)
        record("slab_after_sigkill", kills=len(pids), slabs_left=left)
        assert left == 0
    finally:
        assert s.terminate() == 0
    assert not slabs_of(s.pid)  # a clean stop removes its own
    record("slab_after_sigkill",
           blocks_found_after_kill=min(recovered) if recovered else 0,
           seconds_to_serving_after_kill=round(max(serving_s[1:]), 2))


def test_any_daemon_starting_removes_what_a_killed_daemon_of_another_identity_left(tmp_path) -> None:
    """A SIGKILLed daemon whose identity never starts again (here: its Unix
    socket) left its slab and its owner file in /dev/shm for good. The next
    daemon of the same user to start, whatever its identity, removes both
    (``slab_owner.sweep_dead``); a live daemon's are untouched."""
    from kvstore.daemon.slab_owner import state_path
    from tests.faults.faultlib import slabs_of

    flags = ("--dram", "16MiB")
    a = Serve(str(tmp_path / "a.sock"), *flags).wait_healthy()
    live = Serve(str(tmp_path / "live.sock"), *flags).wait_healthy()
    try:
        a_owner = state_path("unix:" + os.path.realpath(str(tmp_path / "a.sock")))
        a.kill()
        assert slabs_of(a.pid) and os.path.exists(a_owner), "SIGKILL leaves the slab and the owner file"
        b = Serve(str(tmp_path / "b.sock"), *flags).wait_healthy()
        try:
            assert not slabs_of(a.pid), "the killed daemon's slab is still in /dev/shm"
            assert not os.path.exists(a_owner), "the killed daemon's owner file is still in /dev/shm"
            assert len(slabs_of(live.pid)) == 1 and len(slabs_of(b.pid)) == 1
        finally:
            assert b.terminate() == 0
    finally:
        a.kill()
        assert live.terminate() == 0
    assert not slabs_of(live.pid) and not os.path.exists(a_owner)
