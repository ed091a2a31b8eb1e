"""What every servicer of the daemon shares: the store, auth, admission, the
QoS gate, events, metrics and sessions, the request helpers built on them
(namespace binding, the owner of leases and reservations), the background
tasks (reaper, tier worker), and ``store_config`` (the store's settings from
the daemon's config tree).

The store is single-threaded: every handler runs on the server's event
loop, so store calls never interleave.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Any

from admission.qos import QosClass, QosConfig, QosGate, QosRejected
from admission.quota import TenantRateLimiter
from admission.slo import AdmissionConfig, AdmissionController, PredictorConfig, TTFTPredictor
from kvstore import errors
from kvstore.config import Config, ConfigError, format_size
from kvstore.core.eviction import PolicyName
from kvstore.core.ssd_mover import SsdSpec, WriteMode
from kvstore.core.hbm_mover import spec_from_config as hbm_spec_from_config
from kvstore.core.store import SlotResult, StoreConfig, TieredStore
from kvstore.daemon import slab_owner
from kvstore.daemon.auth import Auth, Principal
from kvstore.daemon.disk_worker import DiskWorker
from kvstore.daemon.events import EventLog
from kvstore.daemon.metrics import Metrics, loop_stats_fn
from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.fs_room import free_bytes
from kvstore.keys import Namespace
from kvstore.wire.convert import ns_from_pb, slots_pb
from kvstore.wire.shm import host_identity
from proto import kvstore_pb2 as pb
from tiers.ssd_dir import files_bytes

log = logging.getLogger("kvstore.daemon.server")

PROTOCOL_VERSION = 1
SESSION_MD = "x-kvstore-session"


class DaemonState:
    """The daemon's state and the helpers its servicers share."""

    def __init__(self, config: Config, store: TieredStore | None = None) -> None:
        self.config = config
        self.auth = Auth(config)
        self.identity = slab_owner.identity(config) if store is None else ""
        self.reclaimed_slab = slab_owner.reclaim_predecessor(self.identity, config.dram.shm_name)
        self.swept = slab_owner.sweep_dead() if store is None else []  # other dead daemons' slabs
        if store is None:
            check_dram_room(config)
            check_ssd_room(config)
        self.disk = DiskWorker(store or TieredStore(store_config(config, self.auth.shares)))
        slab_owner.record(self.identity, self.disk.raw.dram.name)
        self.store = self.disk.store  # each call under the store lock; disk-bound ones on the disk worker
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
        self.metrics = Metrics(loop_stats_fn(asyncio.get_running_loop(), self.store.stats),
                               config.metrics.namespace_series)
        self.sessions: dict[str, str | None] = {}  # session id -> tenant
        self.unbound: dict[str, float] = {}  # session id -> when it ends unless its KeepAlive opens
        self.host_id = host_identity()
        self.slab_id = secrets.token_hex(8)
        self.started = time.time()
        self._tasks: list[asyncio.Task[Any]] = []
        self._ns_cache: dict[tuple[str | None, bytes], Namespace] = {}
        self.wake_background = asyncio.Event()
        self.lookup_socket = ""  # set by start() when the fast Lookup socket listens
        self.decode_guard: Any = None  # kvstore.daemon.decode.DecodeGuard, set by start()
        self.cluster: Any = None  # kvstore.daemon.peers.ClusterNode when cluster.mode is not off

    # ----------------------------------------------------------- helpers
    def namespace(self, msg: pb.Namespace, who: Principal) -> Namespace:
        """The request's namespace (validated once per distinct message and
        tenant, then served from a bounded cache: building and hashing a
        Namespace costs more than a whole small Lookup)."""
        return self.namespace_from_wire(msg.SerializeToString(deterministic=True), who, msg)

    def namespace_from_wire(self, data: bytes, who: Principal, msg: pb.Namespace | None = None) -> Namespace:
        """``namespace`` from a serialized Namespace message (the fast Lookup socket)."""
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

    def session_of(self, context: Any, who: Principal) -> str:
        """The caller's session id (metadata ``x-kvstore-session``, checked:
        live and the caller's tenant's), or "" without one."""
        for k, v in context.invocation_metadata() or ():
            if k == SESSION_MD:
                if v not in self.sessions:
                    raise errors.NotFound(f"session {v!r} is unknown (expired or from another daemon run)")
                if self.sessions[v] != who.tenant:
                    raise PermissionDenied("session belongs to another tenant")
                return str(v)
        return ""

    def owner(self, context: Any, who: Principal) -> tuple[str, bool]:
        """(owner id, has a live session)."""
        sid = self.session_of(context, who)
        if sid:
            return sid, True
        return "anon:" + context.peer(), False

    def slots(self, res: SlotResult) -> pb.SlotArray:
        sa = slots_pb(res)
        if self.store.hbm is not None:
            sa.device = self.store.hbm.tier.device_index
        return sa

    def need_cluster(self) -> Any:
        if self.cluster is None:
            raise errors.Unavailable("cluster mode is off on this daemon")
        return self.cluster

    # ---------------------------------------------------------- background
    async def _reaper(self) -> None:
        interval = max(0.05, float(self.config.server.lease_check_interval))
        while True:
            await asyncio.sleep(interval)
            try:
                n = self.store.reap()
                if n:
                    log.info("reclaimed %d expired reservations/leases/grants", n)
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
                    pass  # ... but holds no slot while the disk worker runs the step
                more = await self.disk.always(self.store.background)
            except QosRejected:
                more = False
            except Exception:
                log.exception("background tier work failed")
                more = False
            if more:
                await asyncio.sleep(0)
                continue
            self.wake_background.clear()
            try:
                await asyncio.wait_for(self.wake_background.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    def _end_unbound_sessions(self) -> None:
        """End sessions whose client never opened the KeepAlive stream (it
        died right after its Handshake, or never meant to): their leases and
        reservations would otherwise be held for ever, and their entries
        pile up."""
        now = time.monotonic()
        for sid in [s for s, t in self.unbound.items() if t <= now]:
            del self.unbound[sid]
            self.sessions.pop(sid, None)
            self.store.release_owner(sid)

    def start_background(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._reaper()))
        if self.store.ssd is not None:
            self._tasks.append(loop.create_task(self._tier_worker()))

    async def stop_background(self) -> None:
        """End the background tasks (cancelled, then awaited: a loop closed
        right after would otherwise destroy them pending) and the disk
        worker (after its step in flight)."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)  # bounded: a stop never hangs on a stuck step
        self.disk.close()


def check_dram_room(config: Config, shm_dir: str = slab_owner.SHM_DIR) -> None:
    """Refuse at start a ``dram.capacity`` that the shared-memory file system
    cannot back, as a resize past it is refused (kvstore/core/resize.py): the
    slab is a sparse file, so it would be accepted, and the first write
    that finds tmpfs full would kill the daemon (and clients that map the
    slab) with SIGBUS."""
    free = free_bytes(shm_dir)
    cap = config.dram.capacity
    if cap > free:
        raise ConfigError(f"dram.capacity: {format_size(cap)} ({cap} bytes) is more than {shm_dir} can back "
                          f"({free} bytes free): lower dram.capacity (--dram) or give {shm_dir} more room",
                          key="dram.capacity")


def check_ssd_room(config: Config) -> None:
    """Refuse at start an ``ssd.capacity`` that the directory's file system
    cannot hold: more than its free space plus what the tier's own files
    there already take (a resize past it is refused the same way,
    kvstore/core/resize.py). Else writes would fail with ENOSPC once the
    disk filled, long after start."""
    cap = config.ssd.capacity
    if not cap:
        return
    path = str(config.ssd.resolved_path())
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:  # not made yet: where it will be
        probe = os.path.dirname(probe)
    free, held = free_bytes(probe), files_bytes(path)
    if cap > free + held:
        raise ConfigError(f"ssd.capacity: {format_size(cap)} ({cap} bytes) is more than {path} can hold "
                          f"({free + held} bytes: {held} its files take + {free} free): lower ssd.capacity "
                          f"(--ssd) or put ssd.path (--ssd-path) on a disk with more room", key="ssd.capacity")


def store_config(config: Config, shares: dict[str, float] | None = None) -> StoreConfig:
    """The store's settings from the daemon's config tree."""
    ssd = None
    if config.ssd.capacity:
        path = config.ssd.resolved_path()
        ssd = SsdSpec(path=str(path), capacity_bytes=config.ssd.capacity,
                      admit_min_hits=config.ssd.admit_min_hits,
                      write_budget_mbps=float(config.ssd.write_budget_mbps),
                      write_mode=WriteMode(config.ssd.write_mode.value), low_watermark=config.ssd.low_watermark,
                      sync=config.ssd.sync, shutdown_flush_seconds=config.ssd.shutdown_flush_seconds)
    return StoreConfig(
        dram_bytes=config.dram.capacity,
        dram_page_bytes=config.dram.page_size,
        dram_slot_sizes=tuple(config.dram.slot_sizes),
        dram_populate=config.dram.populate,
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


def version() -> str:
    """This package's version ("0" when it is not installed)."""
    try:
        from importlib.metadata import version as _dist_version

        return _dist_version("kvstore")
    except Exception:
        return "0"
