"""The worker half of the vLLM connector (``engine_adapter.vllm``).

A store block is the bytes of one vLLM block across all layers, moved as
opaque bytes (layer-major: layer 0's block bytes, then layer 1's, ...).
Under tensor parallelism (TP = k) it is the k ranks' shards back to back in
**one** slot under **one** key: shard r = rank r's KV heads, all layers
(``[r * shard_bytes, (r + 1) * shard_bytes)`` of the slot), then a seal
with each shard's own XXH3-64 (``kvstore.client.shards``). So a block is
present only when all its shards are, and eviction drops them together: the
daemon knows only whole blocks.

- **Load** (every rank on its own; no collective): ``Client.get_into`` per
  request (DRAM blocks read without a lease through the daemon's shared
  index, else under an ``Acquire``/``Release`` lease) -> each whole block
  copied out of the daemon's shared-memory slab straight to this rank's
  places in the layer tensors, hashed there (xxh3_64) 1 KiB at a time
  (``kvstore.client.sinks.ScatterSink``). At TP > 1 a rank reads only its
  shard and the seal, and checks the shard against its entry in the seal
  (``ShardSink``): another rank's shard is that rank's to check. Layouts
  ``scatter_layout`` cannot place (device tensors) stage the checked blocks
  (at TP > 1 only this rank's shards) in a pooled buffer first, then copy
  them in with one ``copy_`` per run of consecutive blocks per layer. A
  block that fails (checksum, wrong size, gone since the lookup, daemon
  error) is reported through ``get_block_ids_with_load_errors`` with every
  later block of the same request, whatever its pages now hold. vLLM
  merges the ranks' reports (the union, ``KVOutputAggregator``) and
  recomputes each affected request from its first reported block on every
  rank: so no rank keeps a block another rank missed.
- **Save**: ``engine_adapter.vllm_saves.SaveSide``, which this class
  extends (its ``Reserve`` s go out at the end of ``start_load_kv``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_adapter.layout import scatter_blocks, scatter_layout
from engine_adapter.tp import LocalGroup, TorchDistGroup, TPGroup
from engine_adapter.vllm_common import (
    FAULT_TYPES,
    PEER_FETCHED_BYTES,
    TORCH_KV,
    BlockMove,
    ConnectorIdentity,
    DaemonLink,
    KVStoreConnectorMetadata,
    layout_descriptor,
    request_ns,
)
from engine_adapter.vllm_saves import SaveSide
from kvstore.buffers import keys_at
from kvstore.client import Client, PendingReservation
from kvstore.client.shards import seal_bytes
from kvstore.client.sinks import BlockSink, BufferSink, LayerScatter, ShardScatter, ShardSink
from kvstore.errors import KeyStatus
from kvstore.keys import KEY_LEN, KVDtype, Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerSide", "vllm_tp_group"]

log = logging.getLogger("kvstore.vllm")

WIRE_DECISIONS = ("unspecified", "local", "fetch", "recompute")
"""Names of the wire ``ChainDecision`` values an acquire answers."""
LOAD_PHASES = ("setup", "acquire", "copy", "release", "scatter")
"""Phases of a step's loads, timed into its ``load_step`` record: the
staging buffer and the daemon connection (made on first use), the Acquire
call, the verified copies out of the slab (straight into vLLM's KV tensors
when ``scatter_layout`` places them), sending the Release, and the copies
from staging into the KV tensors (0 when there is no staging)."""


FP8_KV = (KVDtype.FLOAT8_E4M3FN, KVDtype.FLOAT8_E5M2)
"""KV dtypes whose cache vLLM allocates as ``torch.uint8`` (the fp8 bytes)."""


def vllm_tp_group(tp_size: int) -> TPGroup:
    """This worker's tensor-parallel group: vLLM's TP group over its CPU
    (gloo) process group; :class:`LocalGroup` at TP = 1."""
    if tp_size == 1:
        return LocalGroup()
    from vllm.distributed.parallel_state import get_tp_group

    return TorchDistGroup(group=get_tp_group().cpu_group, device="cpu")


class WorkerSide(SaveSide):
    """Loads and saves of one worker-role connector (one TP rank)."""

    def __init__(self, ident: ConnectorIdentity, link: DaemonLink, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig | None) -> None:
        self.ident = ident
        self.link = link
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.group: TPGroup | None = None
        """The TP group (:func:`vllm_tp_group`, joined at the first use; a test may set it)."""
        self.layers: list[torch.Tensor] = []
        self.layer_bytes = 0
        self.shard_bytes = 0
        """This rank's part of a stored block (all layers)."""
        self.block_bytes = 0
        """A stored block: ``shard_bytes`` at TP = 1, else ``tp * shard_bytes`` and the seal."""
        self.staging = torch.empty(0, dtype=torch.uint8)
        self.scatter: LayerScatter | ShardScatter | None = None
        """Where a verified read puts this rank's shard of a block straight
        into the KV tensors (CPU layouts ``scatter_layout`` knows; a
        ``ShardScatter`` at TP > 1); None: loads stage the blocks (at TP > 1
        this rank's shards) and copy them in afterwards."""
        self.phases = dict.fromkeys(LOAD_PHASES, 0.0)
        """Seconds of the current step's loads in each of ``LOAD_PHASES``."""
        self.load_errors: set[int] = set()
        self.load_failed: set[str] = set()
        """Requests with a block that failed to load in this step: their saves of this step are not stored."""
        self.stored: dict[str, list[tuple[int, int]]] = {}
        self.sent: set[str] = set()
        self.ahead: tuple[list[BlockMove], Client, list[PendingReservation | None]] | None = None
        """This step's save reservations, sent before the forward: (its saves, client, one per save)."""
        self.reads_prepared = False
        """Whether ``after_forward`` made the shared-index reads of the namespace ready (tried once)."""

    def tp_group(self) -> TPGroup:
        if self.group is None:
            self.group = vllm_tp_group(self.tp)
            if self.group.size != self.tp:
                raise ValueError(f"kvstore connector: the TP group has {self.group.size} ranks, "
                                 f"tensor_parallel_size is {self.tp}")
        return self.group

    @property
    def read_bytes(self) -> int:
        """What a load reads from the slab per block: this rank's shard and
        the seal at TP > 1, else the whole block."""
        return self.block_bytes if self.tp == 1 else self.shard_bytes + seal_bytes(self.tp)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Record the layer tensors as block-major views ``[num_blocks, ...]``."""
        kcc = self.kv_cache_config
        num_blocks = int(kcc.num_blocks) if kcc is not None else None
        layers = []
        originals = list(kv_caches.values())
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
        # vLLM allocates an fp8 KV cache ("fp8", "fp8_e4m3", "fp8_e5m2") as uint8 tensors of the fp8 bytes
        fp8_bytes = dtype == torch.uint8 and self.ident.kv_dtype in FP8_KV
        if TORCH_KV.get(dtype) is not self.ident.kv_dtype and not fp8_bytes:
            raise ValueError(f"kvstore connector: KV tensors are {dtype} but the namespace says "
                             f"{self.ident.kv_dtype.value}")
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        want = 2 * mc.get_num_kv_heads(pc) * mc.get_head_size() * self.block_size  # KV heads of this rank
        if int(np.prod(shape)) != want or len(layers) != mc.get_num_layers(pc):
            raise ValueError(f"kvstore connector: {len(layers)} KV layers of block shape {shape} do not match "
                             f"the layout schema {layout_descriptor(self.vllm_config, kcc)}")
        self.layers = layers
        self.layer_bytes = int(np.prod(shape)) * dtype.itemsize
        self.shard_bytes = self.layer_bytes * len(layers)
        self.block_bytes = self.shard_bytes if self.tp == 1 else self.shard_bytes * self.tp + seal_bytes(self.tp)
        lay = scatter_layout(originals, layers, 0, self.layer_bytes, self.shard_bytes)
        self.scatter = lay if lay is None or self.tp == 1 else ShardScatter(lay, self.rank, self.tp)
        if self.link.prefault:  # connect now: the slab's resident pages get mapped before the first load
            self.link.client()
        log.info("kvstore connector: %d layers, block %s %s, %d bytes per stored block (%d per rank, TP=%d); "
                 "loads %s", len(layers), shape, dtype, self.block_bytes, self.shard_bytes, self.tp,
                 "straight into the KV tensors" if self.scatter is not None else "staged, then copied in")

    # ------------------------------------------------------------ loads
    def start_load_kv(self, meta: Any) -> None:
        try:
            self.load_all(meta)
        finally:  # the loads are done (or failed): this step's saves can reserve now
            self.reserve_ahead(meta)

    def fail_loads(self, moves: list[Any]) -> None:
        """Report ``moves`` (``BlockMove``) as not loaded: their blocks are
        load errors, which vLLM recomputes."""
        self.load_errors.update(b for m in moves for b in m.block_ids)
        self.load_failed.update(m.req_id for m in moves)

    def load_all(self, meta: Any) -> None:
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        loads = [m for m in meta.loads if m.keys]
        if len(loads) < len(meta.loads):  # dropped by the scheduler (no keys: its LoRA changed since planned)
            dropped = [m for m in meta.loads if not m.keys]
            self.fail_loads(dropped)
            self.link.stats["failed_blocks"] += sum(len(m.block_ids) for m in dropped)
            if not loads:
                return
        base = self.ident.ns
        if not self.layers or base is None:  # nothing registered (or no identity): nothing can be loaded
            self.fail_loads(loads)
            return
        t0 = time.perf_counter()
        at = time.monotonic()  # (the system-wide clock: bench/vllm.py lines up the ranks' steps with it)
        self.phases = dict.fromkeys(LOAD_PHASES, 0.0)
        rank = self.rank
        total = sum(len(m.block_ids) for m in loads)
        place = self.scatter  # blocks straight into the KV tensors, else staged and copied in below
        sealed = self.tp > 1  # a rank reads its shard and the seal (staged: shard-wide rows)
        raw, typed = (None, []) if place is not None else \
            self.stage(total, self.shard_bytes if sealed else self.block_bytes)
        rows = raw.numpy() if raw is not None else np.empty((0, 0), np.uint8)
        good_ids: list[int] = []
        good_rows: list[int] = []
        recs: list[dict[str, Any]] = []  # the stats lines, written once the step is timed
        row = 0
        c = self.link.client()
        self.phases["setup"] = time.perf_counter() - t0
        for m in loads:
            n = len(m.block_ids)
            if place is not None:  # (the keys stay packed: a sealed read checks them against its seals)
                sink: BlockSink = place.sink(m.block_ids, m.keys)
            elif sealed:
                sink = ShardSink(BufferSink([rows[row + i] for i in range(n)]), rank, self.tp, self.shard_bytes,
                                 m.keys)
            else:
                sink = BufferSink([rows[row + i] for i in range(n)])
            ok = self.load_one(c, base, m, sink) if c is not None else 0
            good_ids += m.block_ids[:ok]
            good_rows += range(row, row + ok)
            self.load_errors.update(m.block_ids[ok:])
            if ok < n:
                self.load_failed.add(m.req_id)
            self.link.stats["loaded_blocks"] += ok
            self.link.stats["failed_blocks"] += n - ok
            if self.link.stats_path:
                recs.append(dict(event="load", rank=rank, req=m.req_id, planned_blocks=n, loaded_blocks=ok,
                                 ms=round((time.perf_counter() - t0) * 1000, 3)))
            row += n
            if c is not None and self.link.current is None:
                c = None  # a fault closed it: the rest are failures too
        t1 = time.perf_counter()
        if good_ids and place is None:
            scatter_blocks(self.layers, typed, np.asarray(good_ids, dtype=np.int64),
                           np.asarray(good_rows, dtype=np.int64))
        t2 = time.perf_counter()
        self.phases["scatter"] = t2 - t1
        # one line per step's loads: where the time went, scatter included
        # (bench/vllm.py reports each phase, and the bytes moved against a
        # memcpy of the same bytes)
        if self.link.stats_path:
            recs.append(dict(event="load_step", rank=rank, reqs=len(loads), planned_blocks=total,
                             loaded_blocks=len(good_ids), bytes=len(good_ids) * self.shard_bytes,
                             copied_bytes=len(good_ids) * self.read_bytes, at=round(at, 6),
                             ms=round((t2 - t0) * 1000, 3),
                             **{f"{k}_ms": round(v * 1000, 3) for k, v in self.phases.items()}))
            self.link.record_all(recs)

    def load_one(self, c: Client, base: Namespace, m: BlockMove, sink: BlockSink) -> int:
        """Copy the leading verified blocks of ``m`` (its keys passed on
        packed, as the scheduler sent them) into ``sink`` (staging rows, or
        the KV tensors themselves); how many."""
        ns, keys = request_ns(base, m.adapter, m.salt), m.keys
        if c.slab is None or (c.reads_without_lease and not m.cluster):
            # another host: inline bytes (checked by the daemon, and against its checksums here);
            # same host with the daemon's shared index: get_into reads DRAM blocks without a lease
            # (verified against the index before and after the copy; otherwise it takes a lease
            # itself), and reports blocks failing their checksum as Acquire's path below does
            t0 = time.perf_counter()
            try:
                st = c.get_into(ns, keys, sink)
            except FAULT_TYPES as e:
                self.link.fault("load", e)
                return 0
            finally:
                self.phases["copy"] += time.perf_counter() - t0
            ok = next((i for i, x in enumerate(st) if x is not KeyStatus.OK), len(st))
            if ok < len(st) and st[ok] is KeyStatus.CORRUPT:
                log.warning("kvstore: a block of request %s failed its checksum; vLLM recomputes it", m.req_id)
            return ok
        t0 = time.perf_counter()
        try:
            lease = c.acquire(ns, keys, cluster=m.cluster, peer=m.peer)
        except FAULT_TYPES as e:
            self.link.fault("load", e)
            return 0
        t1 = time.perf_counter()
        self.phases["acquire"] += t1 - t0
        if m.cluster:
            self.note_fetch(m, lease.fetched_blocks, lease.decision, lease.hit_blocks, len(keys) // KEY_LEN)
        try:
            hit = lease.hit_blocks
            sizes_ok = [int(x) == self.block_bytes for x in lease.lengths[:hit]]
            hit = sizes_ok.index(False) if False in sizes_ok else hit
            good = sink.write(range(hit), [lease.views[i] for i in range(hit)],
                              lease.checksums[:hit]) if hit else np.zeros(0, bool)
        except FAULT_TYPES as e:
            self.link.fault("load", e)
            return 0
        finally:
            t2 = time.perf_counter()
            self.phases["copy"] += t2 - t1
            try:
                lease.release(wait=False)  # answered before this client's next call; nothing waits on it
            except FAULT_TYPES as e:
                self.link.fault("release", e)
            self.phases["release"] += time.perf_counter() - t2
        bad = np.flatnonzero(~good)
        ok = int(bad[0]) if bad.size else hit
        if bad.size and self.link.current is not None:
            log.warning("kvstore: %d block(s) of request %s failed their checksum; vLLM recomputes them",
                        bad.size, m.req_id)
            try:
                self.link.current.report_corrupt(ns, keys_at(keys, bad.tolist()))
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

    # ------------------------------------------------------------ saves
    def wait_for_save(self, meta: Any) -> None:
        try:
            super().wait_for_save(meta)
        finally:
            self.after_forward()

    def after_forward(self) -> None:
        """After a step's forward and saves: the counts of its reads told the
        daemon (the client holds them: a load never sends them, nor wakes the
        daemon while other TP ranks still load); and once, as soon as the
        namespace is known without waiting, its shared-index reads made ready
        (``Client.prepare_reads``), so the process's first load makes no round
        trip for the namespace's id and does not map the index."""
        c = self.link.current
        if c is None:
            return
        try:
            c.send_counts()
            if not self.reads_prepared and self.ident.future.done():
                self.reads_prepared = True
                if (ns := self.ident.ns) is not None:
                    c.prepare_reads(ns)
        except FAULT_TYPES as e:
            self.link.fault("prepare", e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out
