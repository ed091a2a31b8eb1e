"""The ``KVStore`` gRPC service: sessions (Handshake, KeepAlive), the data
calls (Lookup, Reserve/Commit/Abort, Acquire/Release, Put/Get, Prefetch,
ReportCorrupt, Remove, Clear), admission (Admit, Report), Stats and
WatchEvents. Each handler converts messages, calls the store and converts
back; unary handlers go through ``kvstore.daemon.rpc.rpc``.

Sessions: a client's ``Handshake`` returns a session id; its ``KeepAlive``
stream lives as long as the client, and when it ends the session's leases
and reservations are reclaimed. Reservations never committed expire after
``server.reservation_timeout``; so do leases taken without a session.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, AsyncIterator, cast

import grpc
import numpy as np

from admission.predictor import check_positive
from admission.slo import DecisionKind
from kvstore import errors
from kvstore.checksum import checksum
from kvstore.daemon.auth import Principal
from kvstore.daemon.rpc import gave_up, rpc
from kvstore.daemon.state import PROTOCOL_VERSION, DaemonState, version
from kvstore.errors import InvalidArgument, KeyStatus, KVStoreError
from kvstore.wire.convert import (chain_keys, details_pb, hbm_pb, keys_of, parent_of, results_pb, status_for, status_pb,
                                  tier_pb, ttft_pb, want_tier)
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tiers.base import TierKind

log = logging.getLogger("kvstore.daemon.server")


class KVStoreService(DaemonState, pb_grpc.KVStoreServicer):
    """The KVStore servicer (the engines' calls)."""

    # ------------------------------------------------------------ session
    @rpc("Handshake")
    async def Handshake(self, request: pb.HandshakeRequest, context: Any, who: Principal) -> pb.HandshakeResponse:
        if request.protocol_version > PROTOCOL_VERSION:  # (0: a client that predates the field)
            log.warning("refused a client of protocol %d (%s, pid %d): this daemon speaks %d",
                        request.protocol_version, request.client_name, request.pid, PROTOCOL_VERSION)
            raise InvalidArgument(f"client protocol {request.protocol_version} is newer than this daemon's "
                                  f"({PROTOCOL_VERSION}, kvstore {version()}): upgrade the daemon before its clients")
        sid = "s-" + secrets.token_hex(12)
        self.sessions[sid] = who.tenant
        self.unbound[sid] = time.monotonic() + self.config.server.reservation_timeout
        t = self.store.dram
        same = bool(request.host_id) and request.host_id == self.host_id
        resp = pb.HandshakeResponse(
            session_id=sid, same_host=same, max_message_bytes=self.config.server.max_message_bytes,
            protocol_version=PROTOCOL_VERSION, server_version=version(), host_id=self.host_id,
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
        if self.unbound.pop(sid, None) is None:  # its stream is open already: one per session
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"session {sid!r} already has a KeepAlive stream")
            return
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
    @rpc("Lookup")
    async def Lookup(self, request: pb.LookupRequest, context: Any, who: Principal) -> pb.LookupResponse:
        ns = self.namespace(request.ns, who)
        res = self.store.lookup(ns, chain_keys(request))
        self.metrics.lookup_hits(res.tier_codes)
        if request.cluster:
            from kvstore.daemon.cluster_service import lookup_response

            return await lookup_response(self, request, ns, res, chain_keys(request))
        if request.keys_packed:
            return pb.LookupResponse(hit_blocks=res.hit_blocks,
                                     tiers_packed=(res.tier_codes.astype(np.uint8) + 1).tobytes())
        return pb.LookupResponse(hit_blocks=res.hit_blocks, tiers=(res.tier_codes.astype(np.int64) + 1).tolist())

    @rpc("Reserve")
    async def Reserve(self, request: pb.ReserveRequest, context: Any, who: Principal) -> pb.ReserveResponse:
        ns = self.namespace(request.ns, who)
        keys = chain_keys(request)
        if request.sizes and request.block_bytes:
            raise InvalidArgument("give sizes or block_bytes, not both")
        sizes: list[int] | int
        if request.sizes:
            sizes = list(request.sizes)
        elif request.block_bytes:
            sizes = int(request.block_bytes)
        else:
            raise InvalidArgument("sizes or block_bytes is required")
        parent = parent_of(request)
        owner, _ = self.owner(context, who)
        nbytes = sizes if isinstance(sizes, int) else max(sizes)
        res = await self.disk.run(lambda: self.store.needs_disk_write(len(keys), nbytes), self.store.reserve,
                                  ns, keys, sizes, owner=owner, parent=parent,
                                  tier=want_tier(request.tier),
                                  undo=lambda r: r.handle and self.store.abort(r.handle, owner))
        if res.handle and gave_up(context):  # nobody will write or commit these slots
            self.store.abort(res.handle, owner)
            raise errors.DeadlineExceeded("Reserve: the caller's deadline passed; the reservation was aborted")
        return pb.ReserveResponse(reservation_id=res.handle, slots=self.slots(res),
                                  details=details_pb(res.statuses, res.messages),
                                  expires_in_ms=int(self.config.server.reservation_timeout * 1000))

    @rpc("Commit")
    async def Commit(self, request: pb.CommitRequest, context: Any, who: Principal) -> pb.CommitResponse:
        owner, _ = self.owner(context, who)
        if request.keys:
            raise InvalidArgument("keys: partial commit is not supported (leave keys empty): commit the whole "
                                  "reservation or abort it")
        res = self.store.commit(request.reservation_id, owner, list(request.checksums) or None)
        return pb.CommitResponse(results=results_pb(None, res))

    @rpc("Abort")
    async def Abort(self, request: pb.AbortRequest, context: Any, who: Principal) -> pb.AbortResponse:
        owner, _ = self.owner(context, who)
        return pb.AbortResponse(aborted=self.store.abort(request.reservation_id, owner))

    @rpc("Acquire")
    async def Acquire(self, request: pb.AcquireRequest, context: Any, who: Principal) -> pb.AcquireResponse:
        ns = self.namespace(request.ns, who)
        keys = chain_keys(request)
        owner, has_session = self.owner(context, who)
        ttl = None if has_session else self.config.server.reservation_timeout
        fetched, decision = 0, 0
        if request.cluster and request.promote and self.cluster is not None:
            fetched, decision = await self.cluster.fetch_for(request, context.invocation_metadata(), ns, keys)
        res = await self.disk.run(lambda: self.store.needs_disk_read(ns, keys), self.store.acquire, ns, keys,
                                  owner=owner, ttl=ttl, promote=request.promote, tier=want_tier(request.tier),
                                  undo=lambda r: r.handle and self.store.release(r.handle, owner))
        if res.handle and gave_up(context):  # (e.g. a slow promotion): nobody will release this lease
            self.store.release(res.handle, owner)
            raise errors.DeadlineExceeded("Acquire: the caller's deadline passed; the lease was released")
        hit = int(np.count_nonzero(res.offsets >= 0))
        return pb.AcquireResponse(lease_id=res.handle, hit_blocks=hit, slots=self.slots(res),
                                  fetched_blocks=fetched, decision=cast(Any, decision))

    @rpc("Release")
    async def Release(self, request: pb.ReleaseRequest, context: Any, who: Principal) -> pb.ReleaseResponse:
        owner, _ = self.owner(context, who)
        return pb.ReleaseResponse(released=self.store.release(request.lease_id, owner))

    @rpc("Put")
    async def Put(self, request: pb.PutRequest, context: Any, who: Principal) -> pb.PutResponse:
        ns = self.namespace(request.ns, who)
        keys = keys_of(request.keys)
        parent = parent_of(request)
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
                    res = self.store.put(ns, keys_ok, payloads[:i], parent=parent)
                    res.statuses += [KeyStatus.CORRUPT] + [KeyStatus.PARENT_MISSING] * (len(keys) - i - 1)
                    res.messages[i] = "payload does not match its checksum"
                    return pb.PutResponse(results=results_pb(keys, res))
        nbytes = len(payloads[0]) if payloads else 0
        res = await self.disk.run(lambda: self.store.needs_disk_write(len(keys), nbytes), self.store.put,
                                  ns, keys, payloads, parent=parent)
        self.metrics.inline_bytes("in", sum(len(p) for p in payloads))
        return pb.PutResponse(results=results_pb(keys, res))

    async def Get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetChunk]:
        t0 = time.perf_counter()
        sent = 0
        try:  # timed and its bytes counted however it ends (refused, cancelled mid-stream), as rpc() times calls
            try:
                who = self.auth.principal(context.invocation_metadata())
                ns = self.namespace(request.ns, who)
                keys = keys_of(request.keys)
                limit = self.config.server.max_message_bytes - 4096
                chunk = min(int(request.max_chunk_bytes or limit), limit)
                if chunk <= 0:
                    raise InvalidArgument("max_chunk_bytes must be positive")
                res = await self.disk.run(lambda: self.store.needs_disk_read(ns, keys), self.store.get, ns, keys)
            except KVStoreError as e:
                self.metrics.rejected("Get", status_for(e).name)
                await context.abort(status_for(e), str(e))
                return
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
                    sent += len(piece)
        finally:
            self.metrics.inline_bytes("out", sent)
            self.metrics.observe("Get", time.perf_counter() - t0)

    @rpc("Admit")
    async def Admit(self, request: pb.AdmitRequest, context: Any, who: Principal) -> pb.AdmitResponse:
        ns = self.namespace(request.ns, who)
        keys = chain_keys(request)
        if not request.ttft_target_s > 0:
            raise InvalidArgument(f"ttft_target_s must be > 0, got {request.ttft_target_s}")
        res = self.store.peek(ns, keys)  # no I/O, not counted as a lookup
        block_bytes = self.store.block_bytes(ns) or int(request.block_bytes)
        d = self.admission.decide(ns.tenant, int(request.n_tokens), None, ns.block_size, block_bytes,
                                  float(request.ttft_target_s), block_tiers=res.tier_codes,
                                  queue_wait_s=request.queue_wait_s or None, klass=request.klass or None,
                                  dry_run=request.dry_run, owner=(who.tenant, self.session_of(context, who)))
        self.metrics.admission_decision(ns.tenant, d.kind.name.lower(), d.reason_code, d.predicted.total_s)
        return pb.AdmitResponse(
            kind=cast(Any, {DecisionKind.ADMIT: 1, DecisionKind.ADMIT_DEGRADED: 2, DecisionKind.REJECT: 3}[d.kind]),
            predicted=ttft_pb(d.predicted), full=ttft_pb(d.full), reason=d.reason, reason_code=d.reason_code,
            hit_blocks=d.hit_blocks, use_blocks=d.use_blocks, decision_id=d.decision_id,
            retry_after_ms=int(d.retry_after_s * 1000), starved=d.starved)

    @rpc("Report")
    async def Report(self, request: pb.ReportRequest, context: Any, who: Principal) -> pb.ReportResponse:
        # refused whole before anything counts: a bad value would consume the decision and move the error
        # figures before the predictor refused it (and a report on an unknown id is refused the same)
        check_positive("actual_ttft_s", request.actual_ttft_s)
        check_positive("queue_s", request.queue_s, allow_zero=True)
        # only the tenant and session that received the decision may report on it; anyone else's
        # report is ignored like an unknown id (the id is random, so it cannot be guessed either)
        err = self.admission.report(int(request.decision_id), float(request.actual_ttft_s),
                                    actual_queue_s=request.queue_s or None,
                                    owner=(who.tenant, self.session_of(context, who)))
        if err is None:
            return pb.ReportResponse(matched=False)
        self.metrics.admission_report(err, self.admission.predictor.prefill_tokens_per_s)
        return pb.ReportResponse(matched=True, error_s=err)

    @rpc("Prefetch")
    async def Prefetch(self, request: pb.PrefetchRequest, context: Any, who: Principal) -> pb.PrefetchResponse:
        hit, in_dram, queued = self.store.prefetch(self.namespace(request.ns, who), chain_keys(request))
        if queued:
            self.wake_background.set()
        return pb.PrefetchResponse(hit_blocks=hit, in_dram=in_dram, queued=queued)

    @rpc("ReportCorrupt")
    async def ReportCorrupt(self, request: pb.ReportCorruptRequest, context: Any,
                            who: Principal) -> pb.ReportCorruptResponse:
        n = self.store.report_corrupt(self.namespace(request.ns, who), keys_of(request.keys))
        return pb.ReportCorruptResponse(dropped=n)

    @rpc("Remove")
    async def Remove(self, request: pb.RemoveRequest, context: Any, who: Principal) -> pb.RemoveResponse:
        keys = keys_of(request.keys)
        res = self.store.remove(self.namespace(request.ns, who), keys)
        return pb.RemoveResponse(results=results_pb(keys, res),
                                 removed=sum(1 for s in res.statuses if s is KeyStatus.OK))

    @rpc("Clear")
    async def Clear(self, request: pb.ClearRequest, context: Any, who: Principal) -> pb.ClearResponse:
        has_ns = request.HasField("ns")
        if has_ns == request.all_namespaces:
            raise InvalidArgument("give exactly one of ns or all_namespaces")
        if has_ns:
            return pb.ClearResponse(removed=self.store.clear(self.namespace(request.ns, who)))
        if who.tenant is None or who.admin:
            return pb.ClearResponse(removed=self.store.clear(None))
        removed = 0
        for ns in self.store.namespaces():
            if ns.tenant == who.tenant:
                removed += self.store.clear(ns)
        return pb.ClearResponse(removed=removed)

    @rpc("Stats")
    async def Stats(self, request: pb.StatsRequest, context: Any, who: Principal) -> pb.StatsResponse:
        return self.stats_pb(include_namespaces=request.include_namespaces, tenant=who.tenant if not who.admin else None)

    def stats_pb(self, include_namespaces: bool = True, tenant: str | None = None) -> pb.StatsResponse:
        """The whole daemon's stats; with ``tenant`` (a non-admin caller with
        auth on), that tenant's own figures (``TieredStore.stats``), never
        another tenant's activity."""
        st = self.store.stats(tenant)
        c = st.counters
        sessions = len(self.sessions) if tenant is None else sum(1 for t in self.sessions.values() if t == tenant)
        out = pb.StatsResponse(
            lookups=c.lookups, hit_blocks=c.lookup_hit_blocks, miss_blocks=c.lookup_blocks - c.lookup_hit_blocks,
            hit_tokens=c.lookup_hit_tokens, miss_tokens=c.lookup_tokens - c.lookup_hit_tokens,
            puts=c.put_blocks, gets=c.get_hit_blocks, bytes_written=c.put_bytes, bytes_read=c.get_bytes,
            bytes_promoted=st.bytes_promoted, bytes_demoted=st.bytes_demoted,
            checksum_failures=c.checksum_failures, active_reservations=st.reservations,
            active_leases=st.leases, reservations_expired=c.reservations_expired,
            leases_expired=c.leases_expired, sessions=sessions, uptime_seconds=time.time() - self.started,
            tenant=tenant or "")
        for t in st.tiers:
            out.tiers.append(pb.TierStats(tier=tier_pb(t.tier), capacity_bytes=t.capacity_bytes,
                                          used_bytes=t.used_bytes, blocks=t.blocks,
                                          pinned_bytes=t.pinned_bytes, evictions=t.evictions,
                                          promotions=t.promotions, demotions=t.demotions, hits=t.hits,
                                          disk_bytes=t.disk_bytes))
        ast = self.admission.stats()
        for (who_, kind), count in ast.decisions.items():
            if tenant is not None and who_ != tenant:
                continue
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
            only = self.namespace(request.ns, who).digest if request.HasField("ns") else None
        except KVStoreError as e:
            await context.abort(status_for(e), str(e))
            return
        async for ev in self.events.stream(request.after_seq, lambda e: self._visible(e, who, only),
                                           request.run_id):
            yield ev

    def _visible(self, ev: pb.Event, who: Principal, only: bytes | None) -> bool:
        kind = ev.WhichOneof("kind")
        digest = getattr(ev, kind).ns_digest if kind in ("stored", "removed", "cleared") else b""
        if only is not None and digest and digest != only:
            return False
        if who.tenant is not None and not who.admin and digest:
            return self.store.tenant_of(digest) == who.tenant
        return True
