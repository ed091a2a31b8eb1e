"""``kvstore route``: the OpenAI-compatible front door (FastAPI + uvicorn).

Per request: authenticate the bearer key (tenant, class); read the body;
tokenize the prompt as the backend will and hash its block keys; ask each
backend's cache view which leading blocks it holds (by tier); rank the
backends by predicted TTFT (:mod:`router.decision`); refuse with 429 when the
best prediction misses the class target; forward to the best backend with a
pooled ``httpx.AsyncClient``. A failure before the first byte (no connection,
a 5xx, a timeout) is retried once on the next-best backend; a backend that
dies mid-stream ends that stream with an error event and leaves the pool
until its health check passes; a client that disconnects closes the
upstream request (vLLM aborts it).

The decision is visible: ``x-kvstore-backend``, ``x-kvstore-predicted-ttft-ms``,
``x-kvstore-runner-up`` (``name=ms``), ``x-kvstore-hit-tokens`` response
headers and a debug log line. The measured TTFT of streamed requests
(first upstream body chunk) goes back to the chosen backend's predictor,
whose prefill throughput learns from it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvstore.errors import InvalidArgument
from router.backends import Backend, Pool, read_capped
from router.config import ApiKey, RouterConfig
from router.decision import Candidate, Decider, Plan, RejectReason, Rejection
from router.metrics import RouterMetrics
from router.pd import PDOrchestrator
from router.prompts import (
    BadRequest,
    Endpoint,
    ModelEntry,
    NamespaceFn,
    PromptKeys,
    keys_at,
    load_model,
    request_tokens,
)
from tiers.base import TierKind

log = logging.getLogger("kvstore.router")

__all__ = ["RouterService", "build_app"]

_TIERS = [t.label for t in TierKind]
_T = TypeVar("_T")


def error_response(status: int, message: str, kind: str, code: str | int | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


class _BeforeFirstByte(Exception):
    """The upstream failed before sending anything: the request may be retried."""


class _RouterBusy(Exception):
    """Every upstream connection of the router is in use (its own limit, not a backend's failure)."""


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None when it is longer than ``limit`` bytes
    (refused from its content-length, or as soon as that many have come)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            return None
    return bytes(buf)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class _ClientGone(Exception):
    """The client disconnected while the router waited on a backend for it."""


async def _unless_gone(request: Request, work: Coroutine[Any, Any, _T]) -> _T:
    """``work``'s result, or :class:`_ClientGone` when the client goes away
    first; then (or when this handler is cancelled) ``work`` is cancelled,
    which closes its upstream request and runs its clean-up."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise _ClientGone()
    return task.result()


class _RelayResponse(StreamingResponse):
    """A stream relayed from a backend: ``release`` (ending the in-flight
    entry, closing the upstream response) runs however the response ends,
    also when the client left before the relay's first step (the relay's
    own ``finally`` never runs then)."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], Awaitable[None]], *,
                 status_code: int, headers: Mapping[str, str], media_type: str) -> None:
        super().__init__(content, status_code=status_code, headers=headers, media_type=media_type)
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()


class RouterService:
    """State of one router: models, backends, decider, metrics, upstream pool."""

    def __init__(self, cfg: RouterConfig, *, namespace_fn: NamespaceFn | None = None,
                 follow_events: bool = True) -> None:
        self.cfg = cfg
        self.models: dict[str, ModelEntry] = {m.name: load_model(m, namespace_fn) for m in cfg.models}
        self.keys: dict[str, ApiKey] = {k.key: k for k in cfg.api_keys}
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        timeout = httpx.Timeout(connect=cfg.connect_timeout, read=max(cfg.first_byte_timeout, cfg.read_timeout),
                                write=30.0, pool=cfg.connect_timeout)
        self.http = httpx.AsyncClient(limits=limits, timeout=timeout)
        self.pool = Pool(cfg, self.http, follow_events=follow_events)
        longest = max((m.max_model_len for m in self.models.values()), default=0)
        self.decider = Decider(cfg, max_prompt_tokens=min(cfg.max_prompt_tokens or longest, longest))
        self.metrics = RouterMetrics(self.pool)
        self.pd = (PDOrchestrator(cfg, self.pool, self.decider, self.http, self.metrics.oversized,
                                  self.metrics.timeouts)
                   if cfg.pd is not None else None)
        """Prefill/decode disaggregation (``[pd]``), or None."""
        self.overheads: collections.deque[float] = collections.deque(maxlen=100_000)
        """Recent router work before the upstream call, seconds (the benchmark reads it)."""

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        await self.http.aclose()
        if self.pd is not None:
            self.pd.close()

    # ------------------------------------------------------------ auth
    def authenticate(self, request: Request) -> ApiKey | JSONResponse:
        if not self.keys:
            return ApiKey(key="", tenant="anonymous", klass=self.cfg.classes[0].name)
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            self.metrics.bad_requests.labels("401").inc()
            return error_response(401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error",
                                  "missing_api_key")
        k = self.keys.get(token.strip())
        if k is None:
            self.metrics.bad_requests.labels("401").inc()
            return error_response(401, "invalid API key", "authentication_error", "invalid_api_key")
        return k

    # ------------------------------------------------------------ requests
    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        t0 = time.perf_counter()
        who = self.authenticate(request)
        if isinstance(who, Response):
            return who
        raw = await _read_body(request, self.cfg.max_body_bytes)
        if raw is None:
            return self._bad(413, f"the request body is larger than {self.cfg.max_body_bytes} bytes",
                             code="body_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return self._bad(400, f"the request body is not valid JSON: {e}")
        except RecursionError:
            return self._bad(400, "the request body is not valid JSON: nested too deeply")
        if not isinstance(body, dict):
            return self._bad(400, "the request body must be a JSON object")
        name = body.get("model")
        model = self.models.get(name) if isinstance(name, str) else None
        if model is None:
            return self._bad(404, f"the model {name!r} does not exist; served: {', '.join(self.models)}",
                             "NotFoundError", "model_not_found")
        try:
            prompt = request_tokens(model, endpoint, body)
        except BadRequest as e:
            return self._bad(400, str(e))
        except InvalidArgument as e:
            return self._bad(400, str(e))
        limit = self.cfg.max_prompt_tokens
        if limit and prompt.n_tokens > limit:
            return self._bad(400, f"the prompt has {prompt.n_tokens} tokens; this router accepts at most {limit}")
        stream = bool(body.get("stream", False))
        if self.pd is not None:
            t_pd = time.perf_counter()
            try:  # a client that leaves during the prefill cancels it (and no decode runs)
                plan = await _unless_gone(request, self.pd.plan(who.tenant, who.klass, model, prompt, endpoint,
                                                                body))
            except _ClientGone:
                self.metrics.requests.labels("-", endpoint.value, "499").inc()
                return Response(status_code=499)
            t0 += time.perf_counter() - t_pd  # the prefill step is a backend's work, not the router's
        else:
            plan = await self._plan(who, model, prompt)
        if isinstance(plan, Rejection):
            self.metrics.rejections.labels(who.klass, who.tenant, plan.reason.value).inc()
            log.info("refused (%s) tenant=%s class=%s: %s", plan.reason.value, who.tenant, who.klass, plan.message)
            retry = max(int(math.ceil(plan.retry_after_s)), 1)
            if plan.reason is RejectReason.TOKEN_BURST:  # retrying cannot help
                return self._bad(400, plan.message, code=plan.reason.value)
            status = 503 if plan.reason is RejectReason.NO_BACKEND else 429
            return error_response(status, plan.message, "rate_limit_exceeded" if status == 429 else "service_unavailable",
                                  plan.reason.value, headers={"retry-after": str(retry)})
        spent = time.perf_counter() - t0
        self.metrics.overhead.observe(spent)
        self.overheads.append(spent)
        return await self._forward(request, endpoint, raw, stream, plan, who, model, prompt)

    def _bad(self, status: int, message: str, kind: str = "BadRequestError",
             code: str | int | None = None) -> JSONResponse:
        self.metrics.bad_requests.labels(str(status)).inc()
        return error_response(status, message, kind, code)

    async def _plan(self, who: ApiKey, model: ModelEntry, prompt: PromptKeys) -> Plan | Rejection:
        backends = self.pool.healthy()
        tiers: list[np.ndarray] = []
        for b in backends:
            at = keys_at(model, prompt, b.engine_version)  # None: its vLLM version is unknown, a miss
            local = b.cache.chain_tiers(at[1]) if b.cache is not None and at else np.zeros(0, dtype=np.int64)
            if b.cache is not None and at and b.spec.cluster:
                local = await asyncio.to_thread(b.cache.cluster_tiers, at[0], at[1], local)
            tiers.append(local)
        return self.decider.decide(who.tenant, who.klass, backends, tiers, prompt.n_tokens, model.spec.block_size,
                                   model.block_bytes)

    def _headers(self, plan: Plan, c: Candidate, model: ModelEntry, attempt: int) -> dict[str, str]:
        h = {"x-kvstore-backend": c.backend.name, "x-kvstore-predicted-ttft-ms": f"{c.predicted_s * 1e3:.1f}",
             "x-kvstore-hit-tokens": str(len(c.block_tiers) * model.spec.block_size)}
        others = [o for o in plan.candidates if o is not c]
        if others:
            h["x-kvstore-runner-up"] = f"{others[0].backend.name}={others[0].predicted_s * 1e3:.1f}"
        if attempt:
            h["x-kvstore-retried"] = str(attempt)
        h.update(plan.extra_headers)
        return h

    def _note_routed(self, plan: Plan, c: Candidate, who: ApiKey, model: ModelEntry, prompt: PromptKeys) -> int:
        bs = model.spec.block_size
        for t, n in zip(_TIERS, c.hit_tokens_by_tier(bs)):
            if n:
                self.metrics.hit_tokens.labels(c.backend.name, t).inc(float(n))
        self.metrics.prompt_tokens.labels(c.backend.name).inc(prompt.n_tokens)
        self.metrics.predicted.labels(c.backend.name).observe(c.predicted_s)
        if self.cfg.log_decisions and log.isEnabledFor(logging.DEBUG):
            ru = next((o for o in plan.candidates if o is not c), None)
            log.debug("route tenant=%s class=%s tokens=%d -> %s predicted %.1f ms (hit %d blocks: %s)%s",
                      who.tenant, who.klass, prompt.n_tokens, c.backend.name, c.predicted_s * 1e3,
                      len(c.block_tiers), dict(zip(_TIERS, np.bincount(c.block_tiers, minlength=4).tolist())),
                      f"; runner-up {ru.backend.name} {ru.predicted_s * 1e3:.1f} ms" if ru else "")
        return self.decider.admitted(c, who.tenant, prompt.n_tokens, bs, model.block_bytes)

    def _observe_ttft(self, c: Candidate, decision_id: int, actual_s: float) -> None:
        b, predicted_s = c.backend, c.predicted_s
        b.learn_penalty(c.running, actual_s - predicted_s)
        self.metrics.measured.labels(b.name).observe(actual_s)
        self.metrics.error.labels(b.name).observe(actual_s - predicted_s)
        self.metrics.rel_error.labels(b.name).observe(abs(actual_s - predicted_s) / max(actual_s, 1e-9))
        if decision_id:
            b.controller.report(decision_id, actual_s)

    async def _open(self, b: Backend, endpoint: Endpoint, raw: bytes,
                    deadline: float) -> tuple[httpx.Response, AsyncIterator[bytes], bytes, float]:
        """Send the request; wait for the status and the first body chunk
        (by ``deadline``, the event loop's clock, at the latest)."""
        req = self.http.build_request("POST", f"{b.spec.url}{endpoint.value}", content=raw,
                                      headers={"content-type": "application/json", **b.spec.auth_headers()})
        t_sent = time.perf_counter()
        try:
            async with asyncio.timeout_at(deadline):
                resp = await self.http.send(req, stream=True)
        except httpx.PoolTimeout:
            raise _RouterBusy() from None
        except httpx.HTTPError as e:
            raise _BeforeFirstByte(f"{type(e).__name__}: {e}") from None
        except TimeoutError:
            raise _BeforeFirstByte(f"no answer within request_timeout = {self.cfg.request_timeout} s") from None
        try:
            it = resp.aiter_raw()
            first = b""
            async with asyncio.timeout_at(deadline):
                async for chunk in it:
                    if chunk:
                        first = chunk
                        break
            ttft = time.perf_counter() - t_sent
        except httpx.HTTPError as e:
            await resp.aclose()
            raise _BeforeFirstByte(f"{type(e).__name__}: {e}") from None
        except TimeoutError:
            await resp.aclose()
            raise _BeforeFirstByte(f"no first byte within request_timeout = {self.cfg.request_timeout} s") from None
        if resp.status_code >= 500:
            await resp.aclose()
            raise _BeforeFirstByte(f"HTTP {resp.status_code}: {first[:200]!r}")
        return resp, it, first, ttft

    async def _forward(self, request: Request, endpoint: Endpoint, raw: bytes, stream: bool, plan: Plan,
                       who: ApiKey, model: ModelEntry, prompt: PromptKeys) -> Response:
        tries = plan.candidates[: 1 + self.cfg.retries]
        last = ""
        for attempt, c in enumerate(tries):
            b = c.backend
            if attempt:
                self.metrics.retries.labels(tries[attempt - 1].backend.name).inc()
            rid = self.pool.next_id()
            did = self._note_routed(plan, c, who, model, prompt)
            b.begin(rid, prompt.n_tokens, c.predicted_s - c.decision.predicted.queue_s, time.monotonic())
            deadline = asyncio.get_running_loop().time() + self.cfg.request_timeout
            try:
                resp, it, first, ttft = await _unless_gone(request, self._open(b, endpoint, raw, deadline))
            except _ClientGone:  # the client went away before the first byte: upstream is cancelled
                b.end(rid)
                self.metrics.requests.labels(b.name, endpoint.value, "499").inc()
                return Response(status_code=499)
            except _RouterBusy:
                b.end(rid)
                self.metrics.requests.labels(b.name, endpoint.value, "503").inc()
                return error_response(503, "the router has no free upstream connection; retry shortly",
                                      "service_unavailable", "router_busy", headers={"retry-after": "1"})
            except _BeforeFirstByte as e:
                b.end(rid)
                last = f"backend {b.name}: {e}"
                log.warning("request failed before its first byte on %s: %s", b.name, e)
                self.pool.mark_failed(b, str(e))
                continue
            b.inflight[rid].first_byte = time.monotonic()
            headers = self._headers(plan, c, model, attempt)
            ctype = resp.headers.get("content-type", "application/json")
            status = resp.status_code
            self.metrics.requests.labels(b.name, endpoint.value, str(status)).inc()
            if stream and status == 200:
                self._observe_ttft(c, did, ttft)
                async def release(b: Backend = b, rid: int = rid, resp: httpx.Response = resp) -> None:
                    b.end(rid)
                    await resp.aclose()

                sse = ctype.startswith("text/event-stream")
                return _RelayResponse(self._relay(b, rid, resp, it, first, deadline, sse), release, status_code=status,
                                      headers=headers, media_type=ctype)
            limit = self.cfg.max_response_bytes
            try:  # buffered up to the limit; past it (or the deadline) the upstream response is closed unread
                async with asyncio.timeout_at(deadline):
                    whole = await read_capped(it, limit, first)
            except TimeoutError:
                self.metrics.timeouts.labels(b.name).inc()
                log.warning("backend %s did not finish its answer within request_timeout = %s s: cut", b.name,
                            self.cfg.request_timeout)
                return error_response(504, f"backend {b.name} did not finish its answer within request_timeout = "
                                      f"{self.cfg.request_timeout} s", "timeout_error", "backend_timeout",
                                      headers=headers)
            except httpx.HTTPError as e:
                self.pool.mark_failed(b, str(e))
                self.metrics.stream_errors.labels(b.name).inc()
                return error_response(502, f"backend {b.name} failed mid-response: {e}", "backend_error")
            finally:
                await resp.aclose()
                b.end(rid)
            if whole is None:
                self.metrics.oversized.labels(b.name).inc()
                log.warning("backend %s answered more than max_response_bytes = %d bytes: cut", b.name, limit)
                return error_response(502, f"backend {b.name}'s answer is larger than max_response_bytes = {limit} "
                                      "bytes (the router's limit on a non-streamed answer; stream it instead)",
                                      "backend_error", "response_too_large", headers=headers)
            if status == 200 and prompt.max_tokens <= 1:
                self._observe_ttft(c, did, ttft)
            return Response(whole, status_code=status, headers=headers, media_type=ctype)
        return error_response(502, f"no backend could serve the request ({last})", "backend_error")

    async def _relay(self, b: Backend, rid: int, resp: httpx.Response, it: AsyncIterator[bytes],
                     first: bytes, deadline: float, sse: bool) -> AsyncIterator[bytes]:
        """The stream, chunk by chunk, until it ends or ``deadline`` (a timeout
        per read: never one around a ``yield``, which would cancel the client's send).
        An SSE stream that ends without ``data: [DONE]`` gets an error event:
        a truncated stream must not look complete."""
        try:
            yield first
            prev, last = b"", first
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        chunk = await anext(it)
                except StopAsyncIteration:
                    break
                if chunk:
                    prev, last = last, chunk
                yield chunk
            if sse and not (prev[-32:] + last).rstrip().endswith(b"data: [DONE]"):
                log.warning("backend %s ended a stream without data: [DONE]", b.name)
                self.metrics.stream_errors.labels(b.name).inc()
                err = {"error": {"message": f"backend {b.name} ended the stream without data: [DONE] (truncated)",
                                 "type": "backend_error", "param": None, "code": 502}}
                yield f"data: {json.dumps(err)}\n\n".encode()
        except TimeoutError:
            log.warning("backend %s's stream passed request_timeout = %s s: ended", b.name, self.cfg.request_timeout)
            self.metrics.timeouts.labels(b.name).inc()
            err = {"error": {"message": f"backend {b.name} did not finish its answer within request_timeout = "
                             f"{self.cfg.request_timeout} s", "type": "timeout_error", "param": None, "code": 504}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        except httpx.HTTPError as e:
            log.warning("backend %s failed mid-stream: %s", b.name, e)
            self.pool.mark_failed(b, f"mid-stream: {e}")
            self.metrics.stream_errors.labels(b.name).inc()
            err = {"error": {"message": f"backend {b.name} failed mid-stream: {type(e).__name__}",
                             "type": "backend_error", "param": None, "code": 502}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            b.end(rid)
            await resp.aclose()

    # ------------------------------------------------------------ other endpoints
    def models_list(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "kvstore-route",
                                            "root": m.spec.path} for n, m in self.models.items()]}

    def state(self) -> dict[str, Any]:
        now = time.monotonic()
        out = []
        for b in self.pool.backends:
            out.append({"name": b.name, "url": b.spec.url, "healthy": b.healthy, "routed": b.routed,
                        "engine_version": b.engine_version,
                        "inflight": len(b.inflight), "pending": len(b.pending()),
                        "queue_wait_s": b.queue_wait_s(now), "decode_penalty_s": b.decode_penalty_s,
                        "engine": {"waiting": b.engine.waiting, "running": b.engine.running,
                                   "kv_usage": b.engine.kv_usage},
                        "prefill_tokens_per_s": b.predictor.prefill_tokens_per_s,
                        "cached_blocks": b.cache.held_blocks() if b.cache is not None else 0,
                        "events_connected": bool(b.cache and b.cache.connected)})
        ov = np.asarray(self.overheads, dtype=np.float64)
        q: list[float | None] = (np.percentile(ov, [50, 99]) * 1e3).tolist() if ov.size else [None, None]
        return {"backends": out, "overhead_ms": {"p50": q[0], "p99": q[1], "n": int(ov.size)}}


def build_app(cfg: RouterConfig, *, namespace_fn: NamespaceFn | None = None, follow_events: bool = True) -> FastAPI:
    """The router's ASGI app (models load now; backends are followed from start-up)."""
    svc = RouterService(cfg, namespace_fn=namespace_fn, follow_events=follow_events)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await svc.start()
        try:
            yield
        finally:
            await svc.stop()

    app = FastAPI(title="kvstore route", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = svc

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await svc.handle(request, Endpoint.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await svc.handle(request, Endpoint.CHAT)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        who = svc.authenticate(request)
        if isinstance(who, Response):
            return who
        return JSONResponse(svc.models_list())

    @app.get("/health")
    async def health() -> Response:
        ok = bool(svc.pool.healthy())
        return JSONResponse({"status": "ok" if ok else "no healthy backend"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/router/backends")
    async def backends(request: Request) -> Response:
        who = svc.authenticate(request)
        if isinstance(who, Response):
            return who
        return JSONResponse(svc.state())

    return app
