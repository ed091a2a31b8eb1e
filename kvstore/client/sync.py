"""Python clients for the kvstore daemon: ``Client`` (sync) and ``AsyncClient``.

On the same host the client maps the daemon's shared-memory slab and moves
the bytes itself: a put is ``Reserve`` -> copy into the slots (fused with the
xxh3_64 checksum) -> ``Commit``; a get is ``Acquire`` -> copy out (checksum
verified) -> ``Release``. Elsewhere (or with ``use_shm=False``) it falls back
to inline ``Put``/``Get`` bytes, split under the message size limit. Every
call takes a whole batch of keys: one RPC per request, not one per block.

A session (``Handshake`` + a ``KeepAlive`` stream held open in the
background) ties the client's leases and reservations to its life: if the
process dies, the daemon reclaims them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, cast

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from kvstore.checksum import copy_many, verify_many
from kvstore.errors import (CapacityError, DataLoss, DeadlineExceeded, InvalidArgument, KeyStatus,
                            KVStoreError, NotFound, PermissionDenied, Unauthenticated, Unavailable)
from kvstore.keys import Namespace
from kvstore.wire.shm import SlabMapping, host_identity
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tiers.base import Buffer, TierKind

DEFAULT_TARGET = "127.0.0.1:50051"
log = logging.getLogger("kvstore.client")

_CODE_TO_ERROR: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def error_from_rpc(e: grpc.RpcError) -> KVStoreError:
    """The exception-tree class for a failed call (the inverse of the server's table)."""
    code = e.code() if hasattr(e, "code") else None
    cls = _CODE_TO_ERROR.get(code, Unavailable)  # type: ignore[arg-type]
    detail = e.details() if hasattr(e, "details") else str(e)
    return cls(f"{code.name if code else 'ERROR'}: {detail}")


@dataclass(slots=True, frozen=True)
class LookupResult:
    hit_blocks: int
    tiers: list[str]


def _as_u8(buf: Buffer) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _as_u8_writable(buf: Buffer) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def _pack(keys: Sequence[bytes]) -> bytes:
    """Keys back to back (``keys_packed``), after checking each is 16 bytes."""
    if keys and set(map(len, keys)) != {16}:
        bad = next(i for i, k in enumerate(keys) if len(k) != 16)
        raise InvalidArgument(f"key {bad} must be 16 bytes, got {len(keys[bad])}")
    return b"".join(keys)


def _tier_field(tier: str | None) -> Any:
    """A request's tier field from "hbm"/"dram"/None."""
    if tier is None:
        return 0
    t = TierKind.parse(tier)
    if t not in (TierKind.HBM, TierKind.DRAM):
        raise InvalidArgument(f"tier {tier!r} cannot be asked for; allowed: hbm, dram")
    return int(t) + 1


def ns_pb(ns: Namespace) -> pb.Namespace:
    d: dict[str, Any] = dict(ns.to_dict())
    fields = pb.Namespace.DESCRIPTOR.fields_by_name
    return pb.Namespace(**{k: v for k, v in d.items() if k in fields})


def _tier_name(t: int) -> str:
    return TierKind(t - 1).label if t else "unspecified"


_TIER_NAMES = [_tier_name(t) for t in range(len(TierKind) + 1)]


@dataclass(slots=True, frozen=True)
class ClusterLookup:
    """``Client.cluster_lookup``: the local prefix, the run peers hold after
    it, and the decision for that run with both estimates (seconds)."""

    local_blocks: int
    remote_blocks: int
    decision: str  # "local" | "fetch" | "recompute"
    fetch_s: float
    recompute_s: float
    locations: list[tuple[str, str, float]]  # (tier, peer or "", load seconds) per block
    status: str


_DECISIONS = {1: "local", 2: "fetch", 3: "recompute"}


def _lookup_result(r: pb.LookupResponse) -> "LookupResult":
    codes = r.tiers_packed if r.tiers_packed else r.tiers
    return LookupResult(r.hit_blocks, [_TIER_NAMES[t] for t in codes])


def _read_token(token: str | None, token_file: str | None) -> str | None:
    if token:
        return token
    if token_file:
        with open(token_file) as f:
            return f.read().strip()
    return os.environ.get("KVSTORE_TOKEN") or None


class _Base:
    def __init__(self, target: str | None, token: str | None, token_file: str | None,
                 tls_ca_file: str | None, name: str, use_shm: bool, timeout: float) -> None:
        self.target = target or os.environ.get("KVSTORE_ADDRESS") or DEFAULT_TARGET
        self.token = _read_token(token, token_file)
        self.tls_ca = open(tls_ca_file, "rb").read() if tls_ca_file else None
        self.name = name
        self.use_shm = use_shm
        self.timeout = timeout
        self.session = ""
        self.slab: SlabMapping | None = None
        self._fast_path = ""  # the daemon's fast Lookup socket, when same host
        self._fast: Any = None
        self._ns_wire: dict[Namespace, bytes] = {}
        self.max_message_bytes = 4 << 20
        self.server_tenant = ""
        self.copy_threads = 2
        """Threads that copy one large batch in and out of the slab."""
        self.hbm_regions: list[pb.DeviceMemInfo] = []
        """The daemon's HBM tier regions (same host only); map with map_hbm()."""
        self.hbm: Any = None
        """The mapped HBM region (kvstore.wire.hbm_ipc.HbmMapping), once map_hbm() ran."""

    def _creds(self) -> grpc.ChannelCredentials | None:
        return grpc.ssl_channel_credentials(self.tls_ca) if self.tls_ca is not None else None

    def _options(self) -> list[tuple[str, Any]]:
        return [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]

    def _md(self) -> list[tuple[str, str]]:
        md = []
        if self.token:
            md.append(("authorization", f"Bearer {self.token}"))
        if self.session:
            md.append(("x-kvstore-session", self.session))
        return md

    def _after_handshake(self, resp: pb.HandshakeResponse) -> None:
        self.session = resp.session_id
        self.max_message_bytes = resp.max_message_bytes or self.max_message_bytes
        self.server_tenant = resp.tenant
        if self.use_shm and resp.same_host and resp.HasField("shm"):
            try:
                self.slab = SlabMapping(resp.shm.path, resp.shm.size_bytes, resp.shm.slab_id)
            except OSError:
                self.slab = None  # e.g. another container: fall back to inline bytes
        self.hbm_regions = list(resp.hbm) if resp.same_host else []
        self._fast_path = resp.lookup_socket if resp.same_host else ""

    def _view(self, offset: int, length: int) -> np.ndarray:
        assert self.slab is not None
        if not self.slab.covers(offset, length):
            # the daemon grew its slab: map again
            path, sid = self.slab.path, self.slab.slab_id
            self.slab.close()
            self.slab = SlabMapping(path, 0, sid)
        return self.slab.view(offset, length)

    # Request building and response handling shared by Client and AsyncClient:
    # the two differ only in how they call.
    def _put_requests(self, ns: Namespace, keys: list[bytes], payloads: Sequence[Buffer],
                      parent: bytes | None) -> Iterator[pb.PutRequest]:
        """Inline puts, split into messages under the size limit."""
        limit = max(1, self.max_message_bytes - 64 * 1024)
        nsm = ns_pb(ns)
        start, size = 0, 0
        bounds = []
        for i, p in enumerate(payloads):
            n = _as_u8(p).size + 64
            if i > start and size + n > limit:
                bounds.append((start, i))
                start, size = i, 0
            size += n
        if start < len(keys):
            bounds.append((start, len(keys)))
        for a, b in bounds:
            par = parent if a == 0 else keys[a - 1]
            yield pb.PutRequest(ns=nsm, keys=keys[a:b], parent=par or b"",
                                payloads=[_as_u8(p).tobytes() for p in payloads[a:b]])

    @staticmethod
    def _reserve_request(ns: Namespace, keys: list[bytes], srcs: list[np.ndarray],
                         parent: bytes | None) -> pb.ReserveRequest:
        req = pb.ReserveRequest(ns=ns_pb(ns), keys_packed=_pack(keys), parent=parent or b"")
        sizes = {s.size for s in srcs}
        if len(sizes) == 1:
            req.block_bytes = sizes.pop()
        else:
            req.sizes.extend(s.size for s in srcs)
        return req

    def _fill_slots(self, r: pb.ReserveResponse, srcs: list[np.ndarray]) -> tuple[list[KeyStatus], list[int]]:
        """Write each reserved slot (copy fused with its checksum)."""
        sa = r.slots
        statuses = [KeyStatus(x) for x in sa.status]
        ok = [i for i, st in enumerate(sa.status) if st == 0]
        dsts = [self._view(sa.offset[i], sa.length[i]) for i in ok]
        csums = copy_many(dsts, [srcs[i] for i in ok], self.copy_threads).tolist()
        return statuses, csums

    @staticmethod
    def _merge_commit(statuses: list[KeyStatus], c: pb.CommitResponse) -> list[KeyStatus]:
        committed = iter(KeyStatus(int(x.status)) for x in c.results)
        return [next(committed) if s is KeyStatus.OK else s for s in statuses]

    def _read_slots(self, r: pb.AcquireResponse, outs: Sequence[Buffer]) -> list[KeyStatus]:
        """Copy acquired blocks out of the slab, verifying checksums."""
        sa = r.slots
        statuses = [KeyStatus(x) for x in sa.status]
        todo = []
        for i in range(int(r.hit_blocks)):
            if _as_u8_writable(outs[i]).size != sa.length[i]:
                statuses[i] = KeyStatus.INVALID
            else:
                todo.append(i)
        ok = verify_many([_as_u8_writable(outs[i]) for i in todo],
                         [self._view(sa.offset[i], sa.length[i]) for i in todo],
                         [sa.checksum[i] for i in todo], self.copy_threads)
        for i, good in zip(todo, ok.tolist()):
            if not good:
                statuses[i] = KeyStatus.CORRUPT
        return statuses

    @staticmethod
    def _apply_chunk(chunk: pb.GetChunk, outs: Sequence[Buffer], statuses: list[KeyStatus]) -> None:
        i = chunk.index
        statuses[i] = KeyStatus(int(chunk.status))
        if chunk.status != pb.STATUS_OK:
            return
        dst = _as_u8_writable(outs[i])
        if dst.size != chunk.total:
            statuses[i] = KeyStatus.INVALID
            return
        dst[chunk.offset : chunk.offset + len(chunk.data)] = np.frombuffer(chunk.data, np.uint8)

    @staticmethod
    def _statuses(results: Any) -> list[KeyStatus]:
        return [KeyStatus(int(r.status)) for r in results]


class Client(_Base):
    """Synchronous client. Use as a context manager or call ``close()``."""

    def __init__(self, target: str | None = None, *, token: str | None = None, token_file: str | None = None,
                 tls_ca_file: str | None = None, name: str = "kvstore-client", use_shm: bool = True,
                 timeout: float = 30.0, session: bool = True, fast_lookup: bool = True) -> None:
        """``fast_lookup``: on the daemon's host, send ``lookup`` over its fast
        Lookup socket (kvstore/fastlookup.py) instead of gRPC."""
        super().__init__(target, token, token_file, tls_ca_file, name, use_shm, timeout)
        creds = self._creds()
        self.channel = (grpc.secure_channel(self.target, creds, self._options()) if creds
                        else grpc.insecure_channel(self.target, self._options()))
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self._keepalive: Any = None
        if session:
            resp = self._call(self.stub.Handshake, pb.HandshakeRequest(
                client_name=name, pid=os.getpid(), host_id=host_identity(), protocol_version=1))
            self._after_handshake(resp)
            self._keepalive = self.stub.KeepAlive(pb.KeepAliveRequest(session_id=self.session),
                                                  metadata=self._md())
            threading.Thread(target=self._drain_keepalive, daemon=True, name="kvstore-keepalive").start()
            if fast_lookup and self._fast_path:
                from kvstore.daemon.socket_server import LookupSocketClient

                try:
                    self._fast = LookupSocketClient(self._fast_path, self.session, timeout, self.token)
                except (OSError, KVStoreError) as e:
                    log.info("fast Lookup socket %s unusable (%s): Lookup goes over gRPC", self._fast_path, e)

    def _drain_keepalive(self) -> None:
        try:
            for _ in self._keepalive:
                pass
        except grpc.RpcError:
            pass

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return method(request, metadata=self._md(), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def _unary(self, name: str, request: Any) -> Any:
        """A control call of the shared-memory path: over the fast socket when
        there is one (kvstore/fastlookup.py), else gRPC. A socket that breaks
        mid-call fails the call (it may have run) and gRPC is used from then on."""
        fast = self._fast
        if fast is not None:
            try:
                data = fast.call(name, request.SerializeToString())
            except KVStoreError:  # the daemon's answer (some are OSError subclasses)
                raise
            except OSError as e:
                log.warning("fast socket failed (%s): control calls go over gRPC", e)
                fast.close()
                self._fast = None
                raise Unavailable(f"UNAVAILABLE: {name} over the fast socket failed: {e}") from None
            return getattr(pb, name + "Response").FromString(data)
        return self._call(getattr(self.stub, name), request)

    def close(self) -> None:
        if self._fast is not None:
            self._fast.close()
            self._fast = None
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
    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> LookupResult:
        fast = self._fast
        if fast is not None:
            wire = self._ns_wire.get(ns)
            if wire is None:
                wire = self._ns_wire[ns] = ns_pb(ns).SerializeToString(deterministic=True)
            try:
                hit, tiers = fast.lookup(wire, _pack(keys))
                return LookupResult(hit, [_TIER_NAMES[t] for t in tiers])
            except KVStoreError:  # the daemon's answer (some are OSError subclasses)
                raise
            except OSError as e:  # the socket broke: gRPC from now on
                log.warning("fast Lookup socket failed (%s): Lookup goes over gRPC", e)
                fast.close()
                self._fast = None
        r = self._call(self.stub.Lookup, pb.LookupRequest(ns=ns_pb(ns), keys_packed=_pack(keys)))
        return _lookup_result(r)

    def cluster_lookup(self, ns: Namespace, keys: Sequence[bytes], to_hbm: bool = False) -> "ClusterLookup":
        """Lookup in cluster mode (docs/cluster.md): where each block is and
        whether to fetch or recompute what peers hold."""
        r = self._call(self.stub.Lookup, pb.LookupRequest(ns=ns_pb(ns), keys_packed=_pack(keys), cluster=True,
                                                          to_hbm=to_hbm))
        return ClusterLookup(int(r.local_blocks), int(r.remote_blocks), _DECISIONS.get(int(r.decision), "local"),
                             float(r.fetch_s), float(r.recompute_s),
                             [(_TIER_NAMES[x.tier], x.peer, float(x.load_s)) for x in r.locations],
                             r.cluster_status)

    def stats(self, include_namespaces: bool = True) -> dict[str, Any]:
        r = self._call(self.stub.Stats, pb.StatsRequest(include_namespaces=include_namespaces))
        return MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    # --------------------------------------------------------------- put
    def put(self, ns: Namespace, keys: Sequence[bytes], payloads: Sequence[Buffer],
            parent: bytes | None = None) -> list[KeyStatus]:
        """Store a chain segment; one status per key."""
        keys = list(keys)
        if len(keys) != len(payloads):
            raise InvalidArgument(f"{len(keys)} keys but {len(payloads)} payloads")
        if self.slab is not None:
            return self._put_shm(ns, keys, payloads, parent)
        return self._put_inline(ns, keys, payloads, parent)

    def _put_shm(self, ns: Namespace, keys: list[bytes], payloads: Sequence[Buffer],
                 parent: bytes | None) -> list[KeyStatus]:
        srcs = [_as_u8(p) for p in payloads]
        r = self._unary("Reserve", self._reserve_request(ns, keys, srcs, parent))
        if not r.reservation_id:
            return [KeyStatus(x) for x in r.slots.status]
        try:
            statuses, csums = self._fill_slots(r, srcs)
        except BaseException:
            self._unary("Abort", pb.AbortRequest(reservation_id=r.reservation_id))
            raise
        c = self._unary("Commit", pb.CommitRequest(reservation_id=r.reservation_id, checksums=csums))
        return self._merge_commit(statuses, c)

    def _put_inline(self, ns: Namespace, keys: list[bytes], payloads: Sequence[Buffer],
                    parent: bytes | None) -> list[KeyStatus]:
        out: list[KeyStatus] = []
        for req in self._put_requests(ns, keys, payloads, parent):
            out += self._statuses(self._call(self.stub.Put, req).results)
        return out

    # --------------------------------------------------------------- get
    def get_into(self, ns: Namespace, keys: Sequence[bytes], outs: Sequence[Buffer]) -> list[KeyStatus]:
        """Copy the leading present blocks into ``outs``; one status per key."""
        keys = list(keys)
        if len(outs) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} output buffers")
        if self.slab is not None:
            return self._get_shm(ns, keys, outs)
        return self._get_inline(ns, keys, outs)

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
        bufs: dict[int, bytearray] = {}
        for idx, chunk in self._stream_get(ns, keys):
            if chunk.status != pb.STATUS_OK:
                continue
            b = bufs.setdefault(idx, bytearray(chunk.total))
            b[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
        return [np.frombuffer(bufs[i], np.uint8) if i in bufs else None for i in range(len(keys))]

    def _get_shm(self, ns: Namespace, keys: list[bytes], outs: Sequence[Buffer]) -> list[KeyStatus]:
        r = self._unary("Acquire", pb.AcquireRequest(ns=ns_pb(ns), keys_packed=_pack(keys), promote=True))
        try:
            statuses = self._read_slots(r, outs)
        finally:
            if r.lease_id:
                self._unary("Release", pb.ReleaseRequest(lease_id=r.lease_id))
        self._report_bad(ns, [k for k, s in zip(keys, statuses) if s is KeyStatus.CORRUPT])
        return statuses

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

    def _get_inline(self, ns: Namespace, keys: list[bytes], outs: Sequence[Buffer]) -> list[KeyStatus]:
        statuses = [KeyStatus.MISS] * len(keys)
        for _, chunk in self._stream_get(ns, keys):
            self._apply_chunk(chunk, outs, statuses)
        return statuses

    # ------------------------------------------------ two-phase, low level
    def view(self, offset: int, length: int) -> np.ndarray:
        """Writable zero-copy view of slab bytes (same-host clients only)."""
        if self.slab is None:
            raise Unavailable("no shared-memory slab: the daemon is on another host or use_shm=False")
        return self._view(offset, length)

    def map_hbm(self) -> Any:
        """Map the daemon's HBM slab through CUDA IPC (once per process) and
        return the mapping (``view(offset, length)`` gives device tensors).
        Raises Unavailable without an HBM tier, on another host, when the
        tier runs on the host (hbm.on_cpu) or without CUDA here."""
        if self.hbm is None:
            if not self.hbm_regions:
                raise Unavailable("the daemon has no hbm tier this client can map (none, or another host)")
            from kvstore.wire.hbm_ipc import open_region

            r = self.hbm_regions[0]
            self.hbm = open_region(r.device, r.ipc_handle, r.base_offset, r.size_bytes, r.slab_id, r.ipc)
        return self.hbm

    def hbm_view(self, offset: int, length: int) -> Any:
        """Device tensor view of an HBM slot (after map_hbm)."""
        return self.map_hbm().view(offset, length)

    def reserve(self, ns: Namespace, keys: Sequence[bytes], block_bytes: int,
                parent: bytes | None = None, tier: str | None = None) -> "Reservation":
        """Reserve slots for a chain segment of equal-size blocks; write them
        through ``view(offset, length)`` (from any process that maps the
        slab, e.g. every TP rank writing its shard), then ``commit``.
        ``tier="hbm"`` asks for device slots: those whose ``tiers`` entry is
        HBM are written through ``hbm_view`` (the daemon may answer DRAM)."""
        req = pb.ReserveRequest(ns=ns_pb(ns), keys_packed=_pack(keys), parent=parent or b"",
                                block_bytes=block_bytes, tier=_tier_field(tier))
        r = self._unary("Reserve", req)
        sa = r.slots
        return Reservation(r.reservation_id, [KeyStatus(x) for x in sa.status], list(sa.offset), list(sa.length),
                           [TierKind(t - 1) if t else None for t in sa.tier], int(sa.device))

    def commit(self, reservation: "Reservation", checksums: Sequence[int] | None = None) -> list[KeyStatus]:
        """Make reserved blocks visible. Without ``checksums`` the daemon
        computes them from the slab."""
        c = self._unary("Commit", pb.CommitRequest(reservation_id=reservation.reservation_id,
                                                          checksums=list(checksums or [])))
        return self._merge_commit(reservation.statuses, c)

    def abort(self, reservation: "Reservation") -> int:
        return int(self._unary("Abort", pb.AbortRequest(reservation_id=reservation.reservation_id)).aborted)

    def acquire(self, ns: Namespace, keys: Sequence[bytes], tier: str | None = None,
                cluster: bool = False) -> "Lease":
        """Pin the hit prefix and return zero-copy views into the slab
        (shared-memory clients only). Release with ``Lease.release()`` or a
        ``with`` block. ``tier="hbm"`` (after ``map_hbm``): blocks are
        promoted into HBM where possible and HBM slots come back as device
        tensor views (``Lease.tiers`` says which). ``cluster``: fetch what
        peers hold first when that beats recomputing it (docs/cluster.md)."""
        if self.slab is None:
            raise Unavailable("zero-copy acquire needs the shared-memory slab (same host)")
        want = _tier_field(tier)
        if want == TierKind.HBM + 1:
            self.map_hbm()
        r = self._unary("Acquire", pb.AcquireRequest(ns=ns_pb(ns), keys_packed=_pack(keys), promote=True,
                                                     tier=want, cluster=cluster))
        sa = r.slots
        hit = int(r.hit_blocks)
        tiers = [TierKind(sa.tier[i] - 1) for i in range(hit)]
        views: list[Any] = [self.hbm.view(sa.offset[i], sa.length[i]) if t is TierKind.HBM
                            else self._view(sa.offset[i], sa.length[i]) for i, t in enumerate(tiers)]
        views += [None] * (len(sa.status) - hit)
        lease = Lease(self, r.lease_id, hit, views, list(sa.checksum), list(sa.offset[:hit]), list(sa.length[:hit]))
        lease.tiers = tiers
        return lease

    # ------------------------------------------------------------ others
    def remove(self, ns: Namespace, keys: Sequence[bytes]) -> list[KeyStatus]:
        return self._statuses(self._call(self.stub.Remove, pb.RemoveRequest(ns=ns_pb(ns), keys=list(keys))).results)

    def report_corrupt(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Tell the daemon these blocks failed their checksum on our side."""
        return int(self._call(self.stub.ReportCorrupt, pb.ReportCorruptRequest(ns=ns_pb(ns), keys=list(keys))).dropped)

    def clear(self, ns: Namespace | None = None) -> int:
        req = pb.ClearRequest(ns=ns_pb(ns)) if ns is not None else pb.ClearRequest(all_namespaces=True)
        return int(self._call(self.stub.Clear, req).removed)

    def watch_events(self, after_seq: int = 0, ns: Namespace | None = None,
                     timeout: float | None = None) -> Iterator[pb.Event]:
        req = pb.WatchRequest(after_seq=after_seq)
        if ns is not None:
            req.ns.CopyFrom(ns_pb(ns))
        try:
            yield from self.stub.WatchEvents(req, metadata=self._md(), timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            raise error_from_rpc(e) from None

    def admin_get_config(self) -> str:
        return str(self._call(self.admin.GetConfig, pb.GetConfigRequest()).toml)

    def admin_resize(self, tier: str, capacity_bytes: int) -> dict[str, Any]:
        r = self._call(self.admin.ResizeTier, pb.ResizeTierRequest(
            tier=cast(Any, int(TierKind.parse(tier)) + 1), capacity_bytes=capacity_bytes))
        return MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    def admin_set_policy(self, name: str) -> dict[str, Any]:
        r = self._call(self.admin.SetEvictionPolicy, pb.SetEvictionPolicyRequest(policy=name))
        return MessageToDict(r, preserving_proto_field_name=True)


@dataclass(slots=True)
class Reservation:
    """Slots reserved for new blocks: write ``length`` bytes at ``offset`` of
    each OK key, then ``Client.commit``."""

    reservation_id: str
    statuses: list[KeyStatus]
    offsets: list[int]
    lengths: list[int]
    tiers: list[TierKind | None] = field(default_factory=list)
    """Tier of each slot (HBM: write through Client.hbm_view)."""
    device: int = 0
    """CUDA device of the HBM slots."""


class Lease:
    """Pinned blocks a shared-memory client reads in place: the first
    ``hit_blocks`` keys, at ``offsets``/``lengths`` in the slab."""

    def __init__(self, client: Client, lease_id: str, hit_blocks: int, views: list[np.ndarray | None],
                 checksums: list[int], offsets: list[int] | None = None, lengths: list[int] | None = None) -> None:
        self.client = client
        self.lease_id = lease_id
        self.hit_blocks = hit_blocks
        self.views = views
        self.checksums = checksums
        self.offsets = offsets or []
        self.lengths = lengths or []
        self.tiers: list[TierKind] = [TierKind.DRAM] * hit_blocks
        self._released = not lease_id

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.views = [None] * len(self.views)
            self.client._unary("Release", pb.ReleaseRequest(lease_id=self.lease_id))

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class AsyncClient(_Base):
    """asyncio client with the same calls as ``Client`` (awaitable)."""

    def __init__(self, target: str | None = None, *, token: str | None = None, token_file: str | None = None,
                 tls_ca_file: str | None = None, name: str = "kvstore-aio-client", use_shm: bool = True,
                 timeout: float = 30.0) -> None:
        super().__init__(target, token, token_file, tls_ca_file, name, use_shm, timeout)
        creds = self._creds()
        self.channel = (grpc.aio.secure_channel(self.target, creds, self._options()) if creds
                        else grpc.aio.insecure_channel(self.target, self._options()))
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self._ka_task: asyncio.Task[None] | None = None

    async def connect(self, session: bool = True) -> "AsyncClient":
        if session:
            resp = await self._call(self.stub.Handshake, pb.HandshakeRequest(
                client_name=self.name, pid=os.getpid(), host_id=host_identity(), protocol_version=1))
            self._after_handshake(resp)
            call = self.stub.KeepAlive(pb.KeepAliveRequest(session_id=self.session), metadata=self._md())
            self._ka_task = asyncio.get_running_loop().create_task(self._drain(call))
        return self

    @staticmethod
    async def _drain(call: Any) -> None:
        try:
            async for _ in call:
                pass
        except (grpc.RpcError, asyncio.CancelledError):
            pass

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, metadata=self._md(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    async def close(self) -> None:
        if self._ka_task is not None:
            self._ka_task.cancel()
        if self.slab is not None:
            self.slab.close()
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> LookupResult:
        r = await self._call(self.stub.Lookup, pb.LookupRequest(ns=ns_pb(ns), keys_packed=_pack(keys)))
        return _lookup_result(r)

    async def put(self, ns: Namespace, keys: Sequence[bytes], payloads: Sequence[Buffer],
                  parent: bytes | None = None) -> list[KeyStatus]:
        keys = list(keys)
        if len(keys) != len(payloads):
            raise InvalidArgument(f"{len(keys)} keys but {len(payloads)} payloads")
        if self.slab is None:
            out: list[KeyStatus] = []
            for req in self._put_requests(ns, keys, payloads, parent):
                out += self._statuses((await self._call(self.stub.Put, req)).results)
            return out
        srcs = [_as_u8(p) for p in payloads]
        r = await self._call(self.stub.Reserve, self._reserve_request(ns, keys, srcs, parent))
        if not r.reservation_id:
            return [KeyStatus(x) for x in r.slots.status]
        try:
            statuses, csums = self._fill_slots(r, srcs)
        except BaseException:
            await self._call(self.stub.Abort, pb.AbortRequest(reservation_id=r.reservation_id))
            raise
        c = await self._call(self.stub.Commit, pb.CommitRequest(reservation_id=r.reservation_id, checksums=csums))
        return self._merge_commit(statuses, c)

    async def get_into(self, ns: Namespace, keys: Sequence[bytes], outs: Sequence[Buffer]) -> list[KeyStatus]:
        keys = list(keys)
        if len(outs) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} output buffers")
        if self.slab is None:
            statuses = [KeyStatus.MISS] * len(keys)
            try:
                async for chunk in self.stub.Get(pb.GetRequest(ns=ns_pb(ns), keys=keys), metadata=self._md(),
                                                 timeout=self.timeout):
                    self._apply_chunk(chunk, outs, statuses)
            except grpc.RpcError as e:
                raise error_from_rpc(e) from None
            return statuses
        r = await self._call(self.stub.Acquire, pb.AcquireRequest(ns=ns_pb(ns), keys_packed=_pack(keys),
                                                                   promote=True))
        try:
            statuses = self._read_slots(r, outs)
        finally:
            if r.lease_id:
                await self._call(self.stub.Release, pb.ReleaseRequest(lease_id=r.lease_id))
        bad = [k for k, s in zip(keys, statuses) if s is KeyStatus.CORRUPT]
        if bad:  # the daemon drops them (best effort: they are misses here already)
            try:
                await self._call(self.stub.ReportCorrupt, pb.ReportCorruptRequest(ns=ns_pb(ns), keys=bad))
            except KVStoreError:
                pass
        return statuses

    async def remove(self, ns: Namespace, keys: Sequence[bytes]) -> list[KeyStatus]:
        r = await self._call(self.stub.Remove, pb.RemoveRequest(ns=ns_pb(ns), keys=list(keys)))
        return self._statuses(r.results)

    async def stats(self) -> dict[str, Any]:
        r = await self._call(self.stub.Stats, pb.StatsRequest(include_namespaces=True))
        return MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
