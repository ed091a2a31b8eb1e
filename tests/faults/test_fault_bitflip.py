"""Bit flips in DRAM slots (the tier's ``corrupt_for_test`` hook) and in SSD
segment files: every flipped block read back is detected (a miss, counted
and dropped), never returned; blocks nobody flipped keep being hits."""

from __future__ import annotations

import asyncio
import os
import random

import numpy as np

from kvstore.client import AsyncClient, Client
from kvstore.errors import KeyStatus
from kvstore.core.index import keys_to_array
from kvstore.keys import Namespace
from tests.conftest import payload_for
from tests.faults.faultlib import isetting, record
from tests.integration.conftest import wait_until
from tiers.ssd import HEADER_BYTES

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BS = 16 * 1024


def P(k: bytes) -> bytes:
    return payload_for(b"flip", k, BS)


def _keys(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def _rows(d, keys: list[bytes]) -> list[int]:
    def find() -> list[int]:
        st = d.store
        nid = st.namespace_id(NS, create=False)
        return st.index.find_committed(nid, keys_to_array(keys)).tolist()

    return d.call(find)


class Readers:
    """One client per read path, kept for the whole test (the asyncio one on
    its own loop)."""

    def __init__(self, d) -> None:
        self.shm = Client(d.target)
        self.inline = Client(d.target, use_shm=False)
        self.loop = asyncio.new_event_loop()
        async def make() -> AsyncClient:  # the channel binds to the loop it is made on
            return await AsyncClient(d.target).connect()

        self.aio = self.loop.run_until_complete(make())

    def close(self) -> None:
        self.shm.close()
        self.inline.close()
        self.loop.run_until_complete(self.aio.close())
        self.loop.run_until_complete(asyncio.sleep(0.1))  # let the cancelled keep-alive finish
        # (the loop stays open: gRPC's poller may still post to it)

    def read(self, path: str, keys: list[bytes]) -> list[bytes | None]:
        """Read blocks back through one of the client read paths."""
        if path == "shm_get":
            return [g.tobytes() if g is not None else None for g in self.shm.get(NS, keys)]
        if path == "inline_get":
            return [g.tobytes() if g is not None else None for g in self.inline.get(NS, keys)]
        outs = [np.zeros(BS, np.uint8) for _ in keys]
        if path == "shm_get_into":
            st = self.shm.get_into(NS, keys, outs)
        elif path == "async_get_into":
            st = self.loop.run_until_complete(self.aio.get_into(NS, keys, outs))
        else:
            raise AssertionError(path)
        return [o.tobytes() if s is KeyStatus.OK else None for o, s in zip(outs, st)]


PATHS = ("shm_get", "shm_get_into", "inline_get", "async_get_into")


def _flip_and_read(d, keys: list[bytes], flip, rng: random.Random) -> dict[str, int]:
    """Flip one bit in each of half the blocks (``flip(row, rng)``, False
    when the flipped bit is one a read need not check), then read every
    block back through each read path in turn."""
    flipped = set(rng.sample(range(len(keys)), len(keys) // 2))
    rows = _rows(d, keys)
    benign = {i for i in flipped if not flip(rows[i], rng)}
    detected = false_hits = lost_clean = benign_hits = 0
    order = list(range(len(keys)))
    rng.shuffle(order)
    readers = Readers(d)
    try:
        results = [(i, readers.read(PATHS[j % len(PATHS)], [keys[i]])[0]) for j, i in enumerate(order)]
        # a detected block is dropped, so a second read is a plain miss
        again = readers.read("inline_get", [keys[i] for i in sorted(flipped)])
    finally:
        readers.close()
    for i, got in results:
        if i in benign:  # exact bytes (its payload and identity are intact) or a miss
            benign_hits += got is not None
            false_hits += got is not None and got != P(keys[i])
        elif i in flipped:
            if got is None:
                detected += 1
            elif got != P(keys[i]):
                false_hits += 1
            # (a flip the block survives unchanged is impossible: every flip changes a bit)
        else:
            if got is None:
                lost_clean += 1
            elif got != P(keys[i]):
                false_hits += 1
    false_hits += sum(g is not None and g != P(keys[i]) for g, i in zip(again, sorted(flipped)))
    return {"flipped": len(flipped) - len(benign), "benign": len(benign), "benign_hits": benign_hits,
            "detected": detected, "false_hits": false_hits, "lost_clean": lost_clean,
            "still_hit_after": sum(g is not None for g, i in zip(again, sorted(flipped)) if i not in benign)}


def test_dram_bit_flips_are_always_detected(make_daemon) -> None:
    n = isetting("flips", 200) * 2
    d = make_daemon(dram__capacity=f"{max(16, n * BS * 2 >> 20)}MiB")
    keys = _keys(1, n)
    with Client(d.target) as c:
        for k in keys:  # one block per chain: a flip drops only that block
            assert c.put(NS, [k], [P(k)]) == [KeyStatus.OK]
    rng = random.Random(11)

    def flip(row: int, rng: random.Random) -> None:
        def go() -> None:
            st = d.store
            st.dram.corrupt_for_test(st.index.offset(row), rng.randrange(BS * 8))

        d.call(go)
        return True

    out = _flip_and_read(d, keys, flip, rng)
    failures = d.call(lambda: d.store.counters.checksum_failures)
    record("bitflip_dram", flipped_blocks=out["flipped"], detected=out["detected"],
           detection_rate=out["detected"] / out["flipped"], false_hits=out["false_hits"],
           intact_blocks_lost=out["lost_clean"], daemon_checksum_failures=failures,
           read_paths=",".join(PATHS))
    assert out["false_hits"] == 0
    assert out["detected"] == out["flipped"]
    assert out["lost_clean"] == 0
    assert out["still_hit_after"] == 0
    assert failures >= out["flipped"]  # every detection reached the daemon, which dropped the block


def test_ssd_bit_flips_are_always_detected(make_daemon, tmp_path) -> None:
    n = isetting("flips", 200) * 2
    d = make_daemon(dram__capacity=f"{max(16, n * BS * 2 >> 20)}MiB", ssd__capacity=f"{max(32, n * BS * 3 >> 20)}MiB",
                    ssd__path=str(tmp_path / "ssd"), ssd__write_mode="through", ssd__admit_min_hits=0,
                    ssd__sync=False)
    keys = _keys(2, n)
    with Client(d.target) as c:
        for k in keys:
            assert c.put(NS, [k], [P(k)]) == [KeyStatus.OK]
    idx = d.store.index
    wait_until(lambda: d.call(lambda: int((idx.ssd_loc[idx.used_rows()] >= 0).sum())) == n, timeout=60,
               what="write-through copies")
    rows = _rows(d, keys)

    def to_ssd() -> None:  # evict the DRAM copies: every block now lives on SSD only
        d.store.ssd.evict_dram(np.asarray(rows, dtype=np.int64))

    d.call(to_ssd)
    assert d.call(lambda: int((idx.tier[np.asarray(rows)] == 2).sum())) == n
    tier = d.store.ssd.tier
    where = {"header": 0, "payload": 0}

    def flip(row: int, rng: random.Random) -> bool:
        def locate() -> tuple[str, int, int]:
            loc = int(idx.loc[row])
            at = tier.table.rows[loc]
            return tier._seg_path(int(at["seg"])), int(at["off"]), int(at["size"])

        path, off, size = d.call(locate)
        at = rng.randrange(HEADER_BYTES) if rng.random() < 0.5 else HEADER_BYTES + rng.randrange(size)
        where["header" if at < HEADER_BYTES else "payload"] += 1
        fd = os.open(path, os.O_RDWR)
        try:
            b = os.pread(fd, 1, off + at)
            os.pwrite(fd, bytes([b[0] ^ (1 << rng.randrange(8))]), off + at)
        finally:
            os.close(fd)
        # the last 8 header bytes are the header's own xxh3, checked when the
        # index is rebuilt from segments; a read compares the 80 bytes before
        # them with the index, and the payload with its checksum
        return not HEADER_BYTES - 8 <= at < HEADER_BYTES

    out = _flip_and_read(d, keys, flip, random.Random(12))
    corrupt = d.call(lambda: tier.corrupt_count)
    record("bitflip_ssd", flipped_blocks=out["flipped"], flipped_in_header=where["header"] - out["benign"],
           flipped_in_payload=where["payload"], flipped_in_header_crc=out["benign"],
           header_crc_flips_read_exact=out["benign_hits"], detected=out["detected"],
           detection_rate=out["detected"] / out["flipped"], false_hits=out["false_hits"],
           intact_blocks_lost=out["lost_clean"], ssd_corrupt_count=corrupt)
    assert out["false_hits"] == 0
    assert out["detected"] == out["flipped"]
    assert out["lost_clean"] == 0
    assert out["still_hit_after"] == 0
    assert corrupt == out["flipped"] + out["benign"] - out["benign_hits"]
