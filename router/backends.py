"""The router's view of each backend: health, load and cache state.

Load is tracked two ways, as Dynamo's KV router does plus what vLLM says:

- the router's own in-flight table: per request, its predicted prefill work
  until its first byte arrives (queued prefill), then it counts as a running
  decode until it ends;
- vLLM's ``/metrics`` polled every ``health_interval`` (``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``), which also sees
  requests that did not come through this router.

Health: ``GET /health`` every ``health_interval``; ``health_failures``
consecutive failures (or a request that could not connect) take the backend
out of the pool, one passing check brings it back.

Version: ``GET /version`` after each passing check (vLLM's OpenAI server
answers ``{"version": "..."}``): the vLLM version the backend's keys are
hashed in (``router.prompts.keys_at``). A failed check, or an answer the
router cannot use (none, not a string, empty, over :data:`MAX_VERSION`
characters), leaves it unknown ("") and the backend predicted a miss.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from admission import (
    AdmissionConfig,
    AdmissionController,
    PredictorConfig,
    TierLoad,
    TTFTPredictor,
)
from router.cache_view import CacheView
from router.config import BackendSpec, RouterConfig

log = logging.getLogger("kvstore.router")

__all__ = ["Backend", "EngineMetrics", "InFlight", "Pool", "read_capped", "read_engine_metrics", "tier_loads"]

_VLLM_WAITING = "vllm:num_requests_waiting"
_VLLM_RUNNING = "vllm:num_requests_running"
_VLLM_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
MAX_VERSION = 200
"""Longest vLLM version string the router takes from a backend's ``/version``."""


def tier_loads(cfg: RouterConfig) -> tuple[TierLoad, TierLoad, TierLoad, TierLoad]:
    """Load model by tier (hbm, dram, ssd, remote) for the predictor: the
    configured bandwidths, the remote one seeded from ``transport.cost``'s
    link model unless configured."""
    from transport.cost import CostConfig

    p = cfg.predictor
    remote = p.remote_Bps or CostConfig().bandwidth_Bps
    return (TierLoad(2.0e12, 0.0), TierLoad(p.dram_Bps, 2e-6), TierLoad(p.ssd_Bps, 50e-6),
            TierLoad(remote, CostConfig().latency_s))


async def read_capped(chunks: AsyncIterator[bytes], limit: float, first: bytes = b"") -> bytes | None:
    """``first`` and the rest of a response body, joined; None as soon as it
    passes ``limit`` bytes (nothing more is read: the caller closes the response)."""
    parts = [first]
    size = len(first)
    if size > limit:
        return None
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


@dataclass(slots=True)
class EngineMetrics:
    """The last ``/metrics`` poll of a vLLM server."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    polled_at: float = 0.0
    own_pending: int = 0
    """The router's requests there before their first byte at some moment while the poll was out
    (those when it was sent, plus those sent before its answer)."""
    own_total: int = 0
    """The router's requests there at some moment while the poll was out (in flight when it was
    sent, plus those sent before its answer)."""

    def foreign(self) -> tuple[float, float]:
        """(waiting, running) requests the router did not send (or that vLLM
        still counted after the router saw them end): the poll's counts less
        every one of the router's own there while the poll was out."""
        total = max(self.waiting + self.running - self.own_total, 0.0)
        waiting = min(max(self.waiting - self.own_pending, 0.0), total)
        return waiting, total - waiting


@dataclass(slots=True)
class InFlight:
    """One request the router sent to a backend."""

    id: int
    prompt_tokens: int
    work_s: float
    """Predicted prefill (+ load) seconds of this request."""
    started: float
    first_byte: float = 0.0


@dataclass
class Backend:
    """One backend: spec, state and its own TTFT predictor."""

    spec: BackendSpec
    controller: AdmissionController
    cache: CacheView | None
    healthy: bool = True
    failures: int = 0
    engine: EngineMetrics = field(default_factory=EngineMetrics)
    inflight: dict[int, InFlight] = field(default_factory=dict)
    routed: int = 0
    engine_version: str = ""
    """The vLLM version its ``GET /version`` answered at the last passing check; "" = unknown."""
    decode_penalty_s: float = 0.005
    """Seconds a new prefill waits per request decoding there (seeded from
    the config, learned from measured TTFTs: :meth:`learn_penalty`)."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def predictor(self) -> TTFTPredictor:
        return self.controller.predictor

    # ------------------------------------------------------------ load
    def pending(self) -> list[InFlight]:
        return [r for r in self.inflight.values() if not r.first_byte]

    def running_now(self) -> float:
        """Requests decoding there now: the router's own plus the engine's others."""
        pend = len(self.pending())
        return float(len(self.inflight) - pend) + self.engine.foreign()[1]

    def queue_wait_s(self, now: float) -> float:
        """Predicted wait before this backend starts a new request's prefill:
        the remaining prefill work queued ahead (the router's own requests,
        plus the engine's waiting requests the router did not send, at the
        average work), plus :attr:`decode_penalty_s` per running decode (the
        router's own now, plus the engine's others)."""
        pend = self.pending()
        backlog = sum(max(r.work_s - (now - r.started), 0.0) for r in pend)
        mean = (sum(r.work_s for r in pend) / len(pend)) if pend else self.predictor.prefill_s(512)
        f_waiting, _ = self.engine.foreign()
        return backlog + f_waiting * mean + self.running_now() * self.decode_penalty_s

    def learn_penalty(self, running: float, error_s: float, alpha: float = 0.1, ceiling_s: float = 1.0) -> None:
        """A measured TTFT missed its prediction by ``error_s`` (actual -
        predicted) with ``running`` decodes counted at the decision: move the
        per-decode penalty by ``alpha`` of the error per decode (the
        predictor's throughput learns the rest), within [0, ceiling_s]."""
        if running < 1.0:
            return
        step = alpha * error_s / running
        cap = max(self.decode_penalty_s, 0.005)
        step = min(max(step, -0.5 * cap), cap)
        self.decode_penalty_s = min(max(self.decode_penalty_s + step, 0.0), ceiling_s)

    def begin(self, rid: int, prompt_tokens: int, work_s: float, now: float) -> InFlight:
        r = InFlight(rid, prompt_tokens, work_s, now)
        self.inflight[rid] = r
        self.routed += 1
        return r

    def end(self, rid: int) -> None:
        self.inflight.pop(rid, None)


class Pool:
    """All backends, and the task that checks their health and polls their metrics."""

    def __init__(self, cfg: RouterConfig, http: httpx.AsyncClient, *, follow_events: bool = True) -> None:
        self.cfg = cfg
        self.http = http
        self._ids = itertools.count(1)
        loads = tier_loads(cfg)
        p = cfg.predictor
        self.backends: list[Backend] = []
        for spec in cfg.backends:
            pc = PredictorConfig(prefill_tokens_per_s=p.prefill_tokens_per_s, prefill_overhead_s=p.prefill_overhead_s,
                                 tier_loads=loads, calibrate_alpha=p.calibrate_alpha, calibrate_min_tokens=16,
                                 calibrate_max_step=1.0, min_tokens_per_s=10.0)
            ctl = AdmissionController(TTFTPredictor(pc), AdmissionConfig(headroom=cfg.headroom, degrade_tiers=()))
            view = CacheView(spec.name, spec.daemon, spec.daemon_token) if spec.daemon else None
            self.backends.append(Backend(spec=spec, controller=ctl, cache=view, decode_penalty_s=p.decode_penalty_s))
        self._follow = follow_events
        self._task: asyncio.Task[None] | None = None

    def next_id(self) -> int:
        return next(self._ids)

    def by_name(self, name: str) -> Backend:
        for b in self.backends:
            if b.name == name:
                return b
        raise KeyError(name)

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._follow:
            for b in self.backends:
                if b.cache is not None:
                    b.cache.start()
        await asyncio.gather(*(self.check(b) for b in self.backends))
        for b in self.backends:  # a backend that is not up at start joins when its check passes
            if b.failures:
                b.healthy = False
                log.warning("backend %s (%s) is not answering; it joins the pool when it does", b.name, b.spec.url)
        self._task = asyncio.create_task(self._loop(), name="kvstore-route-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for b in self.backends:
            if b.cache is not None:
                await asyncio.to_thread(b.cache.stop)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval)
            await asyncio.gather(*(self.check(b) for b in self.backends), return_exceptions=True)

    # ------------------------------------------------------------ checks
    def mark_failed(self, b: Backend, why: str) -> None:
        """A request could not reach ``b``: out of the pool until a check passes."""
        if b.healthy:
            log.warning("backend %s leaves the pool: %s", b.name, why)
        b.healthy = False
        b.failures = max(b.failures, self.cfg.health_failures)

    async def check(self, b: Backend) -> None:
        t = min(self.cfg.health_interval * 2, 5.0)
        try:
            r = await self.http.get(f"{b.spec.url}/health", timeout=t, headers=b.spec.auth_headers())
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            if not b.healthy:
                log.warning("backend %s is back in the pool", b.name)
            b.healthy, b.failures = True, 0
            await self._poll_version(b, t)
            await self._poll_metrics(b, t)
        else:
            b.engine_version = ""  # (a restart may bring another version)
            b.failures += 1
            if b.failures >= self.cfg.health_failures and b.healthy:
                log.warning("backend %s leaves the pool: %d failed health checks", b.name, b.failures)
                b.healthy = False

    async def _poll_version(self, b: Backend, timeout: float) -> None:
        version = ""
        try:
            async with self.http.stream("GET", f"{b.spec.url}/version", timeout=timeout,
                                        headers=b.spec.auth_headers()) as r:
                body = await read_capped(r.aiter_bytes(), 4 * MAX_VERSION) if r.status_code == 200 else None
            got = json.loads(body) if body else None
            v = got.get("version") if isinstance(got, dict) else None
            if isinstance(v, str) and v.strip() and len(v) <= MAX_VERSION:
                version = v
        except (httpx.HTTPError, ValueError) as e:
            log.debug("backend %s: no usable /version: %s", b.name, e)
        if version != b.engine_version:
            log.info("backend %s: vLLM version %s", b.name, version or "unknown (predicted a miss)")
            b.engine_version = version

    async def _poll_metrics(self, b: Backend, timeout: float) -> None:
        # vLLM measures its counts at some moment while the poll is out: the router's own there are
        # those in flight when it was sent plus those sent since (not only those left at the answer,
        # which counted a burst that ended meanwhile as load from elsewhere until the next poll)
        pending, total, routed = len(b.pending()), len(b.inflight), b.routed
        try:
            r = await self.http.get(f"{b.spec.url}/metrics", timeout=timeout, headers=b.spec.auth_headers())
            if r.status_code != 200:
                return
            text = r.text
        except httpx.HTTPError:
            return
        sent = b.routed - routed
        m = EngineMetrics(polled_at=time.monotonic(), own_pending=pending + sent, own_total=total + sent)
        try:
            read_engine_metrics(text, m)
        except ValueError as e:
            log.debug("backend %s: unreadable /metrics: %s", b.name, e)
            return
        b.engine = m


def read_engine_metrics(text: str, m: EngineMetrics) -> None:
    """Add the waiting/running/KV-usage samples of a vLLM ``/metrics`` text to
    ``m``. Only those lines are read (string prefixes, no full exposition
    parse: vLLM's page is large and this runs on the router's event loop)."""
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, value = line.partition(" ")
        else:
            value = rest.rpartition("}")[2]
        if name == _VLLM_WAITING:
            m.waiting += _sample(line, value)
        elif name == _VLLM_RUNNING:
            m.running += _sample(line, value)
        elif name in _VLLM_KV_USAGE:
            m.kv_usage = max(m.kv_usage, _sample(line, value))


def _sample(line: str, value: str) -> float:
    """A sample's value: a finite number >= 0 (these are counts and a ratio),
    else ValueError, which discards the poll; a NaN or infinite count would
    make every prediction, and so every request, fail."""
    parts = value.split()
    v = float(parts[0]) if parts else math.nan
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"not a finite count: {line[:200]!r}")
    return v
