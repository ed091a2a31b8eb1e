"""Same-host fast ``Lookup`` (and the shared-memory data path's control
calls): a Unix socket next to the gRPC one (issue 9).

A ``Lookup`` is the first call of every request an engine serves, and on a
small machine a gRPC round trip costs more than the lookup itself (an empty
unary call is ~1 ms on the 2-core box of docs/replay.md, a 1,024-key index
lookup ~0.1 ms). Same-host clients therefore send ``Lookup`` over a plain
stream socket with fixed little-endian frames; everything else stays on
gRPC. The answer is the same as the gRPC ``Lookup``'s (the same store call,
namespace validation, tenant binding, QoS gate, metrics and error codes).

The four control calls of the shared-memory data path (``Reserve``,
``Commit``, ``Abort``, ``Acquire``, ``Release``: two per put or get, each a
~1 ms gRPC round trip here) go over the same socket as their protobuf
messages, handled by the very same servicer methods (auth, QoS, deadlines,
metrics, errors) through a small stand-in for the gRPC call context.

Who may use it: the socket is created mode 0600 beside ``server.unix_socket``
(``server.lookup_socket``; default ``<unix_socket>.lookup``, ``off`` to
disable) and its path is only sent in a same-host ``Handshake`` answer. A
connection first presents its session id (from that ``Handshake``, which did
the authentication); the session's tenant is bound to every lookup on the
connection, and the connection is refused or closed once the session ends.

Frames (u32 = little-endian uint32; ``len`` counts the bytes after it)::

    hello     u32 len | session id (ASCII) [| "\n" | bearer token]
    hello ok  u32 len=1 | u8 0            (else an error frame, then close)
    lookup    u32 len | u16 ns_len | Namespace message (protobuf) | keys (n x 16 bytes)
    answer    u32 len | u8 0 | u32 hit_blocks | hit_blocks x u8 Tier value
    call      u32 len | u16 0xFFFF | u8 method (1-based in CALLS) | request message (protobuf)
    reply     u32 len | u8 0 | response message (protobuf)
    error     u32 len | u8 status | UTF-8 message   (status: the gRPC status code)

No pickle, no Python objects on the wire; frames over ``MAX_FRAME`` are
refused. The client falls back to gRPC when the socket is missing or breaks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError, NotFound, Unavailable

if TYPE_CHECKING:
    from kvstore.daemon.server import Daemon

log = logging.getLogger("kvstore.daemon.socket_server")

MAX_FRAME = 16 + 65536 + 16 * 65536
"""Largest request frame: a namespace and 65,536 keys."""
_U32 = struct.Struct("<I")
_HIT = struct.Struct("<BI")
_CALL = b"\xff\xff"
CALLS = ("Reserve", "Commit", "Abort", "Acquire", "Release")
"""The unary calls the socket carries besides Lookup (method id = index + 1)."""


class _Aborted(BaseException):
    """``context.abort`` on the socket (BaseException: it must pass through the
    handlers' ``except Exception``, like grpc.aio's abort)."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _LocalContext:
    """What the daemon's unary handlers use of a ``grpc.aio`` call context."""

    def __init__(self, metadata: list[tuple[str, str]], peer: str) -> None:
        self._md = metadata
        self._peer = peer

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._md

    def time_remaining(self) -> float | None:
        return None

    def cancelled(self) -> bool:
        return False

    def peer(self) -> str:
        return self._peer

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: Any, details: str = "") -> None:
        raise _Aborted(code, details)


def _frame(body: bytes) -> bytes:
    return _U32.pack(len(body)) + body


def _error(code: int, message: str) -> bytes:
    return _frame(bytes([code]) + message.encode()[:4096])


class LookupSocketServer:
    """The daemon side: one asyncio Unix-socket server on the daemon's loop."""

    def __init__(self, daemon: "Daemon", path: str) -> None:
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
        import grpc

        from kvstore.daemon.auth import Principal

        self._conns.add(writer)
        try:
            n = _U32.unpack(await reader.readexactly(4))[0]
            if n > 8192:
                writer.write(_error(grpc.StatusCode.INVALID_ARGUMENT.value[0], "hello too long"))
                return
            sid, _, token = (await reader.readexactly(n)).decode("ascii", "replace").partition("\n")
            md = [("x-kvstore-session", sid)] + ([("authorization", f"Bearer {token}")] if token else [])
            d = self.daemon
            if sid not in d.sessions:
                writer.write(_error(grpc.StatusCode.NOT_FOUND.value[0], f"session {sid!r} is unknown"))
                return
            who = Principal(tenant=d.sessions[sid], admin=False)
            writer.write(_frame(b"\x00"))
            while True:
                head = await reader.readexactly(4)
                n = _U32.unpack(head)[0]
                if n > MAX_FRAME or n < 2:
                    writer.write(_error(grpc.StatusCode.INVALID_ARGUMENT.value[0], f"frame of {n} bytes"))
                    return
                body = await reader.readexactly(n)
                if sid not in d.sessions:  # the session ended (its KeepAlive stream closed)
                    writer.write(_error(grpc.StatusCode.NOT_FOUND.value[0], f"session {sid!r} ended"))
                    return
                if body[:2] == _CALL:
                    writer.write(await self._call(body, md, sid))
                else:
                    writer.write(await self._lookup(body, who))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._conns.discard(writer)
            writer.close()

    async def _call(self, body: bytes, md: list[tuple[str, str]], sid: str) -> bytes:
        """One of ``CALLS``, through the daemon's own (wrapped) handler."""
        import grpc

        from proto import kvstore_pb2 as pb

        op = body[2] - 1 if len(body) > 2 else -1
        if not 0 <= op < len(CALLS):
            return _error(grpc.StatusCode.INVALID_ARGUMENT.value[0], f"unknown method id {op + 1}")
        name = CALLS[op]
        try:
            req = getattr(pb, name + "Request").FromString(body[3:])
        except Exception:
            return _error(grpc.StatusCode.INVALID_ARGUMENT.value[0], f"{name}: not a valid request message")
        try:
            resp = await getattr(self.daemon, name)(req, _LocalContext(md, f"local:{sid}"))
        except _Aborted as e:
            return _error(e.code.value[0], e.details)
        return _frame(b"\x00" + resp.SerializeToString())

    async def _lookup(self, body: bytes, who: Any) -> bytes:
        import grpc

        from admission.qos import QosClass, QosRejected
        from kvstore.wire.convert import MAX_KEYS, status_for

        d = self.daemon
        t0 = time.perf_counter()
        try:
            nslen = int.from_bytes(body[:2], "little")
            keys = body[2 + nslen:]
            if len(keys) % 16:
                raise InvalidArgument(f"keys are {len(keys)} bytes, not a multiple of 16")
            if len(keys) // 16 > MAX_KEYS:
                raise InvalidArgument(f"{len(keys) // 16} keys in one call; at most {MAX_KEYS}")
            ns = d.namespace_from_wire(body[2 : 2 + nslen], who)
            cls = QosClass.for_method("Lookup")
            if cls is None:
                res = d.store.lookup(ns, keys)
            else:
                async with d.qos.slot(cls):
                    res = d.store.lookup(ns, keys)
            d.metrics.lookup_hits(res.tier_codes)
            tiers = (res.tier_codes.astype(np.uint8) + 1).tobytes()
            return _frame(_HIT.pack(0, res.hit_blocks) + tiers)
        except QosRejected as e:
            d.metrics.rejected("Lookup", "RESOURCE_EXHAUSTED")
            return _error(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], str(e))
        except KVStoreError as e:
            code = status_for(e)
            d.metrics.rejected("Lookup", code.name)
            return _error(code.value[0], str(e))
        except Exception as e:  # a bug: log it, answer INTERNAL, keep serving
            log.exception("fast Lookup failed")
            d.metrics.rejected("Lookup", "INTERNAL")
            return _error(grpc.StatusCode.INTERNAL.value[0], f"internal error in Lookup: {type(e).__name__}")
        finally:
            d.metrics.observe("Lookup", time.perf_counter() - t0)


class LookupSocketClient:
    """The client side: one connected socket, one call at a time (a lock)."""

    def __init__(self, path: str, session: str, timeout: float = 30.0, token: str | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.lock = threading.Lock()
        self._ns_wire: dict[Any, bytes] = {}
        try:
            self.sock.connect(path)
            hello = session + ("\n" + token if token else "")
            self.sock.sendall(_frame(hello.encode("ascii")))
            self._answer()
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def _recv(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("lookup socket closed")
            got += k
        return buf

    def _answer(self) -> bytearray:
        n = _U32.unpack(self._recv(4))[0]
        body = self._recv(n)
        if body[0] != 0:
            import grpc

            from kvstore.client.sync import _CODE_TO_ERROR

            code = next((c for c in grpc.StatusCode if c.value[0] == body[0]), grpc.StatusCode.UNKNOWN)
            raise _CODE_TO_ERROR.get(code, Unavailable)(f"{code.name}: {bytes(body[1:]).decode(errors='replace')}")
        return body

    def lookup(self, ns_wire: bytes, packed_keys: bytes) -> tuple[int, bytes]:
        """(hit_blocks, one Tier value byte per hit block)."""
        if len(ns_wire) >= 0xFFFF:
            raise InvalidArgument("namespace message too long")
        body_len = 2 + len(ns_wire) + len(packed_keys)
        with self.lock:
            self.sock.sendall(_U32.pack(body_len) + len(ns_wire).to_bytes(2, "little") + ns_wire + packed_keys)
            body = self._answer()
        status, hit = _HIT.unpack_from(body)
        tiers = bytes(body[_HIT.size:])
        if len(tiers) != hit:
            raise NotFound(f"malformed lookup answer: {hit} hits, {len(tiers)} tiers")
        return hit, tiers

    def call(self, name: str, request: bytes) -> bytes:
        """One of ``CALLS``: the serialized request in, the serialized response
        out (errors raise the exception-tree class of their status)."""
        op = CALLS.index(name) + 1
        with self.lock:
            self.sock.sendall(_U32.pack(3 + len(request)) + _CALL + bytes([op]) + request)
            body = self._answer()
        return bytes(body[1:])
