"""Same-host fast ``Lookup`` (and the shared-memory data path's control
calls): a Unix socket next to the gRPC listener (issues 9, 18). The daemon's
side; the frames are in ``kvstore.wire.frames``, the client's side in
``kvstore.client.socket``.

A ``Lookup`` is the first call of every request an engine serves, and on a
small machine a gRPC round trip costs more than the lookup itself (an empty
unary call is ~0.7 ms on the 2-core box of docs/performance.md, a 1,024-key
index lookup ~0.1 ms). Same-host clients therefore send ``Lookup`` over a
plain stream socket with fixed little-endian frames. The answer is the same
as the gRPC ``Lookup``'s: the same store call, namespace validation, tenant
binding and RPC wrapper (``kvstore.daemon.rpc``: QoS gate, metrics, errors).

The control calls of the shared-memory data path (``Reserve``, ``Commit``,
``Abort``, ``Acquire``, ``Release``) go over the same socket as their
protobuf messages, handled by the same servicer methods (``rpc.LocalContext``).

Cost per call (issue 18): the connection is an ``asyncio.Protocol``, not a
stream reader: frames are parsed in ``data_received`` and each handler's
coroutine is driven to its end on the spot (``drive``), since the store's
calls never wait; only a call that really waits (a full QoS queue, a peer
fetch) continues in a task, and the frames behind it wait for it, so a
connection's calls run and answer in the order they were sent. The answers
to everything one read brought are written back in one write. A client may
therefore send a call without waiting for its answer (its ``Commit`` and
``Release``) and read that answer later: it always runs before the client's
next call.

The shared index (kvstore/daemon/shared_index.py) is published here when
the socket opens (``share_index``) and its header's path goes back in the
hello answer. Its clients then send three more frames: ``nsid`` (a
namespace's id, after the same namespace and tenant checks as a Lookup),
``tally`` (lookups they answered themselves, counted as the daemon counts
its own) and ``reads`` (blocks they read without a lease: a get, and the
blocks' accesses); the last two only for ids this connection was told.

Write-behind puts (issue 18): a ``stage`` frame gives the connection a
staging file of its own (``STAGING_BYTES``, mode 0600 in ``/dev/shm``,
unlinked once the client has mapped it, i.e. at its first ``put`` frame,
or when the connection closes). A ``put`` frame names blocks the client
copied there; the daemon runs ``Reserve`` (DRAM slots), copies the blocks
from staging into them, hashing them (``PUT_UNHASHED``: stored with those
hashes; else a block not matching the client's fails the put whole) and
runs ``Commit``, through the same servicer methods as the calls above: a
put lands whole or not at all, and a client that dies mid-batch leaves
nothing reserved. At most ``MAX_STAGED`` connections hold a staging file.

Who may use it: the socket is created mode 0600, either beside
``server.unix_socket`` or in a private directory (mode 0700) of the
daemon's user (``default_path``); ``server.lookup_socket = "off"`` disables
it. Its path is only sent in a same-host ``Handshake`` answer. A connection
first presents its session id (from that ``Handshake``, which did the
authentication); the session's tenant is bound to every lookup on the
connection, and the connection is refused or closed once the session ends.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import re
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, cast

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kvstore.checksum import copy_many
from kvstore.daemon.private import private_dir, private_umask
from kvstore.daemon import granted
from kvstore.daemon.auth import Principal
from kvstore.daemon.shared_index import SharedIndex, sweep_stale
from kvstore.daemon.slab_owner import pid_alive
from kvstore.daemon.rpc import Aborted, LocalContext, rpc
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.wire import frames
from kvstore.wire.convert import MAX_KEYS
from kvstore.wire.frames import CALLS, MAX_FRAME
from kvstore.wire.shared_index import TALLY
from proto import kvstore_pb2 as pb
from tiers.base import TierKind
from tiers.dram import SHM_DIR

if TYPE_CHECKING:
    from kvstore.daemon.state import DaemonState

__all__ = ["CALLS", "MAX_FRAME", "LookupSocketServer", "default_path", "drive", "fast_lookup", "private_dir"]

log = logging.getLogger("kvstore.daemon.socket_server")

MAX_TALLY = 4096
"""Namespaces in one tally frame."""
OUT_LIMIT = 1 << 20
"""Answers a connection may hold unread in the daemon (bytes): past it, it
stops reading and answering that connection until the client reads."""
STAGING_BYTES = 16 << 20
"""Size of a connection's staging file for write-behind puts."""
MAX_STAGED = 32
"""Connections that may hold a staging file at a time (32 x 16 MiB of shared memory at most)."""
STAGE_NAME = re.compile(r"kvstore-stage-[0-9]+-[0-9]+-[0-9a-f]+")
"""Staging files' names in ``/dev/shm`` (uid, daemon pid): those of dead daemons are removed at start."""
DRAM_WIRE = int(TierKind.DRAM) + 1
"""The wire ``Tier`` value that asks ``Reserve`` for DRAM slots."""
_REQUESTS = tuple(getattr(pb, name + "Request") for name in CALLS)
"""Request message class of each of ``CALLS``."""


def _error(code: grpc.StatusCode, message: str) -> bytes:
    return frames.error_frame(code.value[0], message)


def default_path(unix_socket: str) -> str:
    """Where the same-host socket goes when ``server.lookup_socket`` is empty:
    beside the gRPC Unix socket, else a new name in ``private_dir()``."""
    if unix_socket:
        return unix_socket + ".lookup"
    base = private_dir()
    for name in os.listdir(base):  # sockets left by daemons that died without stopping
        pid = name.split("-")[1] if name.startswith("kv-") and name.endswith(".sock") else ""
        if pid.isdigit() and not pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(base, name))
            except OSError:
                pass
    return os.path.join(base, f"kv-{os.getpid()}-{secrets.token_hex(4)}.sock")


def drive(coro: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """Run ``coro`` as far as it goes without waiting: ``(True, result)``
    when it finished (its exception propagates), else ``(False, task)``
    where the task finishes it on the loop."""
    try:
        waiting = coro.send(None)
    except StopIteration as e:
        return True, e.value
    return False, asyncio.get_running_loop().create_task(_resume(coro, waiting))


async def _resume(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
    """What an asyncio Task does for a coroutine that already ran up to its
    first wait on ``waiting`` (a future, or None for a bare yield)."""
    try:
        while True:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait((waiting,))
            try:
                waiting = coro.send(None)
            except StopIteration as e:
                return e.value
    except asyncio.CancelledError:
        coro.close()
        raise


@rpc("NamespaceId")
async def fast_nsid(d: "DaemonState", body: bytes, context: LocalContext, who: Principal) -> int:
    """An nsid frame -> the namespace's id (``NO_NSID`` when it has none yet),
    after the same namespace and tenant checks as a Lookup."""
    ns = d.namespace_from_wire(body[2:], who)
    return int(d.store.namespace_id(ns, create=False))


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
    if res.hit_blocks:
        d.metrics.lookup_hits(res.tier_codes)
    return frames.answer_frame(res.hit_blocks, (res.tier_codes.astype(np.uint8) + 1).tobytes())


class Staging:
    """A connection's staging file: ``/dev/shm``, created ``O_EXCL`` with
    mode 0600 and mapped; the client maps it by path."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.path: str | None = os.path.join(SHM_DIR, f"kvstore-stage-{os.getuid()}-{os.getpid()}-"
                                                      f"{secrets.token_hex(6)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._map, dtype=np.uint8)
        self.buf[::4096] = 0  # its pages exist and are mapped here from the start (no fault on a put's path)

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def close(self) -> None:
        self.unlink()
        self.buf = np.zeros(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # a copy still holds a view; unmapped when it goes


class _Connection(asyncio.Protocol):
    """One client connection: a hello frame, then calls, answered in order."""

    def __init__(self, server: "LookupSocketServer") -> None:
        self.server = server
        self.daemon = server.daemon
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.sid = ""
        self.lookups: LocalContext | None = None
        self.calls: LocalContext | None = None
        self.waiting: asyncio.Task[Any] | None = None  # a call that could not finish at once
        self.closing = False
        self.nids: set[int] = set()
        """Namespace ids this connection was told (nsid frames): the only ones it may tally."""
        self.staging: Staging | None = None
        """Its staging file for write-behind puts, once asked for (a stage frame)."""
        self.read_paused = False  # (see ``flow``)
        self.out_paused = False
        """Its unread answers passed ``OUT_LIMIT``: no frame is read or answered until they drain."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.set_write_buffer_limits(high=OUT_LIMIT)  # type: ignore[union-attr]
        self.server.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.conns.discard(self)
        self.closing = True
        if self.waiting is not None:
            self.waiting.cancel()
        self.drop_staging()

    def drop_staging(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None
            self.server.staged -= 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.pump()
        self.flow()

    def pause_writing(self) -> None:
        self.out_paused = True

    def resume_writing(self) -> None:
        self.out_paused = False
        self.pump()
        self.flow()

    def flow(self) -> None:
        """Stop reading a client that sends on behind a waiting call past a
        frame's worth, or that leaves more than ``OUT_LIMIT`` of answers
        unread (the rest stays in its socket), until that call is done or
        the answers drain. (kvstore.client.socket reads its answers while
        it sends: it never waits on this.)"""
        full = self.out_paused or (self.waiting is not None and len(self.buf) >= MAX_FRAME)
        if self.transport is None or self.closing or full == self.read_paused:
            return
        self.read_paused = full
        if full:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()
        if self.waiting is None:  # (else the call in flight may still copy from it: connection_lost drops it)
            self.drop_staging()

    def pump(self) -> None:
        """Answer every complete frame in the buffer, in order, in one write;
        stop at a call that has to wait (its task pumps again when done) or
        once the unread answers pass ``OUT_LIMIT`` (``resume_writing`` pumps
        again)."""
        buf, more = self.buf, True
        while more and self.transport is not None:
            out: list[bytes] = []
            room = OUT_LIMIT - self.transport.get_write_buffer_size()
            while room >= 0 and self.waiting is None and not self.closing and not self.out_paused and len(buf) >= 4:
                n = frames.HEADER.unpack_from(buf)[0]
                limit = MAX_FRAME if self.lookups is not None else frames.MAX_HELLO
                if n > limit or (self.lookups is not None and n < 2):
                    out.append(_error(grpc.StatusCode.INVALID_ARGUMENT,
                                      "hello too long" if self.lookups is None else f"frame of {n} bytes"))
                    self.closing = True
                    break
                if len(buf) < 4 + n:
                    break
                body = bytes(buf[4 : 4 + n])
                del buf[: 4 + n]
                answer = self.hello(body) if self.lookups is None else self.frame(body)
                if answer is not None:
                    out.append(answer)
                    room -= len(answer)
            if out:
                self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            more = room < 0 and not self.out_paused  # (the kernel took some: the buffer is under the limit again)
        if self.closing:
            self.close()

    def hello(self, body: bytes) -> bytes:
        refused = frames.hello_refusal(body)
        if refused:  # another socket version: the client goes over gRPC
            self.closing = True
            self.daemon.metrics.rejected("SocketHello", grpc.StatusCode.FAILED_PRECONDITION)
            log.warning("same-host socket: refused a client: %s", refused)
            return _error(grpc.StatusCode.FAILED_PRECONDITION, refused)
        sid, token = frames.parse_hello(body)
        d = self.daemon
        if sid not in d.sessions:
            self.closing = True
            return _error(grpc.StatusCode.NOT_FOUND, f"session {sid!r} is unknown")
        md = [("x-kvstore-session", sid)] + ([("authorization", f"Bearer {token}")] if token else [])
        self.sid = sid
        self.lookups = LocalContext(md, f"local:{sid}", Principal(tenant=d.sessions[sid], admin=False))
        self.calls = LocalContext(md, f"local:{sid}")
        shared = self.server.shared
        path = shared.path.encode() if shared is not None and not shared.failed else b""
        return frames.frame(bytes([frames.OK]) + path)

    def frame(self, body: bytes) -> bytes | None:
        """One call frame -> its answer (None: it continues in a task)."""
        if self.sid not in self.daemon.sessions:  # the session ended (its KeepAlive stream closed)
            self.closing = True
            return _error(grpc.StatusCode.NOT_FOUND, f"session {self.sid!r} ended")
        mark = body[:2]
        coro: Any
        wrap: Callable[[Any], bytes]
        if mark == frames.TALLY_MARK:
            return self.tally(body)
        if mark == frames.READS_MARK:
            return self.reads(body)
        if mark == frames.STAGE_MARK:
            return self.stage()
        if mark == frames.NSID_MARK:
            coro = fast_nsid(self.daemon, body, self.lookups)
            wrap = self.nsid_answer
        elif mark == frames.PUT_MARK:
            try:
                put = self.parse_put(body)
            except KVStoreError as e:
                return _error(grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, InvalidArgument)
                              else grpc.StatusCode.FAILED_PRECONDITION, str(e))
            coro = self.put_staged(put)
            wrap = _put_answer
        elif mark in (frames.GRANT_MARK, frames.GPUT_MARK):  # granted puts (kvstore.daemon.granted)
            coro = (granted.grant if mark == frames.GRANT_MARK else granted.put)(self.daemon, body, self.calls)
            wrap = _raw_answer
        elif frames.is_call(body):
            op = frames.call_method_id(body) - 1
            if not 0 <= op < len(CALLS):
                return _error(grpc.StatusCode.INVALID_ARGUMENT, f"{frames.UNKNOWN_METHOD} {op + 1}")
            name = CALLS[op]
            t0 = time.perf_counter()
            try:
                req = _REQUESTS[op].FromString(body[3:])
            except Exception:  # counted and timed once, as the RPC wrapper does the calls that decode
                self.daemon.metrics.refused(name, "INVALID_ARGUMENT", time.perf_counter() - t0)
                return _error(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: not a valid request message")
            coro = getattr(self.daemon, name)(req, self.calls)
            wrap = _proto_answer
        else:
            coro = fast_lookup(self.daemon, body, self.lookups)
            wrap = _raw_answer
        try:
            done, value = drive(coro)
        except Aborted as e:
            return _error(e.code, e.details)
        if done:
            return wrap(value)
        self.waiting = value
        value.add_done_callback(lambda t: self.resumed(t, wrap))
        return None

    def stage(self) -> bytes:
        """A stage frame: this connection's staging file (made once)."""
        if self.staging is None:
            if self.server.staged >= MAX_STAGED:
                return _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{MAX_STAGED} connections hold a staging file already: put through Reserve")
            try:
                self.staging = Staging(STAGING_BYTES)
            except OSError as e:
                return _error(grpc.StatusCode.UNAVAILABLE, f"no staging file: {e}")
            self.server.staged += 1
        st = self.staging
        if st.path is None:
            return _error(grpc.StatusCode.FAILED_PRECONDITION, "the staging file was mapped already")
        return frames.frame(frames.STAGE_OK.pack(frames.OK, st.size) + st.path.encode())

    def parse_put(self, body: bytes) -> frames.PutFrame:
        """A put frame, checked against this connection's staging file
        before anything is reserved."""
        st = self.staging
        if st is None:
            raise Unavailable("put frame without a staging file (send a stage frame first)")
        st.unlink()  # the client mapped it before it wrote this put: nobody else may open it now
        put = frames.parse_put(body)
        try:
            pb.Namespace.FromString(put.ns_wire)
        except DecodeError:
            raise InvalidArgument("the put frame's namespace is not a Namespace message") from None
        n, size = len(put.keys) // 16, put.block_bytes
        if not 0 < n <= MAX_KEYS or size <= 0:
            raise InvalidArgument(f"put of {n} blocks of {size} bytes")
        if put.offset < 0 or put.offset + n * size > st.size:
            raise InvalidArgument(f"put of {n} x {size} bytes at staging offset {put.offset} overruns the "
                                  f"{st.size}-byte staging file")
        return put

    async def put_staged(self, put: frames.PutFrame) -> list[int]:
        """Reserve DRAM slots, copy the blocks from staging into them,
        commit: the servicer's own Reserve and Commit (the same checks,
        metrics and tenant shares as those calls over this socket)."""
        d: Any = self.daemon  # (the servicer: DaemonState and its KVStore methods)
        ctx = self.calls
        r = await d.Reserve(pb.ReserveRequest(ns=pb.Namespace.FromString(put.ns_wire), keys_packed=put.keys,
                                              parent=put.parent, block_bytes=put.block_bytes,
                                              tier=cast(Any, DRAM_WIRE)), ctx)
        sa = r.slots
        statuses = list(sa.status)
        if not r.reservation_id:
            return statuses
        ok = [i for i, x in enumerate(statuses) if x == 0]
        st, size, at, sent = self.staging, put.block_bytes, put.offset, put.checksums
        try:
            if st is None:
                raise Aborted(grpc.StatusCode.UNAVAILABLE, "the connection closed")
            dram = d.store.dram
            got = copy_many([dram.view(int(sa.offset[i]), size) for i in ok],
                            [st.buf[at + i * size : at + (i + 1) * size] for i in ok], dram.copy_threads).tolist()
            # the staging bytes changed after the client hashed them (PUT_UNHASHED: nothing to
            # compare, the blocks are stored with the landing copy's hashes)
            if sent is not None and got != [sent[i] for i in ok]:
                raise Aborted(grpc.StatusCode.INVALID_ARGUMENT,
                              "a block of the put does not match its checksum: the put is not stored")
        except BaseException as e:
            await d.Abort(pb.AbortRequest(reservation_id=r.reservation_id), ctx)
            if isinstance(e, (Aborted, asyncio.CancelledError)):
                raise
            log.exception("a staged put failed")
            raise Aborted(grpc.StatusCode.INTERNAL, f"internal error in a staged put: {type(e).__name__}") from None
        c = await d.Commit(pb.CommitRequest(reservation_id=r.reservation_id, checksums=got), ctx)
        for i, res in zip(ok, c.results):
            statuses[i] = int(res.status)
        return statuses

    def nsid_answer(self, nid: int) -> bytes:
        if nid != frames.NO_NSID:
            self.nids.add(nid)
        return frames.frame(frames.NSID.pack(frames.OK, nid))

    def tally(self, body: bytes) -> bytes:
        """Count lookups the client answered from the shared index: only in
        namespaces this connection was told the id of, as the daemon counts
        its own (``TieredStore.count_lookups``, per-tier hit metrics)."""
        recs = memoryview(body)[2:]
        if len(recs) % TALLY.size or len(recs) // TALLY.size > MAX_TALLY:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, f"tally of {len(recs)} bytes")
        d = self.daemon
        bad = 0
        for nid, lookups, blocks, hits, hbm, dram, ssd in TALLY.iter_unpack(recs):
            if nid not in self.nids or hbm + dram + ssd != hits or not d.store.count_lookups(nid, lookups, blocks,
                                                                                             hits):
                bad += 1
                continue
            for code, n in ((0, hbm), (1, dram), (2, ssd)):
                if n:
                    d.metrics.lookup_tier_hits(code, n)
        if bad:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, f"{bad} tally records refused (unknown namespace id "
                                                            "or inconsistent counts)")
        return frames.frame(bytes([frames.OK]))

    def reads(self, body: bytes) -> bytes:
        """Count blocks the client read from the slab itself (their accesses
        count for eviction as an Acquire's do): only in namespaces this
        connection was told the id of."""
        if len(body) < 2 + frames.READS.size:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, "short reads frame")
        nid, asked = frames.READS.unpack_from(body, 2)
        keys = body[2 + frames.READS.size :]
        if len(keys) % 16 or len(keys) // 16 > MAX_KEYS or asked > MAX_KEYS or nid not in self.nids:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, "reads frame refused (bad keys or unknown namespace id)")
        self.daemon.store.count_reads(nid, keys, asked)
        return frames.frame(bytes([frames.OK]))

    def resumed(self, task: asyncio.Task[Any], wrap: Any) -> None:
        self.waiting = None
        if task.cancelled() or self.closing or self.transport is None:
            return
        exc = task.exception()
        if isinstance(exc, Aborted):
            answer = _error(exc.code, exc.details)
        elif exc is not None:
            answer = _error(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        else:
            answer = wrap(task.result())
        self.transport.write(answer)
        self.pump()
        self.flow()


def share_index(d: "DaemonState") -> SharedIndex | None:
    """Publish the daemon's shared index when ``server.shared_index`` is on
    and it can be (the native helper is built, DRAM admission is off); None
    (logged) otherwise: clients then ask the daemon for every lookup."""
    if not d.config.server.shared_index:
        return None
    raw = d.disk.raw
    if raw.place.freq is not None:
        log.info("no shared index: DRAM admission counts the keys of every lookup, so lookups go to the daemon")
        return None
    try:
        shared = SharedIndex(raw, d.disk.lock)
        shared.start()
    except OSError as e:
        log.warning("no shared index (%s): same-host lookups go to the daemon", e)
        return None
    return shared


def _put_answer(statuses: list[int]) -> bytes:
    return frames.frame(bytes([frames.OK]) + bytes(statuses))


def _proto_answer(resp: Any) -> bytes:
    return frames.reply_frame(resp.SerializeToString())


def _raw_answer(answer: bytes) -> bytes:
    return answer


class LookupSocketServer:
    """The daemon side: one asyncio Unix-socket server on the daemon's loop."""

    def __init__(self, daemon: "DaemonState", path: str) -> None:
        self.daemon = daemon
        self.path = path
        self.server: asyncio.AbstractServer | None = None
        self.conns: set[_Connection] = set()
        self.shared: SharedIndex | None = None
        """The shared index (kvstore/daemon/shared_index.py), when published."""
        self.staged = 0
        """Connections holding a staging file."""

    async def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        loop = asyncio.get_running_loop()
        with private_umask():  # 0600 from the bind on, whatever the operator's umask
            self.server = await loop.create_unix_server(lambda: _Connection(self), path=self.path)
        os.chmod(self.path, 0o600)
        sweep_stale(SHM_DIR, STAGE_NAME)  # staging files a crashed daemon left before their first put
        self.shared = share_index(self.daemon)

    async def stop(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self.server is not None:
            self.server.close()
            for c in list(self.conns):
                c.close()
            await self.server.wait_closed()
            self.server = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
