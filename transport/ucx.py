"""Block transfer between daemons over UCX (the ``ucxx`` package).

This module moves memory regions and knows nothing about the index: a
:class:`BlockServer` answers a request (an opaque header) with the regions its
``provider`` hands it, a :class:`BlockClient` receives them straight into the
destinations its ``alloc`` hands it and checks each block's XXH3-64 on arrival.
The cluster layer (``transport/cluster.py``) encodes namespace, credential and
keys in the header and pins/unpins blocks in the provider.

Wire protocol (all tag messages on the one endpoint a client opens to a
server's listener; ucxx hashes our tags with the endpoint's own tags, so two
connections never match each other's messages)::

    client -> server  REQUEST   TAG_REQ            preamble + header
    server -> client  TABLE     _tag_tab(seq)      head + lengths[count] + checksums[count]
    client -> server  GO        _tag_go(seq)       uint8 want[count]   (only if status OK and
                                                                        some block is present)
    server -> client  BLOCK i   _tag_blk(seq, i)   the region, received into alloc()'s view

``seq`` is unique per client process, so the answers of concurrent fetches
over one endpoint never mix.  The GO round trip lets the receiver say which
blocks it has room for (``alloc`` may return ``None``), so nothing is sent
that nobody receives.

Deadlines: every wait of a fetch is bounded by the caller's deadline; on a
timeout or any transport error the pooled endpoint is aborted and dropped
(the next fetch to that address reconnects).  How late data is kept out of
the destinations: UCX writes a destination only through a receive posted on
that endpoint.  ``Endpoint.abort()`` force-closes it -- its TCP connections
are closed and every receive still posted on it is completed as cancelled --
and ``fetch`` returns only after every receive it posted has completed (data,
error or cancellation), waiting at most :data:`CANCEL_GRACE_S` more.  When a
receive is still unconfirmed after that (never seen in testing) the result's
``error`` says so and the destinations must not be reused.

Server side: the request carries the client's remaining time; the server
bounds the provider call, the GO wait and the sends by it (plus
:data:`SERVER_SLACK_S`).  On a timeout or error it aborts the endpoint, so
UCX stops reading the regions, and then calls ``release()``: exactly once per
successful provider call, on success and failure alike.

UCX setup (once per process, on the first event loop that uses it): progress
thread with Python futures (no busy polling while idle).  Peer failure
detection (``endpoint_error_handling``) makes UCX leave out its shared-memory
transports, so between processes on one host the data goes over TCP; on a
real cluster UCX picks RDMA by itself.  ``UCX_NET_DEVICES`` defaults to ``lo``
when the first address used is a loopback one.  Note: ucxx's listener binds
its port on every interface (ucxx has no bind address); the other UCX
sockets bind to the chosen devices only.  Only one event loop at a time may
use UCX in a process; a new loop (tests) re-binds the notifier thread.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Final, Sequence

import numpy as np

from kvstore.checksum import checksum
from kvstore.errors import InvalidArgument

__all__ = ["Alloc", "BlockClient", "BlockServer", "FetchResult", "Provider", "Served",
           "MAX_BLOCKS", "MAX_HEADER", "shutdown", "ucx_module"]

log = logging.getLogger("kvstore.transport.ucx")

MAX_HEADER: Final = 1 << 20
"""Largest request header in bytes (the server's receive buffer per endpoint)."""
MAX_BLOCKS: Final = 1 << 20
"""Most blocks in one fetch."""
CANCEL_GRACE_S: Final = 1.0
"""After aborting an endpoint, how long fetch waits for UCX to confirm every
receive it posted has completed or been cancelled."""
SERVER_SLACK_S: Final = 0.5
"""Added to the client's remaining time for the server's own waits."""

_MAGIC: Final = b"KVB1"
_PRE: Final = struct.Struct("<4sIQIId")  # magic, flags, seq, count, header length, timeout (s)
_HEAD: Final = struct.Struct("<QII240s")  # seq, status, error length, error text
ST_OK, ST_REFUSED, ST_INVALID, ST_FAILED = 0, 1, 2, 3
_STATUS_WORD: Final = {ST_REFUSED: "refused", ST_INVALID: "invalid request", ST_FAILED: "failed"}

_SEQ = itertools.count(1)  # unique per process: tags of concurrent fetches never collide
_SEQ_MASK: Final = (1 << 37) - 1

# Tags are ints below 2**61 - 1: ucxx mixes ``hash(tag)`` with the endpoint's
# own tag, and ``hash`` of such an int is the int itself in every process
# (``hash`` of str/bytes is salted per process; never use those here).
TAG_REQ: Final = 4 << 57


def _tag_tab(seq: int) -> int:
    return (1 << 57) | (seq & _SEQ_MASK)


def _tag_go(seq: int) -> int:
    return (2 << 57) | (seq & _SEQ_MASK)


def _tag_blk(seq: int, i: int) -> int:
    return (3 << 57) | (i << 37) | (seq & _SEQ_MASK)


# ------------------------------------------------------------------ types
@dataclass(slots=True, frozen=True)
class Served:
    """What a provider hands the server for one request."""

    lengths: np.ndarray
    """int64 per requested block; 0 = absent on this peer."""
    checksums: np.ndarray
    """uint64 per block: XXH3-64 of the payload, as the sender's index has it."""
    regions: list[memoryview]
    """One per PRESENT block, in order: views over the sender's slab, no copies."""
    release: Callable[[], None]
    """Called exactly once when the send completed or failed (the provider unpins there)."""


Provider = Callable[[bytes], Awaitable[Served]]
"""Answers an opaque request header; may raise PermissionError / ValueError,
which the client sees as ``FetchResult.error`` (all ``ok`` False)."""


@dataclass(slots=True)
class FetchResult:
    ok: np.ndarray
    """bool per requested block: arrived AND checksum verified."""
    lengths: np.ndarray
    """int64 per block as the peer reported (0 = absent)."""
    nbytes: int
    """Bytes of the blocks that arrived verified."""
    seconds: float
    error: str | None
    """Whole-call failure (peer gone, deadline, refused); then ok is all False."""
    corrupt: int = 0
    """Blocks that arrived but failed the checksum."""
    checksums: np.ndarray | None = None
    """uint64 per block as the peer reported (valid where ``ok``): what the
    receiver commits, so it need not hash the bytes again."""


Alloc = Callable[[np.ndarray], Sequence["memoryview | None"]]
"""Given per-block lengths, a destination per block (None = skip that block)."""


# -------------------------------------------------------------- UCX setup
_bound_loop: asyncio.AbstractEventLoop | None = None


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ucx_module(host: str = "127.0.0.1", net_devices: str | None = None) -> Any:
    """The ``ucxx`` module, its context initialised for the running loop
    (``host``: the first address used, to pick ``lo`` for loopback; the
    block server and client call it; a caller may call it first to pay
    UCX's one-time set-up outside a deadline)."""
    global _bound_loop
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx

    loop = asyncio.get_running_loop()
    if _bound_loop is loop:
        return ucxx
    if _bound_loop is None:
        opts: dict[str, str] = {}
        if net_devices is None and "UCX_NET_DEVICES" not in os.environ and _is_loopback(host):
            net_devices = "lo"
        if net_devices and net_devices != "all":
            opts["NET_DEVICES"] = net_devices
        try:
            # thread progress + Python futures: the only mode that does not poll while idle
            ucxx.init(options=opts, progress_mode="thread", enable_python_future=True)
        except RuntimeError as e:
            if "already initiated" not in str(e):
                raise
            # someone else (bare ucxx in a benchmark) initialised UCX first: bind it to this loop
            _rebind(ucxx, loop)
        _bound_loop = loop
        return ucxx
    _rebind(ucxx, loop)  # a new event loop (tests): move the notifier thread and progress to it
    _bound_loop = loop
    return ucxx


def _rebind(ucxx: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Bind the initialised UCX context to ``loop``: restart the notifier
    thread (its futures belong to the loop it started on) and attach progress.

    ucxx publishes no accessor for its application context, whose notifier
    thread must be restarted here; ``core._get_ctx()`` is the one place this
    module reaches into ucxx's private names."""
    ctx = ucxx.core._get_ctx()
    if ctx.notifier_thread is not None:  # its futures belong to the old loop
        ctx.stop_notifier_thread()
        ctx.start_notifier_thread()
    ucxx.core.continuous_ucx_progress(loop)


def shutdown() -> None:
    """Stop UCX's notifier thread (a non-daemon thread that otherwise keeps
    the process from exiting) and release the context.  Call once at process
    exit, after every BlockServer/BlockClient is stopped/closed."""
    global _bound_loop
    if "ucxx" not in sys.modules or _bound_loop is None:
        return
    from ucxx import core

    core.stop_notifier_thread()
    try:
        core.reset()
    except Exception as e:  # noqa: BLE001 - objects still alive: the thread is stopped anyway
        log.debug("ucxx reset: %r", e)
    _bound_loop = None


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgument(f"peer address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _abort(ep: Any) -> None:
    try:
        ep.abort()
    except Exception as e:  # noqa: BLE001 - closing a broken endpoint
        log.debug("abort: %r", e)


# ---------------------------------------------------------------- server
class BlockServer:
    """Answers block requests from peers: one handler per client endpoint,
    one task per request."""

    def __init__(self, provider: Provider, host: str = "127.0.0.1", port: int = 0, *,
                 net_devices: str | None = None) -> None:
        self._provider = provider
        self._host, self._port = host, port
        self._net_devices = net_devices
        self._listener: Any = None
        self._eps: set[Any] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.requests = 0
        """Requests answered (any status); for tests and metrics."""

    @property
    def endpoints(self) -> int:
        """Client endpoints currently open."""
        return len(self._eps)

    async def start(self) -> str:
        ucxx = ucx_module(self._host, self._net_devices)
        self._listener = ucxx.create_listener(self._serve, port=self._port)
        return f"{self._host}:{self._listener.port}"

    async def stop(self) -> None:
        self._closing = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for ep in list(self._eps):
            _abort(ep)
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_GRACE_S + 1)

    async def _serve(self, ep: Any) -> None:
        if self._closing:
            _abort(ep)
            return
        self._eps.add(ep)
        inbox = np.empty(_PRE.size + MAX_HEADER, dtype=np.uint8)
        try:
            while not self._closing:
                await ep.recv(inbox, tag=TAG_REQ)
                magic, _flags, seq, count, hlen, timeout = _PRE.unpack_from(inbox.data, 0)
                if magic != _MAGIC or hlen > MAX_HEADER or count > MAX_BLOCKS:
                    log.warning("bad request preamble from a peer; closing its endpoint")
                    break
                header = inbox[_PRE.size:_PRE.size + hlen].tobytes()
                t = asyncio.ensure_future(self._answer(ep, seq, count, header, timeout))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
        except Exception as e:  # noqa: BLE001 - peer closed or died: the normal end
            log.debug("endpoint ended: %r", e)
        finally:
            self._eps.discard(ep)
            _abort(ep)

    async def _answer(self, ep: Any, seq: int, count: int, header: bytes, timeout: float) -> None:
        end = time.monotonic() + max(0.0, min(timeout, 3600.0)) + SERVER_SLACK_S
        served: Served | None = None
        status, msg = ST_OK, ""
        try:
            try:
                served = await _provide(self._provider, header, end)
                msg = _check_served(served, count)
                status = ST_FAILED if msg else ST_OK
            except PermissionError as e:
                status, msg = ST_REFUSED, str(e) or "permission denied"
            except ValueError as e:
                status, msg = ST_INVALID, str(e) or "invalid request"
            except asyncio.TimeoutError:
                status, msg = ST_FAILED, "provider timed out"
            except Exception as e:  # noqa: BLE001 - reported to the peer, logged here
                log.exception("block provider failed")
                status, msg = ST_FAILED, f"provider error: {type(e).__name__}: {e}"
            self.requests += 1
            table = _table(seq, status, msg, served if status == ST_OK else None, count)
            await _bounded(ep.send(table, tag=_tag_tab(seq)), end)
            if status != ST_OK or served is None or not served.regions:
                return
            want = np.zeros(count, dtype=np.uint8)
            await _bounded(ep.recv(want, tag=_tag_go(seq)), end)
            present = np.flatnonzero(served.lengths > 0)
            sends = [ep.send(served.regions[j], tag=_tag_blk(seq, int(i)))
                     for j, i in enumerate(present) if want[i]]
            if sends:
                await _bounded(asyncio.gather(*sends), end)
        except Exception as e:  # noqa: BLE001 - timeout or transport error: drop the endpoint
            log.debug("request %d aborted: %r", seq, e)
            _abort(ep)  # UCX stops reading the regions before they are released
        finally:
            if served is not None:
                try:
                    served.release()
                except Exception:  # noqa: BLE001
                    log.exception("release() of a served batch failed")


async def _provide(provider: Provider, header: bytes, end: float) -> Served:
    """Call the provider, bounded by ``end`` but never cancelled: a provider
    that answers after the deadline has its batch released at once, so a pin
    it took is never leaked."""
    task = asyncio.ensure_future(provider(header))
    done, _ = await asyncio.wait([task], timeout=max(0.0, end - time.monotonic()))
    if not done:
        task.add_done_callback(_release_late)
        raise asyncio.TimeoutError()
    return task.result()


def _release_late(task: asyncio.Future[Any]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    s = task.result()
    try:
        s.release()
    except Exception:  # noqa: BLE001
        log.exception("release() of a late batch failed")


def _check_served(s: Any, count: int) -> str:
    if not isinstance(s, Served):
        return f"provider returned {type(s).__name__}, not Served"
    if len(s.lengths) != count or len(s.checksums) != count:
        return f"provider answered {len(s.lengths)} blocks for a request of {count}"
    present = np.asarray(s.lengths) > 0
    if int(present.sum()) != len(s.regions):
        return f"provider gave {len(s.regions)} regions for {int(present.sum())} present blocks"
    for n, r in zip(np.asarray(s.lengths)[present], s.regions):
        if r.nbytes != int(n):
            return f"provider region of {r.nbytes} bytes for a block of {int(n)}"
    return ""


def _table(seq: int, status: int, msg: str, served: Served | None, count: int) -> np.ndarray:
    out = np.zeros(_HEAD.size + 16 * count, dtype=np.uint8)
    text = msg.encode("utf-8", "replace")[:240]
    _HEAD.pack_into(out.data, 0, seq, status, len(text), text)
    if served is not None:
        body = out[_HEAD.size:]
        body[: 8 * count].view(np.int64)[:] = np.asarray(served.lengths, dtype=np.int64)
        body[8 * count:].view(np.uint64)[:] = np.asarray(served.checksums, dtype=np.uint64)
    return out


async def _bounded(aw: Awaitable[Any], end: float) -> Any:
    return await asyncio.wait_for(aw, max(0.0, end - time.monotonic()))


# ---------------------------------------------------------------- client
class _Conn:
    __slots__ = ("ep", "address", "fetches")

    def __init__(self, ep: Any, address: str) -> None:
        self.ep, self.address, self.fetches = ep, address, 0


class BlockClient:
    """Fetches blocks from peers: one pooled endpoint per peer address, reused
    by every fetch; safe for concurrent fetches."""

    def __init__(self, *, connect_timeout_s: float = 2.0, net_devices: str | None = None) -> None:
        self._connect_timeout = connect_timeout_s
        self._net_devices = net_devices
        self._conns: dict[str, _Conn] = {}
        self._connecting: dict[str, asyncio.Future[_Conn]] = {}
        self.connects = 0
        """Endpoints opened so far (reuse shows as fetches >> connects)."""

    @property
    def pooled(self) -> list[str]:
        """Addresses with a live pooled endpoint."""
        return [a for a, c in self._conns.items() if not c.ep.closed]

    async def _get(self, address: str, timeout: float) -> _Conn:
        c = self._conns.get(address)
        if c is not None and not c.ep.closed:
            return c
        if c is not None:
            self._drop(c)
        pending = self._connecting.get(address)
        if pending is None:
            pending = asyncio.ensure_future(self._connect(address))
            self._connecting[address] = pending
            pending.add_done_callback(lambda _f: self._connecting.pop(address, None))
            # a connect whose waiter gave up still ends; retrieve its failure
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.wait_for(asyncio.shield(pending), timeout)

    async def _connect(self, address: str) -> _Conn:
        host, port = _split_address(address)
        ucxx = ucx_module(host, self._net_devices)
        ep = await asyncio.wait_for(
            ucxx.create_endpoint(host, port, connect_timeout=self._connect_timeout),
            self._connect_timeout + 0.5)
        c = _Conn(ep, address)
        self._conns[address] = c
        self.connects += 1
        return c

    def _drop(self, c: _Conn) -> None:
        if self._conns.get(c.address) is c:
            del self._conns[c.address]
        _abort(c.ep)

    async def close(self) -> None:
        for c in list(self._conns.values()):
            self._drop(c)
        for f in list(self._connecting.values()):
            f.cancel()

    async def fetch(self, address: str, header: bytes, count: int, alloc: Alloc,
                    deadline_s: float) -> FetchResult:
        """Fetch ``count`` blocks named by ``header`` from the peer at ``address``
        into the views ``alloc`` returns; never raises for peer or transport
        faults (they come back as ``error``)."""
        if not 0 <= count <= MAX_BLOCKS:
            raise InvalidArgument(f"count must be in [0, {MAX_BLOCKS}], got {count}")
        if len(header) > MAX_HEADER:
            raise InvalidArgument(f"header of {len(header)} bytes exceeds the limit of {MAX_HEADER}")
        t0 = time.monotonic()
        end = t0 + max(0.0, float(deadline_s))
        ok = np.zeros(count, dtype=bool)
        lengths = np.zeros(count, dtype=np.int64)

        def failed(msg: str) -> FetchResult:
            return FetchResult(np.zeros(count, dtype=bool), lengths, 0, time.monotonic() - t0, msg)

        try:
            conn = await self._get(address, max(0.0, min(self._connect_timeout + 0.5, end - t0)))
        except ValueError:
            raise
        except (asyncio.TimeoutError, TimeoutError):
            return failed(f"connect to {address} timed out")
        except Exception as e:  # noqa: BLE001 - peer unreachable
            return failed(f"connect to {address} failed: {type(e).__name__}: {e}")
        conn.fetches += 1
        ep = conn.ep
        seq = next(_SEQ)
        posted: list[asyncio.Future[Any]] = []
        try:
            table = np.empty(_HEAD.size + 16 * count, dtype=np.uint8)
            trecv = asyncio.ensure_future(ep.recv(table, tag=_tag_tab(seq)))
            posted.append(trecv)
            req = bytearray(_PRE.size + len(header))
            _PRE.pack_into(req, 0, _MAGIC, 0, seq, count, len(header), max(0.0, end - time.monotonic()))
            req[_PRE.size:] = header
            await _bounded(ep.send(req, tag=TAG_REQ), end)
            await _wait_all([trecv], end)
            _seq, status, elen, etext = _HEAD.unpack_from(table.data, 0)
            if status != ST_OK:
                word = _STATUS_WORD.get(status, f"status {status}")
                return failed(f"peer {address} {word}: {etext[:elen].decode('utf-8', 'replace')}")
            body = table[_HEAD.size:]
            lengths[:] = body[: 8 * count].view(np.int64)
            sums = body[8 * count:].view(np.uint64).copy()
            present = np.flatnonzero(lengths > 0)
            if present.size == 0:
                return FetchResult(ok, lengths, 0, time.monotonic() - t0, None, 0, sums)
            try:
                dests = alloc(lengths.copy())
                if len(dests) != count:
                    raise InvalidArgument(f"alloc returned {len(dests)} destinations for {count} blocks")
            except Exception as e:  # noqa: BLE001 - tell the peer to send nothing
                await _bounded(ep.send(np.zeros(count, np.uint8), tag=_tag_go(seq)), end)
                return failed(f"alloc failed: {type(e).__name__}: {e}")
            want = np.zeros(count, dtype=np.uint8)
            verified: dict[int, bool] = {}

            async def one(i: int, dst: Any) -> None:
                await ep.recv(dst, tag=_tag_blk(seq, i))
                verified[i] = checksum(dst) == int(sums[i])

            for i in present.tolist():
                d = dests[i]
                if d is not None and d.nbytes == lengths[i] and not d.readonly:
                    want[i] = 1
                    posted.append(asyncio.ensure_future(one(i, d)))
            await _bounded(ep.send(want, tag=_tag_go(seq)), end)
            await _wait_all(posted, end)
            corrupt = 0
            for j, good in verified.items():
                ok[j] = good
                corrupt += not good
            nbytes = int(lengths[ok].sum())
            return FetchResult(ok, lengths, nbytes, time.monotonic() - t0, None, corrupt, sums)
        except Exception as e:  # noqa: BLE001 - deadline or transport fault: drop the endpoint
            self._drop(conn)
            unconfirmed = await _settle(posted)
            if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
                msg = f"fetch from {address} missed its deadline of {deadline_s:g}s"
            else:
                msg = f"fetch from {address} failed: {type(e).__name__}: {e}"
            if unconfirmed:
                msg += f"; {unconfirmed} receives not confirmed cancelled: do not reuse the destinations"
            return failed(msg)


async def _wait_all(futs: list[asyncio.Future[Any]], end: float) -> None:
    """Wait for every future until ``end`` without cancelling them; raise the
    first failure, or TimeoutError."""
    pending = [f for f in futs if not f.done()]
    while pending:
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise asyncio.TimeoutError()
        done, still = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        pending = list(still)
    for f in futs:
        if f.exception() is not None:
            raise f.exception()  # type: ignore[misc]


async def _settle(futs: list[asyncio.Future[Any]]) -> int:
    """After the endpoint was aborted: wait (bounded) until UCX has completed
    every posted receive; return how many are still outstanding."""
    pending = [f for f in futs if not f.done()]
    if pending:
        _done, still = await asyncio.wait(pending, timeout=CANCEL_GRACE_S)
        pending = list(still)
    for f in futs:
        if f.done() and not f.cancelled():
            f.exception()  # retrieved: no "never retrieved" warnings
    if pending:
        log.error("%d UCX receives still outstanding after abort", len(pending))
    return len(pending)
