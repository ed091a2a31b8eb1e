"""The client side of the daemon's same-host socket (issue 9): ``Lookup``
and the shared-memory path's control calls over a Unix socket, in the
frames of ``kvstore.wire.frames``. One connected socket, one call at a time
(a lock). The client falls back to gRPC when the socket is missing or breaks.
"""

from __future__ import annotations

import socket
import threading

from kvstore.errors import NotFound
from kvstore.wire import frames
from kvstore.wire.status import code_from_value, error_for


class LookupSocketClient:
    """One connection to the daemon's same-host socket, bound to a session."""

    def __init__(self, path: str, session: str, timeout: float = 30.0, token: str | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.lock = threading.Lock()
        try:
            self.sock.connect(path)
            self.sock.sendall(frames.hello_frame(session, token))
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
        n = frames.HEADER.unpack(self._recv(4))[0]
        body = self._recv(n)
        if body[0] != frames.OK:
            raise error_for(code_from_value(body[0]), bytes(body[1:]).decode(errors="replace"))
        return body

    def lookup(self, ns_wire: bytes, packed_keys: bytes) -> tuple[int, bytes]:
        """(hit_blocks, one Tier value byte per hit block)."""
        msg = frames.lookup_frame(ns_wire, packed_keys)
        with self.lock:
            self.sock.sendall(msg)
            body = self._answer()
        _, hit = frames.HIT.unpack_from(body)
        tiers = bytes(body[frames.HIT.size:])
        if len(tiers) != hit:
            raise NotFound(f"malformed lookup answer: {hit} hits, {len(tiers)} tiers")
        return hit, tiers

    def call(self, name: str, request: bytes) -> bytes:
        """One of ``frames.CALLS``: the serialized request in, the serialized
        response out (errors raise the exception-tree class of their status)."""
        msg = frames.call_frame(name, request)
        with self.lock:
            self.sock.sendall(msg)
            body = self._answer()
        return bytes(body[1:])
