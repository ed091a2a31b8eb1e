"""Same-host fast ``Lookup``: a Unix socket next to the gRPC one (issue 9).

A ``Lookup`` is the first call of every request an engine serves, and on a
small machine a gRPC round trip costs more than the lookup itself (an empty
unary call is ~1 ms on the 2-core box of docs/replay.md, a 1,024-key index
lookup ~0.1 ms). Same-host clients therefore send ``Lookup`` over a plain
stream socket with fixed little-endian frames; everything else stays on
gRPC. The answer is the same as the gRPC ``Lookup``'s (the same store call,
namespace validation, tenant binding, QoS gate, metrics and error codes).

Who may use it: the socket is created mode 0600 beside ``server.unix_socket``
(``server.lookup_socket``; default ``<unix_socket>.lookup``, ``off`` to
disable) and its path is only sent in a same-host ``Handshake`` answer. A
connection first presents its session id (from that ``Handshake``, which did
the authentication); the session's tenant is bound to every lookup on the
connection, and the connection is refused or closed once the session ends.

Frames (u32 = little-endian uint32; ``len`` counts the bytes after it)::

    hello     u32 len | session id (ASCII)
    hello ok  u32 len=1 | u8 0            (else an error frame, then close)
    lookup    u32 len | u16 ns_len | Namespace message (protobuf) | keys (n x 16 bytes)
    answer    u32 len | u8 0 | u32 hit_blocks | hit_blocks x u8 Tier value
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
    from kvstore.server import Daemon

log = logging.getLogger("kvstore.fastlookup")

MAX_FRAME = 16 + 65536 + 16 * 65536
"""Largest request frame: a namespace and 65,536 keys."""
_U32 = struct.Struct("<I")
_HIT = struct.Struct("<BI")


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

        from kvstore.auth import Principal

        self._conns.add(writer)
        try:
            n = _U32.unpack(await reader.readexactly(4))[0]
            if n > 256:
                writer.write(_error(grpc.StatusCode.INVALID_ARGUMENT.value[0], "hello too long"))
                return
            sid = (await reader.readexactly(n)).decode("ascii", "replace")
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
                writer.write(await self._lookup(body, who))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._conns.discard(writer)
            writer.close()

    async def _lookup(self, body: bytes, who: Any) -> bytes:
        import grpc

        from admission.qos import QosClass, QosRejected
        from kvstore.server import MAX_KEYS, status_for

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

    def __init__(self, path: str, session: str, timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.lock = threading.Lock()
        self._ns_wire: dict[Any, bytes] = {}
        try:
            self.sock.connect(path)
            sid = session.encode("ascii")
            self.sock.sendall(_frame(sid))
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

            from kvstore.client import _CODE_TO_ERROR

            code = next((c for c in grpc.StatusCode if c.value[0] == body[0]), grpc.StatusCode.UNKNOWN)
            raise _CODE_TO_ERROR.get(code, Unavailable)(f"{code.name}: {bytes(body[1:]).decode(errors='replace')}")
        return body

    def lookup(self, ns_wire: bytes, packed_keys: bytes) -> tuple[int, bytes]:
        """(hit_blocks, one Tier value byte per hit block)."""
        if len(ns_wire) > 0xFFFF:
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
