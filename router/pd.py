"""Prefill/decode disaggregation through kvstore (``[pd]`` in the router config; docs/pd.md).

As vLLM's disaggregated-prefill proxy and ``vllm-router
--vllm-pd-disaggregation`` do, a request goes twice:

1. **Prefill**: to a backend of the ``prefill`` pool (a ``kv_producer``
   vLLM, node A, daemon A), non-streaming, with ``max_tokens = 1``. Its
   connector saves the prompt's blocks into daemon A, which publishes them to
   the cluster directory. P is picked by cache and load: the smallest
   predicted TTFT over the prefill pool (the router's usual decision, with
   admission, quotas and fairness applied there).
2. **Decode**: the client's request as it came, to a backend of the
   ``decode`` pool (a ``kv_consumer`` vLLM, node B, daemon B). Its connector
   asks daemon B in cluster mode; when the cost model says fetch, daemon B
   fetches the blocks from A over UCX into its slab (and keeps them: the next
   turn starts local) and vLLM loads them from there; otherwise it
   recomputes. D is picked by load: the smallest predicted TTFT over the
   decode pool with the prompt's blocks counted as remote on each (its own
   local blocks, from a previous turn, as local).

Between the two, the router waits (at most ``pd.visible_timeout``) until
daemon B's cluster lookup sees the prompt's blocks, so the decode's own
lookup does not race the directory publish. A prefill that fails (no
backend, an error, a timeout) is not the client's failure: the decode
backend then computes the whole prompt. The decode step has the router's
usual retry and streaming (:meth:`router.server.RouterService.handle`).

Response headers add ``x-kvstore-prefill`` (the P backend, or ``-`` when it
failed), ``x-kvstore-prefill-ms``, ``x-kvstore-pd-decision`` (daemon B's
decision when the decode was sent: ``fetch``, ``recompute``, ``local`` or
``unseen``) and ``x-kvstore-pd-fetch-ms`` / ``x-kvstore-pd-recompute-ms``
(its two estimates).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from prometheus_client import Counter

from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.results import ClusterLookup
from router.backends import Backend, Pool, read_capped
from router.config import RouterConfig
from router.decision import Decider, Plan, RejectReason, Rejection
from router.prompts import Endpoint, ModelEntry, PromptKeys, keys_at
from tiers.base import TierKind

__all__ = ["PREFILL_MAX_BYTES", "PDOrchestrator", "PrefillOutcome", "prefill_body"]

log = logging.getLogger("kvstore.router.pd")

POLL_S = 0.005
"""How often the decode daemon is asked whether the prefill's blocks are visible."""

PREFILL_MAX_BYTES = 1 << 20
"""The most of a prefill answer (a one-token completion, unused) the router reads; the bound is
``min(this, max_response_bytes)``. Past it the answer is closed unread and counted."""


def prefill_body(body: Mapping[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """The prefill request: the client's, non-streaming, one completion of one token."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "best_of")}
    out.update(stream=False, max_tokens=1, n=1)
    if endpoint is Endpoint.CHAT:
        out["max_completion_tokens"] = 1
    return out


@dataclass(slots=True)
class PrefillOutcome:
    """What the prefill step did (for headers, logs and tests)."""

    backend: str = "-"
    """The P backend that computed the prompt; ``-`` when none did."""
    seconds: float = 0.0
    decision: str = "unseen"
    """Daemon B's chain decision when the decode was sent (``unseen``: the blocks were not visible in time)."""
    fetch_s: float = 0.0
    recompute_s: float = 0.0
    error: str = ""

    def headers(self) -> tuple[tuple[str, str], ...]:
        return (("x-kvstore-prefill", self.backend), ("x-kvstore-prefill-ms", f"{self.seconds * 1e3:.1f}"),
                ("x-kvstore-pd-decision", self.decision),
                ("x-kvstore-pd-fetch-ms", f"{self.fetch_s * 1e3:.2f}"),
                ("x-kvstore-pd-recompute-ms", f"{self.recompute_s * 1e3:.2f}"))


class PDOrchestrator:
    """The two steps of a disaggregated request (see the module docstring)."""

    def __init__(self, cfg: RouterConfig, pool: Pool, decider: Decider, http: httpx.AsyncClient,
                 oversized: Counter | None = None, timeouts: Counter | None = None) -> None:
        assert cfg.pd is not None
        self.spec = cfg.pd
        self.cfg = cfg
        self.pool = pool
        self.decider = decider
        self.http = http
        self.oversized = oversized
        """Counts prefill answers cut at their bound, by backend (the router's metric), or None."""
        self.timeouts = timeouts
        """Counts prefill answers cut at ``request_timeout``, by backend, or None."""
        self.max_answer = min(cfg.max_response_bytes, PREFILL_MAX_BYTES)
        self.clients: dict[str, Client] = {}
        self.outcomes: list[PrefillOutcome] = []
        """Recent outcomes (bounded; the benchmark and tests read them)."""

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.clients.clear()

    async def plan(self, tenant: str, klass: str, model: ModelEntry, prompt: PromptKeys, endpoint: Endpoint,
                   body: Mapping[str, Any]) -> Plan | Rejection:
        """Run the prefill step; the decode backends in the order to try them."""
        healthy = self.pool.healthy()
        pre = [b for b in healthy if b.name in self.spec.prefill]
        dec = [b for b in healthy if b.name in self.spec.decode]
        bs = model.spec.block_size
        if not dec:
            return Rejection(RejectReason.NO_BACKEND, "no decode backend is available", self.cfg.health_interval)
        out = PrefillOutcome()
        p_plan: Plan | Rejection | None = None
        p_at = [keys_at(model, prompt, b.engine_version) for b in pre]  # None: version unknown, a miss
        d_at = [keys_at(model, prompt, b.engine_version) for b in dec]
        if pre:
            p_tiers = [b.cache.chain_tiers(at[1]) if b.cache is not None and at else np.zeros(0, np.int64)
                       for b, at in zip(pre, p_at)]
            p_plan = self.decider.decide(tenant, klass, pre, p_tiers, prompt.n_tokens, bs, model.block_bytes)
            if isinstance(p_plan, Rejection) and p_plan.reason is not RejectReason.NO_BACKEND:
                return p_plan
        remote = np.full((prompt.n_tokens - 1) // bs, TierKind.REMOTE.value, dtype=np.int64)
        d_local = [b.cache.chain_tiers(at[1]) if b.cache is not None and at else np.zeros(0, np.int64)
                   for b, at in zip(dec, d_at)]
        if isinstance(p_plan, Plan):
            target = p_plan.target_s
            p_ns = {at[0] for at in p_at if at}  # a decode of another vLLM version cannot load P's blocks
            d_tiers = [np.concatenate([local, remote[len(local):]]) if at and at[0] in p_ns else local
                       for local, at in zip(d_local, d_at)]
            d_cands = self.decider.candidates(dec, d_tiers, prompt.n_tokens, bs, model.block_bytes, target, tenant)
        else:  # no prefill: the decode backend computes the prompt, under the usual admission and quotas
            d_plan = self.decider.decide(tenant, klass, dec, d_local, prompt.n_tokens, bs, model.block_bytes)
            if isinstance(d_plan, Rejection):
                return d_plan
            target, d_cands = d_plan.target_s, list(d_plan.candidates)
        if isinstance(p_plan, Plan):
            await self.prefill(p_plan, tenant, model, prompt, endpoint, body, out)
        else:
            out.error = "no prefill backend is available"
        if out.backend != "-":
            await self.wait_visible(d_cands[0].backend, model, prompt, out)
        log.info("pd: prefill %s (%.1f ms%s) -> decode %s, decision %s (fetch %.2f ms, recompute %.2f ms)",
                 out.backend, out.seconds * 1e3, f", {out.error}" if out.error else "", d_cands[0].backend.name,
                 out.decision, out.fetch_s * 1e3, out.recompute_s * 1e3)
        self.outcomes.append(out)
        del self.outcomes[:-1000]
        return Plan(tuple(d_cands), target, extra_headers=out.headers())

    async def prefill(self, plan: Plan, tenant: str, model: ModelEntry, prompt: PromptKeys, endpoint: Endpoint,
                      body: Mapping[str, Any], out: PrefillOutcome) -> None:
        """Send the prefill to the best P (retrying on the next one as
        configured); calibrate P's predictor with its measured time."""
        raw = prefill_body(body, endpoint)
        for c in plan.candidates[: 1 + self.cfg.retries]:
            b = c.backend
            rid = self.pool.next_id()
            did = self.decider.admitted(c, tenant, prompt.n_tokens, model.spec.block_size, model.block_bytes)
            b.begin(rid, prompt.n_tokens, c.predicted_s - c.decision.predicted.queue_s, time.monotonic())
            t0 = time.perf_counter()
            try:  # read up to a bound and a deadline: the answer is not used, a backend that keeps sending is cut
                async with asyncio.timeout(self.cfg.request_timeout), \
                        self.http.stream("POST", f"{b.spec.url}{endpoint.value}", json=raw,
                                         headers=b.spec.auth_headers(), timeout=self.cfg.first_byte_timeout) as r:
                    answer = await read_capped(r.aiter_raw(), self.max_answer)
            except TimeoutError:  # slow, not failed: the decode backend computes what the prefill did not
                out.error = f"{b.name}: no answer within request_timeout = {self.cfg.request_timeout} s"
                if self.timeouts is not None:
                    self.timeouts.labels(b.name).inc()
                break
            except httpx.PoolTimeout:  # the router's own connection limit: no backend's fault
                out.error = "no free upstream connection"
                break
            except httpx.HTTPError as e:
                out.error = f"{b.name}: {type(e).__name__}: {e}"
                self.pool.mark_failed(b, out.error)
                continue
            finally:
                b.end(rid)
            took = time.perf_counter() - t0
            if answer is None:  # its status came after the prompt was computed: the prefill still counts
                log.warning("pd: %s's prefill answer is over %d bytes: cut", b.name, self.max_answer)
                if self.oversized is not None:
                    self.oversized.labels(b.name).inc()
            if r.status_code >= 500:
                out.error = f"{b.name}: HTTP {r.status_code}"
                self.pool.mark_failed(b, out.error)
                continue
            if r.status_code != 200:  # the decode backend answers the client with the same complaint
                out.error = f"{b.name}: HTTP {r.status_code}"
                return
            out.backend, out.seconds = b.name, took
            if did:
                b.controller.report(did, took)
            return
        log.warning("pd: no prefill succeeded (%s); the decode backend computes the prompt", out.error)

    def client(self, b: Backend) -> Client:
        c = self.clients.get(b.name)
        if c is None:
            c = Client(b.spec.daemon, token=b.spec.daemon_token or None, use_shm=False, session=False,
                       timeout=max(self.spec.visible_timeout, 1.0))
            self.clients[b.name] = c
        return c

    async def wait_visible(self, d: Backend, model: ModelEntry, prompt: PromptKeys, out: PrefillOutcome) -> None:
        """Until ``d``'s daemon sees every loadable block of the prompt
        (locally or at a peer), at most ``visible_timeout`` seconds."""
        at = keys_at(model, prompt, d.engine_version)
        if not d.spec.daemon or at is None or not at[1] or self.spec.visible_timeout <= 0:
            return
        ns, keys = at
        want = len(keys)
        deadline = time.monotonic() + self.spec.visible_timeout
        while True:
            try:
                cl: ClusterLookup | None = await asyncio.to_thread(self.client(d).cluster_lookup, ns, keys)
            except (KVStoreError, OSError) as e:
                log.debug("pd: cluster lookup at %s failed: %s", d.name, e)
                cl = None
            if cl is not None and cl.local_blocks + cl.remote_blocks >= want:
                out.decision = cl.decision.value
                out.fetch_s, out.recompute_s = float(cl.fetch_s), float(cl.recompute_s)
                return
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(POLL_S)

