"""A stalled disk stalls only the calls that need it (issue 19, item 3):
while a Get of SSD blocks waits on a read that does not return, lookups and
DRAM hits are answered. No timing: the disk is held until they are."""

from __future__ import annotations

import threading
from typing import Any, Sequence

from kvstore.client import Client, ns_pb
from kvstore.errors import KeyStatus
from kvstore.keys import Namespace
from proto import kvstore_pb2 as pb
from tests.conftest import payload_for
from tests.faults.faultlib import record
from tests.support.keys import chain_keys
from tests.support.waits import wait_until
from tiers.base import TierKind
from tiers.ssd import OsFileLayer

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BS = 64 * 1024


def P(k: bytes) -> bytes:
    return payload_for(b"stall", k, BS)


class StalledReads(OsFileLayer):
    """Reads wait until ``go`` is set (when ``hold`` is on)."""

    def __init__(self) -> None:
        self.hold = False
        self.go = threading.Event()
        self.waiting = threading.Event()

    def preadv(self, fd: int, bufs: Sequence[Any], offset: int) -> int:  # type: ignore[override]
        if self.hold:
            self.waiting.set()
            self.go.wait(120)
        return super().preadv(fd, bufs, offset)


def test_a_stalled_disk_read_does_not_stall_lookups_or_dram_hits(make_daemon, tmp_path) -> None:
    d = make_daemon(**{"dram__capacity": "4MiB", "dram__page_size": "1MiB", "ssd__capacity": "64MiB",
                       "ssd__path": str(tmp_path / "ssd"), "ssd__admit_min_hits": 0, "ssd__write_mode": "back"})
    fs = StalledReads()
    d.call(lambda: setattr(d.store.ssd.tier, "fs", fs))
    chains = [chain_keys(3000 + i, 8) for i in range(16)]  # 8 MiB through 4 MiB of DRAM
    with Client(d.target) as c:
        for keys in chains:
            assert c.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 8
        c.flush()  # every write-behind put stored, and the evictions it made done

        def where(keys: list[bytes]) -> set[int]:
            return set(c.lookup(NS, keys).tiers[: len(keys)])

        def wholly(tier: TierKind, order: list[list[bytes]]) -> list[bytes] | None:
            return next((k for k in order if where(k) == {tier}), None)

        # (demotions finish on the disk worker: wait for one chain to be wholly on SSD)
        wait_until(lambda: wholly(TierKind.SSD, chains) is not None, timeout=30, what="a chain wholly on SSD")
        on_ssd = wholly(TierKind.SSD, chains)
        in_dram = wholly(TierKind.DRAM, chains[::-1])
        assert on_ssd is not None and in_dram is not None
        fs.hold = True
        got: list[Any] = []
        def read() -> None:
            with Client(d.target) as rc:
                got.append(rc.get(NS, on_ssd))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            wait_until(fs.waiting.is_set, timeout=30, what="the Get of SSD blocks waits on the disk")
            # the disk is stalled: these must still be answered (10 s deadlines)
            r = c._call(c.stub.Lookup, pb.LookupRequest(ns=ns_pb(NS), keys_packed=b"".join(in_dram)), timeout=10)
            lease = c.acquire(NS, in_dram)
            hits = [v.tobytes() if v is not None else None for v in lease.views]
            lease.release()
            inline = c._call(c.stub.Lookup, pb.LookupRequest(ns=ns_pb(NS), keys_packed=b"".join(on_ssd)), timeout=10)
            still_waiting = reader.is_alive()
        finally:
            fs.hold = False
            fs.go.set()
        reader.join(60)
    record("stalled_disk", lookups_answered_while_disk_stalled=2, dram_hits_while_disk_stalled=sum(
        h is not None for h in hits))
    assert r.hit_blocks == 8 and inline.hit_blocks == 8
    assert hits == [P(k) for k in in_dram]
    assert still_waiting  # they were answered while the SSD read was still stalled
    assert got and [g.tobytes() for g in got[0]] == [P(k) for k in on_ssd]
