"""Crashes and damaged files: SIGKILL of a real ``kvstore serve`` during puts
and during demotion, in a loop; SSD segment and index files cut or garbled
at arbitrary offsets while the daemon is stopped. After every restart the
daemon starts, and every block it returns is byte-exact (a miss otherwise)."""

from __future__ import annotations

import random
import shutil
import threading
import time
from pathlib import Path

from kvstore.client import Client
from kvstore.errors import KeyStatus, KVStoreError
from kvstore.keys import Namespace
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.core.ssd_mover import SsdSpec
from tests.conftest import payload_for
from tests.faults.faultlib import KilledSlabs, Serve, isetting, record
from tests.integration.conftest import wait_until
from tests.support.keys import chain_keys

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BS = 64 * 1024


def P(k: bytes) -> bytes:
    return payload_for(b"crash", k, BS)


# (name, extra serve flags, env): "puts" keeps most blocks in DRAM and copies
# them to SSD in the background; "demotion" has a DRAM tier a fraction of
# what is written, so nearly every put demotes blocks to SSD (and reads
# promote them back) at the moment of the kill.
MODES = [
    ("puts", ["--dram", "32MiB"], {"KVSTORE_SSD_WRITE_MODE": "through", "KVSTORE_SSD_ADMIT_MIN_HITS": "0"}),
    ("demotion", ["--dram", "4MiB"], {"KVSTORE_SSD_WRITE_MODE": "back", "KVSTORE_SSD_ADMIT_MIN_HITS": "0"}),
]


def _check(c: Client, written: list[list[bytes]]) -> tuple[int, int, int]:
    """(blocks checked, hits, wrong bytes) over everything ever written."""
    checked = hits = wrong = 0
    for keys in written:
        for k, g in zip(keys, c.get(NS, keys)):
            checked += 1
            if g is not None:
                hits += 1
                wrong += g.tobytes() != P(k)
    return checked, hits, wrong


def _demotions(c: Client) -> int:
    try:
        return sum(t.demotions for t in c.stats().tiers)
    except KVStoreError:
        return 0


def test_sigkill_during_puts_and_demotion(tmp_path) -> None:
    rounds = isetting("kill_rounds", 6)
    sock = str(tmp_path / "kv.sock")
    ssd = str(tmp_path / "ssd")
    rng = random.Random(5)
    written: list[list[bytes]] = []
    lock = threading.Lock()
    stats = {"kills": 0, "checked": 0, "hits": 0, "wrong": 0, "demotions_before_kill": 0,
             "checksum_failures": 0, "kills_during_demotion": 0, "restarts": 0}
    killed = KilledSlabs()
    leaked: set[str] = set()

    def report() -> None:  # what was measured so far (called before any assert on it)
        record("crash_sigkill", kills=stats["kills"], restarts=stats["restarts"], slabs_left_by_sigkill=len(leaked),
               kills_while_demoting=stats["kills_during_demotion"], blocks_checked=stats["checked"],
               blocks_recovered_hits=stats["hits"], corrupt_returns=stats["wrong"],
               checksum_failures_seen=stats["checksum_failures"])

    for rnd in range(rounds + 1):
        name, flags, env = MODES[rnd % len(MODES)]
        s = Serve(sock, *flags, "--ssd", "48MiB", "--ssd-path", ssd,
                  env={"KVSTORE_DRAM_PAGE_SIZE": "1MiB", **env})
        try:
            s.wait_healthy()
            killed.note(s.pid)  # its slab, named while its pid is its own
            stats["restarts"] += 1
            with Client(s.target, timeout=20) as c:
                with lock:
                    snapshot = list(written)
                checked, hits, wrong = _check(c, snapshot)
                stats["checked"] += checked
                stats["hits"] += hits
                stats["wrong"] += wrong
                stats["checksum_failures"] += c.stats().checksum_failures
                report()
                assert wrong == 0, f"round {rnd}: {wrong} blocks came back with wrong bytes"
                if rnd == rounds:
                    break  # the final clean start: checked, done
                stop = threading.Event()

                def writer(seed: int) -> None:
                    with Client(s.target, timeout=20) as w:
                        i = 0
                        while not stop.is_set():
                            keys = chain_keys(seed * 100_000 + i, 8)
                            with lock:
                                written.append(keys)
                            try:
                                w.put(NS, keys, [P(k) for k in keys])
                                if name == "demotion" and i % 3 == 2:  # promote older chains back
                                    with lock:
                                        old = written[rng.randrange(len(written))]
                                    w.get(NS, old)
                            except KVStoreError:
                                return  # the daemon is gone
                            i += 1

                threads = [threading.Thread(target=writer, args=(rnd * 10 + j,), daemon=True) for j in range(2)]
                for t in threads:
                    t.start()
                if name == "demotion":  # the DRAM tier is full: every put demotes from now on
                    wait_until(lambda: _demotions(c) > 0, timeout=60, what="demotions")
                time.sleep(rng.uniform(0.3, 1.2))  # a random moment during the writes
                if name == "demotion":
                    d = _demotions(c)
                    stats["demotions_before_kill"] += d
                    stats["kills_during_demotion"] += d > 0
                s.kill()
                stats["kills"] += 1
                stop.set()
                for t in threads:
                    t.join(60)
        finally:
            s.kill()
    # SIGKILL leaves the slab behind (the next start does not need it): clean up ours
    leaked = killed.remove()
    report()
    assert stats["wrong"] == 0
    assert stats["hits"] > 0  # blocks did survive the kills
    assert stats["kills_during_demotion"] > 0


# ------------------------------------------------------------- damaged files
def _config(path: str) -> StoreConfig:
    return StoreConfig(dram_bytes=4 << 20, dram_page_bytes=1 << 20,
                       ssd=SsdSpec(path=path, capacity_bytes=32 << 20, admit_min_hits=0, write_mode="back",
                                   sync=True, segment_bytes=1 << 20))


def _populate(path: str) -> list[list[bytes]]:
    chains = [chain_keys(10_000 + i, 6) for i in range(24)]  # 9 MiB through a 4 MiB DRAM tier
    with TieredStore(_config(path)) as s:
        for keys in chains:
            assert s.put(NS, keys, [P(k) for k in keys]).ok
        for _ in range(200):
            if not s.background():
                break
        s.remove(NS, chains[3][2:])  # some freed records (garbage) too
    return chains


def _damage(root: Path, rng: random.Random) -> list[str]:
    """1-3 random injuries to the tier's files (never SCHEMA or LOCK: a
    wrong schema marker is refused on purpose)."""
    done = []
    for _ in range(rng.randint(1, 3)):
        files = [p for p in root.rglob("*") if p.is_file() and p.name not in ("SCHEMA", "LOCK")]
        kind = rng.choice(["cut", "garble", "zeros", "cut", "garble", "unlink"])
        p = rng.choice(files)
        size = p.stat().st_size
        if kind == "unlink":
            if rng.random() < 0.3:
                shutil.rmtree(root / "index", ignore_errors=True)
                done.append("rm index/")
                continue
            p.unlink()
        elif kind == "cut":
            with open(p, "r+b") as f:
                f.truncate(rng.randrange(size + 1) if size else 0)
        else:
            if not size:
                continue
            at = rng.randrange(size)
            n = min(size - at, rng.choice([1, 7, 88, 512, 4096]))
            data = bytes(n) if kind == "zeros" else rng.randbytes(n)
            with open(p, "r+b") as f:
                f.seek(at)
                f.write(data)
        done.append(f"{kind} {p.relative_to(root)}")
    return done


def test_torn_and_garbled_ssd_files(tmp_path, make_daemon) -> None:
    trials = isetting("torn_trials", 40)
    pristine = tmp_path / "pristine"
    chains = _populate(str(pristine))
    rng = random.Random(9)
    starts = wrong = hits = checked = 0
    odd_statuses: list[KeyStatus] = []
    injuries: list[str] = []
    for trial in range(trials):
        root = tmp_path / f"t{trial}"
        shutil.copytree(pristine, root)
        injuries += _damage(root, rng)
        if trial < 2:  # the real daemon, too: it starts and serves
            d = make_daemon(dram__capacity="4MiB", dram__page_size="1MiB", ssd__capacity="32MiB",
                            ssd__path=str(root), ssd__admit_min_hits=0)
            starts += 1
            with Client(d.target) as c:
                for keys in chains:
                    for k, g in zip(keys, c.get(NS, keys)):
                        checked += 1
                        hits += g is not None
                        wrong += g is not None and g.tobytes() != P(k)
            d.stop()
        else:
            with TieredStore(_config(str(root))) as s:
                starts += 1
                for keys in chains:
                    res = s.get(NS, keys)
                    for k, g, st in zip(keys, res.payloads, res.statuses):
                        checked += 1
                        hits += g is not None
                        wrong += g is not None and g.tobytes() != P(k)
                        if st not in (KeyStatus.OK, KeyStatus.MISS, KeyStatus.CORRUPT):
                            odd_statuses.append(st)
        shutil.rmtree(root)
    record("torn_files", trials=trials, injuries=len(injuries), daemon_starts=starts, blocks_checked=checked,
           blocks_hit=hits, corrupt_returns=wrong, unexpected_statuses=len(odd_statuses))
    assert not odd_statuses, odd_statuses[:5]
    assert starts == trials
    assert wrong == 0
    assert hits > 0
