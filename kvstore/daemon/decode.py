"""Request bytes that do not decode: INVALID_ARGUMENT, not UNKNOWN.

grpc.aio deserializes a request before any handler runs; when protobuf
refuses the bytes, grpc answers ``UNKNOWN: Unexpected <DecodeError>`` and
logs a traceback per call, so a flood of garbage fills the log. Each
method's deserializer is wrapped here instead: bytes that do not parse
become an ``Undecodable`` marker, and the method's behaviour (wrapped too)
answers it with INVALID_ARGUMENT and a short message before the servicer
sees it. The failure is logged as one line per peer host, at most once per
``PER_PEER_S`` for that host and ``MAX_LINES_PER_MIN`` lines in all, with a
count of what was left out.

``add_guarded(server, add_fn, servicer, guard)`` registers a generated
``add_XServicer_to_server`` through a stand-in server that wraps every
unary-request method's handler of an asyncio servicer (the generated functions only call
``add_generic_rpc_handlers`` and ``add_registered_method_handlers``).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from kvstore.errors import KVStoreError
from kvstore.wire.status import status_for

log = logging.getLogger("kvstore.daemon.decode")

PER_PEER_S = 60.0
"""A peer host's undecodable requests are logged at most once per this long."""
MAX_LINES_PER_MIN = 20
"""At most this many such log lines per minute, over all peers."""
MAX_PEERS = 4096
"""Peer hosts remembered for the rate limit (forgotten all at once past it)."""


class Undecodable:
    """What a guarded deserializer returns for bytes it cannot parse."""

    __slots__ = ("type_name", "reason")

    def __init__(self, type_name: str, reason: str) -> None:
        self.type_name, self.reason = type_name, reason

    @property
    def message(self) -> str:
        return f"request is not a valid {self.type_name} message: {self.reason}"


def _short(e: BaseException) -> str:
    """protobuf's reason, without the type name it repeats ("Error parsing
    message with type 'X': Wire format was corrupt" -> "Wire format was corrupt")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("Error parsing message") and "': " in text:
        text = text.split("': ", 1)[1]
    return text if len(text) <= 160 else text[:157] + "..."


def peer_host(peer: str) -> str:
    """``ipv4:127.0.0.1:5431`` -> ``ipv4:127.0.0.1`` (the port changes per connection)."""
    if peer.startswith("unix:"):
        return "unix"
    head, sep, tail = peer.rpartition(":")
    return head if sep and tail.isdigit() else peer


class DecodeGuard:
    """The wrapping, the rate-limited log, and an ``on_reject(method, code,
    seconds)`` callback (metrics: each refused call, undecodable or
    unauthenticated, is counted and timed once, as the RPC wrapper counts
    and times the calls that decode)."""

    def __init__(self, on_reject: Callable[[str, str, float], None] | None = None,
                 authenticate: Callable[[Any], object] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.on_reject = on_reject
        self.authenticate = authenticate
        """Checks the caller's credentials first (raises a KVStoreError): garbage
        from a caller without a valid token is UNAUTHENTICATED, never logged."""
        self.clock = clock
        self.rejected = 0
        """Undecodable requests answered, in all."""
        self.logged = 0
        """Log lines written about them."""
        self.peers: dict[str, tuple[float, int]] = {}  # host -> (last logged, left out since)
        self.window: tuple[float, int] = (0.0, 0)  # (minute start, lines in it)

    # ------------------------------------------------------------ logging
    def note(self, method: str, peer: str, bad: Undecodable) -> None:
        """Count one undecodable request; log it if the limits allow."""
        self.rejected += 1
        now = self.clock()
        host = peer_host(peer)
        last, skipped = self.peers.get(host, (-PER_PEER_S - 1.0, 0))
        start, lines = self.window
        if now - start >= 60.0:
            start, lines = now, 0
        if now - last < PER_PEER_S or lines >= MAX_LINES_PER_MIN:
            if len(self.peers) >= MAX_PEERS and host not in self.peers:
                self.peers.clear()
            self.peers[host] = (last, skipped + 1)
            self.window = (start, lines)
            return
        if len(self.peers) >= MAX_PEERS and host not in self.peers:
            self.peers.clear()
        self.peers[host] = (now, 0)
        self.window = (start, lines + 1)
        self.logged += 1
        more = f" ({skipped} more from this peer since its last report)" if skipped else ""
        log.warning("undecodable %s request from %s answered INVALID_ARGUMENT: %s%s", method, host, bad.reason,
                    more)

    # ----------------------------------------------------------- wrapping
    def deserializer(self, fn: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
        def decode(data: bytes) -> Any:
            try:
                return fn(data)
            except Exception as e:  # noqa: BLE001 - DecodeError, bad UTF-8 in a string field, ...
                return Undecodable(type_name, _short(e))

        return decode

    async def refuse(self, method: str, request: Undecodable, context: Any) -> None:
        """Answer an undecodable request (UNAUTHENTICATED first, without valid credentials)."""
        t0 = time.perf_counter()
        code, details = grpc.StatusCode.INVALID_ARGUMENT, request.message
        if self.authenticate is not None:
            try:
                self.authenticate(context)
            except KVStoreError as e:
                code, details = status_for(e), str(e)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            self.note(method, context.peer(), request)
        if self.on_reject is not None:
            self.on_reject(method, code.name, time.perf_counter() - t0)
        await context.abort(code, details)

    def unary(self, method: str, fn: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
        async def behaviour(request: Any, context: Any) -> Any:
            if request.__class__ is Undecodable:
                await self.refuse(method, request, context)
            return await fn(request, context)

        return behaviour

    def stream(self, method: str, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], AsyncIterator[Any]]:
        async def behaviour(request: Any, context: Any) -> AsyncIterator[Any]:
            if request.__class__ is Undecodable:
                await self.refuse(method, request, context)
                return
            async for item in fn(request, context):
                yield item

        return behaviour

    def handlers(self, service: str, handlers: dict[str, Any]) -> dict[str, Any]:
        """Wrap every unary-request method of one service (others unchanged)."""
        out: dict[str, Any] = {}
        for name, h in handlers.items():
            fn = h.unary_stream if h.response_streaming else h.unary_unary
            if (h.request_streaming or h.request_deserializer is None
                    or not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn))):
                out[name] = h  # a client stream, or a synchronous servicer: left as it is
                continue
            type_name = getattr(getattr(h.request_deserializer, "__self__", None), "DESCRIPTOR", None)
            label = type_name.full_name if type_name is not None else name + " request"
            method = name
            dec = self.deserializer(h.request_deserializer, label)
            if h.response_streaming:
                out[name] = grpc.unary_stream_rpc_method_handler(
                    self.stream(method, h.unary_stream), request_deserializer=dec,
                    response_serializer=h.response_serializer)
            else:
                out[name] = grpc.unary_unary_rpc_method_handler(
                    self.unary(method, h.unary_unary), request_deserializer=dec,
                    response_serializer=h.response_serializer)
        return out


class _Registrar:
    """Stands in for the server while a generated ``add_*_to_server`` runs."""

    def __init__(self, server: Any, guard: DecodeGuard) -> None:
        self.server, self.guard = server, guard
        self.generic: tuple[Any, ...] = ()
        self.registered = False

    def add_generic_rpc_handlers(self, handlers: tuple[Any, ...]) -> None:
        self.generic = tuple(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        wrapped = self.guard.handlers(service, handlers)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        self.server.add_registered_method_handlers(service, wrapped)
        self.registered = True


def add_guarded(server: Any, add_fn: Callable[[Any, Any], None], servicer: Any, guard: DecodeGuard) -> None:
    """``add_fn(servicer, server)`` with every unary-request method guarded."""
    reg = _Registrar(server, guard)
    add_fn(servicer, reg)
    if not reg.registered and reg.generic:  # an add function of another shape: registered as it is
        server.add_generic_rpc_handlers(reg.generic)
