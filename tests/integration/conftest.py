"""Fixtures that run the real daemon: in-process on port 0 (its own event
loop on a thread), waiting on the gRPC health service, never on sleeps."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.config import load_config


def wait_healthy(target: str, timeout: float = 20.0, creds: Any = None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        ch = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError as e:
            last = e
        finally:
            ch.close()
        time.sleep(0.05)
    raise TimeoutError(f"daemon at {target} not healthy: {last}")


def wait_until(pred, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll a condition with a bounded deadline (for effects of another
    process, e.g. a killed client's stream closing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


class DaemonThread:
    """The real daemon on its own loop in a thread."""

    def __init__(self, overrides: dict[str, Any], env: dict[str, str] | None = None) -> None:
        base = {"server.port": 0, "metrics.port": 0, "dram.capacity": "16MiB"}
        base.update(overrides)
        self.config = load_config(None, env or {}, base)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        from kvstore.daemon import server
        self.running = asyncio.run_coroutine_threadsafe(server.start(self.config), self.loop).result(30)
        self.target = f"127.0.0.1:{self.running.port}" if self.running.port else self.running.address
        self.daemon = self.running.daemon
        self.store = self.daemon.store

    def call(self, fn, *a: Any) -> Any:
        """Run ``fn(*a)`` on the daemon's loop (the store is single-threaded)."""
        async def run() -> Any:
            return fn(*a)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.running.stop(1.0), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.store.close()


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
