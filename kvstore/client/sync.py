"""The synchronous client for the kvstore daemon: ``Client``, and the
``Reservation``/``Lease`` of its two-phase zero-copy calls.

On the same host the client maps the daemon's shared-memory slab and moves
the bytes itself: a put is ``Reserve`` -> copy into the slots (fused with the
xxh3_64 checksum) -> ``Commit``; a get is ``Acquire`` -> copy out (checksum
verified) -> ``Release``. Elsewhere (or with ``use_shm=False``) it falls back
to inline ``Put``/``Get`` bytes, split under the message size limit. Every
call takes a whole batch of keys: one RPC per request, not one per block.

A session (``Handshake`` + a ``KeepAlive`` stream held open in the
background) ties the client's leases and reservations to its life: if the
process dies, the daemon reclaims them. Answers are typed
(``kvstore.results``); failures raise the exception tree
(``kvstore.wire.status``)."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Iterator, Sequence

import grpc
import numpy as np

from kvstore.buffers import KEY_BYTES, as_u8, keys_at, pack_keys, split_keys
from kvstore.checksum import verify_many
from kvstore.client.base import DEFAULT_TARGET, tier_field
from kvstore.client.control import ControlCalls
from kvstore.client.holds import Lease, PendingReservation, Reservation
from kvstore.client.shared import OwnWrites, SharedPath
from kvstore.client.sinks import BlockSink, as_sink, is_sink
from kvstore.client.socket import LookupSocketClient, settle_quietly
from kvstore.client.staging import WRITE_BEHIND_DELAY, WriteBehind
from kvstore.errors import DeadlineExceeded, InvalidArgument, KeyStatus, KVStoreError, Unavailable
from kvstore.keys import Namespace
from kvstore.results import LookupResult
from kvstore.wire.answers import (lookup_from_pb, lookup_from_values)
from kvstore.wire.convert import ns_pb
from kvstore.wire.frames import fits_frame
from kvstore.wire.shared_index import SharedIndexReader
from kvstore.wire.shm import host_identity
from kvstore.wire.status import error_from_rpc
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tiers.base import Buffer, TierKind

log = logging.getLogger("kvstore.client")

__all__ = ["DEFAULT_TARGET", "Client", "Lease", "PendingReservation", "Reservation", "error_from_rpc"]


class Client(ControlCalls):
    """Synchronous client. Use as a context manager or call ``close()``."""

    def __init__(self, target: str | None = None, *, token: str | None = None, token_file: str | None = None,
                 tls_ca_file: str | None = None, name: str = "kvstore-client", use_shm: bool = True,
                 timeout: float = 30.0, session: bool = True, fast_lookup: bool = True,
                 pipeline: bool = True, shared_index: bool = True, write_behind: bool | str = True,
                 prefault: bool = False, hold_counts: bool = False, write_behind_delay: float = WRITE_BEHIND_DELAY) -> None:
        """``fast_lookup``: on the daemon's host, send ``lookup`` and the shared-memory path's control calls
        over its same-host socket (kvstore.client.socket) instead of gRPC. ``pipeline`` (with that socket):
        ``put`` sends its ``Commit`` and ``get_into`` its ``Release`` without waiting for the answer
        (kvstore.client.socket); the daemon runs them before this client's next call, so this client always
        reads its own writes, and another client sees the blocks once the daemon has taken in the ``Commit``
        (microseconds later). ``shared_index`` (with that socket): answer ``lookup`` from the daemon's shared
        index when it publishes one (kvstore/wire/shared_index.py), without a round trip. ``write_behind``
        (with the shared index and ``pipeline``): a put is copied into slots the daemon granted ahead (one put
        of up to 64 MiB; kvstore/client/grants.py) or a small one into a staging ring ("staged": the ring
        only), and sent without waiting (kvstore/client/staging.py); blocks the daemon then cannot store are
        counted in ``late_rejected``. ``write_behind_delay``: seconds such a put's frames may wait to go out
        with this client's next frame on the socket (a ``flush``, any call; another write-behind put joins
        them) before they are sent on their own; meanwhile the daemon does not land the put, so the client's
        own work right after it (a get of those blocks, read from where it wrote them) has the machine's
        cores. Other clients see the put at most that much later. 0: sent at once. ``prefault``: once the slab
        is mapped, map its resident pages on a background thread (``SlabMapping.prefault``), so the first read
        of an old block takes no page faults; for a long-lived engine process. ``hold_counts``: counts of
        shared-index reads and lookups wait for ``send_counts`` (or a call)."""
        self._own = OwnWrites()
        """This client's puts in flight (Commit or write-behind frame unanswered), for its own reads."""
        self._wb = WriteBehind(self._own, bool(write_behind), write_behind != "staged", write_behind_delay)
        self.write_behind_delay = self._wb.delay
        super().__init__(target, token, token_file, tls_ca_file, name, use_shm, timeout)
        self.prefault = prefault
        creds = self._creds()
        self.channel = (grpc.secure_channel(self.target, creds, self._options()) if creds
                        else grpc.insecure_channel(self.target, self._options()))
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self._keepalive: Any = None
        self.pipeline = pipeline
        self._shared: SharedPath | None = None
        """Lookups and lease-free reads from the daemon's shared index, when
        it publishes one (same host; kvstore/client/shared.py)."""
        if session:
            resp = self._call(self.stub.Handshake, pb.HandshakeRequest(
                client_name=name, pid=os.getpid(), host_id=host_identity(), protocol_version=1))
            self._after_handshake(resp)
            self._keepalive = self.stub.KeepAlive(pb.KeepAliveRequest(session_id=self.session),
                                                  metadata=self._md())
            threading.Thread(target=self._drain_keepalive, daemon=True, name="kvstore-keepalive").start()
            if fast_lookup and self._fast_path:
                try:
                    self._fast = LookupSocketClient(self._fast_path, self.session, timeout, self.token, self._wb.delay)
                except (OSError, KVStoreError) as e:
                    log.info("fast Lookup socket %s unusable (%s): Lookup goes over gRPC", self._fast_path, e)
                else:  # a process that exits without close() still lands its last pipelined Commit
                    weakref.finalize(self, settle_quietly, self._fast)
                    if shared_index and self._fast.shared_path:
                        try:
                            self._shared = SharedPath(SharedIndexReader(self._fast.shared_path), hold_counts)
                        except OSError as e:
                            log.info("shared index %s unusable (%s): lookups go to the daemon",
                                     self._fast.shared_path, e)

    def _drain_keepalive(self) -> None:
        try:
            for _ in self._keepalive:
                pass
        except grpc.RpcError:
            pass
        self._shared = None  # the session is over (or the daemon gone): stop reading its index

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        fast = self._fast
        if fast is not None and (fast.owed or self.tally_pending):
            # (our pipelined calls, and the counts we owe, go before this one)
            self.flush()
        try:
            return method(request, metadata=self._md(), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def _unary(self, name: str, request: Any) -> Any:
        """A control call of the shared-memory path: over the fast socket when
        there is one (kvstore.client.socket), else gRPC. A socket that breaks
        mid-call fails the call (it may have run) and gRPC is used from then on."""
        fast = self._fast
        body = request.SerializeToString() if fast is not None else b""
        if fast is not None and fits_frame(len(body)):  # a bigger request goes over gRPC
            try:
                data = fast.call(name, body)
            except KVStoreError:  # the daemon's answer (some are OSError subclasses)
                raise
            except OSError as e:
                raise self._socket_failed(name, e) from None
            return getattr(pb, name + "Response").FromString(data)
        return self._call(getattr(self.stub, name), request)

    def _send(self, name: str, request: Any) -> int:
        """A control call whose answer is not needed now: over the same-host
        socket without waiting (``pipeline``; a failure is logged when its
        answer is read), else an ordinary call. Returns the frame's number
        on the socket (``LookupSocketClient.sent``), 0 when it was answered."""
        fast = self._fast
        body = request.SerializeToString() if fast is not None and self.pipeline else b""
        if fast is None or not self.pipeline or not fits_frame(len(body)):
            self._unary(name, request)
            return 0
        try:
            return fast.send(name, body)
        except OSError as e:
            raise self._socket_failed(name, e) from None

    def _socket_failed(self, name: str, e: OSError) -> KVStoreError:
        """The same-host socket broke (or timed out: its stream is then out of
        step): close it, use gRPC from now on, and say how ``name`` failed
        (DeadlineExceeded for a timeout, as over gRPC; else Unavailable: the
        call may have run)."""
        log.warning("same-host socket failed (%s): calls go over gRPC", e)
        self._shared = None
        self._wb.close()  # (its staging ring belongs to the same-host connection)
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        if isinstance(e, TimeoutError):
            return DeadlineExceeded(f"DEADLINE_EXCEEDED: {name} over the same-host socket timed out "
                                    f"after {self.timeout}s")
        return Unavailable(f"UNAVAILABLE: {name} over the same-host socket failed: {e}")

    def flush(self) -> None:
        """Wait until the daemon has run every call this client sent without
        waiting (the ``Commit`` of its puts, the ``Release`` of its gets)."""
        if self.tally_pending:
            self.send_counts()
        fast = self._fast
        if fast is not None:
            try:
                fast.flush()
            except OSError as e:
                log.warning("fast socket failed (%s): control calls go over gRPC", e)
                fast.close()
                self._fast = None
                self._wb.close()  # (its staging ring belongs to the same-host connection)

    def close(self) -> None:
        if self._fast is not None:
            self.flush()
        self._wb.close()  # (its staging ring belongs to the same-host connection)
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        shared, self._shared = self._shared, None  # (read once: the keepalive thread may drop it meanwhile)
        if shared is not None:
            shared.close()
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self.slab is not None:
            self.slab.close()
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------- queries
    def lookup(self, ns: Namespace, keys: Sequence[bytes] | bytes) -> LookupResult:
        packed = pack_keys(keys, check=True)
        wire = self._wire_of(ns) if self._fast is not None else b""
        got = self._shared_lookup(self._fast, wire, packed) if self._shared is not None and self._fast else None
        if got is not None:
            return lookup_from_values(*got)
        fast = self._fast  # (still there unless the shared path found the socket broken)
        if fast is not None and fits_frame(len(packed) + 1024):
            try:
                hit, tiers = fast.lookup(wire, packed)
                return lookup_from_values(hit, tiers)
            except KVStoreError:  # the daemon's answer (some are OSError subclasses)
                raise
            except TimeoutError as e:
                raise self._socket_failed("Lookup", e) from None
            except OSError as e:  # the socket broke: gRPC from now on
                log.warning("fast Lookup socket failed (%s): Lookup goes over gRPC", e)
                fast.close()
                self._fast = None
        r = self._call(self.stub.Lookup, pb.LookupRequest(ns=ns_pb(ns), keys_packed=packed))
        return lookup_from_pb(r)

    @property
    def late_rejected(self) -> int:
        """Blocks of write-behind puts that answered OK here but that the daemon could not store."""
        return self._fast.late_rejected if self._fast is not None else 0

    @property
    def tally_pending(self) -> int:
        """Shared-index lookups and reads not yet told the daemon (every 256, 0.1 s, before any call, at flush)."""
        return s.pending + s.reads_pending if (s := self._shared) is not None else 0  # (read once, as in close)

    @property
    def shared_reads(self) -> int:
        """``get_into`` calls served from the shared index without a lease."""
        return s.reads if (s := self._shared) is not None else 0

    @property
    def own_write_reads(self) -> int:
        """Blocks ``get_into`` read from this client's own puts whose Commit was still in flight."""
        return s.own_blocks if (s := self._shared) is not None else 0

    @property
    def shared_lookups(self) -> int:
        """Lookups answered from the daemon's shared index (no round trip)."""
        return s.lookups if (s := self._shared) is not None else 0

    def _own_commits(self) -> bool:
        """Read-your-writes for a shared-index probe that came back short: wait for this
        client's pipelined Commits and write-behind puts; whether there were any."""
        fast = self._fast
        if fast is None or ("Commit" not in fast.owed and "Put" not in fast.owed):
            return False
        self.flush()
        return True

    def _shared_lookup(self, fast: LookupSocketClient, wire: bytes, packed: bytes) -> tuple[int, bytes] | None:
        """``lookup`` from the daemon's shared index, or None (ask the daemon)."""
        shared = self._shared
        nid = shared.nid(fast, wire) if shared is not None else None
        if shared is None or nid is None:
            return None
        got = shared.lookup(nid, packed, self._own_commits)
        if shared.tally_due():
            self.send_counts()
        return got

    def prepare_reads(self, ns: Namespace) -> bool:
        """Ask for ``ns``'s id and map the shared index now, not at the first ``get_into``; whether reads go there."""
        return (s := self._shared) is not None and (f := self._fast) is not None and s.prepare(f, self._wire_of(ns))

    def _wire_of(self, ns: Namespace) -> bytes:
        """The namespace's serialized message (made once per namespace)."""
        wire = self._ns_wire.get(ns)
        if wire is None:
            wire = self._ns_wire[ns] = self._ns_msg(ns).SerializeToString(deterministic=True)
        return wire

    def send_counts(self) -> None:
        """Tell the daemon in one write, not waiting, the shared index's lookups and reads since last time
        (none: nothing sent; dropped when the socket is gone: they only count)."""
        shared, fast = self._shared, self._fast
        if shared is None or fast is None:
            return
        tally = shared.take_tally()
        msgs = ([tally] if tally else []) + shared.take_reads()
        if msgs:
            try:
                fast.send_frames("Tally/Reads", msgs)
            except OSError as e:
                self._socket_failed("Tally/Reads", e)

    # --------------------------------------------------------------- put
    def put(self, ns: Namespace, keys: Sequence[bytes] | bytes, payloads: Sequence[Buffer],
            parent: bytes | None = None) -> list[KeyStatus]:
        """Store a chain segment; one status per key (16-byte keys, or packed back to back)."""
        packed = pack_keys(keys, check=True)
        if len(packed) != KEY_BYTES * len(payloads):
            raise InvalidArgument(f"{len(packed) // KEY_BYTES} keys but {len(payloads)} payloads")
        if not packed:  # every block already hit (the README's keys[hit:]): nothing to reserve
            return []
        if self.slab is not None:
            return self._put_shm(ns, packed, payloads, parent)
        return self._put_inline(ns, split_keys(packed), payloads, parent)

    def _put_shm(self, ns: Namespace, packed: bytes, payloads: Sequence[Buffer],
                 parent: bytes | None) -> list[KeyStatus]:
        srcs = [as_u8(p) for p in payloads]
        staged = self._put_staged(ns, packed, srcs, parent)
        if staged is not None:
            return staged
        req = self._reserve_request(ns, packed, srcs, parent)
        r = self._unary("Reserve", req)
        if (shared := self._shared) is not None:
            shared.known(self._wire_of(ns))  # the namespace exists now: ask for its id again
        if not r.reservation_id:
            return [KeyStatus(x) for x in r.slots.status]
        try:
            statuses, csums = self._fill_slots(r, srcs)
        except BaseException:
            self._unary("Abort", pb.AbortRequest(reservation_id=r.reservation_id))
            raise
        commit = pb.CommitRequest(reservation_id=r.reservation_id, checksums=csums)
        if self.pipeline and self._fast is not None:
            seq = self._send("Commit", commit)
            sa = r.slots
            if seq and self._shared is not None and self.slab is not None and not any(sa.status) and \
                    all(t == TierKind.DRAM + 1 for t in sa.tier):
                self._own.add(self._wire_of(ns), req.keys_packed, list(sa.offset), list(sa.length), csums,
                              self.slab.buf, seq)
            return statuses
        return self._merge_commit(statuses, self._unary("Commit", commit))

    def _put_staged(self, ns: Namespace, packed: bytes, srcs: list[np.ndarray],
                    parent: bytes | None) -> list[KeyStatus] | None:
        """A write-behind put (``WriteBehind.put``), or None: put through ``Reserve``."""
        wb, fast, shared = self._wb, self._fast, self._shared
        if not self.pipeline or fast is None or shared is None:
            return None
        try:
            return wb.put(fast, shared, self._wire_of(ns), packed, srcs, parent, self.copy_threads, self.flush,
                          self.slab.buf if self.slab is not None else None)
        except OSError as e:
            raise self._socket_failed("Put", e) from None

    def _put_inline(self, ns: Namespace, keys: list[bytes], payloads: Sequence[Buffer],
                    parent: bytes | None) -> list[KeyStatus]:
        out: list[KeyStatus] = []
        for req in self._put_requests(ns, keys, payloads, parent):
            out += self._statuses(self._call(self.stub.Put, req).results)
        return out

    # --------------------------------------------------------------- get
    def get_into(self, ns: Namespace, keys: Sequence[bytes] | bytes,
                 outs: Sequence[Buffer] | BlockSink) -> list[KeyStatus]:
        """Copy the leading present blocks into ``outs`` (one buffer per key,
        or a ``kvstore.client.sinks`` sink); one status per key. ``keys``:
        16-byte keys, or packed back to back (used as they are, same host)."""
        packed = pack_keys(keys, check=True)
        if len(outs) != len(packed) // KEY_BYTES:
            raise InvalidArgument(f"{len(packed) // KEY_BYTES} keys but {len(outs)} output buffers")
        if self.slab is not None:
            got = self._read_staged(ns, packed, outs) if self._own.recent and isinstance(outs, (list, tuple)) else None
            return got if got is not None else self._get_shm(ns, packed, as_sink(outs, self.copy_threads))
        keys = split_keys(packed)
        if is_sink(outs):
            parts, sums = self._inline_parts(outs)
            return self._inline_done(outs, parts, sums, self._get_inline(ns, keys, parts, sums))
        statuses = self._get_inline(ns, keys, outs, sums := {})
        self._report_bad(ns, [keys[i] for i in self._inline_checked(outs, sums, statuses, self.copy_threads)])
        return statuses

    def get(self, ns: Namespace, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """The present blocks' bytes (None where missing)."""
        keys = list(keys)
        if self.slab is not None:
            out: list[np.ndarray | None] = [None] * len(keys)
            with self.acquire(ns, keys) as lease:
                hit = [i for i, v in enumerate(lease.views) if v is not None]
                copies = [np.empty(int(lease.views[i].size), np.uint8) for i in hit]  # type: ignore[union-attr]
                ok = verify_many(copies, [lease.views[i] for i in hit], [lease.checksums[i] for i in hit],
                                 self.copy_threads)
            for i, buf, good in zip(hit, copies, ok.tolist()):
                out[i] = buf if good else None  # bytes failing their checksum are a miss, never returned
            self._report_bad(ns, [keys[i] for i, good in zip(hit, ok.tolist()) if not good])
            return out
        blocks, bad = self._inline_blocks((c for _, c in self._stream_get(ns, keys)), len(keys), self.copy_threads)
        self._report_bad(ns, [keys[i] for i in bad])
        return blocks

    def _get_shm(self, ns: Namespace, packed: bytes, sink: BlockSink) -> list[KeyStatus]:
        if self._shared is not None and self._fast is not None:
            read = self._shared_read(ns, packed, sink)
            if read is not None:
                return read
        r = self._unary("Acquire", pb.AcquireRequest(ns=self._ns_msg(ns), keys_packed=packed, promote=True))
        try:
            statuses = self._read_slots(r, sink)
        finally:
            if r.lease_id:
                self._send("Release", pb.ReleaseRequest(lease_id=r.lease_id))
        self._report_bad(ns, keys_at(packed, [i for i, s in enumerate(statuses) if s is KeyStatus.CORRUPT]))
        return statuses

    @property
    def reads_without_lease(self) -> bool:
        """Whether ``get_into`` may read DRAM blocks from the daemon's shared index without a lease."""
        return self._shared is not None

    def _read_staged(self, ns: Namespace, packed: bytes, outs: Sequence[Buffer]) -> list[KeyStatus] | None:
        """``get_into`` of keys that all lie in this client's own write-behind put in flight
        (``SharedPath.read_staged``), or None (the ordinary way)."""
        shared, fast, wire = self._shared, self._fast, self._ns_wire.get(ns)
        if shared is None or fast is None or wire is None:
            return None
        got = shared.read_staged(fast, self._own, wire, packed, outs, self.copy_threads)
        if got is not None and shared.tally_due():
            self.send_counts()
        return got

    def _shared_read(self, ns: Namespace, packed: bytes, sink: BlockSink) -> list[KeyStatus] | None:
        """``get_into`` without a lease from the shared index (``SharedPath.read``), or None (take a lease)."""
        shared, fast = self._shared, self._fast
        if shared is None or fast is None or self.slab is None:
            return None
        if not fits_frame(len(packed) + 64):
            return None
        wire = self._wire_of(ns)
        nid = shared.nid(fast, wire)
        own = self._own
        got = shared.read(nid, packed, sink, self.slab, self._own_commits,
                          lambda tail: own.find(wire, tail, fast.in_flight, fast.is_corked)) if nid is not None else None
        if got is not None and shared.tally_due():
            self.send_counts()
        return got

    def _report_bad(self, ns: Namespace, keys: list[bytes]) -> None:
        """Tell the daemon which blocks failed their checksum here, so it
        drops them (best effort: the read already treats them as misses)."""
        if keys:
            try:
                self.report_corrupt(ns, keys)
            except KVStoreError:
                pass

    def _stream_get(self, ns: Namespace, keys: list[bytes]) -> Iterator[tuple[int, pb.GetChunk]]:
        try:
            for chunk in self.stub.Get(pb.GetRequest(ns=ns_pb(ns), keys=keys), metadata=self._md(),
                                       timeout=self.timeout):
                yield chunk.index, chunk
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def _get_inline(self, ns: Namespace, keys: list[bytes], outs: Sequence[Buffer],
                    sums: dict[int, int] | None = None) -> list[KeyStatus]:
        statuses = [KeyStatus.MISS] * len(keys)
        for _, chunk in self._stream_get(ns, keys):
            self._apply_chunk(chunk, outs, statuses, sums)
        return statuses

    # ------------------------------------------------ two-phase, low level
    def view(self, offset: int, length: int) -> np.ndarray:
        """Writable zero-copy view of slab bytes (same-host clients only)."""
        if self.slab is None:
            raise Unavailable(f"no shared-memory slab: {self.no_slab_reason()}")
        return self._view(offset, length)

    def reserve(self, ns: Namespace, keys: Sequence[bytes] | bytes, block_bytes: int,
                parent: bytes | None = None, tier: str | None = None) -> "Reservation":
        """Reserve slots for a chain segment of equal-size blocks (``keys``:
        16-byte keys, or packed back to back); write them through ``view``
        (from any process that maps the slab: every TP rank), then ``commit``.
        ``tier="hbm"`` asks for device slots: those whose ``tiers`` entry is
        HBM are written through ``hbm_view`` (the daemon may answer DRAM)."""
        req = pb.ReserveRequest(ns=self._ns_msg(ns), keys_packed=pack_keys(keys, check=True), parent=parent or b"",
                                block_bytes=block_bytes, tier=tier_field(tier))
        return self._reservation(self._unary("Reserve", req))

    def reserve_later(self, ns: Namespace, keys: Sequence[bytes] | bytes, block_bytes: int,
                      parent: bytes | None = None) -> PendingReservation:
        """``reserve``, answered later: over the same-host socket (with
        ``pipeline``) the request goes out now without waiting, the daemon
        reserves while the caller works, and ``result()`` reads the answer
        (an engine sends its step's save reservations before the forward
        and writes the slots after it). Otherwise the plain ``reserve``,
        done now. Reserved slots nobody commits are reclaimed as any
        reservation is (Abort, the session's end, or expiry)."""
        req = pb.ReserveRequest(ns=self._ns_msg(ns), keys_packed=pack_keys(keys, check=True), parent=parent or b"",
                                block_bytes=block_bytes)
        fast = self._fast
        body = req.SerializeToString() if fast is not None and self.pipeline else b""
        if fast is None or not body or not fits_frame(len(body)):
            return PendingReservation(None, self._reservation(self._unary("Reserve", req)))
        try:
            seq = fast.send_kept("Reserve", body)
        except OSError as e:
            raise self._socket_failed("Reserve", e) from None

        def answer() -> Reservation:
            if self._fast is not fast:  # the socket broke since: its session's reservations are the daemon's
                raise Unavailable("the same-host socket closed before the reservation was answered")
            try:
                return self._reservation(pb.ReserveResponse.FromString(fast.answer(seq)))
            except KVStoreError:
                raise
            except OSError as e:
                raise self._socket_failed("Reserve", e) from None

        return PendingReservation(answer)

    @staticmethod
    def _reservation(r: Any) -> "Reservation":
        sa = r.slots
        return Reservation(r.reservation_id, [KeyStatus(x) for x in sa.status], list(sa.offset), list(sa.length),
                           [TierKind(t - 1) if t else None for t in sa.tier], int(sa.device))

    def commit(self, reservation: "Reservation", checksums: Sequence[int] | None = None,
               wait: bool = True) -> list[KeyStatus]:
        """Make reserved blocks visible. Without ``checksums`` the daemon
        computes them from the slab. ``wait=False``: over the same-host
        socket (``pipeline``) the ``Commit`` is sent without waiting, as
        ``put`` sends its own: it runs before this client's next call, and
        the statuses returned are the reservation's (a commit that fails
        later, e.g. because its session ended, is logged and counted in
        ``LookupSocketClient.late_errors``); else it waits."""
        req = pb.CommitRequest(reservation_id=reservation.reservation_id, checksums=list(checksums or []))
        fast = self._fast
        if not wait and fast is not None and self.pipeline and fits_frame(req.ByteSize()):
            self._send("Commit", req)  # (over the socket: conditions checked above)
            return list(reservation.statuses)
        return self._merge_commit(reservation.statuses, self._unary("Commit", req))

    def release_lease(self, lease_id: str, wait: bool = True) -> None:
        """Unpin a lease's blocks (``Lease.release`` calls this). ``wait=False``:
        over the same-host socket, send it without waiting for the answer
        (``pipeline``); it runs before this client's next call."""
        req = pb.ReleaseRequest(lease_id=lease_id)
        if wait:
            self._unary("Release", req)
        else:
            self._send("Release", req)

    def abort(self, reservation: "Reservation") -> int:
        return int(self._unary("Abort", pb.AbortRequest(reservation_id=reservation.reservation_id)).aborted)

    def acquire(self, ns: Namespace, keys: Sequence[bytes] | bytes, tier: str | None = None,
                cluster: bool = False, peer: tuple[str, int, int] = ("", 0, 0)) -> "Lease":
        """Pin the hit prefix and return zero-copy views into the slab
        (shared-memory clients only). Release with ``Lease.release()`` or a
        ``with`` block. ``tier="hbm"`` (after ``map_hbm``): blocks are
        promoted into HBM where possible and HBM slots come back as device
        tensor views (``Lease.tiers`` says which). ``cluster``: fetch what
        peers hold first when that beats recomputing it (docs/cluster.md);
        ``peer``: the (node, first, blocks) run a cluster lookup found there."""
        if self.slab is None:
            raise Unavailable("zero-copy acquire needs the shared-memory slab (same host)")
        want = tier_field(tier)
        if want == TierKind.HBM + 1:
            self.map_hbm()
        r = self._unary("Acquire", pb.AcquireRequest(ns=self._ns_msg(ns), keys_packed=pack_keys(keys, check=True), promote=True,
                                                     tier=want, cluster=cluster, peer=peer[0], peer_from=peer[1],
                                                     peer_blocks=peer[2]))
        sa = r.slots
        hit = int(r.hit_blocks)
        tiers = [TierKind(sa.tier[i] - 1) for i in range(hit)]
        views: list[Any] = [self.hbm.view(sa.offset[i], sa.length[i]) if t is TierKind.HBM
                            else self._view(sa.offset[i], sa.length[i]) for i, t in enumerate(tiers)]
        views += [None] * (len(sa.status) - hit)
        lease = Lease(self, r.lease_id, hit, views, list(sa.checksum), list(sa.offset[:hit]), list(sa.length[:hit]))
        lease.tiers = tiers
        lease.fetched_blocks = int(r.fetched_blocks)
        lease.decision = int(r.decision)
        return lease
