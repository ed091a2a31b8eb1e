"""``KeepAlive`` (kvstore.daemon.kv_service), driven without a server: one
stream per session, and its end releases the session's leases once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from kvstore.daemon.auth import Principal
from kvstore.daemon.kv_service import KVStoreService
from proto import kvstore_pb2 as pb


class _Aborted(Exception):
    pass


class _Ctx:
    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: grpc.StatusCode, msg: str) -> None:
        raise _Aborted(code)


def _daemon() -> Any:
    released: list[str] = []

    def release_owner(sid: str) -> tuple[int, int]:
        released.append(sid)
        return 1, 0

    return SimpleNamespace(
        auth=SimpleNamespace(principal=lambda md: Principal(None, True)),
        sessions={"s-1": None}, unbound={"s-1": 1e18}, released=released,
        config=SimpleNamespace(server=SimpleNamespace(lease_check_interval=3600.0)),
        store=SimpleNamespace(release_owner=release_owner))


def _stream(d: Any) -> Any:
    return KVStoreService.KeepAlive(d, pb.KeepAliveRequest(session_id="s-1"), _Ctx())  # type: ignore[arg-type]


def test_a_second_stream_for_a_session_is_refused_and_cannot_end_it() -> None:
    """A second KeepAlive for a live session is refused (ALREADY_EXISTS): were
    it accepted, its end would release the leases the first stream's client
    still reads through, and leave that stream beating for a dead session."""
    async def run() -> None:
        d = _daemon()
        first = _stream(d)
        await asyncio.wait_for(first.__anext__(), 30.0)
        assert "s-1" not in d.unbound
        second = _stream(d)
        with pytest.raises(_Aborted) as e:
            await asyncio.wait_for(second.__anext__(), 30.0)
        assert e.value.args[0] is grpc.StatusCode.ALREADY_EXISTS
        await second.aclose()
        assert d.sessions == {"s-1": None} and d.released == []
        await first.aclose()  # the session's one stream ends: released once
        assert d.sessions == {} and d.released == ["s-1"]

    asyncio.run(run())
