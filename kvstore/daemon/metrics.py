"""Prometheus metrics of the daemon, on a registry of their own.

Two kinds of metric live here:

- **Scraped from the store.** A custom collector calls ``stats_fn()`` (a
  :class:`kvstore.core.store.StoreStats` snapshot) on every scrape and turns it
  into families: blocks/bytes/capacity/pinned bytes per tier, evictions by
  tier and reason, lookup counters (overall and per namespace), puts/gets and
  the bytes they moved, checksum failures, capacity rejects, expired
  reservations, open reservations and leases, the eviction policy. Nothing
  is counted twice: the store's own counters are the source of truth.
- **Updated directly by the server**: the op latency histogram
  (``observe``/``timed``), rejected RPCs by method and status name
  (``rejected``), inline bytes by direction (``inline_bytes``) and prefix-hit
  blocks by the tier that served them (``lookup_hits``).

The prefix hit ratio is not exported as a ratio: it is computed in PromQL
from two counters, so that it aggregates correctly over time and instances::

    sum by (instance) (rate(kvstore_lookup_hit_blocks_total[5m]))
      / sum by (instance) (rate(kvstore_lookup_blocks_total[5m]))

Every ``Metrics`` owns a fresh :class:`CollectorRegistry` (never the global
default), so tests and several daemons in one process do not collide.

The store is single-threaded (it lives on the daemon's event loop) while the
HTTP endpoint scrapes from its own threads: pass ``loop_stats_fn(loop, store)``
as ``stats_fn`` so the snapshot is taken on the loop. A snapshot that fails
or times out does not fail the scrape: the store families are left out and
``kvstore_stats_errors_total`` counts it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence
from wsgiref.simple_server import WSGIServer

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import start_http_server
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            InfoMetricFamily, Metric)
from prometheus_client.registry import Collector

from kvstore.core.store import StoreStats
from tiers.base import TierKind

__all__ = ["MAX_TENANT_LABELS", "NAMESPACE_SERIES", "OP_BUCKETS", "OTHER_TENANT", "PREFIX", "Metrics", "StoreCollector", "exported_names",
           "loop_stats_fn", "tier_label"]

log = logging.getLogger(__name__)

PREFIX = "kvstore_"

OP_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)
"""Latency buckets of ``kvstore_op_seconds``: 50 µs to 5 s (+Inf above)."""

MAX_TENANT_LABELS = 256
"""Distinct ``tenant`` label values of ``kvstore_admission_decisions_total``
(without auth a request names any tenant it likes); later ones are ``OTHER_TENANT``."""
OTHER_TENANT = "_other"

NAMESPACE_SERIES = 64
"""Namespace labels of ``kvstore_namespace_lookup_*`` with a series of their own (``metrics.namespace_series``):
the busiest when they are first seen; the rest are summed into ``OTHER_TENANT`` (a namespace label always
holds a "/", so never collides with it)."""

_SUFFIXES: dict[str, tuple[str, ...]] = {
    # sample-name suffixes each metric type exposes in the text format
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "stateset": ("",),
    "unknown": ("",),
}


def tier_label(tier: object) -> str:
    """The ``tier`` label value: "hbm", "dram", "ssd", "remote".

    Accepts a ``TierKind`` (or anything with ``.label``/``.name``) or a
    string."""
    label = getattr(tier, "label", None)
    if isinstance(label, str):
        return label
    name = getattr(tier, "name", None)
    if isinstance(name, str):
        return name.lower()
    return str(tier).lower()


def _status_name(code: object) -> str:
    """"NOT_FOUND" from a grpc.StatusCode, a KeyStatus or a string."""
    name = getattr(code, "name", None)
    return name if isinstance(name, str) else str(code).upper()


def exported_names(families: Iterable[Metric]) -> set[str]:
    """Every sample name ``families`` can expose (``kvstore_x_total``,
    ``kvstore_y_bucket``...), whether or not a sample exists yet."""
    out: set[str] = set()
    for fam in families:
        for suffix in _SUFFIXES.get(fam.type, ("",)):
            out.add(fam.name + suffix)
    return out


# ---------------------------------------------------------------------------
# Scrape-time collector over StoreStats
# ---------------------------------------------------------------------------


class StoreCollector(Collector):
    """Yields the store's families from one ``stats_fn()`` call per scrape."""

    def __init__(self, stats_fn: Callable[[], StoreStats], namespace_series: int = NAMESPACE_SERIES) -> None:
        self._stats_fn = stats_fn
        self._errors = 0
        self._lock = threading.Lock()
        self._ns_series = max(0, namespace_series)
        self._ns_labels: set[str] = set()
        """Namespace labels given a series of their own: kept for the daemon's life (a counter never
        moves between series), so ``_other`` only grows too."""

    @property
    def errors(self) -> int:
        """Scrapes whose snapshot failed."""
        return self._errors

    # Families, built empty; ``_fill`` adds samples from a snapshot.
    @staticmethod
    def _families() -> dict[str, Metric]:
        c, g = CounterMetricFamily, GaugeMetricFamily
        tier = ["tier"]
        fams: list[Metric] = [
            g("kvstore_tier_blocks", "Blocks stored in the tier now.", labels=tier),
            g("kvstore_tier_used_bytes", "Payload bytes stored in the tier now.", labels=tier),
            g("kvstore_tier_capacity_bytes", "Configured capacity of the tier in bytes.",
              labels=tier),
            g("kvstore_tier_pinned_bytes",
              "Bytes of the tier's blocks held by a pin or a lease (not evictable).",
              labels=tier),
            g("kvstore_tier_disk_bytes",
              "Bytes the tier occupies on disk (SSD: segments incl. garbage not yet "
              "reclaimed, and its index); equals used bytes for memory tiers.", labels=tier),
            c("kvstore_tier_promotions", "Blocks moved into the tier from a colder one.", labels=tier),
            c("kvstore_tier_demotions", "Blocks moved out of the tier to a colder one.", labels=tier),
            c("kvstore_evictions_total",
              "Blocks that left a tier, by reason: evicted (for room), demoted (for room, to the "
              "tier below), resized (tier shrunk), corrupt (checksum mismatch), removed, cleared, "
              "aborted (reservation).",
              labels=["tier", "reason"]),
            c("kvstore_lookups_total", "Lookup calls."),
            c("kvstore_lookup_blocks_total",
              "Blocks queried by lookups (the prefix hit ratio's denominator)."),
            c("kvstore_lookup_hit_blocks_total",
              "Leading blocks found by lookups (the prefix hit ratio's numerator)."),
            c("kvstore_namespace_lookup_blocks_total",
              "Blocks queried by lookups, per namespace (tenant/model).",
              labels=["namespace"]),
            c("kvstore_namespace_lookup_hit_blocks_total",
              "Leading blocks found by lookups, per namespace (tenant/model).",
              labels=["namespace"]),
            c("kvstore_puts_total", "Put and commit calls."),
            c("kvstore_put_blocks_total", "Blocks stored by puts and commits."),
            c("kvstore_put_bytes_total", "Payload bytes stored by puts and commits."),
            c("kvstore_gets_total", "Get and acquire calls."),
            c("kvstore_get_blocks_total", "Blocks asked for by gets and acquires."),
            c("kvstore_get_hit_blocks_total", "Blocks served by gets and acquires."),
            c("kvstore_get_bytes_total", "Payload bytes served by gets and acquires."),
            c("kvstore_checksum_failures_total",
              "Blocks whose checksum did not match on read (dropped, served as a miss)."),
            c("kvstore_capacity_rejects_total",
              "Blocks that puts or reserves could not place: no room after eviction."),
            c("kvstore_reservations_expired_total",
              "Reservations reclaimed because they were never committed."),
            c("kvstore_leases_expired_total",
              "Leases taken without a session released because their holder never did."),
            g("kvstore_open_reservations", "Reservations not yet committed or aborted."),
            g("kvstore_open_leases", "Leases (acquired blocks) not yet released."),
            g("kvstore_granted_bytes", "DRAM granted to same-host writers ahead of their puts "
                                       "(in the dram tier's used bytes; not blocks yet)."),
            InfoMetricFamily("kvstore_eviction_policy", "The eviction policy in use."),
        ]
        return {f.name: f for f in fams}

    def describe(self) -> Iterable[Metric]:
        fams = list(self._families().values())
        fams.append(CounterMetricFamily(
            "kvstore_stats_errors_total",
            "Scrapes whose store snapshot failed or timed out (store families left out)."))
        return fams

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats_fn()
            fams = self._fill(stats)
        except Exception:  # a scrape never fails because of the store
            with self._lock:
                self._errors += 1
            log.warning("metrics: store stats snapshot failed", exc_info=True)
            fams = []
        yield from fams
        yield CounterMetricFamily(
            "kvstore_stats_errors_total",
            "Scrapes whose store snapshot failed or timed out (store families left out).",
            value=self._errors)

    def _fill(self, st: StoreStats) -> list[Metric]:
        f: Any = self._families()  # Metric has add_metric only on the subclasses
        for t in st.tiers:
            lab = [tier_label(t.tier)]
            f["kvstore_tier_blocks"].add_metric(lab, t.blocks)
            f["kvstore_tier_used_bytes"].add_metric(lab, t.used_bytes)
            f["kvstore_tier_capacity_bytes"].add_metric(lab, t.capacity_bytes)
            f["kvstore_tier_pinned_bytes"].add_metric(lab, t.pinned_bytes)
            f["kvstore_tier_disk_bytes"].add_metric(lab, t.disk_bytes)
            f["kvstore_tier_promotions"].add_metric(lab, t.promotions)
            f["kvstore_tier_demotions"].add_metric(lab, t.demotions)
        c = st.counters
        for (tier, reason), n in sorted(c.evictions.items(), key=lambda kv: (int(kv[0][0]),
                                                                              kv[0][1])):
            f["kvstore_evictions"].add_metric([tier_label(tier), reason], n)
        scalars = {
            "kvstore_lookups": c.lookups,
            "kvstore_lookup_blocks": c.lookup_blocks,
            "kvstore_lookup_hit_blocks": c.lookup_hit_blocks,
            "kvstore_puts": c.puts,
            "kvstore_put_blocks": c.put_blocks,
            "kvstore_put_bytes": c.put_bytes,
            "kvstore_gets": c.gets,
            "kvstore_get_blocks": c.get_blocks,
            "kvstore_get_hit_blocks": c.get_hit_blocks,
            "kvstore_get_bytes": c.get_bytes,
            "kvstore_checksum_failures": c.checksum_failures,
            "kvstore_capacity_rejects": c.capacity_rejects,
            "kvstore_reservations_expired": c.reservations_expired,
            "kvstore_leases_expired": c.leases_expired,
            "kvstore_open_reservations": st.reservations,
            "kvstore_open_leases": st.leases,
            "kvstore_granted_bytes": st.granted_bytes,
        }
        for name, value in scalars.items():
            f[name].add_metric([], value)
        # the label leaves out fields (salt, weights digest, layout...): namespaces that
        # share it are one series, summed (two samples with one label set would clash)
        per_label: dict[str, list[int]] = {}
        for ns in st.namespaces:
            sums = per_label.setdefault(ns.label, [0, 0])
            sums[0] += ns.queried_blocks
            sums[1] += ns.hit_blocks
        # at most ``namespace_series`` labels of their own (busiest first when first seen), the rest summed
        other: list[int] | None = None
        with self._lock:
            own = self._ns_labels
            for label, sums in sorted(per_label.items(), key=lambda kv: (-kv[1][0], kv[0])):
                if label not in own and len(own) < self._ns_series:
                    own.add(label)
                if label not in own:
                    other = other or [0, 0]
                    other[0] += sums[0]
                    other[1] += sums[1]
                    del per_label[label]
        # lookups in namespaces the store did not register (past QUERY_NAMESPACES known ones) are in
        # the totals and in no namespace: into ``_other``, so the series still sum to the totals
        rest_q = c.lookup_blocks - sum(q for q, _ in per_label.values()) - (other[0] if other else 0)
        rest_h = c.lookup_hit_blocks - sum(h for _, h in per_label.values()) - (other[1] if other else 0)
        if rest_q > 0 or rest_h > 0:
            other = other or [0, 0]
            other[0] += max(0, rest_q)
            other[1] += max(0, rest_h)
        if other is not None:
            per_label[OTHER_TENANT] = other
        for label, (queried, hit) in sorted(per_label.items()):
            f["kvstore_namespace_lookup_blocks"].add_metric([label], queried)
            f["kvstore_namespace_lookup_hit_blocks"].add_metric([label], hit)
        f["kvstore_eviction_policy"].add_metric([], {"policy": str(st.policy)})
        return list(f.values())


def loop_stats_fn(loop: asyncio.AbstractEventLoop, stats: Callable[[], StoreStats],
                  timeout: float = 2.0) -> Callable[[], StoreStats]:
    """A ``stats_fn`` that takes the snapshot on ``loop``'s thread (where the
    single-threaded store lives) and waits at most ``timeout`` seconds for it.

    Called on the loop's own thread it calls ``stats`` directly (no deadlock).
    A timeout raises, which the collector counts in kvstore_stats_errors_total.
    """

    def fn() -> StoreStats:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or loop.is_closed():
            return stats()

        async def snap() -> StoreStats:
            return stats()

        return asyncio.run_coroutine_threadsafe(snap(), loop).result(timeout)

    return fn


# ---------------------------------------------------------------------------
# Metrics: registry, collector, direct metrics, HTTP endpoint
# ---------------------------------------------------------------------------


class Metrics:
    """All kvstore metrics on one private registry.

    ``stats_fn`` returns a :class:`StoreStats` snapshot; it is called once
    per scrape (see :func:`loop_stats_fn` for a store on an event loop).
    """

    def __init__(self, stats_fn: Callable[[], StoreStats], namespace_series: int = NAMESPACE_SERIES) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.collector = StoreCollector(stats_fn, namespace_series)
        self.registry.register(self.collector)
        r = self.registry
        self.op_seconds = Histogram(
            "kvstore_op_seconds",
            "Time to serve one call, by operation (the RPC method: Lookup, Reserve, Commit, "
            "Acquire, Put, Get, ...), including calls that failed.",
            ["op"], buckets=OP_BUCKETS, registry=r)
        self.rpc_rejected = Counter(
            "kvstore_rpc_rejected_total",
            "Calls that ended with a non-OK gRPC status, by method and status name.",
            ["method", "code"], registry=r)
        self.inline_bytes_total = Counter(
            "kvstore_inline_bytes_total",
            "Payload bytes carried inside gRPC messages (inline Put = in, Get = out).",
            ["direction"], registry=r)
        self.tier_hit_blocks = Counter(
            "kvstore_tier_lookup_hit_blocks_total",
            "Leading blocks found by lookups, by the tier that holds them.",
            ["tier"], registry=r)
        self.admission_decisions = Counter(
            "kvstore_admission_decisions_total",
            "Admit decisions by kind (admit, admit_degraded, reject), reason code and tenant.",
            ["kind", "reason", "tenant"], registry=r)
        self.predicted_ttft = Histogram(
            "kvstore_admission_predicted_ttft_seconds", "Predicted TTFT of Admit decisions.",
            buckets=OP_BUCKETS, registry=r)
        self.ttft_error = Histogram(
            "kvstore_admission_ttft_error_seconds",
            "Absolute error of the TTFT prediction, from engines' Report calls.",
            buckets=OP_BUCKETS, registry=r)
        self.prefill_speed = Gauge(
            "kvstore_admission_prefill_tokens_per_second",
            "The admission model's calibrated prefill speed.", registry=r)
        self.start_time = Gauge(
            "kvstore_start_time_seconds", "Unix time the metrics (daemon) started.",
            registry=r)
        self.start_time.set(time.time())
        self._cluster_metrics(r)
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None
        self._op_children: dict[str, Any] = {}
        self._tier_children: dict[int, Any] = {}
        self._tenant_labels: set[str] = set()

    # ---------------------------------------------------------- direct updates
    def observe(self, op: str, seconds: float) -> None:
        """One ``op`` call took ``seconds``."""
        child = self._op_children.get(op)
        if child is None:
            child = self._op_children[op] = self.op_seconds.labels(op=op)
        child.observe(max(0.0, float(seconds)))

    @contextlib.contextmanager
    def timed(self, op: str) -> Iterator[None]:
        """``with metrics.timed("lookup"): ...`` observes the block's duration,
        also when it raises."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(op, time.perf_counter() - t0)

    def _tier_child(self, code: int) -> Any:
        """The ``kvstore_tier_lookup_hit_blocks_total`` child of a TierKind value (cached:
        ``labels()`` costs more than the increment)."""
        child = self._tier_children.get(code)
        if child is None:
            child = self._tier_children[code] = self.tier_hit_blocks.labels(tier=tier_label(TierKind(code)))
        return child

    def rejected(self, method: str, code: object) -> None:
        """A ``method`` call ended with non-OK status ``code`` (a status name
        like "NOT_FOUND", or a ``grpc.StatusCode``)."""
        self.rpc_rejected.labels(method=method, code=_status_name(code)).inc()

    def refused(self, method: str, code: object, seconds: float) -> None:
        """A ``method`` call refused before its handler ran (its request did
        not decode, or its caller did not authenticate): counted in
        ``kvstore_rpc_rejected_total`` and timed in ``kvstore_op_seconds``
        once, as the RPC wrapper does for the calls that reach their handler."""
        self.rejected(method, code)
        self.observe(method, seconds)

    def inline_bytes(self, direction: str, nbytes: int) -> None:
        """``nbytes`` of payload crossed gRPC inline; direction "in" (Put)
        or "out" (Get)."""
        if nbytes > 0:
            self.inline_bytes_total.labels(direction=direction).inc(nbytes)

    def admission_decision(self, tenant: str, kind: str, reason: str, predicted_s: float) -> None:
        """Count an Admit decision and observe its predicted TTFT. Without
        auth the tenant is whatever the request names: past
        ``MAX_TENANT_LABELS`` distinct tenants, new ones count as ``OTHER_TENANT``."""
        if tenant not in self._tenant_labels:
            if len(self._tenant_labels) >= MAX_TENANT_LABELS:
                tenant = OTHER_TENANT
            else:
                self._tenant_labels.add(tenant)
        self.admission_decisions.labels(kind=kind, reason=reason, tenant=tenant).inc()
        self.predicted_ttft.observe(predicted_s)

    def admission_report(self, error_s: float, prefill_tokens_per_s: float) -> None:
        """An engine reported the actual TTFT: observe the prediction error."""
        self.ttft_error.observe(abs(error_s))
        self.prefill_speed.set(prefill_tokens_per_s)

    def lookup_tier_hits(self, code: int, n: int) -> None:
        """Count ``n`` lookup hit blocks in the tier of TierKind value ``code``
        (lookups clients answered from the shared index, told in tallies)."""
        self._tier_child(code).inc(n)

    def lookup_hits(self, tiers: Sequence[object] | np.ndarray) -> None:
        """Count a lookup's hit blocks by tier (``LookupResult.tier_codes``, or
        a sequence of tiers)."""
        if isinstance(tiers, np.ndarray):
            if tiers.size == 0:
                return
            first = int(tiers[0])
            if tiers.size == 1 or not (tiers != first).any():  # one tier: no bincount
                self._tier_child(first).inc(tiers.size)
                return
            for code, n in enumerate(np.bincount(tiers, minlength=0).tolist()):
                if n:
                    self._tier_child(code).inc(n)
            return
        for tier, n in collections.Counter(tier_label(t) for t in tiers).items():
            self.tier_hit_blocks.labels(tier=tier).inc(n)

    # --------------------------------------------------------------- cluster
    def _cluster_metrics(self, r: CollectorRegistry) -> None:
        self.peer_bytes = Counter("kvstore_peer_fetch_bytes_total",
                                  "Payload bytes fetched from peers, by peer node id.", ["peer"], registry=r)
        self.peer_blocks = Counter("kvstore_peer_fetch_blocks_total",
                                   "Blocks fetched from peers (committed here), by peer.", ["peer"], registry=r)
        self.peer_seconds = Histogram("kvstore_peer_fetch_seconds", "Duration of successful peer fetches.",
                                      buckets=OP_BUCKETS, registry=r)
        self.peer_failures = Counter(
            "kvstore_peer_fetch_failures_total",
            "Blocks or fetches from peers that ended as misses, by peer and reason "
            "(error, refused, corrupt, absent, partial, gone, wire_version).", ["peer", "reason"], registry=r)
        self.peer_served_bytes = Counter("kvstore_peer_served_bytes_total",
                                         "Payload bytes served to peers, by fetching peer.", ["peer"], registry=r)
        self.cluster_decisions = Counter("kvstore_cluster_decisions_total",
                                         "Cluster chain decisions by kind (local, fetch, recompute).",
                                         ["kind"], registry=r)
        self.cluster_members_gauge = Gauge("kvstore_cluster_members", "Live cluster members, this daemon included.",
                                           registry=r)
        self.cluster_up = Gauge("kvstore_cluster_membership_up",
                                "1 while the membership source (etcd) answers, 0 while it does not.", registry=r)

    def cluster_members(self, n: int, healthy: bool) -> None:
        self.cluster_members_gauge.set(n)
        self.cluster_up.set(1 if healthy else 0)

    def cluster_decision(self, kind: str) -> None:
        self.cluster_decisions.labels(kind=kind).inc()

    def peer_fetched(self, peer: str, blocks: int, nbytes: int, seconds: float) -> None:
        self.peer_blocks.labels(peer=peer).inc(blocks)
        self.peer_bytes.labels(peer=peer).inc(nbytes)
        self.peer_seconds.observe(max(0.0, seconds))

    def peer_fetch_failed(self, peer: str, reason: str, n: int = 1) -> None:
        self.peer_failures.labels(peer=peer, reason=reason).inc(n)

    def peer_served(self, peer: str, blocks: int, nbytes: int) -> None:
        if nbytes:
            self.peer_served_bytes.labels(peer=peer).inc(nbytes)

    # ---------------------------------------------------------------- export
    def render(self) -> bytes:
        """The text exposition of every metric (what a scrape returns)."""
        return generate_latest(self.registry)

    def names(self) -> set[str]:
        """Every sample name this registry can expose, with suffixes
        (``kvstore_lookups_total``, ``kvstore_op_seconds_bucket``...)."""
        fams: list[Metric] = list(self.collector.describe())
        for direct in (self.op_seconds, self.rpc_rejected, self.inline_bytes_total,
                       self.tier_hit_blocks, self.admission_decisions, self.predicted_ttft,
                       self.ttft_error, self.prefill_speed, self.start_time, self.peer_bytes,
                       self.peer_blocks, self.peer_seconds, self.peer_failures, self.peer_served_bytes,
                       self.cluster_decisions, self.cluster_members_gauge, self.cluster_up):
            fams.extend(direct.describe())
        return exported_names(fams)

    def start_http(self, host: str = "127.0.0.1", port: int = 9400) -> tuple[WSGIServer, int]:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread.

        Returns ``(server, bound_port)``; port 0 picks a free port. The
        serving thread is :attr:`http_thread`; :meth:`stop_http` stops it."""
        if self._http is not None:
            raise RuntimeError("metrics HTTP endpoint already started")
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:  # name the endpoint: "[Errno 98] Address already in use" is not enough
            raise OSError(e.errno, f"metrics endpoint {host}:{port}: {e.strerror or e}") from None
        self._http, self._http_thread = server, thread
        return server, int(server.server_port)

    @property
    def http_port(self) -> int | None:
        """The bound port of the HTTP endpoint, None when not started."""
        return None if self._http is None else int(self._http.server_port)

    @property
    def http_thread(self) -> threading.Thread | None:
        """The thread serving the HTTP endpoint, None when not started."""
        return self._http_thread

    def stop_http(self) -> None:
        """Stop the HTTP endpoint (no-op when not started)."""
        server, thread = self._http, self._http_thread
        self._http = self._http_thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)
