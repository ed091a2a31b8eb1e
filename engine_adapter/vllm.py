"""kvstore as the external KV cache of vLLM (V1 KV connector API, vLLM 0.32).

Load it into vLLM with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "engine_adapter.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"target": "127.0.0.1:50051"}}'

Two halves, one class (vLLM makes one instance per role):

- **Scheduler** (:meth:`get_num_new_matched_tokens` ... :meth:`request_finished`):
  hashes a request's whole prompt into block keys with one ``block_keys``
  call (block size = vLLM's block size), asks the daemon with one
  ``Lookup`` how many leading blocks it holds, and reports the hit beyond
  vLLM's own prefix cache (always leaving the last prompt token to compute).
  It plans, per step, which vLLM blocks to fill from the store (loads) and
  which newly computed full blocks to store (saves: prompt and generated
  tokens alike, keyed over the real token ids, so a chat's next turn hits
  the previous answer; see :meth:`KVStoreConnector.request_finished` for
  the tail of a finished request), and sends the plan to the worker as
  :class:`KVStoreConnectorMetadata`.
- **Worker** (:meth:`register_kv_caches`, :meth:`start_load_kv`,
  :meth:`wait_for_save`, :meth:`get_block_ids_with_load_errors`): a store
  block is the bytes of one vLLM block across all layers, moved as opaque
  bytes (layer-major: layer 0's block bytes, then layer 1's, ...). A load is
  ``Acquire`` per request -> each block copied out of the daemon's
  shared-memory slab into a pooled staging buffer, fused with its xxh3_64
  check -> ``Release`` -> one ``index_copy_`` per layer for the whole batch.
  A save is ``Reserve`` per request -> one ``index_select`` per layer for the
  whole batch -> each block copied into its slot, fused with its checksum ->
  ``Commit``.

Faults: a daemon that is down, slow or refuses a call is a miss (no external
hit) or an unsaved block, never a failed request: the connector logs, counts
(``kvstore_engine_store_faults_total{op}``) and waits ``retry_interval``
before reconnecting. A block that fails its checksum (or vanished between
the lookup and the load) is reported through
``get_block_ids_with_load_errors``, together with every later block of the
same request, so vLLM recomputes them (``kv_load_failure_policy:
"recompute"``; vLLM's default "fail" fails such a request instead).

Namespace: tenant (extra config), model id, weights digest (extra config or
the model revision), LoRA name, KV dtype, layout ``opaque``, block size, TP
size, the request's ``cache_salt``, and a schema version derived from the
vLLM KV layout (platform, resolved KV cache layout, layers, KV heads, head
size, block size). TP > 1 and pipeline parallelism are refused at start-up.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash
from prometheus_client import Counter

from kvstore.checksum import copy_many, verify_many
from kvstore.client import Client
from kvstore.errors import KeyStatus, KVStoreError
from kvstore.keys import KEY_LEN, KVDtype, KVLayout, Namespace, block_keys, block_keys_array
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorWorkerMetadata)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "connector_namespace"]

log = logging.getLogger("kvstore.vllm")

try:
    FAULTS = Counter("kvstore_engine_store_faults_total",
                     "Store calls from the engine adapter that failed (daemon down, timeout, refused) "
                     "and were served as a miss", ["op"])
except ValueError:  # engine_adapter.connector registered it first in this process
    from engine_adapter.connector import FAULTS

_FAULTS: tuple[type[BaseException], ...] = (KVStoreError, OSError, ValueError, RuntimeError)

_CACHE_DTYPES = {"fp8": KVDtype.FLOAT8_E4M3FN, "fp8_e4m3": KVDtype.FLOAT8_E4M3FN,
                 "fp8_e5m2": KVDtype.FLOAT8_E5M2, "bfloat16": KVDtype.BFLOAT16, "float16": KVDtype.FLOAT16,
                 "half": KVDtype.FLOAT16, "float32": KVDtype.FLOAT32, "float": KVDtype.FLOAT32}
_TORCH_KV = {torch.float16: KVDtype.FLOAT16, torch.bfloat16: KVDtype.BFLOAT16, torch.float32: KVDtype.FLOAT32,
             torch.float8_e4m3fn: KVDtype.FLOAT8_E4M3FN, torch.float8_e5m2: KVDtype.FLOAT8_E5M2,
             torch.int8: KVDtype.INT8, torch.uint8: KVDtype.UINT8}


# --------------------------------------------------------------------------
# Namespace
# --------------------------------------------------------------------------


def _extra(vllm_config: "VllmConfig") -> dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


def _kv_dtype(vllm_config: "VllmConfig") -> KVDtype:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        try:
            return _CACHE_DTYPES[cache_dtype]
        except KeyError:
            raise ValueError(f"kvstore connector: KV cache dtype {cache_dtype!r} is not supported; "
                             f"allowed: auto, {', '.join(_CACHE_DTYPES)}") from None
    return _TORCH_KV[vllm_config.model_config.dtype]


def layout_descriptor(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> str:
    """The vLLM KV layout a stored block's bytes follow; both roles compute
    the same string from the config alone (the worker checks its tensors
    against it)."""
    from vllm.platforms import current_platform

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    resolved = getattr(kv_cache_config, "kv_cache_layout", None) or ""
    tag = str(_extra(vllm_config).get("layout_tag", ""))
    return (f"vllm-v1|{current_platform.device_type}|{resolved}|{tag}|layers={mc.get_num_layers(pc)}"
            f"|kv_heads={mc.get_num_kv_heads(pc)}|head={mc.get_head_size()}"
            f"|block={vllm_config.cache_config.block_size}|{_kv_dtype(vllm_config).value}")


def connector_namespace(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None" = None) -> Namespace:
    """The base namespace of this vLLM deployment (the request's LoRA and
    ``cache_salt`` are added per request)."""
    extra = _extra(vllm_config)
    mc = vllm_config.model_config
    model_id = str(extra.get("model_id") or getattr(mc, "served_model_name", None) or mc.model)
    if isinstance(getattr(mc, "served_model_name", None), list):
        model_id = str(extra.get("model_id") or mc.model)
    if len(model_id.encode()) > 200:
        model_id = "sha:" + xxhash.xxh3_128_hexdigest(model_id.encode())
    digest = str(extra.get("weights_digest") or getattr(mc, "revision", None) or "")
    desc = layout_descriptor(vllm_config, kv_cache_config)
    return Namespace(tenant=str(extra.get("tenant", "default")), model_id=model_id, weights_digest=digest,
                     kv_dtype=_kv_dtype(vllm_config), layout=KVLayout.OPAQUE,
                     block_size=int(vllm_config.cache_config.block_size),
                     tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
                     schema_version=xxhash.xxh3_64_intdigest(desc.encode()) >> 33)  # uint32 on the wire


def _request_ns(base: Namespace, adapter: str, salt: str) -> Namespace:
    if not adapter and not salt:
        return base
    return Namespace(**{**base.to_dict(), "adapter_id": adapter, "salt": salt})  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Scheduler -> worker plan
# --------------------------------------------------------------------------


@dataclass(slots=True)
class BlockMove:
    """Blocks of one request to load or to store: ``keys`` packed (16 bytes
    each), ``block_ids`` the vLLM blocks they live in, ``parent`` the key of
    the block before the first (saves; empty at the chain's start)."""

    req_id: str
    adapter: str
    salt: str
    keys: bytes
    block_ids: list[int]
    first: int = 0
    """Index of the first block in the request's chain."""
    parent: bytes = b""
    final: bool = False
    """The tail save of a finished request whose blocks vLLM keeps until
    the worker reports it done (``get_finished``)."""


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockMove] = field(default_factory=list)
    saves: list[BlockMove] = field(default_factory=list)


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per request, the chain ranges [first, end) now stored."""

    stored: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVStoreWorkerMetadata):
            for k, v in other.stored.items():
                self.stored.setdefault(k, []).extend(v)
        return self


@dataclass(slots=True)
class _ReqState:
    """Scheduler-side state of one request."""

    request: Any
    keys: bytes
    """Keys of every full prompt block, extended over the generated tokens
    as their blocks fill (:meth:`KVStoreConnector._keys_upto`)."""
    adapter: str
    salt: str
    load: bool = True
    save: bool = True
    hit_blocks: int = 0
    """Leading blocks the daemon held at the last lookup."""
    local_tokens: int = 0
    plan: tuple[int, int] | None = None
    """Blocks [a, b) to load in the next step."""
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    """Leading blocks known stored (or planned)."""


def _flag(extra: dict[str, Any], name: str) -> bool:
    """A boolean extra-config entry (default true); accepts JSON booleans and "true"/"false"."""
    v = extra.get(name, True)
    if isinstance(v, str):
        if v.strip().lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"kvstore connector: {name} must be true or false, got {v!r}")
        return v.strip().lower() in ("true", "1", "yes")
    return bool(v)


def _split(keys: bytes) -> list[bytes]:
    return [keys[i:i + KEY_LEN] for i in range(0, len(keys), KEY_LEN)]


# --------------------------------------------------------------------------
# The connector
# --------------------------------------------------------------------------


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by the kvstore daemon (see the module docstring).

    ``kv_connector_extra_config`` keys: ``target`` (daemon address; default
    ``$KVSTORE_ADDRESS`` or 127.0.0.1:50051), ``tenant`` ("default"),
    ``token`` / ``token_file``, ``model_id`` and ``weights_digest``
    (namespace overrides), ``timeout`` (5 s per call), ``retry_interval``
    (1 s after a fault), ``load`` / ``save`` (true; ``kv_role``
    ``kv_consumer`` never saves, ``kv_producer`` never loads), ``use_shm`` (true;
    false moves blocks as inline gRPC bytes), ``layout_tag`` (extra
    text in the layout schema), ``stats_path`` (append a JSON line per
    lookup/load/save there, for tests and debugging).
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        pc = vllm_config.parallel_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise ValueError("kvstore connector: only tensor_parallel_size=1 and pipeline_parallel_size=1 "
                             f"are supported, got TP={pc.tensor_parallel_size} PP={pc.pipeline_parallel_size}")
        extra = _extra(vllm_config)
        self.ns = connector_namespace(vllm_config, kv_cache_config)
        self.block_size = self.ns.block_size
        self.target = extra.get("target") or None
        self.token = extra.get("token") or None
        self.token_file = extra.get("token_file") or None
        self.timeout = float(extra.get("timeout", 5.0))
        self.retry_interval = float(extra.get("retry_interval", 1.0))
        role_name = str(getattr(self._kv_transfer_config, "kv_role", "kv_both"))
        self.do_load = _flag(extra, "load") and role_name != "kv_producer"
        self.do_save = _flag(extra, "save") and role_name != "kv_consumer"
        self.stats_path = extra.get("stats_path") or None
        self.use_shm = _flag(extra, "use_shm")
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")
        if policy != "recompute":
            log.warning("kvstore connector: kv_load_failure_policy is %r; set \"recompute\" so that a block "
                        "failing its checksum is recomputed instead of failing its request", policy)
        self._client: Client | None = None
        self._retry_at = 0.0
        self.stats: dict[str, int] = {"lookups": 0, "hit_tokens": 0, "loaded_blocks": 0, "failed_blocks": 0,
                                      "saved_blocks": 0, "existing_blocks": 0, "faults": 0}
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._finished: dict[str, _ReqState] = {}
        self._tails: list[BlockMove] = []  # tail saves of finished requests, sent with the next step's plan
        self._tail_pending: set[str] = set()  # finished requests whose blocks wait for their tail save
        self._events: list[Any] = []
        kec = getattr(vllm_config, "kv_events_config", None)
        self._emit_events = bool(kec is not None and getattr(kec, "enable_kv_cache_events", False))
        # worker side
        self._layers: list[torch.Tensor] = []
        self._layer_bytes = 0
        self._block_bytes = 0
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._load_errors: set[int] = set()
        self._stored: dict[str, list[tuple[int, int]]] = {}
        self._sent: set[str] = set()
        log.info("kvstore connector (%s): namespace %s, daemon %s", role.name, self.ns.to_dict(),
                 self.target or os.environ.get("KVSTORE_ADDRESS") or "127.0.0.1:50051")
        self._record(event="init", namespace=self.ns.to_dict(),
                     async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)))

    # ------------------------------------------------------------ daemon link
    def _fault(self, op: str, e: BaseException | str) -> None:
        FAULTS.labels(op).inc()
        self.stats["faults"] += 1
        log.warning("kvstore %s failed (%s); serving it as a miss", op, e)
        self._record(event="fault", op=op, error=str(e)[:200])
        if isinstance(e, BaseException) and self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None
            self._retry_at = time.monotonic() + self.retry_interval

    def client(self) -> Client | None:
        """The daemon client, connecting if needed; None while the daemon is unusable."""
        if self._client is None:
            if time.monotonic() < self._retry_at:
                return None
            try:
                self._client = Client(self.target, token=self.token, token_file=self.token_file,
                                      timeout=self.timeout, use_shm=self.use_shm,
                                      name=f"vllm-{self.role.name.lower()}")
            except _FAULTS as e:
                self._retry_at = time.monotonic() + self.retry_interval
                self._fault("connect", e)
                return None
        return self._client

    def _record(self, **fields: Any) -> None:
        if self.stats_path:
            with open(self.stats_path, "a") as f:
                f.write(json.dumps({"role": self.role.name.lower(), "pid": os.getpid(), **fields}) + "\n")

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ================================================= scheduler side
    def _state(self, request: "Request") -> _ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        toks = request.prompt_token_ids
        if toks is None or getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return None  # token ids alone do not name this prompt's KV
        lora = getattr(request, "lora_request", None)
        adapter = str(getattr(lora, "lora_name", "") or "") if lora is not None else ""
        salt = str(getattr(request, "cache_salt", None) or "")
        ns = _request_ns(self.ns, adapter, salt)
        keys = b"".join(block_keys(ns, np.asarray(toks, dtype=np.int64)))
        params = getattr(request, "kv_transfer_params", None) or {}
        st = _ReqState(request, keys, adapter, salt, load=self.do_load and params.get("kvstore_load") is not False,
                       save=self.do_save and params.get("kvstore_save") is not False)
        self._reqs[request.request_id] = st
        return st

    def _keys_upto(self, st: _ReqState, n: int) -> int:
        """Make ``st.keys`` cover the first ``n`` full blocks of the
        request's real tokens (prompt + generated, never speculative drafts
        or async-scheduling placeholders) and return how many blocks it
        covers now (``n`` or fewer when fewer tokens are known). The chain
        is recomputed over the whole known prefix once per newly filled block
        (one native hash call, no per-token Python)."""
        have = len(st.keys) // KEY_LEN
        if n <= have:
            return n
        req = st.request
        n = min(n, int(req.num_tokens) // self.block_size)
        if n <= have:
            return have
        toks = np.asarray(req.all_token_ids[:n * self.block_size], dtype=np.int64)
        st.keys = block_keys_array(_request_ns(self.ns, st.adapter, st.salt), toks).tobytes()
        return n

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request) if self.do_load or self.do_save else None
        if st is None or not st.load:
            return 0, False
        st.local_tokens = num_computed_tokens
        # the last prompt token is always computed (its logits give the first output)
        loadable = min(len(st.keys) // KEY_LEN, (request.num_tokens - 1) // self.block_size)
        if loadable * self.block_size <= num_computed_tokens:
            return 0, False  # vLLM holds every loadable block already: no need to ask
        t0 = time.perf_counter()
        c = self.client()
        if c is None:
            return 0, False
        try:
            hit = int(c.lookup(_request_ns(self.ns, st.adapter, st.salt), _split(st.keys[:loadable * KEY_LEN]))
                      .hit_blocks)
        except _FAULTS as e:
            self._fault("lookup", e)
            return 0, False
        self.stats["lookups"] += 1
        st.hit_blocks = hit
        ext = max(0, min(hit, loadable) * self.block_size - num_computed_tokens)
        self._record(event="lookup", req=request.request_id, prompt_blocks=len(st.keys) // KEY_LEN,
                     local_tokens=num_computed_tokens, hit_blocks=hit, external_tokens=ext,
                     ms=round((time.perf_counter() - t0) * 1000, 3))
        return ext, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens > 0:
            a = st.local_tokens // self.block_size
            b = (st.local_tokens + num_external_tokens) // self.block_size
            st.plan = (a, b)
            self.stats["hit_tokens"] += num_external_tokens
        # blocks below max(local hit, daemon hit) are stored already (a local
        # hit was saved when this process first computed or loaded it)
        st.saved = max(st.hit_blocks, st.local_tokens // self.block_size)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata(saves=self._tails)
        self._tails = []
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(nb[0]) if nb is not None else []
                st.saved = min(st.saved, cached.num_computed_tokens[i] // self.block_size)
            elif nb is not None:
                st.block_ids.extend(nb[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, done in computed.items():
            st = self._reqs[req_id]
            if st.plan is not None:
                a, b = st.plan
                st.plan = None
                if b <= len(st.block_ids):
                    meta.loads.append(BlockMove(req_id, st.adapter, st.salt, st.keys[a * KEY_LEN:b * KEY_LEN],
                                                st.block_ids[a:b]))
                else:  # cannot happen: vLLM allocates a block for every computed token
                    log.error("kvstore: request %s has %d blocks, the load needs %d", req_id,
                              len(st.block_ids), b)
            if not st.save:
                continue
            # blocks whose every token has KV once this step ran; keys only
            # over tokens the scheduler knows (drafts and placeholders wait)
            after = done + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = self._keys_upto(st, min(after // self.block_size, len(st.block_ids)))
            if full > st.saved:
                s = st.saved
                parent = st.keys[(s - 1) * KEY_LEN:s * KEY_LEN] if s else b""
                meta.saves.append(BlockMove(req_id, st.adapter, st.salt, st.keys[s * KEY_LEN:full * KEY_LEN],
                                            st.block_ids[s:full], s, parent))
                st.saved = full
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        bad = getattr(connector_output, "invalid_block_ids", None)
        if bad:  # blocks that failed to load are recomputed by vLLM: store them again afterwards
            for st in self._reqs.values():
                first = next((i for i, b in enumerate(st.block_ids) if b in bad), None)
                if first is not None:
                    st.saved = min(st.saved, first)
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        hbs = getattr(self._kv_cache_config, "hash_block_size", None)
        if hbs not in (None, self.block_size) or not self._emit_events:
            wm = None  # events off, or vLLM's block hashes use another granularity than our blocks
        if isinstance(wm, KVStoreWorkerMetadata):
            for req_id, ranges in wm.stored.items():
                owner = self._reqs.get(req_id) or self._finished.get(req_id)
                if owner is None:
                    continue
                for a, b in ranges:
                    if b > a:
                        self._events.append(self._stored_event(owner, a, b))
        self._tail_pending.difference_update(getattr(connector_output, "finished_sending", None) or ())
        # a finished request's state is kept until its last save is reported
        self._finished = {k: v for k, v in self._finished.items() if k in self._tail_pending}

    def _stored_event(self, st: _ReqState, start: int, end: int) -> Any:
        """vLLM's BlockStored (medium "kvstore") for the request's blocks
        [start, end) now in kvstore, named by vLLM's own block hashes so a
        router that follows vLLM's KV events can tell these prefixes are there."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        req = st.request
        hashes = list(getattr(req, "block_hashes", []) or [])
        end = min(end, len(hashes))
        toks = list(req.all_token_ids[start * self.block_size:end * self.block_size])
        lora = getattr(req, "lora_request", None)
        return BlockStored(block_hashes=[maybe_convert_block_hash(h) for h in hashes[start:end]],
                           parent_block_hash=maybe_convert_block_hash(hashes[start - 1]) if start else None,
                           token_ids=toks, block_size=self.block_size,
                           lora_id=getattr(lora, "lora_int_id", None) if lora else None,
                           medium="kvstore", lora_name=st.adapter or None)

    def take_events(self) -> list[Any]:
        ev, self._events = self._events, []
        return ev

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous (in ``wait_for_save`` of the step that
        computed the block), so vLLM may usually free the blocks at once.
        A request that finished normally may still hold full blocks not yet
        saved: those whose last tokens were only known to the scheduler
        after their step was planned (async scheduling, speculative
        decoding). Then the tail goes with the next step's plan and the
        blocks stay allocated (return True) until the worker reports it
        done through ``get_finished``. Only tokens with KV count: the last
        sampled token has none."""
        from vllm.v1.request import RequestStatus

        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if len(self._finished) < 4096:
            self._finished[request.request_id] = st  # until its last save is reported
        if not st.save or request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None  # aborted/errored: its KV may be incomplete or invalid
        with_kv = min(int(request.num_computed_tokens), int(request.num_tokens) - 1)
        full = self._keys_upto(st, min(with_kv // self.block_size, len(block_ids)))
        if full <= st.saved:
            return False, None
        s = st.saved
        parent = st.keys[(s - 1) * KEY_LEN:s * KEY_LEN] if s else b""
        self._tails.append(BlockMove(request.request_id, st.adapter, st.salt, st.keys[s * KEY_LEN:full * KEY_LEN],
                                     list(block_ids[s:full]), s, parent, final=True))
        st.saved = full
        self._tail_pending.add(request.request_id)
        self._record(event="tail", req=request.request_id, first=s, blocks=full - s)
        return True, None

    # ==================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Record the layer tensors as block-major views ``[num_blocks, ...]``."""
        num_blocks = int(self._kv_cache_config.num_blocks) if self._kv_cache_config is not None else None
        layers = []
        for name, t in kv_caches.items():
            if num_blocks is not None and t.shape[0] != num_blocks and t.dim() > 1 and t.shape[1] == num_blocks:
                t = t.transpose(0, 1)  # [2, num_blocks, ...] (K/V outermost) -> block-major
            if num_blocks is not None and t.shape[0] != num_blocks:
                raise ValueError(f"kvstore connector: cannot find the block dimension of layer {name} "
                                 f"(shape {tuple(t.shape)}, {num_blocks} blocks)")
            layers.append(t)
        shapes = {(tuple(t.shape[1:]), t.dtype) for t in layers}
        if len(shapes) != 1:
            raise ValueError(f"kvstore connector: layers differ in block shape or dtype: {sorted(map(str, shapes))}")
        shape, dtype = shapes.pop()
        if _TORCH_KV.get(dtype) is not self.ns.kv_dtype:
            raise ValueError(f"kvstore connector: KV tensors are {dtype} but the namespace says "
                             f"{self.ns.kv_dtype.value}")
        mc, pc = self._vllm_config.model_config, self._vllm_config.parallel_config
        want = 2 * mc.get_num_kv_heads(pc) * mc.get_head_size() * self.block_size
        if int(np.prod(shape)) != want or len(layers) != mc.get_num_layers(pc):
            raise ValueError(f"kvstore connector: {len(layers)} KV layers of block shape {shape} do not match "
                             f"the layout schema {layout_descriptor(self._vllm_config, self._kv_cache_config)}")
        self._layers = layers
        self._layer_bytes = int(np.prod(shape)) * dtype.itemsize
        self._block_bytes = self._layer_bytes * len(layers)
        log.info("kvstore connector: %d layers, block %s %s, %d bytes per stored block", len(layers), shape,
                 dtype, self._block_bytes)

    def _stage(self, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A pooled ``[n, block_bytes]`` uint8 buffer and its per-layer typed views."""
        need = n * self._block_bytes
        if self._staging.numel() < need:
            self._staging = torch.empty(max(need, 2 * self._staging.numel()), dtype=torch.uint8)
        raw = self._staging[:need].view(n, self._block_bytes)
        per = raw.view(n, len(self._layers), self._layer_bytes)
        typed = [per[:, i].view(t.dtype).view(n, *t.shape[1:]) for i, t in enumerate(self._layers)]
        return raw, typed

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        if not self._layers:  # no KV tensors registered: nothing can be loaded
            self._load_errors.update(b for m in meta.loads for b in m.block_ids)
            return
        t0 = time.perf_counter()
        total = sum(len(m.block_ids) for m in meta.loads)
        raw, typed = self._stage(total)
        rows = raw.numpy()
        good_ids: list[int] = []
        good_rows: list[int] = []
        row = 0
        c = self.client()
        for m in meta.loads:
            n = len(m.block_ids)
            ok = self._load_one(c, m, rows[row:row + n]) if c is not None else 0
            good_ids += m.block_ids[:ok]
            good_rows += range(row, row + ok)
            self._load_errors.update(m.block_ids[ok:])
            self.stats["loaded_blocks"] += ok
            self.stats["failed_blocks"] += n - ok
            self._record(event="load", req=m.req_id, planned_blocks=n, loaded_blocks=ok,
                         ms=round((time.perf_counter() - t0) * 1000, 3))
            row += n
            if c is not None and self._client is None:
                c = None  # a fault closed it: the rest are failures too
        if good_ids:
            ids = torch.tensor(good_ids, dtype=torch.int64)
            sel = torch.tensor(good_rows, dtype=torch.int64)
            for t, src in zip(self._layers, typed):
                part = src if len(good_rows) == total else src.index_select(0, sel)
                t.index_copy_(0, ids.to(t.device), part.to(t.device))

    def _load_one(self, c: Client, m: BlockMove, rows: np.ndarray) -> int:
        """Copy the leading verified blocks of ``m`` into ``rows``; how many."""
        ns = _request_ns(self.ns, m.adapter, m.salt)
        keys = _split(m.keys)
        if c.slab is None:  # daemon on another host: inline bytes (checked by the daemon)
            try:
                st = c.get_into(ns, keys, [rows[i] for i in range(len(keys))])
            except _FAULTS as e:
                self._fault("load", e)
                return 0
            return next((i for i, x in enumerate(st) if x is not KeyStatus.OK), len(st))
        try:
            lease = c.acquire(ns, keys)
        except _FAULTS as e:
            self._fault("load", e)
            return 0
        try:
            hit = lease.hit_blocks
            sizes_ok = [int(x) == self._block_bytes for x in lease.lengths[:hit]]
            hit = sizes_ok.index(False) if False in sizes_ok else hit
            good = verify_many([rows[i] for i in range(hit)], [lease.views[i] for i in range(hit)],
                               lease.checksums[:hit]) if hit else np.zeros(0, bool)
        except _FAULTS as e:
            self._fault("load", e)
            return 0
        finally:
            try:
                lease.release()
            except _FAULTS as e:
                self._fault("release", e)
        bad = np.flatnonzero(~good)
        ok = int(bad[0]) if bad.size else hit
        if bad.size and self._client is not None:
            log.warning("kvstore: %d block(s) of request %s failed their checksum; vLLM recomputes them",
                        bad.size, m.req_id)
            try:
                self._client.report_corrupt(ns, [keys[i] for i in bad.tolist()])
            except _FAULTS as e:
                self._fault("remove", e)
        return ok

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # a stored block holds every layer: saved at once in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves:
            return
        try:
            if self._layers:
                self._save(meta)
        finally:  # saved or not (a failed save is only a miss later), vLLM may free these blocks now
            self._sent.update(m.req_id for m in meta.saves if m.final)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        out, self._sent = self._sent, set()
        return (out or None), None

    def _save(self, meta: KVStoreConnectorMetadata) -> None:
        c = self.client()
        if c is None:
            return
        if c.slab is None:
            self._save_inline(c, meta.saves)
            return
        plans = []  # (move, reservation, indexes of OK keys)
        for m in meta.saves:
            ns = _request_ns(self.ns, m.adapter, m.salt)
            try:
                resv = c.reserve(ns, _split(m.keys), self._block_bytes, parent=m.parent or None)
            except _FAULTS as e:
                self._fault("save", e)
                return
            ok = [i for i, s in enumerate(resv.statuses) if s is KeyStatus.OK]
            self.stats["existing_blocks"] += sum(s is KeyStatus.EXISTS for s in resv.statuses)
            plans.append((m, resv, ok))
        n = sum(len(ok) for _, _, ok in plans)
        csums = np.zeros(0, np.uint64)
        if n:
            raw, typed = self._stage(n)
            ids = torch.tensor([m.block_ids[i] for m, _, ok in plans for i in ok], dtype=torch.int64)
            for t, dst in zip(self._layers, typed):
                torch.index_select(t, 0, ids.to(t.device), out=dst)
            rows = raw.numpy()
            try:
                dsts = [c.view(resv.offsets[i], resv.lengths[i]) for _, resv, ok in plans for i in ok]
                csums = copy_many(dsts, [rows[j] for j in range(n)])
            except _FAULTS as e:
                self._fault("save", e)
                return  # the daemon reclaims the reservations of a lost session
        j = 0
        for m, resv, ok in plans:
            try:
                if not resv.reservation_id:
                    continue
                done = c.commit(resv, csums[j:j + len(ok)].tolist())
            except _FAULTS as e:
                self._fault("save", e)
                return
            finally:
                j += len(ok)
            stored = sum(s is KeyStatus.OK for s in done)
            self.stats["saved_blocks"] += stored
            lead = next((i for i, s in enumerate(done) if s not in (KeyStatus.OK, KeyStatus.EXISTS)), len(done))
            self._stored.setdefault(m.req_id, []).append((m.first, m.first + lead))
            self._record(event="save", req=m.req_id, planned_blocks=len(done), stored_blocks=stored,
                         existing_blocks=sum(s is KeyStatus.EXISTS for s in done))

    def _save_inline(self, c: Client, saves: list[BlockMove]) -> None:
        """Daemon on another host: gather every block once, then one inline ``Put`` per request."""
        n = sum(len(m.block_ids) for m in saves)
        raw, typed = self._stage(n)
        ids = torch.tensor([b for m in saves for b in m.block_ids], dtype=torch.int64)
        for t, dst in zip(self._layers, typed):
            torch.index_select(t, 0, ids.to(t.device), out=dst)
        rows = raw.numpy()
        j = 0
        for m in saves:
            k = len(m.block_ids)
            try:
                st = c.put(_request_ns(self.ns, m.adapter, m.salt), _split(m.keys), [rows[i] for i in range(j, j + k)],
                           parent=m.parent or None)
            except _FAULTS as e:
                self._fault("save", e)
                return
            j += k
            self.stats["saved_blocks"] += sum(s is KeyStatus.OK for s in st)
            lead = next((i for i, s in enumerate(st) if s not in (KeyStatus.OK, KeyStatus.EXISTS)), len(st))
            self._stored.setdefault(m.req_id, []).append((m.first, m.first + lead))

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._stored:
            return None
        out, self._stored = KVStoreWorkerMetadata(self._stored), {}
        return out
