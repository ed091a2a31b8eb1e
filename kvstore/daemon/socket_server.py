"""Same-host fast ``Lookup`` (and the shared-memory data path's control
calls): a Unix socket next to the gRPC one (issue 9). The daemon's side; the
frames are in ``kvstore.wire.frames``, the client's side in
``kvstore.client.socket``.

A ``Lookup`` is the first call of every request an engine serves, and on a
small machine a gRPC round trip costs more than the lookup itself (an empty
unary call is ~1 ms on the 2-core box of docs/replay.md, a 1,024-key index
lookup ~0.1 ms). Same-host clients therefore send ``Lookup`` over a plain
stream socket with fixed little-endian frames; everything else stays on
gRPC. The answer is the same as the gRPC ``Lookup``'s: the same store call,
namespace validation, tenant binding, and the same RPC wrapper
(``kvstore.daemon.rpc``: QoS gate, metrics, error codes).

The control calls of the shared-memory data path (``Reserve``, ``Commit``,
``Abort``, ``Acquire``, ``Release``: two per put or get, each a ~1 ms gRPC
round trip here) go over the same socket as their protobuf messages, handled
by the very same servicer methods through ``rpc.LocalContext``.

Who may use it: the socket is created mode 0600 beside ``server.unix_socket``
(``server.lookup_socket``; default ``<unix_socket>.lookup``, ``off`` to
disable) and its path is only sent in a same-host ``Handshake`` answer. A
connection first presents its session id (from that ``Handshake``, which did
the authentication); the session's tenant is bound to every lookup on the
connection, and the connection is refused or closed once the session ends.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from kvstore.daemon.auth import Principal
from kvstore.daemon.rpc import Aborted, LocalContext, rpc
from kvstore.errors import InvalidArgument
from kvstore.wire import frames
from kvstore.wire.convert import MAX_KEYS
from kvstore.wire.frames import CALLS, MAX_FRAME
from proto import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.daemon.state import DaemonState

__all__ = ["CALLS", "MAX_FRAME", "LookupSocketServer", "fast_lookup"]


def _error(code: grpc.StatusCode, message: str) -> bytes:
    return frames.error_frame(code.value[0], message)


@rpc("Lookup")
async def fast_lookup(d: "DaemonState", body: bytes, context: LocalContext, who: Principal) -> bytes:
    """A lookup frame -> its answer frame (through the RPC wrapper)."""
    req = frames.parse_lookup(body)
    keys = req.keys
    if len(keys) % 16:
        raise InvalidArgument(f"keys are {len(keys)} bytes, not a multiple of 16")
    if len(keys) // 16 > MAX_KEYS:
        raise InvalidArgument(f"{len(keys) // 16} keys in one call; at most {MAX_KEYS}")
    ns = d.namespace_from_wire(req.ns_wire, who)
    res = d.store.lookup(ns, keys)
    d.metrics.lookup_hits(res.tier_codes)
    return frames.answer_frame(res.hit_blocks, (res.tier_codes.astype(np.uint8) + 1).tobytes())


class LookupSocketServer:
    """The daemon side: one asyncio Unix-socket server on the daemon's loop."""

    def __init__(self, daemon: "DaemonState", path: str) -> None:
        self.daemon = daemon
        self.path = path
        self.server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for w in list(self._conns):
                w.close()
            await self.server.wait_closed()
            self.server = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            n = frames.HEADER.unpack(await reader.readexactly(4))[0]
            if n > frames.MAX_HELLO:
                writer.write(_error(grpc.StatusCode.INVALID_ARGUMENT, "hello too long"))
                return
            sid, token = frames.parse_hello(await reader.readexactly(n))
            md = [("x-kvstore-session", sid)] + ([("authorization", f"Bearer {token}")] if token else [])
            d = self.daemon
            if sid not in d.sessions:
                writer.write(_error(grpc.StatusCode.NOT_FOUND, f"session {sid!r} is unknown"))
                return
            lookups = LocalContext(md, f"local:{sid}", Principal(tenant=d.sessions[sid], admin=False))
            calls = LocalContext(md, f"local:{sid}")
            writer.write(frames.frame(bytes([frames.OK])))
            while True:
                head = await reader.readexactly(4)
                n = frames.HEADER.unpack(head)[0]
                if n > MAX_FRAME or n < 2:
                    writer.write(_error(grpc.StatusCode.INVALID_ARGUMENT, f"frame of {n} bytes"))
                    return
                body = await reader.readexactly(n)
                if sid not in d.sessions:  # the session ended (its KeepAlive stream closed)
                    writer.write(_error(grpc.StatusCode.NOT_FOUND, f"session {sid!r} ended"))
                    return
                if frames.is_call(body):
                    writer.write(await self._call(body, calls))
                else:
                    writer.write(await self._lookup(body, lookups))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._conns.discard(writer)
            writer.close()

    async def _call(self, body: bytes, context: LocalContext) -> bytes:
        """One of ``CALLS``, through the daemon's own (wrapped) handler."""
        name = frames.call_method(body)
        if name is None:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, f"unknown method id {frames.call_method_id(body)}")
        try:
            req = getattr(pb, name + "Request").FromString(body[3:])
        except Exception:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: not a valid request message")
        try:
            resp: Any = await getattr(self.daemon, name)(req, context)
        except Aborted as e:
            return _error(e.code, e.details)
        return frames.reply_frame(resp.SerializeToString())

    async def _lookup(self, body: bytes, context: LocalContext) -> bytes:
        try:
            answer: bytes = await fast_lookup(self.daemon, body, context)
        except Aborted as e:
            return _error(e.code, e.details)
        return answer
