"""The save half of the vLLM connector's worker (``engine_adapter.vllm_worker``).

A stored block is one slot under one key holding the k TP ranks' shards
back to back (the worker module says more). Per step:

- **Reserve ahead**: ``start_load_kv``, once the step's loads are done,
  sends each save's ``Reserve`` over the same-host socket without waiting
  (``Client.reserve_later``; rank 0 at TP > 1; none for a request whose
  load failed at TP = 1), so the daemon reserves while vLLM computes the
  forward; ``wait_for_save`` reads the answers.
- **TP = 1**: each block is gathered from the KV tensors straight into its
  slot and hashed on the way (``LayerScatter.gather``: one pass), or, for
  layouts ``scatter_layout`` does not know, staged with one
  ``index_select`` per layer and copied in fused with its checksum; then
  ``Commit``, sent without waiting.
- **TP > 1** (collective over vLLM's TP group, every rank in the same
  order): rank 0 broadcasts the slot offsets as one int64 tensor
  (:class:`~engine_adapter.tp.Plan`); each rank gathers its shards into its
  byte range of each slot, hashed on the way, and writes its part of each
  block's seal (its shard's XXH3-64: ``kvstore.client.shards``); a MIN
  all-reduce of one code per request says whether every rank wrote all its
  shards (and loaded that request's blocks of this step: blocks computed on
  top of a failed load are never stored); rank 0 then commits (the daemon
  checksums the whole block, seal included) or aborts. A rank dying
  mid-save leaves only an uncommitted reservation, which the daemon
  reclaims with the dead session: never a visible half block.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from engine_adapter.tp import PLAN_OK, Plan, TPGroup, slab_identity
from engine_adapter.vllm_common import (
    FAULT_TYPES,
    BlockMove,
    ConnectorIdentity,
    DaemonLink,
    KVStoreConnectorMetadata,
    KVStoreWorkerMetadata,
    request_ns,
)
from kvstore.checksum import copy_many
from kvstore.client import Client, PendingReservation, Reservation
from kvstore.client.shards import write_seals
from kvstore.client.sinks import LayerScatter, ShardScatter
from kvstore.errors import KeyStatus
from kvstore.keys import KEY_LEN, Namespace

__all__ = ["SaveSide"]


class SaveSide:
    """Saves of one worker-role connector (one TP rank); ``WorkerSide``
    holds the state declared here and joins the TP group."""

    ident: ConnectorIdentity
    link: DaemonLink
    tp: int
    layers: list[torch.Tensor]
    layer_bytes: int
    shard_bytes: int
    block_bytes: int
    staging: torch.Tensor
    scatter: LayerScatter | ShardScatter | None
    load_failed: set[str]
    stored: dict[str, list[tuple[int, int]]]
    sent: set[str]
    ahead: tuple[list[BlockMove], Client, list[PendingReservation | None]] | None

    def tp_group(self) -> TPGroup:
        raise NotImplementedError  # (WorkerSide: vLLM's TP group)

    @property
    def rank(self) -> int:
        return self.tp_group().rank

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

    # ------------------------------------------------------------ saves
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
                pending.append(c.reserve_later(request_ns(base, m.adapter, m.salt), m.keys,
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
                    resv = c.reserve(request_ns(base, m.adapter, m.salt), m.keys, self.block_bytes,
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
        gathered = bool(n and isinstance(lay, LayerScatter) and not lay.staged)
        if gathered and isinstance(lay, LayerScatter):  # straight into the slots, hashed on the way: one pass
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
                    c.reserve(request_ns(base, m.adapter, m.salt), m.keys, self.block_bytes,
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
        keys = np.frombuffer(b"".join(m.keys for m in saves), np.uint8).reshape(-1, KEY_LEN)[sel].tobytes()
        lay = self.scatter
        if isinstance(lay, ShardScatter) and not lay.staged:  # this rank's pieces straight into each slot
            try:
                lay.gather([c.view(int(plan.offsets[i]), self.block_bytes) for i in sel.tolist()], all_ids[sel], keys)
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
            blocks = [c.view(int(plan.offsets[i]), self.block_bytes) for i in sel.tolist()]
            sums = copy_many([b[rank * self.shard_bytes:(rank + 1) * self.shard_bytes] for b in blocks],
                             [rows[j] for j in range(sel.shape[0])])
            write_seals(blocks, rank, self.tp, self.shard_bytes, keys, sums)
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
                st = c.put(request_ns(base, m.adapter, m.salt), m.keys,
                           [rows[i] for i in range(j, j + k)], parent=m.parent or None)
            except FAULT_TYPES as e:
                self.link.fault("save", e)
                return
            j += k
            self.link.stats["saved_blocks"] += sum(s is KeyStatus.OK for s in st)
            lead = next((i for i, s in enumerate(st) if s not in (KeyStatus.OK, KeyStatus.EXISTS)), len(st))
            self.stored.setdefault(m.req_id, []).append((m.first, m.first + lead))

    def build_connector_worker_meta(self) -> KVStoreWorkerMetadata | None:
        if not self.stored:
            return None
        out, self.stored = KVStoreWorkerMetadata(self.stored), {}
        return out
