"""The router's Prometheus metrics (``GET /metrics``), one registry per app."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.backends import Pool

__all__ = ["RouterMetrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ERR_BUCKETS = (-5.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0.0, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                5.0)
_REL_BUCKETS = (0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0)
_OVERHEAD_BUCKETS = (0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1)


class _PoolCollector(Collector):
    """Backend state read at scrape time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def collect(self) -> Iterable[GaugeMetricFamily]:
        healthy = GaugeMetricFamily("kvstore_route_backend_healthy", "1 while the backend is in the pool",
                                    labels=["backend"])
        inflight = GaugeMetricFamily("kvstore_route_inflight_requests", "Requests the router has in flight",
                                     labels=["backend", "phase"])
        engine = GaugeMetricFamily("kvstore_route_engine_requests", "vLLM's own waiting/running requests (polled)",
                                   labels=["backend", "state"])
        kv = GaugeMetricFamily("kvstore_route_engine_kv_usage", "vLLM's KV cache usage (0..1, polled)",
                               labels=["backend"])
        tps = GaugeMetricFamily("kvstore_route_prefill_tokens_per_second",
                                "Calibrated prefill throughput of the backend's TTFT predictor", labels=["backend"])
        held = GaugeMetricFamily("kvstore_route_cached_blocks", "Blocks the backend's daemon holds (from events)",
                                 labels=["backend"])
        for b in self.pool.backends:
            healthy.add_metric([b.name], 1.0 if b.healthy else 0.0)
            pend = len(b.pending())
            inflight.add_metric([b.name, "prefill"], float(pend))
            inflight.add_metric([b.name, "decode"], float(len(b.inflight) - pend))
            engine.add_metric([b.name, "waiting"], b.engine.waiting)
            engine.add_metric([b.name, "running"], b.engine.running)
            kv.add_metric([b.name], b.engine.kv_usage)
            tps.add_metric([b.name], b.predictor.prefill_tokens_per_s)
            held.add_metric([b.name], float(b.cache.held_blocks() if b.cache is not None else 0))
        yield from (healthy, inflight, engine, kv, tps, held)


class RouterMetrics:
    """Counters and histograms of one router."""

    def __init__(self, pool: Pool) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvstore_route_requests", "Requests routed, by backend, endpoint and HTTP status",
                                ["backend", "endpoint", "status"], registry=r)
        self.hit_tokens = Counter("kvstore_route_hit_tokens", "Prompt tokens the chosen backend holds, by tier",
                                  ["backend", "tier"], registry=r)
        self.prompt_tokens = Counter("kvstore_route_prompt_tokens", "Prompt tokens routed", ["backend"], registry=r)
        self.predicted = Histogram("kvstore_route_predicted_ttft_seconds", "Predicted TTFT of the chosen backend",
                                   ["backend"], buckets=_TTFT_BUCKETS, registry=r)
        self.measured = Histogram("kvstore_route_ttft_seconds", "Measured TTFT (first streamed byte)",
                                  ["backend"], buckets=_TTFT_BUCKETS, registry=r)
        self.error = Histogram("kvstore_route_ttft_error_seconds", "Measured minus predicted TTFT",
                               ["backend"], buckets=_ERR_BUCKETS, registry=r)
        self.rel_error = Histogram("kvstore_route_ttft_error_ratio", "|measured - predicted| / measured TTFT",
                                   ["backend"], buckets=_REL_BUCKETS, registry=r)
        self.rejections = Counter("kvstore_route_rejections", "Requests refused before any backend saw them",
                                  ["klass", "tenant", "reason"], registry=r)
        self.retries = Counter("kvstore_route_retries", "Requests retried on the next-best backend",
                               ["backend"], registry=r)
        self.stream_errors = Counter("kvstore_route_stream_errors", "Streams ended by a backend failure",
                                     ["backend"], registry=r)
        self.timeouts = Counter("kvstore_route_backend_timeouts",
                                "Backend answers cut at request_timeout (non-streamed: 504; streams: an error event)",
                                ["backend"], registry=r)
        self.oversized = Counter("kvstore_route_oversized_responses",
                                 "Backend answers cut at their size limit (max_response_bytes; a P/D prefill's at "
                                 "min(that, 1 MiB))", ["backend"], registry=r)
        self.bad_requests = Counter("kvstore_route_bad_requests", "Requests refused as invalid, by HTTP status",
                                    ["status"], registry=r)
        self.overhead = Histogram("kvstore_route_decision_seconds",
                                  "Router work before the upstream call (parse, tokenize, hash, decide)",
                                  buckets=_OVERHEAD_BUCKETS, registry=r)
        r.register(_PoolCollector(pool))

    def names(self) -> set[str]:
        """Every sample name this registry can expose, with suffixes
        (``kvstore_route_requests_total``, ``..._bucket``...)."""
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                    "gauge": ("",)}
        out: set[str] = set()
        for fam in self.registry.collect():
            out.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)
