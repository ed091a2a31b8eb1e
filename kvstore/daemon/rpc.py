"""The one RPC wrapper: every unary call of the daemon, over gRPC or the
same-host socket, goes through ``rpc``: authentication (or the socket
session's principal), the admin check, the deadline, the QoS gate, metrics,
and the exception tree -> status code (``kvstore.wire.status``).

The socket server calls the same handlers with a ``LocalContext``: a small
stand-in for a ``grpc.aio`` call context whose ``abort`` raises ``Aborted``.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Awaitable, Callable, Protocol

import grpc

from admission.qos import QosClass, QosGate, QosRejected
from kvstore import errors
from kvstore.daemon.auth import Auth, Principal
from kvstore.daemon.metrics import Metrics
from kvstore.errors import KVStoreError, PermissionDenied
from kvstore.wire.status import status_for

log = logging.getLogger("kvstore.daemon.server")

Handler = Callable[..., Awaitable[Any]]


class RpcHost(Protocol):
    """What the wrapper needs of the object whose method it wraps."""

    auth: Auth
    qos: QosGate
    metrics: Metrics


class Aborted(BaseException):
    """``context.abort`` on the socket (BaseException: it must pass through the
    handlers' ``except Exception``, like grpc.aio's abort)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LocalContext:
    """What the daemon's unary handlers use of a ``grpc.aio`` call context.
    ``principal``: who the caller is when the transport already knows (a
    socket bound to a session); None to authenticate from the metadata."""

    def __init__(self, metadata: list[tuple[str, str]], peer: str, principal: Principal | None = None) -> None:
        self.metadata = metadata
        self.peer_name = peer
        self.principal = principal

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return None

    def cancelled(self) -> bool:
        return False

    def peer(self) -> str:
        return self.peer_name

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Aborted(code, details)


def gave_up(context: Any) -> bool:
    """Whether the caller can no longer receive the answer (its deadline
    passed, or it cancelled the call)."""
    remaining = context.time_remaining()
    return (remaining is not None and remaining <= 0) or context.cancelled()


def principal_of(host: RpcHost, context: Any) -> Principal:
    """The caller: the socket session's principal, else from the credentials."""
    if isinstance(context, LocalContext) and context.principal is not None:
        return context.principal
    return host.auth.principal(context.invocation_metadata())


def rpc(method: str, *, admin: bool = False) -> Callable[[Handler], Handler]:
    """Wrap a unary handler ``fn(host, request, context, who)``: auth,
    deadline, QoS, metrics, error -> status."""

    def deco(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def wrapper(self: RpcHost, request: Any, context: Any) -> Any:
            t0 = time.perf_counter()
            try:
                who = principal_of(self, context)
                if admin and not who.admin:
                    raise PermissionDenied(f"{method} needs an admin token")
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    raise errors.DeadlineExceeded(f"{method}: deadline passed before the call started")
                cls = QosClass.for_method(method)
                if cls is None:
                    return await fn(self, request, context, who)
                async with self.qos.slot(cls):
                    if gave_up(context):
                        raise errors.DeadlineExceeded(f"{method}: deadline passed while the call was queued")
                    return await fn(self, request, context, who)
            except QosRejected as e:
                context.set_trailing_metadata(e.rejection.metadata())
                self.metrics.rejected(method, "RESOURCE_EXHAUSTED")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except KVStoreError as e:
                code = status_for(e)
                self.metrics.rejected(method, code.name)
                await context.abort(code, str(e))
            except Exception as e:  # a bug: log it, answer INTERNAL, keep serving
                log.exception("%s failed", method)
                self.metrics.rejected(method, "INTERNAL")
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}")
            finally:
                self.metrics.observe(method, time.perf_counter() - t0)

        return wrapper

    return deco
