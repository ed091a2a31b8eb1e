"""Fixtures that run the real daemon: in-process on port 0 (its own event
loop on a thread), waiting on the gRPC health service, never on sleeps."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.daemon import DaemonThread
from tests.support.waits import wait_healthy, wait_until

__all__ = ["DaemonThread", "wait_healthy", "wait_until"]  # from tests.support; old imports keep working


@pytest.fixture
def make_daemon():
    made: list[DaemonThread] = []

    def make(**overrides: Any) -> DaemonThread:
        env = overrides.pop("_env", None)
        d = DaemonThread({k.replace("__", "."): v for k, v in overrides.items()}, env)
        made.append(d)
        wait_healthy(d.target)
        return d

    yield make
    for d in made:
        d.stop()


@pytest.fixture
def daemon(make_daemon):
    return make_daemon()


@pytest.fixture
def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def peer():
    """A ``transport.ucx_peer`` process (tests/support/ucx_peer.py), stopped
    after the test; skipped where ucxx is not installed."""
    pytest.importorskip("ucxx")
    from tests.support.ucx_peer import PeerProc

    p = PeerProc()
    yield p
    p.close()
