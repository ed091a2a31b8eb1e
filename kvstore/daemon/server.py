"""The kvstore daemon: a thin grpc.aio layer over one ``TieredStore``.

Each handler converts messages, calls the store and converts back; errors
from the exception tree become status codes through ``STATUS_TABLE`` (the one
place they are mapped). The store is single-threaded: every handler runs on
the server's event loop, so store calls never interleave.

Security defaults: listens on 127.0.0.1 (or a Unix socket, mode 0600); with a
token configured every call needs ``authorization: Bearer <token>`` and the
caller's tenant comes from its token, never from the namespace it sends;
optional TLS. Sessions: a client's ``Handshake`` returns a session id; its
``KeepAlive`` stream lives as long as the client, and when it ends the
session's leases and reservations are reclaimed. Reservations never committed
expire after ``server.reservation_timeout``; so do leases taken without a
session.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, cast

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from admission.qos import QosClass, QosConfig, QosGate, QosRejected
from admission.quota import TenantRateLimiter
from admission.slo import AdmissionConfig, AdmissionController, DecisionKind, PredictorConfig, TTFTPredictor
from kvstore import errors
from kvstore.checksum import checksum
from kvstore.config import Config
from kvstore.errors import InvalidArgument, KeyStatus, KVStoreError, PermissionDenied
from kvstore.daemon.auth import Auth, Principal
from kvstore.daemon.events import EventLog
from kvstore.keys import Namespace
from kvstore.daemon.metrics import Metrics, loop_stats_fn
from kvstore.wire.shm import host_identity
from kvstore.core.eviction import PolicyName
from kvstore.core.store import SlotResult, StoreConfig, TieredStore
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from kvstore.core.hbm_mover import spec_from_config as hbm_spec_from_config
from tiers.base import TierKind
from kvstore.wire.convert import (STATUS_TABLE, _chain_keys, _keys, _ttft_pb, _want_tier, hbm_pb, ns_from_pb,
                          results_pb, slots_pb, status_for, status_pb, tier_pb)

log = logging.getLogger("kvstore.daemon.server")

PROTOCOL_VERSION = 1
SESSION_MD = "x-kvstore-session"



# --------------------------------------------------------------- daemon
def _gave_up(context: Any) -> bool:
    """Whether the caller can no longer receive the answer (its deadline
    passed, or it cancelled the call)."""
    remaining = context.time_remaining()
    return (remaining is not None and remaining <= 0) or context.cancelled()


def _rpc(method: str, *, admin: bool = False) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """Wrap a unary handler: auth, deadline, metrics, error -> status."""

    def deco(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def wrapper(self: "Daemon", request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.perf_counter()
            try:
                who = self.auth.principal(context.invocation_metadata())
                if admin and not who.admin:
                    raise PermissionDenied(f"{method} needs an admin token")
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    raise errors.DeadlineExceeded(f"{method}: deadline passed before the call started")
                cls = QosClass.for_method(method)
                if cls is None:
                    return await fn(self, request, context, who)
                async with self.qos.slot(cls):
                    if _gave_up(context):
                        raise errors.DeadlineExceeded(f"{method}: deadline passed while the call was queued")
                    return await fn(self, request, context, who)
            except QosRejected as e:
                context.set_trailing_metadata(e.rejection.metadata())
                self.metrics.rejected(method, "RESOURCE_EXHAUSTED")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except KVStoreError as e:
                code = status_for(e)
                self.metrics.rejected(method, code.name)
                await context.abort(code, str(e))
            except Exception as e:  # a bug: log it, answer INTERNAL, keep serving
                log.exception("%s failed", method)
                self.metrics.rejected(method, "INTERNAL")
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}")
            finally:
                self.metrics.observe(method, time.perf_counter() - t0)

        return wrapper

    return deco


class Daemon(pb_grpc.KVStoreServicer, pb_grpc.AdminServicer, pb_grpc.ClusterServicer):
    """Servicer for KVStore and Admin, owning the store and sessions."""

    def __init__(self, config: Config, store: TieredStore | None = None) -> None:
        self.config = config
        self.auth = Auth(config)
        self.store = store or TieredStore(store_config(config, self.auth.shares))
        a = config.admission
        self.admission = AdmissionController(
            TTFTPredictor(PredictorConfig(prefill_tokens_per_s=a.prefill_tokens_per_s,
                                          attention_s_per_token2=a.attention_s_per_token2)),
            AdmissionConfig(tenants=frozenset(self.auth.tenants) if self.auth.tenants else None),
            rate_limiter=TenantRateLimiter(None, time.monotonic, per_tenant=self.auth.rates) if self.auth.rates else None)
        q = a.qos_queue_limit
        self.qos = QosGate(QosConfig(max_concurrency=a.qos_max_concurrency,
                                     queue_limits=(q, max(1, q // 2), max(1, q // 4), max(1, q // 8))))
        self.events = EventLog(config.server.event_buffer)
        self.store.subscribe(self.events.append)
        self.metrics = Metrics(loop_stats_fn(asyncio.get_running_loop(), self.store.stats))
        self.sessions: dict[str, str | None] = {}  # session id -> tenant
        self._unbound: dict[str, float] = {}  # session id -> when it ends unless its KeepAlive opens
        self.host_id = host_identity()
        self.slab_id = secrets.token_hex(8)
        self.started = time.time()
        self._tasks: list[asyncio.Task[Any]] = []
        self._ns_cache: dict[tuple[str | None, bytes], Namespace] = {}
        self._wake_background = asyncio.Event()
        self.lookup_socket = ""  # set by start() when the fast Lookup socket listens
        self.cluster: Any = None  # kvstore.daemon.peers.ClusterNode when cluster.mode is not off

    # ----------------------------------------------------------- helpers
    def _ns(self, msg: pb.Namespace, who: Principal) -> Namespace:
        """The request's namespace (validated once per distinct message and
        tenant, then served from a bounded cache: building and hashing a
        Namespace costs more than a whole small Lookup)."""
        return self.namespace_from_wire(msg.SerializeToString(deterministic=True), who, msg)

    def namespace_from_wire(self, data: bytes, who: Principal, msg: pb.Namespace | None = None) -> Namespace:
        """``_ns`` from a serialized Namespace message (the fast Lookup socket)."""
        wire = (who.tenant, data)
        ns = self._ns_cache.get(wire)
        if ns is None:
            if msg is None:
                try:
                    msg = pb.Namespace.FromString(data)
                except Exception:
                    raise InvalidArgument("namespace is not a valid Namespace message") from None
            ns = ns_from_pb(msg, who.tenant)
            if len(self._ns_cache) >= 4096:
                self._ns_cache.clear()
            self._ns_cache[wire] = ns
        return ns

    def _owner(self, context: grpc.aio.ServicerContext, who: Principal) -> tuple[str, bool]:
        """(owner id, has a live session)."""
        for k, v in context.invocation_metadata() or ():
            if k == SESSION_MD:
                if v not in self.sessions:
                    raise errors.NotFound(f"session {v!r} is unknown (expired or from another daemon run)")
                if self.sessions[v] != who.tenant:
                    raise PermissionDenied("session belongs to another tenant")
                return v, True
        return "anon:" + context.peer(), False

    # ------------------------------------------------------------ session
    @_rpc("Handshake")
    async def Handshake(self, request: pb.HandshakeRequest, context: Any, who: Principal) -> pb.HandshakeResponse:
        sid = "s-" + secrets.token_hex(12)
        self.sessions[sid] = who.tenant
        self._unbound[sid] = time.monotonic() + self.config.server.reservation_timeout
        t = self.store.dram
        same = bool(request.host_id) and request.host_id == self.host_id
        resp = pb.HandshakeResponse(
            session_id=sid, same_host=same, max_message_bytes=self.config.server.max_message_bytes,
            protocol_version=PROTOCOL_VERSION, server_version=_version(), host_id=self.host_id,
            tenant=who.tenant or "", reservation_timeout_ms=int(self.config.server.reservation_timeout * 1000))
        if same:
            resp.shm.name = t.name
            resp.shm.path = t.path
            resp.shm.size_bytes = t.size
            resp.shm.alignment = t.slot_align
            resp.shm.slab_id = self.slab_id
            if self.store.hbm is not None:
                resp.hbm.append(hbm_pb(self.store.hbm.tier, self.slab_id))
        if same and self.lookup_socket:
            resp.lookup_socket = self.lookup_socket
        return resp

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> AsyncIterator[pb.KeepAliveResponse]:
        try:
            who = self.auth.principal(context.invocation_metadata())
        except KVStoreError as e:
            await context.abort(status_for(e), str(e))
            return
        sid = request.session_id
        if sid not in self.sessions or self.sessions[sid] != who.tenant:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"session {sid!r} is unknown")
            return
        self._unbound.pop(sid, None)
        interval = max(0.05, float(self.config.server.lease_check_interval))
        try:
            while True:
                yield pb.KeepAliveResponse(time_unix_ns=time.time_ns(), interval_ms=int(interval * 1000))
                await asyncio.sleep(interval)
        finally:
            # the client is gone (or the server is stopping): reclaim
            self.sessions.pop(sid, None)
            leases, resv = self.store.release_owner(sid)
            if leases or resv:
                log.info("session %s ended: released %d leases, aborted %d reservations", sid, leases, resv)

    # -------------------------------------------------------------- data
    @_rpc("Lookup")
    async def Lookup(self, request: pb.LookupRequest, context: Any, who: Principal) -> pb.LookupResponse:
        ns = self._ns(request.ns, who)
        res = self.store.lookup(ns, _chain_keys(request))
        self.metrics.lookup_hits(res.tier_codes)
        if request.cluster:
            from kvstore.daemon.peers import lookup_response

            return await lookup_response(self, request, ns, res, _chain_keys(request))
        if request.keys_packed:
            return pb.LookupResponse(hit_blocks=res.hit_blocks,
                                     tiers_packed=(res.tier_codes.astype(np.uint8) + 1).tobytes())
        return pb.LookupResponse(hit_blocks=res.hit_blocks, tiers=(res.tier_codes.astype(np.int64) + 1).tolist())

    @_rpc("Reserve")
    async def Reserve(self, request: pb.ReserveRequest, context: Any, who: Principal) -> pb.ReserveResponse:
        ns = self._ns(request.ns, who)
        keys = _chain_keys(request)
        if request.sizes and request.block_bytes:
            raise InvalidArgument("give sizes or block_bytes, not both")
        sizes: list[int] | int
        if request.sizes:
            sizes = list(request.sizes)
        elif request.block_bytes:
            sizes = int(request.block_bytes)
        else:
            raise InvalidArgument("sizes or block_bytes is required")
        owner, _ = self._owner(context, who)
        res = self.store.reserve(ns, keys, sizes, owner=owner, parent=request.parent or None,
                                 tier=_want_tier(request.tier))
        if res.handle and _gave_up(context):  # nobody will write or commit these slots
            self.store.abort(res.handle, owner)
            raise errors.DeadlineExceeded("Reserve: the caller's deadline passed; the reservation was aborted")
        return pb.ReserveResponse(reservation_id=res.handle, slots=self._slots(res), details=res.messages,
                                  expires_in_ms=int(self.config.server.reservation_timeout * 1000))

    @_rpc("Commit")
    async def Commit(self, request: pb.CommitRequest, context: Any, who: Principal) -> pb.CommitResponse:
        owner, _ = self._owner(context, who)
        if request.keys:
            raise InvalidArgument("partial commit is not supported: commit the whole reservation or abort it")
        res = self.store.commit(request.reservation_id, owner, list(request.checksums) or None)
        return pb.CommitResponse(results=[pb.KeyResult(status=status_pb(s)) for s in res.statuses])

    @_rpc("Abort")
    async def Abort(self, request: pb.AbortRequest, context: Any, who: Principal) -> pb.AbortResponse:
        owner, _ = self._owner(context, who)
        return pb.AbortResponse(aborted=self.store.abort(request.reservation_id, owner))

    @_rpc("Acquire")
    async def Acquire(self, request: pb.AcquireRequest, context: Any, who: Principal) -> pb.AcquireResponse:
        ns = self._ns(request.ns, who)
        keys = _chain_keys(request)
        owner, has_session = self._owner(context, who)
        ttl = None if has_session else self.config.server.reservation_timeout
        fetched, decision = 0, 0
        if request.cluster and request.promote and self.cluster is not None:
            fetched, decision = await self.cluster.fetch_for(request, context.invocation_metadata(), ns, keys)
        res = self.store.acquire(ns, keys, owner=owner, ttl=ttl, promote=request.promote,
                                 tier=_want_tier(request.tier))
        if res.handle and _gave_up(context):  # (e.g. a slow promotion): nobody will release this lease
            self.store.release(res.handle, owner)
            raise errors.DeadlineExceeded("Acquire: the caller's deadline passed; the lease was released")
        hit = int(np.count_nonzero(res.offsets >= 0))
        return pb.AcquireResponse(lease_id=res.handle, hit_blocks=hit, slots=self._slots(res),
                                  fetched_blocks=fetched, decision=cast(Any, decision))

    def _slots(self, res: SlotResult) -> pb.SlotArray:
        sa = slots_pb(res)
        if self.store.hbm is not None:
            sa.device = self.store.hbm.tier.device_index
        return sa

    @_rpc("Release")
    async def Release(self, request: pb.ReleaseRequest, context: Any, who: Principal) -> pb.ReleaseResponse:
        owner, _ = self._owner(context, who)
        return pb.ReleaseResponse(released=self.store.release(request.lease_id, owner))

    @_rpc("Put")
    async def Put(self, request: pb.PutRequest, context: Any, who: Principal) -> pb.PutResponse:
        ns = self._ns(request.ns, who)
        keys = _keys(request.keys)
        payloads = list(request.payloads)
        if len(payloads) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(payloads)} payloads")
        if request.checksums:
            if len(request.checksums) != len(keys):
                raise InvalidArgument(f"{len(request.checksums)} checksums for {len(keys)} payloads")
            for i, (p, c) in enumerate(zip(payloads, request.checksums)):
                if checksum(p) != c:
                    # stop the chain here: this payload and what follows are not stored
                    keys_ok = keys[:i]
                    res = self.store.put(ns, keys_ok, payloads[:i], parent=request.parent or None)
                    res.statuses += [KeyStatus.CORRUPT] + [KeyStatus.PARENT_MISSING] * (len(keys) - i - 1)
                    res.messages[i] = "payload does not match its checksum"
                    return pb.PutResponse(results=results_pb(keys, res))
        res = self.store.put(ns, keys, payloads, parent=request.parent or None)
        self.metrics.inline_bytes("in", sum(len(p) for p in payloads))
        return pb.PutResponse(results=results_pb(keys, res))

    async def Get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetChunk]:
        t0 = time.perf_counter()
        try:
            who = self.auth.principal(context.invocation_metadata())
            ns = self._ns(request.ns, who)
            keys = _keys(request.keys)
            limit = self.config.server.max_message_bytes - 4096
            chunk = min(int(request.max_chunk_bytes or limit), limit)
            if chunk <= 0:
                raise InvalidArgument("max_chunk_bytes must be positive")
            res = self.store.get(ns, keys)
        except KVStoreError as e:
            self.metrics.rejected("Get", status_for(e).name)
            await context.abort(status_for(e), str(e))
            return
        sent = 0
        for i, (k, s, p) in enumerate(zip(keys, res.statuses, res.payloads)):
            if p is None:
                yield pb.GetChunk(index=i, key=k, status=status_pb(s))
                continue
            c = checksum(p)
            total = p.size
            for off in range(0, max(total, 1), chunk):
                piece = p[off : off + chunk].tobytes()
                yield pb.GetChunk(index=i, key=k, status=status_pb(s), data=piece, checksum=c, offset=off,
                                  total=total, tier=tier_pb(TierKind.DRAM))
            sent += total
        self.metrics.inline_bytes("out", sent)
        self.metrics.observe("Get", time.perf_counter() - t0)

    @_rpc("Admit")
    async def Admit(self, request: pb.AdmitRequest, context: Any, who: Principal) -> pb.AdmitResponse:
        ns = self._ns(request.ns, who)
        keys = _chain_keys(request)
        if not request.ttft_target_s > 0:
            raise InvalidArgument(f"ttft_target_s must be > 0, got {request.ttft_target_s}")
        res = self.store.peek(ns, keys)  # no I/O, not counted as a lookup
        block_bytes = self.store.block_bytes(ns) or int(request.block_bytes)
        d = self.admission.decide(ns.tenant, int(request.n_tokens), None, ns.block_size, block_bytes,
                                  float(request.ttft_target_s), block_tiers=res.tier_codes,
                                  queue_wait_s=request.queue_wait_s or None, klass=request.klass or None,
                                  dry_run=request.dry_run)
        self.metrics.admission_decision(ns.tenant, d.kind.name.lower(), d.reason_code, d.predicted.total_s)
        return pb.AdmitResponse(
            kind=cast(Any, {DecisionKind.ADMIT: 1, DecisionKind.ADMIT_DEGRADED: 2, DecisionKind.REJECT: 3}[d.kind]),
            predicted=_ttft_pb(d.predicted), full=_ttft_pb(d.full), reason=d.reason, reason_code=d.reason_code,
            hit_blocks=d.hit_blocks, use_blocks=d.use_blocks, decision_id=d.decision_id,
            retry_after_ms=int(d.retry_after_s * 1000), starved=d.starved)

    @_rpc("Report")
    async def Report(self, request: pb.ReportRequest, context: Any, who: Principal) -> pb.ReportResponse:
        if not request.actual_ttft_s > 0:
            raise InvalidArgument(f"actual_ttft_s must be > 0, got {request.actual_ttft_s}")
        err = self.admission.report(int(request.decision_id), float(request.actual_ttft_s),
                                    actual_queue_s=request.queue_s or None)
        if err is None:
            return pb.ReportResponse(matched=False)
        self.metrics.admission_report(err, self.admission.predictor.prefill_tokens_per_s)
        return pb.ReportResponse(matched=True, error_s=err)

    @_rpc("Prefetch")
    async def Prefetch(self, request: pb.PrefetchRequest, context: Any, who: Principal) -> pb.PrefetchResponse:
        hit, in_dram, queued = self.store.prefetch(self._ns(request.ns, who), _chain_keys(request))
        if queued:
            self._wake_background.set()
        return pb.PrefetchResponse(hit_blocks=hit, in_dram=in_dram, queued=queued)

    @_rpc("ReportCorrupt")
    async def ReportCorrupt(self, request: pb.ReportCorruptRequest, context: Any,
                            who: Principal) -> pb.ReportCorruptResponse:
        n = self.store.report_corrupt(self._ns(request.ns, who), _keys(request.keys))
        return pb.ReportCorruptResponse(dropped=n)

    @_rpc("Remove")
    async def Remove(self, request: pb.RemoveRequest, context: Any, who: Principal) -> pb.RemoveResponse:
        keys = _keys(request.keys)
        res = self.store.remove(self._ns(request.ns, who), keys)
        return pb.RemoveResponse(results=results_pb(keys, res),
                                 removed=sum(1 for s in res.statuses if s is KeyStatus.OK))

    @_rpc("Clear")
    async def Clear(self, request: pb.ClearRequest, context: Any, who: Principal) -> pb.ClearResponse:
        has_ns = request.HasField("ns")
        if has_ns == request.all_namespaces:
            raise InvalidArgument("give exactly one of ns or all_namespaces")
        if has_ns:
            return pb.ClearResponse(removed=self.store.clear(self._ns(request.ns, who)))
        if who.tenant is None or who.admin:
            return pb.ClearResponse(removed=self.store.clear(None))
        removed = 0
        for ns in self.store.namespaces():
            if ns.tenant == who.tenant:
                removed += self.store.clear(ns)
        return pb.ClearResponse(removed=removed)

    @_rpc("Stats")
    async def Stats(self, request: pb.StatsRequest, context: Any, who: Principal) -> pb.StatsResponse:
        return self.stats_pb(include_namespaces=request.include_namespaces, tenant=who.tenant if not who.admin else None)

    def stats_pb(self, include_namespaces: bool = True, tenant: str | None = None) -> pb.StatsResponse:
        st = self.store.stats()
        c = st.counters
        out = pb.StatsResponse(
            lookups=c.lookups, hit_blocks=c.lookup_hit_blocks, miss_blocks=c.lookup_blocks - c.lookup_hit_blocks,
            hit_tokens=c.lookup_hit_tokens, miss_tokens=c.lookup_tokens - c.lookup_hit_tokens,
            puts=c.put_blocks, gets=c.get_hit_blocks, bytes_written=c.put_bytes, bytes_read=c.get_bytes,
            checksum_failures=c.checksum_failures, active_reservations=st.reservations,
            active_leases=st.leases, sessions=len(self.sessions), uptime_seconds=time.time() - self.started)
        for t in st.tiers:
            out.tiers.append(pb.TierStats(tier=tier_pb(t.tier), capacity_bytes=t.capacity_bytes,
                                          used_bytes=t.used_bytes, blocks=t.blocks,
                                          pinned_bytes=t.pinned_bytes, evictions=t.evictions,
                                          promotions=t.promotions, demotions=t.demotions, hits=t.hits))
        ast = self.admission.stats()
        for (_, kind), count in ast.decisions.items():
            if kind == "admit":
                out.admitted += count
            elif kind == "admit_degraded":
                out.admitted_degraded += count
            elif kind == "reject":
                out.rejected += count
        out.prefill_tokens_per_s = ast.prefill_tokens_per_s
        out.ttft_error_ewma_s = ast.errors.ewma_abs_s
        if self.cluster is not None:
            out.cluster_members = len(self.cluster.membership.members)
            out.cluster_status = self.cluster.status
        if self.store.ssd is not None:
            out.bytes_promoted = self.store.ssd.bytes_promoted
            out.bytes_demoted = self.store.ssd.bytes_demoted
        if include_namespaces:
            for n in st.namespaces:
                if tenant is not None and n.tenant != tenant:
                    continue
                out.namespaces.append(pb.NamespaceStats(
                    namespace_label=n.label, ns_digest=n.digest, lookups=n.lookups, hit_blocks=n.hit_blocks,
                    queried_blocks=n.queried_blocks, blocks=n.blocks))
        return out

    async def WatchEvents(self, request: pb.WatchRequest, context: Any) -> AsyncIterator[pb.Event]:
        try:
            who = self.auth.principal(context.invocation_metadata())
            only = self._ns(request.ns, who).digest if request.HasField("ns") else None
        except KVStoreError as e:
            await context.abort(status_for(e), str(e))
            return
        after = request.after_seq
        gap, _ = self.events.since(after)
        if after and gap is not None:
            yield pb.Event(seq=0, gap=pb.Gap(first_available_seq=gap))
        elif after > self.events.seq:
            # from a previous daemon run: everything since is unknown
            yield pb.Event(seq=0, gap=pb.Gap(first_available_seq=self.events.buf[0].seq if self.events.buf else self.events.seq + 1))
            after = 0
        while True:
            _, evs = self.events.since(after)
            for ev in evs:
                after = ev.seq
                if self._visible(ev, who, only):
                    yield ev
            await self.events.wait(1.0)

    def _visible(self, ev: pb.Event, who: Principal, only: bytes | None) -> bool:
        kind = ev.WhichOneof("kind")
        digest = getattr(ev, kind).ns_digest if kind in ("stored", "removed", "cleared") else b""
        if only is not None and digest and digest != only:
            return False
        if who.tenant is not None and not who.admin and digest:
            return self.store.tenant_of(digest) == who.tenant
        return True

    # ----------------------------------------------------------- cluster
    def _need_cluster(self) -> Any:
        if self.cluster is None:
            raise errors.Unavailable("cluster mode is off on this daemon")
        return self.cluster

    @_rpc("NodeInfo", admin=True)
    async def NodeInfo(self, request: pb.NodeInfoRequest, context: Any, who: Principal) -> pb.NodeInfoResponse:
        c = self._need_cluster()
        me = c.membership.me
        return pb.NodeInfoResponse(node_id=me.node_id, grpc_address=me.grpc_address,
                                   block_address=me.block_address, capacity_bytes=dict(me.capacities))

    @_rpc("Publish", admin=True)
    async def Publish(self, request: pb.PublishRequest, context: Any, who: Principal) -> pb.PublishResponse:
        return pb.PublishResponse(applied=self._need_cluster().apply(request))

    @_rpc("Locate", admin=True)
    async def Locate(self, request: pb.LocateRequest, context: Any, who: Principal) -> pb.LocateResponse:
        if len(request.keys_packed) % 16:
            raise InvalidArgument("keys_packed is not a multiple of 16 bytes")
        p = request.keys_packed
        return self._need_cluster().locate_local(request.ns_digest, [p[i : i + 16] for i in range(0, len(p), 16)])

    # ------------------------------------------------------------- admin
    @_rpc("GetConfig", admin=True)
    async def GetConfig(self, request: pb.GetConfigRequest, context: Any, who: Principal) -> pb.GetConfigResponse:
        return pb.GetConfigResponse(toml=self.config.to_toml(), json=json.dumps(self.config.to_dict()))

    @_rpc("ResizeTier", admin=True)
    async def ResizeTier(self, request: pb.ResizeTierRequest, context: Any, who: Principal) -> pb.ResizeTierResponse:
        if request.tier == 0:
            raise InvalidArgument("tier is required (dram, ssd, hbm)")
        if request.tier - 1 not in set(TierKind):
            raise InvalidArgument(f"unknown tier {request.tier}; allowed: dram, ssd, hbm")
        tier = TierKind(request.tier - 1)
        t = self.store.tiers.get(tier)
        if t is None:
            raise errors.NotFound(f"tier {tier.label} is not configured")
        old = t.capacity_bytes
        evicted = self.store.resize(tier, int(request.capacity_bytes))
        return pb.ResizeTierResponse(old_capacity_bytes=old, new_capacity_bytes=t.capacity_bytes,
                                     evicted_blocks=evicted)

    @_rpc("SetEvictionPolicy", admin=True)
    async def SetEvictionPolicy(self, request: pb.SetEvictionPolicyRequest, context: Any,
                                who: Principal) -> pb.SetEvictionPolicyResponse:
        old = self.store.set_policy(request.policy)
        return pb.SetEvictionPolicyResponse(old_policy=old, new_policy=self.store.policy.name.value)

    # ---------------------------------------------------------- background
    async def _reaper(self) -> None:
        interval = max(0.05, float(self.config.server.lease_check_interval))
        while True:
            await asyncio.sleep(interval)
            try:
                n = self.store.reap()
                if n:
                    log.info("reclaimed %d expired reservations/leases", n)
                self._end_unbound_sessions()
            except Exception:  # never let the reaper die
                log.exception("reaper failed")

    async def _tier_worker(self) -> None:
        """Background tier work in bounded steps; foreground calls run between
        steps (the store is single-threaded), so a get never queues behind a
        backlog of demotions."""
        while True:
            try:
                async with self.qos.slot(QosClass.BACKGROUND):  # yields to queued foreground calls
                    more = self.store.background()
            except QosRejected:
                more = False
            except Exception:
                log.exception("background tier work failed")
                more = False
            if more:
                await asyncio.sleep(0)
                continue
            self._wake_background.clear()
            try:
                await asyncio.wait_for(self._wake_background.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    def _end_unbound_sessions(self) -> None:
        """End sessions whose client never opened the KeepAlive stream (it
        died right after its Handshake, or never meant to): their leases and
        reservations would otherwise be held for ever, and their entries
        pile up."""
        now = time.monotonic()
        for sid in [s for s, t in self._unbound.items() if t <= now]:
            del self._unbound[sid]
            self.sessions.pop(sid, None)
            self.store.release_owner(sid)

    def start_background(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._reaper()))
        if self.store.ssd is not None:
            self._tasks.append(loop.create_task(self._tier_worker()))

    def stop_background(self) -> None:
        for t in self._tasks:
            t.cancel()


def store_config(config: Config, shares: dict[str, float] | None = None) -> StoreConfig:
    """The store's settings from the daemon's config tree."""
    ssd = None
    if config.ssd.capacity:
        from kvstore.core.ssd_mover import SsdSpec, WriteMode

        path = config.ssd.resolved_path()
        ssd = SsdSpec(path=str(path), capacity_bytes=config.ssd.capacity,
                      admit_min_hits=config.ssd.admit_min_hits,
                      write_budget_mbps=float(config.ssd.write_budget_mbps),
                      write_mode=WriteMode(config.ssd.write_mode.value), low_watermark=config.ssd.low_watermark,
                      sync=config.ssd.sync)
    return StoreConfig(
        dram_bytes=config.dram.capacity,
        dram_page_bytes=config.dram.page_size,
        dram_slot_sizes=tuple(config.dram.slot_sizes),
        shm_name=config.dram.shm_name or None,
        policy=PolicyName(config.eviction.policy.value),
        dram_admission=config.eviction.dram_admission,
        reservation_timeout=config.server.reservation_timeout,
        ssd=ssd,
        copy_threads=config.server.workers,
        tenant_shares=tuple(sorted((shares or {}).items())),
        default_tenant_share=config.admission.default_tenant_share,
        hbm=hbm_spec_from_config(config),
    )


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvstore")
    except Exception:
        return "0"


# ------------------------------------------------------------- running
@dataclass
class Running:
    server: grpc.aio.Server
    daemon: Daemon
    port: int
    health: health.HealthServicer
    address: str
    fast: Any = None  # the fast Lookup socket (kvstore.daemon.socket_server), if any

    async def stop(self, grace: float | None = None) -> None:
        self.health.enter_graceful_shutdown()
        if self.fast is not None:
            await self.fast.stop()
        if self.daemon.cluster is not None:
            cluster, self.daemon.cluster = self.daemon.cluster, None
            try:
                await cluster.stop()
            except Exception:
                log.exception("stopping the cluster node failed")
        await self.server.stop(grace)
        self.daemon.stop_background()


async def start(config: Config, store: TieredStore | None = None) -> Running:
    """Build and start the daemon's gRPC server on the running loop."""
    s = config.server
    opts = [("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=opts)
    daemon = Daemon(config, store)
    pb_grpc.add_KVStoreServicer_to_server(daemon, server)
    pb_grpc.add_AdminServicer_to_server(daemon, server)
    pb_grpc.add_ClusterServicer_to_server(daemon, server)
    hs = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = (pb.DESCRIPTOR.services_by_name["KVStore"].full_name,
             pb.DESCRIPTOR.services_by_name["Admin"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    creds = None
    if s.tls_cert_file:
        with open(s.tls_key_file, "rb") as fk, open(s.tls_cert_file, "rb") as fc:
            creds = grpc.ssl_server_credentials([(fk.read(), fc.read())])
    port = 0
    address = ""
    if s.host:
        address = f"{s.host}:{s.port}" if ":" not in s.host else f"[{s.host}]:{s.port}"
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        address = f"{s.host}:{port}"
    if s.unix_socket:
        uaddr = f"unix:{s.unix_socket}"
        server.add_secure_port(uaddr, creds) if creds else server.add_insecure_port(uaddr)
        address = address or uaddr
    await server.start()
    fast = None
    if s.unix_socket:
        os.chmod(s.unix_socket, 0o600)
        if s.lookup_socket != "off":
            from kvstore.daemon.socket_server import LookupSocketServer

            fast = LookupSocketServer(daemon, s.lookup_socket or s.unix_socket + ".lookup")
            await fast.start()
            daemon.lookup_socket = fast.path
    for n in names[:2]:
        hs.set(n, health_pb2.HealthCheckResponse.SERVING)
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    daemon.start_background()
    running = Running(server, daemon, port, hs, address, fast)
    if config.cluster.mode.value != "off":
        from kvstore.daemon.peers import start_cluster

        await start_cluster(running, config)
    return running


def serve(config: Config) -> int:
    """Run the daemon until SIGTERM/SIGINT; drain in-flight calls; return 0."""
    return asyncio.run(_serve(config))


async def _serve(config: Config) -> int:
    t0 = time.perf_counter()
    running = await start(config)
    d = running.daemon
    mport = None
    if config.metrics.port:
        try:
            _, mport = d.metrics.start_http(config.metrics.host, config.metrics.port)
        except Exception:
            await running.stop(0)
            d.store.close()
            raise
    rec = d.store.recovery
    if rec is not None:
        log.info("ssd tier at %s: recovered %d blocks (%d bytes) in %.3fs; dropped %d unusable records",
                 d.store.ssd.tier.path if d.store.ssd else "?", rec.blocks, rec.bytes, rec.seconds, rec.dropped)
    log.info("kvstore serving on %s (dram %d bytes in %s, policy %s, auth %s, metrics %s) in %.2fs",
             running.address, d.store.dram.capacity_bytes, d.store.dram.path, d.store.policy.name.value,
             "on" if d.auth.enabled else "off", f"{config.metrics.host}:{mport}" if mport else "off",
             time.perf_counter() - t0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining (up to %.1fs)", config.server.drain_seconds)
    await running.stop(config.server.drain_seconds)
    d.store.close()
    if config.cluster.mode.value != "off":
        from kvstore.daemon.peers import shutdown_transport

        shutdown_transport()
    log.info("stopped")
    return 0


__all__ = ["Daemon", "Running", "STATUS_TABLE", "serve", "start", "status_for", "ns_from_pb"]
