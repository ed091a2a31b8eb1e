"""The worker half of the vLLM connector (``engine_adapter.vllm``).

A store block is the bytes of one vLLM block across all layers, moved as
opaque bytes (layer-major: layer 0's block bytes, then layer 1's, ...).
Under tensor parallelism (TP = k) it is the k ranks' shards back to back in
**one** slot under **one** key: shard r = rank r's KV heads, all layers
(``[r * shard_bytes, (r + 1) * shard_bytes)`` of the slot). So a block is
present only when all its shards are, and eviction drops them together: the
daemon knows only whole blocks.

- **Load** (every rank on its own; no collective): ``Client.get_into`` per
  request (DRAM blocks read without a lease through the daemon's shared
  index, else under an ``Acquire``/``Release`` lease) -> each whole block
  copied out of the daemon's shared-memory slab fused with its xxh3_64
  check, and this rank's shard placed straight into the layer tensors
  (``kvstore.client.sinks.ScatterSink``: a block that fails reaches no
  page). Layouts ``scatter_layout`` cannot place (device tensors) stage
  the checked blocks in a pooled buffer first, then copy them in with one
  ``copy_`` per run of consecutive blocks per layer. A block that fails (checksum, wrong size, gone since
  the lookup, daemon error) is reported through
  ``get_block_ids_with_load_errors`` with every later block of the same
  request. vLLM merges the ranks' reports (the union, ``KVOutputAggregator``)
  and recomputes each affected request from its first reported block on
  every rank: so no rank keeps a block another rank missed.
- **Save** (collective over vLLM's TP group, every rank in the same order):
  rank 0 ``Reserve`` s per request and broadcasts the slot offsets as one
  int64 tensor (:class:`~engine_adapter.tp.Plan`); each rank gathers its
  shards with one ``index_select`` per layer and copies them into its byte
  range of each slot; a MIN all-reduce of one code per request says whether
  every rank wrote all its shards (and loaded that request's blocks of this
  step: blocks computed on top of a failed load are never stored); rank 0
  then commits (the daemon checksums the whole block at TP > 1) or aborts.
  A rank dying mid-save leaves only an uncommitted reservation, which the
  daemon reclaims with the dead session: never a visible half block.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from engine_adapter.layout import scatter_blocks, scatter_layout
from engine_adapter.tp import PLAN_OK, LocalGroup, Plan, TorchDistGroup, TPGroup
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
from kvstore.checksum import copy_many
from kvstore.client import Client, PendingReservation, Reservation
from kvstore.client.sinks import BlockSink, BufferSink, LayerScatter
from kvstore.errors import KeyStatus
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerSide", "slab_identity", "vllm_tp_group"]

log = logging.getLogger("kvstore.vllm")

WIRE_DECISIONS = ("unspecified", "local", "fetch", "recompute")
"""Names of the wire ``ChainDecision`` values an acquire answers."""
LOAD_PHASES = ("setup", "acquire", "copy", "release", "scatter")
"""Phases of a step's loads, timed into its ``load_step`` record: the
staging buffer and the daemon connection (made on first use), the Acquire
call, the verified copies out of the slab (straight into vLLM's KV tensors
when ``scatter_layout`` places them), sending the Release, and the copies
from staging into the KV tensors (0 when there is no staging)."""


def slab_identity(client: Client | None) -> int:
    """A nonzero int64 naming the slab ``client`` maps (0: none), so a rank
    never writes at offsets reserved in another slab (a restarted daemon)."""
    slab = getattr(client, "slab", None)
    if slab is None:
        return 0
    h = xxhash.xxh3_64_intdigest(f"{slab.path}|{slab.slab_id}".encode())
    h = h - (1 << 64) if h >= 1 << 63 else h
    return h or 1


def vllm_tp_group(tp_size: int) -> TPGroup:
    """This worker's tensor-parallel group: vLLM's TP group over its CPU
    (gloo) process group; :class:`LocalGroup` at TP = 1."""
    if tp_size == 1:
        return LocalGroup()
    from vllm.distributed.parallel_state import get_tp_group

    return TorchDistGroup(group=get_tp_group().cpu_group, device="cpu")


class WorkerSide:
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
        """A stored block: ``tp * shard_bytes``."""
        self.staging = torch.empty(0, dtype=torch.uint8)
        self.scatter: LayerScatter | None = None
        """Where a verified read puts this rank's shard of a block straight
        into the KV tensors (CPU layouts ``scatter_layout`` knows); None:
        loads stage whole blocks and copy them in afterwards."""
        self.phases = dict.fromkeys(LOAD_PHASES, 0.0)
        """Seconds of the current step's loads in each of ``LOAD_PHASES``."""
        self.load_errors: set[int] = set()
        self.load_failed: set[str] = set()
        """Requests with a block that failed to load in this step: their saves of this step are not stored."""
        self.stored: dict[str, list[tuple[int, int]]] = {}
        self.sent: set[str] = set()
        self.ahead: tuple[list[BlockMove], Client, list[PendingReservation | None]] | None = None
        """This step's save reservations, sent before the forward: (its saves, client, one per save)."""

    @property
    def rank(self) -> int:
        return self.tp_group().rank

    def tp_group(self) -> TPGroup:
        if self.group is None:
            self.group = vllm_tp_group(self.tp)
            if self.group.size != self.tp:
                raise ValueError(f"kvstore connector: the TP group has {self.group.size} ranks, "
                                 f"tensor_parallel_size is {self.tp}")
        return self.group

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
        if TORCH_KV.get(dtype) is not self.ident.kv_dtype:
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
        self.block_bytes = self.shard_bytes * self.tp
        self.scatter = scatter_layout(originals, layers, self.rank * self.shard_bytes, self.layer_bytes,
                                      self.block_bytes)
        if self.link.prefault:  # connect now: the slab's resident pages get mapped before the first load
            self.link.client()
        log.info("kvstore connector: %d layers, block %s %s, %d bytes per stored block (%d per rank, TP=%d); "
                 "loads %s", len(layers), shape, dtype, self.block_bytes, self.shard_bytes, self.tp,
                 "straight into the KV tensors" if self.scatter is not None else "staged, then copied in")

    def stage(self, n: int, width: int, at: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A pooled ``[n, width]`` uint8 buffer and per-layer typed views of
        its bytes ``[at, at + shard_bytes)`` of each row (this rank's shard)."""
        need = n * width
        if self.staging.numel() < need:
            self.staging = torch.empty(max(need, 2 * self.staging.numel()), dtype=torch.uint8)
        raw = self.staging[:need].view(n, width)
        per = raw[:, at:at + self.shard_bytes].view(n, len(self.layers), self.layer_bytes)
        typed = [per[:, i].view(t.dtype).view(n, *t.shape[1:]) for i, t in enumerate(self.layers)]
        return raw, typed

    # ------------------------------------------------------------ loads
    def start_load_kv(self, meta: Any) -> None:
        try:
            self.load_all(meta)
        finally:  # the loads are done (or failed): this step's saves can reserve now
            self.reserve_ahead(meta)

    def reserve_ahead(self, meta: Any) -> None:
        """Send this step's save reservations without waiting (rank 0 at
        TP > 1), so the daemon reserves while vLLM computes the forward;
        ``wait_for_save`` reads the answers (``Client.reserve_later``). At
        TP = 1 a request whose load failed in this step reserves nothing: it
        is not stored in this step (at TP > 1 the ranks' codes decide)."""
        self.drop_ahead()
        if (self.rank != 0 or not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves or not self.layers
                or self.ident.ns is None):
            return
        c = self.link.client()
        if c is None or c.slab is None:
            return
        base = self.ident.ns
        pending: list[PendingReservation | None] = []
        for m in meta.saves:
            if self.tp == 1 and m.req_id in self.load_failed:
                pending.append(None)
                continue
            try:
                pending.append(c.reserve_later(request_ns(base, m.adapter, m.salt), split_keys(m.keys),
                                               self.block_bytes, parent=m.parent or None))
            except FAULT_TYPES as e:
                self.link.fault("save", e)  # closes the client: the daemon reclaims what it reserved
                return
        self.ahead = (meta.saves, c, pending)

    def take_ahead(self, saves: list[BlockMove], c: Client) -> list[PendingReservation | None] | None:
        """The reservations ``reserve_ahead`` sent for these saves, one per
        save (None: its load failed), or None (reserve now)."""
        if self.ahead is not None and self.ahead[0] is saves and self.ahead[1] is c:
            pending, self.ahead = self.ahead[2], None
            return pending
        self.drop_ahead()
        return None

    def drop_ahead(self) -> None:
        """Abort reservations sent ahead for a step whose saves never ran."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return
        _, c, pending = ahead
        for p in pending:
            try:
                if p is not None and p.result().reservation_id:
                    c.abort(p.result())
            except FAULT_TYPES as e:
                self.link.fault("save", e)
                return

    def load_all(self, meta: Any) -> None:
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        base = self.ident.ns
        if not self.layers or base is None:  # nothing registered (or no identity): nothing can be loaded
            self.load_errors.update(b for m in meta.loads for b in m.block_ids)
            self.load_failed.update(m.req_id for m in meta.loads)
            return
        t0 = time.perf_counter()
        self.phases = dict.fromkeys(LOAD_PHASES, 0.0)
        rank = self.rank
        total = sum(len(m.block_ids) for m in meta.loads)
        place = self.scatter  # blocks straight into the KV tensors, else staged and copied in below
        raw, typed = self.stage(total, self.block_bytes, rank * self.shard_bytes) if place is None else (None, [])
        rows = raw.numpy() if raw is not None else np.empty((0, 0), np.uint8)
        good_ids: list[int] = []
        good_rows: list[int] = []
        recs: list[dict[str, Any]] = []  # the stats lines, written once the step is timed
        row = 0
        c = self.link.client()
        self.phases["setup"] = time.perf_counter() - t0
        for m in meta.loads:
            n = len(m.block_ids)
            sink: BlockSink = place.sink(m.block_ids) if place is not None else \
                BufferSink([rows[row + i] for i in range(n)])
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
            recs.append(dict(event="load_step", rank=rank, reqs=len(meta.loads), planned_blocks=total,
                             loaded_blocks=len(good_ids), bytes=len(good_ids) * self.shard_bytes,
                             copied_bytes=len(good_ids) * self.block_bytes, ms=round((t2 - t0) * 1000, 3),
                             **{f"{k}_ms": round(v * 1000, 3) for k, v in self.phases.items()}))
            self.link.record_all(recs)

    def load_one(self, c: Client, base: Namespace, m: BlockMove, sink: BlockSink) -> int:
        """Copy the leading verified whole blocks of ``m`` into ``sink``
        (staging rows, or the KV tensors themselves); how many."""
        ns = request_ns(base, m.adapter, m.salt)
        keys = split_keys(m.keys)
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
            lease = c.acquire(ns, keys, cluster=m.cluster)
        except FAULT_TYPES as e:
            self.link.fault("load", e)
            return 0
        t1 = time.perf_counter()
        self.phases["acquire"] += t1 - t0
        if m.cluster:
            self.note_fetch(m, lease.fetched_blocks, lease.decision, lease.hit_blocks, len(keys))
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

    # ------------------------------------------------------------ saves
    def wait_for_save(self, meta: Any) -> None:
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves:
            self.load_failed.clear()
            return
        try:
            base = self.ident.ns
            if self.tp > 1:
                self.save_tp(meta.saves, base)  # collective: every rank, whatever its own state
            elif self.layers and base is not None:
                self.save(meta, base)
        finally:  # saved or not (a failed save is only a miss later), vLLM may free these blocks now
            self.sent.update(m.req_id for m in meta.saves if m.final)
            self.load_failed.clear()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        out, self.sent = self.sent, set()
        return (out or None), None

    def save(self, meta: KVStoreConnectorMetadata, base: Namespace) -> None:
        """TP = 1: reserve, write whole blocks (checksums fused: gathered
        from the KV tensors straight into the slots where the layout allows,
        else staged first), commit. One ``save_step`` stats line per step
        says where the time went."""
        c = self.link.client()
        if c is None:
            return
        if c.slab is None:
            self.save_inline(c, base, [m for m in meta.saves if m.req_id not in self.load_failed])
            return
        t0 = time.perf_counter()
        pending = self.take_ahead(meta.saves, c)
        ahead = pending is not None
        plans = []  # (move, reservation, indexes of OK keys)
        for i, m in enumerate(meta.saves):
            try:
                if pending is not None:  # sent before the forward (reserve_ahead)
                    p = pending[i]
                    if p is None:  # its load failed: nothing reserved, nothing stored
                        continue
                    resv = p.result()
                else:
                    resv = c.reserve(request_ns(base, m.adapter, m.salt), split_keys(m.keys), self.block_bytes,
                                     parent=m.parent or None)
            except FAULT_TYPES as e:
                self.link.fault("save", e)
                return
            ok = [i for i, s in enumerate(resv.statuses) if s is KeyStatus.OK]
            self.link.stats["existing_blocks"] += sum(s is KeyStatus.EXISTS for s in resv.statuses)
            plans.append((m, resv, ok))
        n = sum(len(ok) for _, _, ok in plans)
        t1 = time.perf_counter()
        csums = np.zeros(0, np.uint64)
        lay = self.scatter
        gathered = bool(n and lay is not None and not lay.staged)
        if gathered and lay is not None:  # straight into the slots, hashed on the way: one pass, no staging
            try:
                dsts = [c.view(resv.offsets[i], resv.lengths[i]) for _, resv, ok in plans for i in ok]
                got = lay.gather(dsts, [m.block_ids[i] for m, _, ok in plans for i in ok])
            except FAULT_TYPES as e:
                self.link.fault("save", e)
                return  # the daemon reclaims the reservations of a lost session
            csums = got if got is not None else csums
        elif n:
            raw, typed = self.stage(n, self.block_bytes)
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
        t2 = time.perf_counter()
        for m, resv, ok in plans:
            k, j = j, j + len(ok)
            self.finish(c, m, resv, m.req_id not in self.load_failed, csums[k:j].tolist(), t0)
        if self.link.stats_path:
            t3 = time.perf_counter()
            self.link.record(event="save_step", rank=0, reqs=len(plans), blocks=n, bytes=n * self.block_bytes,
                             gathered=gathered, reserved_ahead=ahead, ms=round((t3 - t0) * 1000, 3),
                             reserve_ms=round((t1 - t0) * 1000, 3),
                             copy_ms=round((t2 - t1) * 1000, 3), commit_ms=round((t3 - t2) * 1000, 3))

    def finish(self, c: Client, m: BlockMove, resv: Reservation, good: bool, csums: list[int] | None,
               t0: float) -> None:
        """Commit ``m``'s reservation (``good``: every rank wrote every
        shard on top of good KV) or abort it; record what is stored."""
        if not resv.reservation_id:
            return  # every block existed already
        try:
            if not good:
                c.abort(resv)
                self.link.record(event="save", rank=0, req=m.req_id, planned_blocks=len(resv.statuses),
                                 stored_blocks=0, existing_blocks=0, aborted=True,
                                 ms=round((time.perf_counter() - t0) * 1000, 3))
                return
            done = c.commit(resv, csums, wait=False)  # runs before this worker's next call
        except FAULT_TYPES as e:
            self.link.fault("save", e)
            return
        stored = sum(s is KeyStatus.OK for s in done)
        self.link.stats["saved_blocks"] += stored
        lead = next((i for i, s in enumerate(done) if s not in (KeyStatus.OK, KeyStatus.EXISTS)), len(done))
        self.stored.setdefault(m.req_id, []).append((m.first, m.first + lead))
        self.link.record(event="save", rank=0, req=m.req_id, planned_blocks=len(done), stored_blocks=stored,
                         existing_blocks=sum(s is KeyStatus.EXISTS for s in done),
                         ms=round((time.perf_counter() - t0) * 1000, 3))

    def save_tp(self, saves: list[BlockMove], base: Namespace | None) -> None:
        """TP > 1, collective (every rank calls it for the same plan):
        rank 0 reserves and broadcasts the offsets, each rank writes its
        shards, a MIN all-reduce agrees per request, rank 0 commits or aborts."""
        group = self.tp_group()
        t0 = time.perf_counter()
        n = sum(len(m.block_ids) for m in saves)
        resvs: list[Reservation | None] = [None] * len(saves)
        plan = Plan.empty(n)
        c = self.link.client() if base is not None and self.layers else None
        ahead = group.rank == 0 and self.ahead is not None and self.ahead[0] is saves
        if group.rank == 0 and c is not None and base is not None:
            plan = self.reserve_all(c, base, saves, resvs)
        try:
            plan = plan.share(group, n)
            if plan.status != PLAN_OK or not plan.count:  # decided by rank 0 for every rank: nothing to write
                if group.rank == 0 and c is not None:
                    self.abort_all(c, resvs)
                return
            codes = np.zeros(len(saves), np.int32)
            if c is not None and slab_identity(c) == plan.slab:
                codes = self.write_shards(c, saves, plan, group.rank)
            elif c is not None:
                self.link.fault("save", "the daemon's slab changed since rank 0 reserved")
            codes = group.all_reduce_min(torch.from_numpy(codes)).numpy()
        except BaseException:
            if group.rank == 0 and c is not None:  # a rank died mid-save: nothing becomes visible
                self.abort_all(c, resvs)
            raise
        self.link.record(event="save_shards", rank=group.rank, blocks=int(plan.count), reserved_ahead=ahead,
                         ms=round((time.perf_counter() - t0) * 1000, 3))
        if group.rank == 0 and c is not None:
            for m, resv, code in zip(saves, resvs, codes.tolist()):
                if resv is not None:
                    self.finish(c, m, resv, code == 1, None, t0)  # the daemon checksums the whole block

    def reserve_all(self, c: Client, base: Namespace, saves: list[BlockMove],
                    resvs: list[Reservation | None]) -> Plan:
        """Rank 0: one ``Reserve`` per request; the plan every rank writes by."""
        n = sum(len(m.block_ids) for m in saves)
        if c.slab is None:
            self.link.fault("save", "TP > 1 stores through the daemon's shared-memory slab (same host) only")
            return Plan.empty(n)
        offsets, write = np.zeros(n, np.int64), np.zeros(n, np.int64)
        pending = self.take_ahead(saves, c)
        j = 0
        for i, m in enumerate(saves):
            try:
                p = pending[i] if pending is not None else None
                resv = p.result() if p is not None else \
                    c.reserve(request_ns(base, m.adapter, m.salt), split_keys(m.keys), self.block_bytes,
                              parent=m.parent or None)
            except FAULT_TYPES as e:
                self.link.fault("save", e)  # closes the client: the daemon reclaims earlier reservations
                return Plan.empty(n)
            resvs[i] = resv
            self.link.stats["existing_blocks"] += sum(s is KeyStatus.EXISTS for s in resv.statuses)
            for b, s in enumerate(resv.statuses):
                if s is KeyStatus.OK:
                    offsets[j + b], write[j + b] = resv.offsets[b], 1
            j += len(m.block_ids)
        return Plan(PLAN_OK, int(write.sum()), slab_identity(c), offsets, write)

    def write_shards(self, c: Client, saves: list[BlockMove], plan: Plan, rank: int) -> np.ndarray:
        """This rank's shards of the planned blocks into their slots; one code
        per request: 1 = all written on top of good KV, 0 = not."""
        codes = np.ones(len(saves), np.int32)
        for i, m in enumerate(saves):
            if m.req_id in self.load_failed:
                codes[i] = 0
        sel = np.flatnonzero(plan.write == 1)
        all_ids = np.asarray([b for m in saves for b in m.block_ids], np.int64)
        lay = self.scatter
        if lay is not None and not lay.staged:  # this rank's pieces straight into each slot
            try:
                lay.gather([c.view(int(plan.offsets[i]), self.block_bytes) for i in sel.tolist()],
                           all_ids[sel], checksums=False)
            except FAULT_TYPES as e:
                self.link.fault("save", e)
                codes[:] = 0
            return codes
        raw, typed = self.stage(sel.shape[0], self.shard_bytes)
        ids = torch.from_numpy(all_ids[sel])
        for t, dst in zip(self.layers, typed):
            torch.index_select(t, 0, ids.to(t.device), out=dst)
        rows = raw.numpy()
        try:
            dsts = [c.view(int(plan.offsets[i]) + rank * self.shard_bytes, self.shard_bytes) for i in sel.tolist()]
            copy_many(dsts, [rows[j] for j in range(sel.shape[0])])
        except FAULT_TYPES as e:
            self.link.fault("save", e)
            codes[:] = 0
        return codes

    def abort_all(self, c: Client, resvs: list[Reservation | None]) -> None:
        for resv in resvs:
            if resv is not None and resv.reservation_id:
                try:
                    c.abort(resv)
                except FAULT_TYPES as e:
                    self.link.fault("save", e)
                    return

    def save_inline(self, c: Client, base: Namespace, saves: list[BlockMove]) -> None:
        """TP = 1, daemon on another host: gather every block once, then one inline ``Put`` per request."""
        n = sum(len(m.block_ids) for m in saves)
        if not n:
            return
        raw, typed = self.stage(n, self.block_bytes)
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
