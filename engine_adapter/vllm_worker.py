"""The worker half of the vLLM connector (``engine_adapter.vllm``).

A store block is the bytes of one vLLM block across all layers, moved as
opaque bytes (layer-major: layer 0's block bytes, then layer 1's, ...). A
load is ``Acquire`` per request -> each block copied out of the daemon's
shared-memory slab into a pooled staging buffer, fused with its xxh3_64
check -> ``Release`` -> one ``index_copy_`` per layer for the whole batch.
A save is ``Reserve`` per request -> one ``index_select`` per layer for the
whole batch -> each block copied into its slot, fused with its checksum ->
``Commit``. A block that fails its checksum (or vanished between the lookup
and the load) is reported through ``get_block_ids_with_load_errors``,
together with every later block of the same request, so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_adapter.vllm_common import (
    FAULT_TYPES,
    PEER_FETCHED_BYTES,
    TORCH_KV,
    BlockMove,
    ConnectorIdentity,
    DaemonLink,
    KVStoreConnectorMetadata,
    KVStoreWorkerMetadata,
    layout_descriptor,
    request_ns,
    split_keys,
)
from kvstore.checksum import copy_many, verify_many
from kvstore.client import Client
from kvstore.errors import KeyStatus
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerSide"]

log = logging.getLogger("kvstore.vllm")

WIRE_DECISIONS = ("unspecified", "local", "fetch", "recompute")
"""Names of the wire ``ChainDecision`` values an acquire answers."""


class WorkerSide:
    """Loads and saves of one worker-role connector."""

    def __init__(self, ident: ConnectorIdentity, link: DaemonLink, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig | None) -> None:
        self.ident = ident
        self.link = link
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.layers: list[torch.Tensor] = []
        self.layer_bytes = 0
        self.block_bytes = 0
        self.staging = torch.empty(0, dtype=torch.uint8)
        self.load_errors: set[int] = set()
        self.stored: dict[str, list[tuple[int, int]]] = {}
        self.sent: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Record the layer tensors as block-major views ``[num_blocks, ...]``."""
        kcc = self.kv_cache_config
        num_blocks = int(kcc.num_blocks) if kcc is not None else None
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
        if TORCH_KV.get(dtype) is not self.ident.kv_dtype:
            raise ValueError(f"kvstore connector: KV tensors are {dtype} but the namespace says "
                             f"{self.ident.kv_dtype.value}")
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        want = 2 * mc.get_num_kv_heads(pc) * mc.get_head_size() * self.block_size
        if int(np.prod(shape)) != want or len(layers) != mc.get_num_layers(pc):
            raise ValueError(f"kvstore connector: {len(layers)} KV layers of block shape {shape} do not match "
                             f"the layout schema {layout_descriptor(self.vllm_config, kcc)}")
        self.layers = layers
        self.layer_bytes = int(np.prod(shape)) * dtype.itemsize
        self.block_bytes = self.layer_bytes * len(layers)
        log.info("kvstore connector: %d layers, block %s %s, %d bytes per stored block", len(layers), shape,
                 dtype, self.block_bytes)

    def stage(self, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A pooled ``[n, block_bytes]`` uint8 buffer and its per-layer typed views."""
        need = n * self.block_bytes
        if self.staging.numel() < need:
            self.staging = torch.empty(max(need, 2 * self.staging.numel()), dtype=torch.uint8)
        raw = self.staging[:need].view(n, self.block_bytes)
        per = raw.view(n, len(self.layers), self.layer_bytes)
        typed = [per[:, i].view(t.dtype).view(n, *t.shape[1:]) for i, t in enumerate(self.layers)]
        return raw, typed

    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        base = self.ident.ns
        if not self.layers or base is None:  # nothing registered (or no identity): nothing can be loaded
            self.load_errors.update(b for m in meta.loads for b in m.block_ids)
            return
        t0 = time.perf_counter()
        total = sum(len(m.block_ids) for m in meta.loads)
        raw, typed = self.stage(total)
        rows = raw.numpy()
        good_ids: list[int] = []
        good_rows: list[int] = []
        row = 0
        c = self.link.client()
        for m in meta.loads:
            n = len(m.block_ids)
            ok = self.load_one(c, base, m, rows[row:row + n]) if c is not None else 0
            good_ids += m.block_ids[:ok]
            good_rows += range(row, row + ok)
            self.load_errors.update(m.block_ids[ok:])
            self.link.stats["loaded_blocks"] += ok
            self.link.stats["failed_blocks"] += n - ok
            self.link.record(event="load", req=m.req_id, planned_blocks=n, loaded_blocks=ok,
                             ms=round((time.perf_counter() - t0) * 1000, 3))
            row += n
            if c is not None and self.link.current is None:
                c = None  # a fault closed it: the rest are failures too
        if good_ids:
            ids = torch.tensor(good_ids, dtype=torch.int64)
            sel = torch.tensor(good_rows, dtype=torch.int64)
            for t, src in zip(self.layers, typed):
                part = src if len(good_rows) == total else src.index_select(0, sel)
                t.index_copy_(0, ids.to(t.device), part.to(t.device))

    def load_one(self, c: Client, base: Namespace, m: BlockMove, rows: np.ndarray) -> int:
        """Copy the leading verified blocks of ``m`` into ``rows``; how many."""
        ns = request_ns(base, m.adapter, m.salt)
        keys = split_keys(m.keys)
        if c.slab is None:  # daemon on another host: inline bytes (checked by the daemon)
            try:
                st = c.get_into(ns, keys, [rows[i] for i in range(len(keys))])
            except FAULT_TYPES as e:
                self.link.fault("load", e)
                return 0
            return next((i for i, x in enumerate(st) if x is not KeyStatus.OK), len(st))
        try:
            lease = c.acquire(ns, keys, cluster=m.cluster)
        except FAULT_TYPES as e:
            self.link.fault("load", e)
            return 0
        if m.cluster:
            self.note_fetch(m, lease.fetched_blocks, lease.decision, lease.hit_blocks, len(keys))
        try:
            hit = lease.hit_blocks
            sizes_ok = [int(x) == self.block_bytes for x in lease.lengths[:hit]]
            hit = sizes_ok.index(False) if False in sizes_ok else hit
            good = verify_many([rows[i] for i in range(hit)], [lease.views[i] for i in range(hit)],
                               lease.checksums[:hit]) if hit else np.zeros(0, bool)
        except FAULT_TYPES as e:
            self.link.fault("load", e)
            return 0
        finally:
            try:
                lease.release()
            except FAULT_TYPES as e:
                self.link.fault("release", e)
        bad = np.flatnonzero(~good)
        ok = int(bad[0]) if bad.size else hit
        if bad.size and self.link.current is not None:
            log.warning("kvstore: %d block(s) of request %s failed their checksum; vLLM recomputes them",
                        bad.size, m.req_id)
            try:
                self.link.current.report_corrupt(ns, [keys[i] for i in bad.tolist()])
            except FAULT_TYPES as e:
                self.link.fault("remove", e)
        return ok

    def note_fetch(self, m: BlockMove, fetched: int, decision: int, hit: int, planned: int) -> None:
        """Stats, metric and record of a load that asked its daemon to fetch
        from a peer first; the blocks it did not get (the fetch failed, timed
        out, was refused or damaged, or the daemon decided otherwise this
        time) are recomputed by vLLM (they are load errors)."""
        nbytes = fetched * self.block_bytes
        kind = WIRE_DECISIONS[decision] if 0 <= decision < len(WIRE_DECISIONS) else str(decision)
        self.link.stats["fetched_blocks"] += fetched
        self.link.stats["fetched_bytes"] += nbytes
        self.link.stats["fetch_failed_blocks"] += planned - hit
        PEER_FETCHED_BYTES.inc(nbytes)
        if hit < planned:
            log.warning("kvstore: request %s: %d of %d block(s) not obtained from the peer (decision %s, %d "
                        "fetched); vLLM recomputes them", m.req_id, planned - hit, planned, kind, fetched)
        self.link.record(event="fetch", req=m.req_id, planned_blocks=planned, fetched_blocks=fetched,
                         fetched_bytes=nbytes, hit_blocks=hit, decision=kind)

    def wait_for_save(self, meta: Any) -> None:
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves:
            return
        try:
            base = self.ident.ns
            if self.layers and base is not None:
                self.save(meta, base)
        finally:  # saved or not (a failed save is only a miss later), vLLM may free these blocks now
            self.sent.update(m.req_id for m in meta.saves if m.final)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        out, self.sent = self.sent, set()
        return (out or None), None

    def save(self, meta: KVStoreConnectorMetadata, base: Namespace) -> None:
        c = self.link.client()
        if c is None:
            return
        if c.slab is None:
            self.save_inline(c, base, meta.saves)
            return
        plans = []  # (move, reservation, indexes of OK keys)
        for m in meta.saves:
            ns = request_ns(base, m.adapter, m.salt)
            try:
                resv = c.reserve(ns, split_keys(m.keys), self.block_bytes, parent=m.parent or None)
            except FAULT_TYPES as e:
                self.link.fault("save", e)
                return
            ok = [i for i, s in enumerate(resv.statuses) if s is KeyStatus.OK]
            self.link.stats["existing_blocks"] += sum(s is KeyStatus.EXISTS for s in resv.statuses)
            plans.append((m, resv, ok))
        n = sum(len(ok) for _, _, ok in plans)
        csums = np.zeros(0, np.uint64)
        if n:
            raw, typed = self.stage(n)
            ids = torch.tensor([m.block_ids[i] for m, _, ok in plans for i in ok], dtype=torch.int64)
            for t, dst in zip(self.layers, typed):
                torch.index_select(t, 0, ids.to(t.device), out=dst)
            rows = raw.numpy()
            try:
                dsts = [c.view(resv.offsets[i], resv.lengths[i]) for _, resv, ok in plans for i in ok]
                csums = copy_many(dsts, [rows[j] for j in range(n)])
            except FAULT_TYPES as e:
                self.link.fault("save", e)
                return  # the daemon reclaims the reservations of a lost session
        j = 0
        for m, resv, ok in plans:
            try:
                if not resv.reservation_id:
                    continue
                done = c.commit(resv, csums[j:j + len(ok)].tolist())
            except FAULT_TYPES as e:
                self.link.fault("save", e)
                return
            finally:
                j += len(ok)
            stored = sum(s is KeyStatus.OK for s in done)
            self.link.stats["saved_blocks"] += stored
            lead = next((i for i, s in enumerate(done) if s not in (KeyStatus.OK, KeyStatus.EXISTS)), len(done))
            self.stored.setdefault(m.req_id, []).append((m.first, m.first + lead))
            self.link.record(event="save", req=m.req_id, planned_blocks=len(done), stored_blocks=stored,
                             existing_blocks=sum(s is KeyStatus.EXISTS for s in done))

    def save_inline(self, c: Client, base: Namespace, saves: list[BlockMove]) -> None:
        """Daemon on another host: gather every block once, then one inline ``Put`` per request."""
        n = sum(len(m.block_ids) for m in saves)
        raw, typed = self.stage(n)
        ids = torch.tensor([b for m in saves for b in m.block_ids], dtype=torch.int64)
        for t, dst in zip(self.layers, typed):
            torch.index_select(t, 0, ids.to(t.device), out=dst)
        rows = raw.numpy()
        j = 0
        for m in saves:
            k = len(m.block_ids)
            try:
                st = c.put(request_ns(base, m.adapter, m.salt), split_keys(m.keys),
                           [rows[i] for i in range(j, j + k)], parent=m.parent or None)
            except FAULT_TYPES as e:
                self.link.fault("save", e)
                return
            j += k
            self.link.stats["saved_blocks"] += sum(s is KeyStatus.OK for s in st)
            lead = next((i for i, s in enumerate(st) if s not in (KeyStatus.OK, KeyStatus.EXISTS)), len(st))
            self.stored.setdefault(m.req_id, []).append((m.first, m.first + lead))

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def build_connector_worker_meta(self) -> KVStoreWorkerMetadata | None:
        if not self.stored:
            return None
        out, self.stored = KVStoreWorkerMetadata(self.stored), {}
        return out
