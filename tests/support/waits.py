"""Waits tests use instead of sleeps: on a daemon's gRPC health service,
or on a condition, each with a bounded deadline."""

from __future__ import annotations

import time
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["wait_healthy", "wait_until"]


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


def wait_until(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll a condition with a bounded deadline (for effects of another
    process, e.g. a killed client's stream closing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")
