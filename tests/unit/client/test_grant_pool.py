"""The client's pool of granted slots (kvstore/client/grants.py), against a
stand-in for the same-host socket: no daemon, no wall clock."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import grants
from kvstore.client.grants import GrantPool
from kvstore.wire import frames


class _Fast:
    """Answers each grant frame with the slots and lifetime given."""

    def __init__(self, life_ms: int, offsets: list[int]) -> None:
        self.life_ms = life_ms
        self.offsets = offsets
        self.sent: list[bytes] = []

    def send_frame(self, name: str, msg: bytes, keep: bool = False, cork: bool = False) -> int:
        self.sent.append(msg)
        return len(self.sent)

    def answer(self, seq: int) -> bytes:
        head = frames.GRANT_OK.pack(frames.OK, self.life_ms, 1 << 30)[1:]
        return head + np.asarray(self.offsets, dtype="<u8").tobytes()


def test_granted_slots_are_not_used_past_half_the_life_counted_from_the_ask(monkeypatch):
    """The daemon's grant lives from when it granted, i.e. about when the
    client asked; the answer may be read much later (at the next put of that
    size). Slots whose grant the daemon has reaped since must not be used:
    they may hold other blocks by then."""
    clock = [1000.0]
    monkeypatch.setattr(grants.time, "monotonic", lambda: clock[0])
    fast = _Fast(life_ms=30_000, offsets=[0, 4096])
    pool = GrantPool()
    pool.ask(fast, b"", 4096, 2)  # type: ignore[arg-type]
    clock[0] += 60.0  # the writer idles past the grant's whole life: the daemon reaped it
    assert pool.take(fast, 4096, 2) is None  # type: ignore[arg-type]
    assert sorted(pool.back) == [0, 4096]  # given back with the next grant frame


def test_granted_slots_answered_at_once_are_used(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(grants.time, "monotonic", lambda: clock[0])
    fast = _Fast(life_ms=30_000, offsets=[0, 4096])
    pool = GrantPool()
    pool.ask(fast, b"", 4096, 2)  # type: ignore[arg-type]
    clock[0] += 1.0
    assert pool.take(fast, 4096, 2) == [0, 4096]  # type: ignore[arg-type]


class _Garbled(_Fast):
    """Answers a grant frame with ``body`` (the answer after its status byte)."""

    def __init__(self, body: bytes) -> None:
        super().__init__(30_000, [])
        self.body, self.closed = body, False

    def answer(self, seq: int) -> bytes:
        return self.body

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("body", [b"", b"\x01" * 11, b"\x01" * 12 + b"\x00" * 5])
def test_a_malformed_grant_answer_is_a_broken_socket(body):
    """A grant answer too short for its fields, or with a partial offset:
    the socket is closed and ConnectionError raised (the put fails over as
    for a broken socket), never a struct.error or ValueError."""
    fast = _Garbled(body)
    pool = GrantPool()
    pool.ask(fast, b"", 4096, 2)  # type: ignore[arg-type]
    with pytest.raises(ConnectionError, match="malformed grant answer"):
        pool.take(fast, 4096, 2)  # type: ignore[arg-type]
    assert fast.closed
