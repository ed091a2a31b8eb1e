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
  the previous answer; see :meth:`~engine_adapter.vllm_scheduler.SchedulerSide.request_finished` for
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

Cache identity (docs/vllm.md): the namespace comes from
:func:`kvstore.identity.engine_namespace`, the function the router calls
too: a digest of the weight files (hashed in a background thread from
construction, remembered in a sidecar cache) or ``weights_digest`` from the
extra config, a digest of the KV-affecting config fields after
``hf_overrides``, tenant, KV dtype, block size, TP size, the request's LoRA
name and ``cache_salt``, and a schema version over the vLLM KV layout. Never
the path or the served name: a weights update at the same path gets a new
namespace, the same weights elsewhere share blocks.

Tensor parallelism (TP = k): the scheduler half does one lookup per prompt
for every rank (one key per block); each worker rank moves only its shard
(its KV heads, all layers) of each block, the k shards living in one slot
under one key (see :mod:`engine_adapter.vllm_worker`). Pipeline parallelism
is refused at start-up.

The halves live in :mod:`engine_adapter.vllm_scheduler` and
:mod:`engine_adapter.vllm_worker`; the namespace, plan and daemon link in
:mod:`engine_adapter.vllm_common`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_adapter.vllm_common import (
    ConnectorIdentity,
    DaemonLink,
    KVStoreConnectorMetadata,
    KVStoreWorkerMetadata,
    cluster_mode,
    connector_namespace,
    extra_config,
    flag,
    layout_descriptor,
)
from engine_adapter.vllm_scheduler import SchedulerSide
from engine_adapter.vllm_worker import WorkerSide
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreWorkerMetadata", "connector_namespace",
           "layout_descriptor"]

log = logging.getLogger("kvstore.vllm")


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by the kvstore daemon (see the module docstring).

    ``kv_connector_extra_config`` keys: ``target`` (daemon address; default
    ``$KVSTORE_ADDRESS`` or 127.0.0.1:50051), ``tenant`` ("default"),
    ``token`` / ``token_file``, ``weights_digest`` (replaces the digest of
    the weight files: the operator vouches that equal strings mean equal
    weights; docs/vllm.md), ``model_id`` (replaces the derived model id),
    ``digest_cache`` (path of the weights digest sidecar cache),
    ``timeout`` (5 s per call), ``retry_interval``
    (1 s after a fault), ``load`` / ``save`` (true; ``kv_role``
    ``kv_consumer`` never saves, ``kv_producer`` never loads), ``use_shm`` (true;
    false moves blocks as inline gRPC bytes), ``prefault`` (true: the
    worker connects when the KV caches are registered and maps the slab's
    resident pages then, off the first load's path), ``layout_tag`` (extra
    text in the layout schema), ``engine_version`` (the vLLM version named in
    the namespace, ``vllm.__version__`` by default: set the same string on two
    versions known to compute the same KV to share blocks across an upgrade;
    docs/vllm.md), ``cluster`` (``"auto"``: lookups in cluster
    mode while the daemon has a cluster, so blocks a peer holds are fetched
    when the daemon's cost model says so; true / false), ``stats_path`` (append a JSON line per
    lookup/load/save there, for tests and debugging).
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise ValueError("kvstore connector: pipeline parallelism is not supported (a stored block holds "
                             f"every layer of the model); got pipeline_parallel_size={pc.pipeline_parallel_size}. "
                             "Tensor parallelism is supported (each rank stores its KV heads).")
        extra = extra_config(vllm_config)
        self.identity = ConnectorIdentity(vllm_config, kv_cache_config)  # starts hashing the weights
        self.block_size = int(vllm_config.cache_config.block_size)
        role_name = str(getattr(self._kv_transfer_config, "kv_role", "kv_both"))
        self.link = DaemonLink(extra, role.name.lower())
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")
        if policy != "recompute":
            log.warning("kvstore connector: kv_load_failure_policy is %r; set \"recompute\" so that a block "
                        "failing its checksum is recomputed instead of failing its request", policy)
        kec = getattr(vllm_config, "kv_events_config", None)
        self.scheduler = SchedulerSide(
            self.identity, self.link, block_size=self.block_size,
            do_load=flag(extra, "load") and role_name != "kv_producer",
            do_save=flag(extra, "save") and role_name != "kv_consumer",
            emit_events=bool(kec is not None and getattr(kec, "enable_kv_cache_events", False)),
            hash_block_size=getattr(kv_cache_config, "hash_block_size", None), cluster=cluster_mode(extra))
        self.worker = WorkerSide(self.identity, self.link, vllm_config, kv_cache_config)
        log.info("kvstore connector (%s): model %s, daemon %s", role.name, self.identity.model_dir,
                 self.link.target or os.environ.get("KVSTORE_ADDRESS") or "127.0.0.1:50051")
        self.link.record(event="init", model_dir=self.identity.model_dir,
                         async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)))
        self.announced = False

    def resolve(self) -> Namespace | None:
        """The namespace (joining the weights hash once), recorded as an ``identity`` event."""
        ns = self.identity.ns
        if not self.announced:
            self.announced = True
            log.info("kvstore connector (%s): namespace %s, layout %s (waited %.3f s for the weights digest)",
                     self.role.name, ns.to_dict() if ns else None, self.identity.descriptor, self.identity.waited_s)
            self.link.record(event="identity", namespace=ns.to_dict() if ns else None,
                             layout_tag=self.identity.layout_tag, schema=self.identity.descriptor,
                             waited_s=round(self.identity.waited_s, 6),
                             weights_digest_given=bool(self.identity.given_digest),
                             engine_version=self.identity.engine_version)
        return ns

    @property
    def ns(self) -> Namespace | None:
        """The base namespace of this deployment (None when the weights could not be hashed)."""
        return self.resolve()

    @property
    def stats(self) -> dict[str, int]:
        return self.link.stats

    def client(self) -> Any:
        """The daemon client, connecting if needed; None while the daemon is unusable."""
        return self.link.client()

    def shutdown(self) -> None:
        self.link.close()

    # ================================================= scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.resolve()
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def take_events(self) -> list[Any]:
        return self.scheduler.take_events()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ==================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if isinstance(self._connector_metadata, KVStoreConnectorMetadata) and self._connector_metadata.loads:
            self.resolve()
        self.worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # a stored block holds every layer: saved at once in wait_for_save

    def wait_for_save(self) -> None:
        if isinstance(self._connector_metadata, KVStoreConnectorMetadata) and self._connector_metadata.saves:
            self.resolve()
        self.worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()
