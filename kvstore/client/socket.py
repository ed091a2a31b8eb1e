"""The client side of the daemon's same-host socket (issues 9, 18): ``Lookup``
and the shared-memory path's control calls over a Unix socket, in the
frames of ``kvstore.wire.frames``. One connected socket, one call at a time
(a lock). The client falls back to gRPC when the socket is missing or breaks.

Calls whose answer the caller does not need at once (``send``: the
``Commit`` of a put, the ``Release`` of a get) are sent without waiting;
their answers are read before the next call's (the daemon runs a
connection's calls in order, so they have run by then) or by ``flush``.
A write-behind put's frames may also wait to be sent (``cork``): they go
out with this client's next frame, or after ``cork_s`` on their own, so
the daemon does not land a put while its writer is still busy (issue 18,
twenty-fourth round: a get right after a put then has both cores).
A pipelined call that failed is logged and counted in ``late_errors``; a
write-behind put (``put`` frames, kvstore.client.staging) whose blocks the
daemon could not store (no room, a parent gone) counts them in
``late_rejected``.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
import weakref

from kvstore.errors import KeyStatus, KVStoreError, Unavailable
from kvstore.wire import frames
from kvstore.wire.status import code_from_value, error_for

log = logging.getLogger("kvstore.client")

MAX_OWED = 64
"""Answers a client may leave unread (pipelined frames) before it reads them."""
READ_CHUNK = 1 << 20
"""Most bytes asked of one ``recv`` (each allocates what it asks for): an
answer's buffer grows with the bytes that arrive, not with its stated length."""
_HEADER = frames.HEADER.unpack_from
_HIT = frames.HIT.unpack_from


class LookupSocketClient:
    """One connection to the daemon's same-host socket, bound to a session."""

    def __init__(self, path: str, session: str, timeout: float = 30.0, token: str | None = None,
                 cork_s: float = 0.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.lock = threading.Lock()
        self.buf = bytearray()
        self.owed: list[str] = []
        """Methods sent with ``send`` whose answers are still unread."""
        self.late_errors = 0
        """Pipelined calls the daemon answered with an error."""
        self.late_rejected = 0
        """Blocks of write-behind puts the daemon answered other than OK or EXISTS."""
        self.sent = 0
        """Frames sent without waiting so far: the n-th one's answer is unread while ``settled < n``."""
        self.settled = 0
        """Answers of frames sent without waiting that have been read."""
        self.keep: set[int] = set()
        """Numbers of frames sent with ``send_kept`` whose answers are unread."""
        self.kept: dict[int, bytes | KVStoreError] = {}
        """Their answers once read (the response, or the daemon's error), until ``answer`` takes them."""
        self.cork_s = cork_s
        """How long a frame sent with ``cork`` may wait for the next frame before it is sent on its own
        (0: corked frames are sent at once)."""
        self.corked: list[bytes] = []
        """Frames sent with ``cork`` and not written yet (numbered and owed already, in order)."""
        self.corked_at = 0.0
        """When the first of them was corked (``time.monotonic``)."""
        self.uncorked = 0
        """Writes of corked frames the ``cork_s`` timer made (no later frame or flush came first)."""
        self._wake = threading.Event()
        self._timer: threading.Thread | None = None
        self.closed = False
        """``close`` was called (the timer thread, if any, ends)."""
        try:
            self.sock.connect(path)
            self._send(frames.hello_frame(session, token))
            hello = self._answer()
        except BaseException:
            self.sock.close()
            raise
        self.shared_path = bytes(hello[1:]).decode(errors="replace")
        """The daemon's shared-index header (kvstore/wire/shared_index.py), or ""."""

    def close(self) -> None:
        """Close the socket; a call another thread has waiting on it (for
        room to write, or for an answer) wakes and fails as on a broken
        socket (an OSError) rather than waiting out its timeout."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # (a close alone wakes no select/recv waiting on it)
        except OSError:
            pass  # (already closed, or the daemon hung up first)
        self.sock.close()
        self.closed = True
        self._wake.set()

    def _send(self, data: bytes) -> None:
        """``sendall`` that reads the daemon's answers meanwhile (into
        ``buf``, for ``_frame``) while the socket is full: the daemon stops
        reading a connection whose answers pile up unread, so a client that
        only wrote could wait on it for ever. One system call when the
        socket takes it all (the usual case). Corked frames go first, in
        the same write."""
        if self.corked:
            data = b"".join(self.corked) + data
            self.corked.clear()
        sock = self.sock
        fd = sock.fileno()
        try:
            done = os.write(fd, data)  # (the socket is non-blocking under its timeout: no poll first)
        except BlockingIOError:
            done = 0
        rest = memoryview(data)[done:]
        while rest:  # (the socket object, not ``fd``: closed by another thread, that number may be another file's)
            try:
                readable, writable, _ = select.select([sock], [sock], [], sock.gettimeout())
            except ValueError:  # (closed meanwhile: its fileno is -1)
                raise ConnectionError("same-host socket closed") from None
            if not readable and not writable:
                raise TimeoutError("timed out sending to the same-host socket")
            if readable:
                got = sock.recv(READ_CHUNK)
                if not got:
                    raise ConnectionError("same-host socket closed")
                self.buf += got
            if writable:
                try:
                    rest = rest[sock.send(rest) :]
                except BlockingIOError:
                    pass

    def _frame(self) -> bytearray:
        """The next answer frame's body (buffered: one read may bring several)."""
        buf = self.buf
        recv = self.sock.recv
        while len(buf) < 4:
            data = recv(65536)
            if not data:
                raise ConnectionError("same-host socket closed")
            buf += data
        n = _HEADER(buf)[0]
        if not 0 < n <= frames.MAX_ANSWER:  # (every answer has its status byte)
            raise self._malformed(f"a frame of {n} bytes")
        end = 4 + n
        while len(buf) < end:
            data = recv(max(65536, min(end - len(buf), READ_CHUNK)))
            if not data:
                raise ConnectionError("same-host socket closed")
            buf += data
        body = buf[4:end]
        del buf[:end]
        return body

    def _answer(self, least: int = 1) -> bytearray:
        """The next answer's body, at least ``least`` bytes when it is OK
        (else the daemon's error is raised)."""
        body = self._frame()
        if body[0] != frames.OK:
            raise error_for(code_from_value(body[0]), bytes(body[1:]).decode(errors="replace"))
        if len(body) < least:
            raise self._malformed(f"an answer of {len(body)} bytes, at least {least} expected")
        return body

    def _malformed(self, what: str) -> ConnectionError:
        """A malformed answer: the stream cannot be trusted any more, so the
        socket is closed and the caller fails over as for a broken socket
        (an OSError, never a KVStoreError)."""
        self.sock.close()
        return ConnectionError(f"malformed answer on the same-host socket: {what}")

    def _settle(self) -> None:
        """Read the answers owed to pipelined calls (lock held; corked frames are sent first)."""
        if self.corked:
            self._send(b"")
        while self.owed:
            name = self.owed.pop(0)
            self.settled += 1
            seq = self.settled
            try:
                body = self._answer()
            except KVStoreError as e:
                if seq in self.keep:  # the caller reads this error from ``answer``
                    self.keep.discard(seq)
                    self.kept[seq] = e
                    continue
                self.late_errors += 1
                log.warning("%s sent without waiting failed: %s", name, e)
                continue
            if seq in self.keep:
                self.keep.discard(seq)
                self.kept[seq] = bytes(body[1:])
                continue
            if name == "Put":
                bad = len(body) - 1 - body.count(KeyStatus.OK, 1) - body.count(KeyStatus.EXISTS, 1)
                if bad:
                    self.late_rejected += bad
                    log.info("a write-behind put could not store %d of its %d blocks", bad, len(body) - 1)

    def lookup(self, ns_wire: bytes, packed_keys: bytes) -> tuple[int, bytes]:
        """(hit_blocks, one Tier value byte per hit block)."""
        msg = frames.lookup_frame(ns_wire, packed_keys)
        with self.lock:
            self._send(msg)
            if self.owed:
                self._settle()
            body = self._answer(frames.HIT.size)
            _, hit = _HIT(body)
            tiers = bytes(body[frames.HIT.size:])
            if len(tiers) != hit:
                raise self._malformed(f"a lookup answer of {hit} hits and {len(tiers)} tiers")
        return hit, tiers

    def nsid(self, ns_wire: bytes) -> int:
        """The daemon's id for this namespace (``frames.NO_NSID``: none yet),
        checked against the session's tenant as a lookup is."""
        msg = frames.nsid_frame(ns_wire)
        with self.lock:
            self._send(msg)
            if self.owed:
                self._settle()
            body = self._answer(frames.NSID.size)
        return int(frames.NSID.unpack_from(body)[1])

    def stage(self) -> tuple[int, str]:
        """This connection's staging file for write-behind puts: (size, path)."""
        with self.lock:
            self._send(frames.stage_frame())
            if self.owed:
                self._settle()
            body = self._answer(frames.STAGE_OK.size)
        _, size = frames.STAGE_OK.unpack_from(body)
        return int(size), bytes(body[frames.STAGE_OK.size :]).decode()

    def send_frames(self, name: str, msgs: list[bytes]) -> None:
        """Several whole frames in one write, none waited for (as ``send_frame``)."""
        with self.lock:
            if len(self.owed) + len(msgs) > MAX_OWED:
                self._settle()
            self._send(b"".join(msgs))
            self.owed += [name] * len(msgs)
            self.sent += len(msgs)

    def send_frame(self, name: str, msg: bytes, keep: bool = False, cork: bool = False) -> int:
        """A whole frame sent without waiting (its answer is read like a
        ``send``'s; ``keep``: and kept for ``answer``). With many answers
        owed, those are read first (they were sent long ago: the socket's
        buffers stay small). ``cork`` (with ``cork_s``): the frame is only
        numbered now; it is written with this client's next frame, by
        ``flush`` or an ``answer``, or ``cork_s`` after the first corked
        frame by a timer thread, whichever comes first. Returns its number
        (see ``sent``)."""
        with self.lock:
            if len(self.owed) >= MAX_OWED:
                self._settle()
            if cork and self.cork_s > 0:
                self.corked.append(msg)
                if len(self.corked) == 1:
                    self.corked_at = time.monotonic()
                    self._arm()
            else:
                self._send(msg)
            self.owed.append(name)
            self.sent += 1
            if keep:  # (under the lock: no other thread's call can read the answer first)
                self.keep.add(self.sent)
            return self.sent

    def is_corked(self, seq: int) -> bool:
        """Whether the ``seq``-th frame sent without waiting is still corked (not written: the daemon has not seen it)."""
        return seq > self.sent - len(self.corked)

    def _arm(self) -> None:
        """Wake the timer thread (started at the first corked frame) for a corked frame (lock held)."""
        if self._timer is None:
            self._timer = threading.Thread(target=_uncork_later, args=(weakref.ref(self), self._wake), daemon=True,
                                           name="kvstore-uncork")
            weakref.finalize(self, self._wake.set)  # (a client dropped without close: its timer ends)
            self._timer.start()
        self._wake.set()

    def uncork_due(self) -> float | None:
        """For the timer thread: write the corked frames if ``cork_s`` has
        passed since the first of them; else the seconds left (None: nothing
        is corked now, or the socket is closed). A socket that fails here is
        closed: the client's next call on it fails over."""
        with self.lock:
            if not self.corked or self.closed:
                return None
            wait = self.corked_at + self.cork_s - time.monotonic()
            if wait > 0:
                return wait
            try:
                self._send(b"")
            except OSError as e:
                log.warning("writing corked frames to the same-host socket failed: %s", e)
                self.close()
                return None
            self.uncorked += 1
            return None

    def call(self, name: str, request: bytes) -> bytes:
        """One of ``frames.CALLS``: the serialized request in, the serialized
        response out (errors raise the exception-tree class of their status)."""
        msg = frames.call_frame(name, request)
        with self.lock:
            self._send(msg)
            if self.owed:
                self._settle()
            body = self._answer()
        return bytes(body[1:])

    def send(self, name: str, request: bytes) -> int:
        """One of ``frames.CALLS`` without waiting for its answer (read
        before the next call's, or by ``flush``). Returns its number (see
        ``sent``)."""
        msg = frames.call_frame(name, request)
        with self.lock:
            self._send(msg)
            self.owed.append(name)
            self.sent += 1
            return self.sent

    def send_kept(self, name: str, request: bytes) -> int:
        """``send``, but its answer is kept for ``answer`` (the caller works
        meanwhile: the daemon answers while it does). Returns its number."""
        return self.send_frame(name, frames.call_frame(name, request), keep=True)

    def answer(self, seq: int) -> bytes:
        """The serialized response to the ``seq``-th frame, sent with
        ``send_kept`` (the answers owed before it are read first); its
        error if the daemon refused it. Each answer is taken once."""
        with self.lock:
            if seq > self.settled:
                self._settle()
            got = self.kept.pop(seq, None)
        if got is None:
            raise Unavailable(f"no answer kept for frame {seq} on the same-host socket")
        if isinstance(got, KVStoreError):
            raise got
        return got

    def in_flight(self, seq: int) -> bool:
        """Whether the answer of the ``seq``-th frame sent without waiting is still unread."""
        return self.settled < seq

    def flush(self) -> None:
        """Wait for every pipelined call's answer."""
        with self.lock:
            self._settle()


def _uncork_later(ref: "weakref.ref[LookupSocketClient]", wake: threading.Event) -> None:
    """The timer thread of a client that corks frames: write them
    ``cork_s`` after the first of them, unless a frame or a flush wrote them
    before. It holds the client only while it looks at it, and ends when the
    client is closed or collected."""
    while True:
        wake.wait()
        wake.clear()
        while True:
            fast = ref()
            if fast is None or fast.closed:
                return
            wait = fast.uncork_due()
            del fast
            if wait is None:
                break
            time.sleep(wait)


def settle_quietly(fast: LookupSocketClient) -> None:
    """At exit (or when a Client is collected): wait for the answers of its
    pipelined calls, so they ran before its session ends."""
    try:
        fast.flush()
    except (OSError, KVStoreError):
        pass
