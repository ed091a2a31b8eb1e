"""Block transfer between daemons over UCX (the ``ucxx`` package).

This module moves memory regions and knows nothing about the index: a
:class:`BlockServer` answers a request (an opaque header) with the regions its
``provider`` hands it, a :class:`BlockClient` receives them straight into the
destinations its ``alloc`` hands it and, unless the caller says its bytes are
checked later (``fetch(..., verify=False)``), checks each block's XXH3-64 on
arrival.
The cluster layer (``transport/cluster.py``) encodes namespace, credential and
keys in the header and pins/unpins blocks in the provider.

Wire protocol: ``transport/ucx_wire.py`` (the request, the table, the
GO of the two-step fetch, the sized fetch's one round trip).

Deadlines: every wait of a fetch is bounded by the caller's deadline; on a
timeout or any transport error the pooled endpoint is aborted and dropped
(the next fetch to that address reconnects).  How late data is kept out of
the destinations: UCX writes a destination only through a receive posted on
that endpoint.  ``Endpoint.abort()`` force-closes it -- its TCP connections
are closed and every receive still posted on it is completed as cancelled --
and ``fetch`` returns only after every receive it posted has completed (data,
error or cancellation), waiting at most :data:`CANCEL_GRACE_S` more.  When a
receive is still unconfirmed after that (never seen in testing) the result's
``unconfirmed`` counts them and the destinations must not be reused. A
failed fetch's ``fault`` (``FetchFault``) says what failed; callers decide on
it, never on ``error``'s wording.

Server side: the request carries the client's remaining time; the server
bounds the provider call, the GO wait and the sends by it, at most
``BlockServer.max_wait_s`` (plus :data:`SERVER_SLACK_S`).  On a timeout or error it aborts the endpoint, so
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
import sys
import time
from typing import Any, Callable, Final, Iterable

import numpy as np

from kvstore.checksum import checksum
from kvstore.errors import InvalidArgument
from transport import ucx_wire as wire
from transport.ucx_waits import bounded, settle, wait_all
from transport.ucx_wire import MAX_BLOCKS, MAX_HEADER, Alloc, FetchFault, FetchResult, Provider, Served

__all__ = ["Alloc", "BlockClient", "BlockServer", "FetchFault", "FetchResult", "Provider", "Served",
           "MAX_BLOCKS", "MAX_HEADER", "shutdown", "ucx_module"]

log = logging.getLogger("kvstore.transport.ucx")

_SEQ = itertools.count(1)  # unique per process: tags of concurrent fetches never collide

CANCEL_GRACE_S: Final = 1.0
"""After aborting an endpoint, how long fetch waits for UCX to confirm every
receive it posted has completed or been cancelled."""
SERVER_SLACK_S: Final = 0.5
"""Added to the client's remaining time for the server's own waits."""

MAX_REQUESTS: Final = 64
"""Default of ``BlockServer.max_requests``."""
MAX_CONNECTIONS: Final = 256
"""Default of ``BlockServer.max_connections``."""

PUT_RNDV_TLS: Final = frozenset({"tcp", "self"})


def _tuning(opts: dict[str, str]) -> dict[str, str]:
    """UCX options added at init; an explicit ``UCX_*`` variable wins.
    Loopback (``lo`` chosen here, ``UCX_TLS`` unset): ``TLS=tcp,self`` (all
    that works between processes there). With tcp/self only:
    ``RNDV_SCHEME=put_zcopy``, 2-3x UCX's default choice over TCP (measured
    in docs/transport.md); never with shared memory, where UCX 1.21 crashed."""
    out: dict[str, str] = {}
    tls = os.environ.get("UCX_TLS")
    if tls is None and opts.get("NET_DEVICES") == "lo":
        tls = out["TLS"] = "tcp,self"
    if ("UCX_RNDV_SCHEME" not in os.environ and tls
            and {t.strip() for t in tls.split(",")} <= PUT_RNDV_TLS):
        out["RNDV_SCHEME"] = "put_zcopy"
    return out


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
    UCX's one-time set-up outside a deadline).

    ucxx publishes no accessor for its application context, whose notifier
    thread must be restarted when the event loop changes (tests): see
    ``_app_context``."""
    global _bound_loop
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx
    from ucxx import core

    loop = asyncio.get_running_loop()
    ctx = _app_context(core)
    if ctx is None:
        opts: dict[str, str] = {}
        if net_devices is None and "UCX_NET_DEVICES" not in os.environ and _is_loopback(host):
            net_devices = "lo"
        if net_devices and net_devices != "all":
            opts["NET_DEVICES"] = net_devices
        opts.update(_tuning(opts))
        # thread progress + Python futures: the only mode that does not poll while idle
        ucxx.init(options=opts, progress_mode="thread", enable_python_future=True)
        _bound_loop = loop
    elif _bound_loop is not loop:
        if ctx.notifier_thread is not None:  # its futures belong to the old loop
            ctx.stop_notifier_thread()
            ctx.start_notifier_thread()
        ctx.continuous_ucx_progress(loop)
        _bound_loop = loop
    return ucxx


def _app_context(core: Any) -> Any:
    """ucxx's application context, or None before ``ucxx.init`` (ucxx has no
    public accessor that does not create one: this is the one private read)."""
    return core._ctx


def shutdown() -> None:
    """Stop UCX's notifier thread (a non-daemon thread that otherwise keeps
    the process from exiting) and release the context.  Call once at process
    exit, after every BlockServer/BlockClient is stopped/closed."""
    global _bound_loop
    if "ucxx" not in sys.modules:
        return
    from ucxx import core

    if _app_context(core) is None:
        return
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
                 net_devices: str | None = None, max_wait_s: float = 3600.0,
                 max_requests: int = MAX_REQUESTS, max_connections: int = MAX_CONNECTIONS) -> None:
        self._provider = provider
        self.max_connections = int(max_connections)
        """Connections open at once (from all peers: UCX does not say who connected); one more is
        closed at once, before its receive buffer (``ucx_wire.INBOX``, over 1 MiB) is allocated."""
        self.refused_connections = 0
        """Connections closed for being over ``max_connections``; for tests and logs."""
        self.max_requests = int(max_requests)
        """Requests of one connection served at once; the next is refused (head only) until one ends."""
        self.max_wait_s = float(max_wait_s)
        """Cap on the time a request may take here, whatever the client's
        request says (plus ``SERVER_SLACK_S``): a provider that pins what it
        serves for a limited time (a lease) passes less than that time, so
        no region is sent after its pin could have lapsed."""
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
        if self._closing or len(self._eps) >= self.max_connections:
            if not self._closing:
                self.refused_connections += 1
                n = self.refused_connections
                if n & (n - 1) == 0:  # 1, 2, 4, ...: a flood does not flood the log
                    log.warning("%d peer connections over the limit of %d closed so far", n, self.max_connections)
            _abort(ep)
            return
        self._eps.add(ep)
        inbox = wire.inbox()
        busy: set[asyncio.Task[Any]] = set()  # this connection's requests being answered
        try:
            while not self._closing:
                await ep.recv(inbox, tag=wire.TAG_REQ)
                try:
                    r = wire.parse_request(inbox)
                except ValueError as e:  # the stream's requests cannot be trusted: end it
                    log.warning("bad request from a peer (%s); closing its endpoint", e)
                    break
                if len(busy) >= self.max_requests:  # refused before the next request is read
                    await self._refuse(ep, r, f"{len(busy)} requests at once on this connection "
                                              f"(the limit is {self.max_requests} requests)")
                    continue
                posted = None if r.posted is None else r.posted.copy()
                t = asyncio.ensure_future(self._answer(ep, r.seq, r.count, r.header.tobytes(), r.timeout, posted))
                for tasks in (self._tasks, busy):
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
        except Exception as e:  # noqa: BLE001 - peer closed or died: the normal end
            log.debug("endpoint ended: %r", e)
        finally:
            self._eps.discard(ep)
            _abort(ep)

    async def _refuse(self, ep: Any, r: wire.Request, msg: str) -> None:
        """Answer ``r`` refused: the head alone, and an empty message for
        each block a sized request posted; nothing is provided or copied.
        Bounded by the request's time; a fault ends the connection."""
        end = time.monotonic() + max(0.0, min(r.timeout, self.max_wait_s)) + SERVER_SLACK_S
        sends = [] if r.posted is None else wire.sized_sends(ep, r.seq, r.posted, None)
        self.requests += 1
        head = wire.table(r.seq, wire.ST_REFUSED, msg, None, r.count)
        await bounded(asyncio.gather(ep.send(head, tag=wire.tag_tab(r.seq)), *sends), end)

    async def _answer(self, ep: Any, seq: int, count: int, header: bytes, timeout: float,
                      posted: np.ndarray | None = None) -> None:
        end = time.monotonic() + max(0.0, min(timeout, self.max_wait_s)) + SERVER_SLACK_S
        served: Served | None = None
        status, msg = wire.ST_OK, ""
        try:
            try:
                served = await _provide(self._provider, header, end)
                msg = wire.check_served(served, count)
                status = wire.ST_FAILED if msg else wire.ST_OK
            except PermissionError as e:
                status, msg = wire.ST_REFUSED, str(e) or "permission denied"
            except ValueError as e:
                status, msg = wire.ST_INVALID, str(e) or "invalid request"
            except asyncio.TimeoutError:
                status, msg = wire.ST_TIMEOUT, "provider timed out"
            except Exception as e:  # noqa: BLE001 - reported to the peer, logged here
                log.exception("block provider failed")
                status, msg = wire.ST_FAILED, f"provider error: {type(e).__name__}: {e}"
            self.requests += 1
            answered = served if status == wire.ST_OK else None
            table = wire.table(seq, status, msg, answered, count)
            if posted is not None:  # sized: the table and every posted block at once, no GO
                sends = wire.sized_sends(ep, seq, posted, answered)
                await bounded(asyncio.gather(ep.send(table, tag=wire.tag_tab(seq)), *sends), end)
                return
            await bounded(ep.send(table, tag=wire.tag_tab(seq)), end)
            if status != wire.ST_OK or served is None or not served.regions:
                return
            want = np.zeros(count, dtype=np.uint8)
            await bounded(ep.recv(want, tag=wire.tag_go(seq)), end)
            present = np.flatnonzero(served.lengths > 0)
            sends = [ep.send(served.regions[j], tag=wire.tag_blk(seq, int(i)))
                     for j, i in enumerate(present) if want[i]]
            if sends:
                await bounded(asyncio.gather(*sends), end)
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

    def retain(self, addresses: Iterable[str]) -> int:
        """Close the pooled endpoints to every address not in ``addresses``
        (peers that left; a fetch still running on one ends as a transport
        fault). Returns how many were closed."""
        keep = set(addresses)
        gone = [c for a, c in self._conns.items() if a not in keep]
        for c in gone:
            self._drop(c)
        return len(gone)

    async def close(self) -> None:
        for c in list(self._conns.values()):
            self._drop(c)
        for f in list(self._connecting.values()):
            f.cancel()

    async def fetch(self, address: str, header: bytes, count: int, alloc: Alloc,
                    deadline_s: float, *, sizes: np.ndarray | None = None, verify: bool = True) -> FetchResult:
        """Fetch ``count`` blocks named by ``header`` from the peer at ``address``
        into the views ``alloc`` returns; never raises for peer or transport
        faults (they come back as ``error``).

        ``sizes`` (int64 per block, the length the caller expects): a sized
        fetch, one round trip (``transport/ucx_wire.py``). ``alloc`` is then called
        with ``sizes`` before the request, and a block whose real length
        differs is not received. Without it, ``alloc`` gets the peer's
        lengths after a first round trip.

        ``verify`` (default): each block's XXH3-64 is checked as it lands and
        a mismatch is ``corrupt``, not ``ok``. ``verify=False``: a block that
        landed whole is ``ok`` unhashed, for a caller that keeps the peer's
        ``checksums`` with the bytes and has every reader check them (the
        daemon's fetch into its DRAM tier: docs/architecture.md); bytes that
        go straight to a consumer must be fetched verified."""
        if not 0 <= count <= MAX_BLOCKS:
            raise InvalidArgument(f"count must be in [0, {MAX_BLOCKS}], got {count}")
        if len(header) > MAX_HEADER:
            raise InvalidArgument(f"header of {len(header)} bytes exceeds the limit of {MAX_HEADER}")
        if sizes is not None:
            sizes = np.asarray(sizes, dtype=np.int64)
            if sizes.shape != (count,):
                raise InvalidArgument(f"sizes has shape {sizes.shape}, not ({count},)")
            if len(header) + 8 * count > MAX_HEADER:
                sizes = None  # too many to post in one request: the two-step protocol
        t0 = time.monotonic()
        end = t0 + max(0.0, float(deadline_s))
        lengths = np.zeros(count, dtype=np.int64)

        def failed(msg: str, fault: FetchFault, unconfirmed: int = 0) -> FetchResult:
            return FetchResult(np.zeros(count, dtype=bool), lengths, 0, time.monotonic() - t0, msg, fault=fault,
                               unconfirmed=unconfirmed)

        try:
            conn = await self._get(address, max(0.0, min(self._connect_timeout + 0.5, end - t0)))
        except ValueError:
            raise
        except (asyncio.TimeoutError, TimeoutError):
            return failed(f"connect to {address} timed out", FetchFault.LINK)
        except Exception as e:  # noqa: BLE001 - peer unreachable
            return failed(f"connect to {address} failed: {type(e).__name__}: {e}", FetchFault.LINK)
        conn.fetches += 1
        if sizes is not None:
            return await self._fetch_sized(conn, header, count, alloc, sizes, lengths, failed, t0, end, deadline_s,
                                           verify)
        ep = conn.ep
        seq = next(_SEQ)
        posted: list[asyncio.Future[Any]] = []
        try:
            table = np.zeros(wire.HEAD.size + 16 * count, dtype=np.uint8)  # a short table: absent blocks
            trecv = asyncio.ensure_future(ep.recv(table, tag=wire.tag_tab(seq)))
            posted.append(trecv)
            req = wire.request(wire.MAGIC, seq, count, header, max(0.0, end - time.monotonic()))
            await bounded(ep.send(req, tag=wire.TAG_REQ), end)
            await wait_all([trecv], end)
            _seq, status, elen, etext = wire.HEAD.unpack_from(table.data, 0)
            if status != wire.ST_OK:
                return failed(*wire.refused(address, status, etext[:elen]))
            body = table[wire.HEAD.size:]
            lengths[:] = body[: 8 * count].view(np.int64)
            sums = body[8 * count:].view(np.uint64).copy()
            present = np.flatnonzero(lengths > 0)
            if present.size == 0:
                return FetchResult(np.zeros(count, dtype=bool), lengths, 0, time.monotonic() - t0, None, 0, sums)
            try:
                dests = alloc(lengths.copy())
                if len(dests) != count:
                    raise InvalidArgument(f"alloc returned {len(dests)} destinations for {count} blocks")
            except Exception as e:  # noqa: BLE001 - tell the peer to send nothing
                await bounded(ep.send(np.zeros(count, np.uint8), tag=wire.tag_go(seq)), end)
                return failed(f"alloc failed: {type(e).__name__}: {e}", FetchFault.ALLOC)
            want = np.zeros(count, dtype=np.uint8)
            verified: dict[int, bool] = {}

            async def one(i: int, dst: Any) -> None:
                await ep.recv(dst, tag=wire.tag_blk(seq, i))
                verified[i] = not verify or checksum(dst) == int(sums[i])

            for i in present.tolist():
                d = dests[i]
                if d is not None and d.nbytes == lengths[i] and not d.readonly:
                    want[i] = 1
                    posted.append(asyncio.ensure_future(one(i, d)))
            await bounded(ep.send(want, tag=wire.tag_go(seq)), end)
            await wait_all(posted, end)
            return wire.verified(verified, lengths, sums, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - deadline or transport fault: drop the endpoint
            return failed(*await self._fault(conn, posted, e, deadline_s))

    async def _fault(self, conn: _Conn, posted: list[asyncio.Future[Any]], e: BaseException,
                     deadline_s: float) -> tuple[str, FetchFault, int]:
        """A fetch's deadline or transport fault: drop the endpoint, wait
        until every receive it posted has ended; the error, fault and
        receives not confirmed ended, to report."""
        self._drop(conn)
        unconfirmed = await settle(posted, CANCEL_GRACE_S)
        if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
            msg = f"fetch from {conn.address} missed its deadline of {deadline_s:g}s"
        else:
            msg = f"fetch from {conn.address} failed: {type(e).__name__}: {e}"
        if unconfirmed:
            msg += f"; {unconfirmed} receives not confirmed cancelled: do not reuse the destinations"
        return msg, FetchFault.LINK, unconfirmed

    async def _fetch_sized(self, conn: _Conn, header: bytes, count: int, alloc: Alloc, sizes: np.ndarray,
                           lengths: np.ndarray, failed: Callable[..., FetchResult], t0: float, end: float,
                           deadline_s: float, verify: bool = True) -> FetchResult:
        """``fetch`` with ``sizes``: alloc, then the request, then the
        receives posted while the peer answers (``transport/ucx_wire.py``).
        ``lengths`` (zeros) gets the peer's; ``failed`` is ``fetch``'s."""
        try:
            dests = alloc(sizes.copy())
            if len(dests) != count:
                raise InvalidArgument(f"alloc returned {len(dests)} destinations for {count} blocks")
        except Exception as e:  # noqa: BLE001 - nothing was asked of the peer yet
            return failed(f"alloc failed: {type(e).__name__}: {e}", FetchFault.ALLOC)
        want = np.zeros(count, dtype=np.int64)
        for i, d in enumerate(dests):
            if d is not None and d.nbytes == sizes[i] > 0 and not d.readonly:
                want[i] = d.nbytes
        ep = conn.ep
        seq = next(_SEQ)
        table = np.zeros(wire.HEAD.size + 16 * count, dtype=np.uint8)  # a short table: absent blocks
        answer: list[Any] = []  # (status, error text, checksums), once the table is read
        verified: dict[int, bool] = {}

        async def read_table() -> None:
            await ep.recv(table, tag=wire.tag_tab(seq))
            _seq, status, elen, etext = wire.HEAD.unpack_from(table.data, 0)
            body = table[wire.HEAD.size:]
            if status == wire.ST_OK:
                lengths[:] = body[: 8 * count].view(np.int64)
            answer[:] = [status, etext[:elen], body[8 * count:].view(np.uint64).copy()]

        trecv = asyncio.ensure_future(read_table())

        async def one(i: int, dst: Any) -> None:
            await ep.recv(dst, tag=wire.tag_blk(seq, i))
            await trecv  # the checksums; a block counts only where the peer sent it
            if answer[0] == wire.ST_OK and lengths[i] == want[i]:
                verified[i] = not verify or checksum(dst) == int(answer[2][i])

        posted: list[asyncio.Future[Any]] = [trecv]
        try:
            req = wire.request(wire.MAGIC_SIZED, seq, count, header, max(0.0, end - time.monotonic()), want)
            sent = asyncio.ensure_future(ep.send(req, tag=wire.TAG_REQ))
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # a fault is reported below
            # posted after the request: the peer answers while these are set up
            posted += [asyncio.ensure_future(one(i, dests[i])) for i in np.flatnonzero(want).tolist()]
            await wait_all([sent, *posted], end)
        except Exception as e:  # noqa: BLE001 - deadline or transport fault: drop the endpoint
            return failed(*await self._fault(conn, posted, e, deadline_s))
        status, etext, sums = answer
        if status != wire.ST_OK:
            return failed(*wire.refused(conn.address, status, etext))
        return wire.verified(verified, lengths, sums, time.monotonic() - t0)

