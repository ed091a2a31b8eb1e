"""The engine-side connector: paged KV <-> store blocks.

:class:`KVConnector` is what runs inside an inference engine (one per TP
rank). Given the request's token ids, its page table and the engine's KV
tensors (layout declared with :class:`~engine_adapter.layout.PagedKVLayout`):

- :meth:`KVConnector.lookup`: how many leading tokens the store holds;
- :meth:`KVConnector.load`: copy the leading cached blocks into the
  request's pages and say exactly which blocks loaded;
- :meth:`KVConnector.save`: store newly computed full blocks.

Data path (same host): ``Acquire`` pins the blocks and returns slab offsets;
each block's bytes are copied from the shared-memory slab into a pooled
staging tensor (fused with the xxh3_64 check), then the verified blocks go
into the pages with one ``index_copy_`` per layer tensor. Pages are written
only after every rank holds every verified block, so a failure part-way
leaves no half-written page reported as loaded. A save gathers the pages
with one ``index_select`` per layer tensor and copies each block into its
reserved slot, then commits. On CUDA the staging buffer is pinned and the
host<->device copies run on a side stream. Without a slab (the daemon is on
another host) TP=1 falls back to inline gRPC bytes.

Faults: a daemon that is down, slow or refuses a call never raises out of
the connector. The call degrades to a miss (load/lookup) or a skipped save,
logs a warning, and counts in ``stats.faults`` and the Prometheus counter
``kvstore_engine_store_faults_total{op}``; the engine computes normally.
Bad input (layout mismatch, page table too short, block size != page size,
namespace TP size != group size) raises InvalidArgument before any data moves.

Tensor parallelism: see :mod:`engine_adapter.tp` (mirrored shards, one plan
broadcast as an int32 tensor, MIN all-reduce agreement). The result types
live in :mod:`engine_adapter.results` (re-exported here).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc
import numpy as np
import torch
from prometheus_client import Counter

from engine_adapter.layout import KVTensors, PagedKVLayout, StagingPool
from engine_adapter.results import ConnectorStats, LoadResult, LookupInfo, SaveResult
from engine_adapter.tp import PLAN_FAULT, PLAN_OK, LocalGroup, Plan, TPGroup, slab_identity
from kvstore.checksum import checksum, copy_checksum, copy_verify
from kvstore.client import Client, Lease, Reservation
from kvstore.errors import InvalidArgument, KeyStatus, KVStoreError
from kvstore.keys import Namespace, TokenInput, as_token_array, block_keys

__all__ = ["ConnectorStats", "KVConnector", "LoadResult", "LookupInfo", "SaveResult"]

log = logging.getLogger("kvstore.engine")

FAULTS = Counter("kvstore_engine_store_faults_total",
                 "Store calls from the engine adapter that failed (daemon down, timeout, refused) "
                 "and were served as a miss", ["op"])
BLOCKS = Counter("kvstore_engine_blocks_total", "Blocks the engine adapter moved", ["op"])

_FAULTS: tuple[type[BaseException], ...] = (KVStoreError, grpc.RpcError, OSError, ValueError)

# per-block codes agreed with a MIN all-reduce (worst wins)
_C_OK, _C_MISS, _C_CORRUPT, _C_INVALID = 1, 0, -1, -2
_ABORTED = "a rank could not write its shards; the reservation was aborted"
_CODE_STATUS = {_C_OK: KeyStatus.OK, _C_MISS: KeyStatus.MISS, _C_CORRUPT: KeyStatus.CORRUPT,
                _C_INVALID: KeyStatus.INVALID}


def _leading(codes: np.ndarray) -> int:
    bad = np.flatnonzero(codes != _C_OK)
    return int(bad[0]) if bad.size else int(codes.shape[0])


class KVConnector:
    """Paged KV <-> kvstore blocks for one engine rank. See the module docstring.

    ``ns``: the namespace (``block_size == layout.page_size``, ``tp_size ==
    group.size``, ``kv_dtype`` and ``layout`` matching the declaration).
    ``target``: the daemon address (default ``$KVSTORE_ADDRESS`` or
    127.0.0.1:50051); or pass a connected ``client`` (not closed by us).
    ``group``: the TP group (default TP=1). ``timeout``: seconds per daemon
    call. ``retry_interval``: after a fault, seconds before reconnecting.
    """

    def __init__(self, ns: Namespace, layout: PagedKVLayout, *, target: str | None = None,
                 client: Client | None = None, group: TPGroup | None = None, timeout: float = 5.0,
                 retry_interval: float = 1.0, use_shm: bool = True, name: str = "kvstore-engine") -> None:
        if not isinstance(layout, PagedKVLayout):
            raise InvalidArgument(f"layout must be a PagedKVLayout, got {type(layout).__name__}")
        self.group: TPGroup = group if group is not None else LocalGroup()
        if ns.block_size != layout.page_size:
            raise InvalidArgument(
                f"namespace block_size is {ns.block_size} tokens but the engine's page_size is "
                f"{layout.page_size}: a store block is exactly one page")
        if ns.kv_dtype is not layout.kv_dtype:
            raise InvalidArgument(f"namespace kv_dtype is {ns.kv_dtype.value} but the KV tensors are "
                                  f"{layout.kv_dtype.value}")
        if ns.layout is not layout.kind:
            raise InvalidArgument(f"namespace layout is {ns.layout.value} but the engine declares "
                                  f"{layout.kind.value}")
        if ns.tp_size != self.group.size:
            raise InvalidArgument(f"namespace tp_size is {ns.tp_size} but the TP group has "
                                  f"{self.group.size} ranks")
        self.ns = ns
        self.layout = layout
        self.rank = self.group.rank
        self.tp = self.group.size
        self.shard_bytes = layout.shard_bytes
        self.block_bytes = self.tp * self.shard_bytes
        self.target = target
        self.timeout = float(timeout)
        self.retry_interval = float(retry_interval)
        self.use_shm = use_shm
        self.name = f"{name}-r{self.rank}"
        self.stats = ConnectorStats()
        self._client = client
        self._own_client = client is None
        self._retry_at = 0.0
        self._pool: StagingPool | None = None
        self._stream: Any = None
        self._dev_staging: torch.Tensor | None = None
        self._csums: list[int] = []

    # ------------------------------------------------------------ plumbing
    def close(self) -> None:
        if self._own_client and self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
        self._client = None

    def __enter__(self) -> "KVConnector":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fault(self, op: str, e: BaseException | str) -> str:
        msg = f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else e
        self.stats.faults += 1
        self.stats.last_fault = f"{op}: {msg}"
        FAULTS.labels(op).inc()
        log.warning("kvstore %s failed on rank %d (%s); serving it as a miss", op, self.rank, msg)
        if self._own_client and isinstance(e, BaseException):
            self.close()
            self._retry_at = time.monotonic() + self.retry_interval
        return msg

    def client(self) -> Client | None:
        """The daemon client, connecting if needed; None while it is unreachable."""
        if self._client is None:
            if not self._own_client or time.monotonic() < self._retry_at:
                return None
            try:
                self._client = Client(self.target, timeout=self.timeout, use_shm=self.use_shm, name=self.name)
            except _FAULTS as e:
                self._fault("connect", e)
                return None
        return self._client

    def _staging(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pool is None:
            self._pool = StagingPool(self.layout, pin_memory=device.type == "cuda")
        return self._pool.get(n)

    def keys(self, tokens: TokenInput) -> list[bytes]:
        """The block keys of ``tokens`` (one call for the whole prompt)."""
        return block_keys(self.ns, tokens)

    def _page_ids(self, page_table: Any, n_tokens: int, n_blocks: int, device: torch.device) -> torch.Tensor:
        """Validated page ids of the first ``n_blocks`` blocks, int64 on ``device``."""
        pt = page_table if isinstance(page_table, torch.Tensor) else torch.as_tensor(np.asarray(page_table))
        if pt.dim() != 1 or pt.dtype.is_floating_point or pt.dtype.is_complex or pt.dtype == torch.bool:
            raise InvalidArgument(f"page_table must be a 1-D integer tensor, got {pt.dtype} "
                                  f"of shape {tuple(pt.shape)}")
        size = self.layout.page_size
        need = -(-n_tokens // size)
        if pt.numel() < need:
            raise InvalidArgument(f"page table has {pt.numel()} pages but {n_tokens} tokens need {need} "
                                  f"pages of {size} tokens")
        ids = pt[:n_blocks].to(torch.int64)
        if n_blocks:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.layout.num_pages:
                raise InvalidArgument(f"page table ids must be in [0, {self.layout.num_pages}), "
                                      f"got [{lo}, {hi}]")
            if torch.unique(ids).numel() != n_blocks:
                raise InvalidArgument("page table maps two blocks to the same page")
        return ids.to(device)

    def _prepare(self, tokens: TokenInput, page_table: Any, kv: KVTensors,
                 n_limit: int | None) -> tuple[tuple[torch.Tensor, ...], list[bytes], torch.Tensor]:
        """Validate everything before any data moves: the KV tensors against
        the layout, the tokens, the page table. Returns (page-major views,
        the keys of the first ``n`` full blocks, their page ids)."""
        views = self.layout.page_major(kv)
        toks = as_token_array(tokens)
        keys = self.keys(toks)
        if n_limit is not None and (isinstance(n_limit, bool) or not isinstance(n_limit, int)):
            raise InvalidArgument(f"block limit must be an int, got {n_limit!r}")
        n = len(keys) if n_limit is None else max(0, min(len(keys), n_limit))
        pages = self._page_ids(page_table, int(toks.shape[0]), n, views[0].device)
        return views, keys[:n], pages

    # -------------------------------------------------------------- lookup
    def lookup(self, tokens: TokenInput) -> LookupInfo:
        """Leading cached blocks of ``tokens`` (rank 0 asks; all ranks get the answer)."""
        keys = self.keys(tokens)
        self.stats.lookups += 1
        plan, fault = Plan.empty(0), None
        tiers: tuple[str, ...] = ()
        if self.rank == 0:
            c = self.client()
            if c is None:
                fault = self.stats.last_fault or "daemon unreachable"
            elif keys:
                try:
                    r = c.lookup(self.ns, keys)
                    plan = Plan(PLAN_OK, int(r.hit_blocks), 0, plan.offsets, plan.write)
                    tiers = tuple(t.label for t in r.tiers[: r.hit_blocks])
                except _FAULTS as e:
                    fault = self._fault("lookup", e)
        plan = plan.share(self.group, 0)
        return LookupInfo(plan.count, self.ns.block_size, tiers, fault)

    # ---------------------------------------------------------------- load
    def load(self, tokens: TokenInput, page_table: Any, kv: KVTensors, *,
             max_blocks: int | None = None) -> LoadResult:
        """Load the leading cached blocks of ``tokens`` (at most
        ``max_blocks``) into the pages ``page_table[i]`` of ``kv``.

        Collective under TP: every rank calls it with the same tokens.
        Returns which blocks loaded; never raises for daemon faults."""
        views, keys, pages = self._prepare(tokens, page_table, kv, max_blocks)
        n = len(keys)
        self.stats.loads += 1
        if n == 0:
            return LoadResult(0, 0, 0, self.ns.block_size, ())
        codes = np.full(n, _C_MISS, np.int32)
        lease: Lease | None = None
        fault: str | None = None
        plan = Plan.empty(n)
        typed, raw = self._staging(n, views[0].device)
        if self.rank == 0:
            plan, lease, fault = self._acquire(keys, raw, codes)
        plan = plan.share(self.group, n)
        hit = plan.count
        if plan.status == PLAN_FAULT and self.rank != 0:
            fault = "rank 0 could not use the daemon"
        if hit and not (self.rank == 0 and lease is None):
            # shared-memory path (the inline TP=1 path filled staging already)
            self._read_shards(plan, raw, codes, lease)
        if hit and self.tp > 1:
            agreed = self.group.all_reduce_min(torch.from_numpy(codes[:hit].copy()))
            codes[:hit] = agreed.numpy()
        if lease is not None and self._client is not None:  # (a fault closed it: the daemon reclaims)
            try:
                lease.release()
            except _FAULTS as e:
                self._fault("release", e)
        ok = _leading(codes[:hit]) if hit else 0
        if ok < hit and fault is None and np.all(codes[:hit] >= _C_MISS):
            fault = "a rank could not read its shards from the daemon's slab"
        if ok:
            self._scatter(views, pages[:ok], typed[:ok])
        if self.rank == 0 and hit > ok and np.any(codes[:hit] == _C_CORRUPT):
            self._drop_corrupt(keys, codes[:hit])
        statuses = self._load_statuses(codes, hit, ok)
        st = self.stats
        st.hit_blocks += hit
        st.loaded_blocks += ok
        st.failed_blocks += hit - ok
        BLOCKS.labels("load").inc(ok)
        return LoadResult(n, hit, ok, self.ns.block_size, statuses, fault)

    @staticmethod
    def _load_statuses(codes: np.ndarray, hit: int, ok: int) -> tuple[KeyStatus, ...]:
        out = [KeyStatus.OK] * ok
        if ok < hit:
            out.append(_CODE_STATUS.get(int(codes[ok]), KeyStatus.MISS))
            out += [KeyStatus.PARENT_MISSING] * (hit - ok - 1)
        out += [KeyStatus.MISS] * (codes.shape[0] - hit)
        return tuple(out)

    def _acquire(self, keys: list[bytes], raw: torch.Tensor,
                 codes: np.ndarray) -> tuple[Plan, Lease | None, str | None]:
        """Rank 0: pin the hit prefix (or, inline, fetch it). Never raises."""
        n = len(keys)
        c = self.client()
        if c is None:
            return Plan.empty(n), None, self.stats.last_fault or "daemon unreachable"
        if c.slab is None:
            if self.tp > 1:
                return Plan.empty(n), None, self._fault(
                    "load", "TP > 1 needs the daemon's shared-memory slab (same host)")
            try:
                rows = raw.numpy()
                st = c.get_into(self.ns, keys, [rows[i] for i in range(n)])
            except _FAULTS as e:
                return Plan.empty(n), None, self._fault("load", e)
            arr = np.asarray([int(s) for s in st])
            hit = _leading(np.where(arr == int(KeyStatus.OK), _C_OK, _C_MISS))
            codes[:hit] = _C_OK
            if hit < n and st[hit] is KeyStatus.CORRUPT:
                codes[hit] = _C_CORRUPT
                hit += 1
            return Plan(PLAN_OK, hit, 0, np.zeros(n, np.int64), np.zeros(n, np.int64)), None, None
        try:
            lease = c.acquire(self.ns, keys)
        except _FAULTS as e:
            return Plan.empty(n), None, self._fault("load", e)
        hit = lease.hit_blocks
        offsets = np.zeros(n, np.int64)
        offsets[:hit] = lease.offsets[:hit]
        # for loads ``write`` flags the blocks of the expected size: a block of
        # another size under this namespace is unusable (INVALID), and so is
        # everything after it
        valid = np.zeros(n, np.int64)
        valid[:hit] = np.asarray(lease.lengths[:hit], np.int64) == self.block_bytes
        return Plan(PLAN_OK, hit, slab_identity(c), offsets, valid), lease, None

    def _mapped_client(self, slab: int) -> Client | None:
        """This rank's client, if it maps the slab the plan names (reconnecting once if not)."""
        c = self.client()
        if c is not None and slab_identity(c) != slab and self._own_client:
            self.close()  # the daemon restarted (a new slab) since we mapped it
            self._retry_at = 0.0
            c = self.client()
        if c is None or slab_identity(c) != slab:
            return None
        return c

    def _read_shards(self, plan: Plan, raw: torch.Tensor, codes: np.ndarray, lease: Lease | None) -> None:
        """Copy this rank's shard of each hit block into staging; set codes."""
        hit = plan.count
        c = self._mapped_client(plan.slab)
        if c is None:
            codes[:hit] = np.minimum(codes[:hit], _C_MISS)
            return
        sb, r = self.shard_bytes, self.rank
        rows = raw.numpy()
        try:
            for i in range(hit):
                if not plan.write[i]:
                    codes[i:hit] = _C_INVALID
                    break
                off = int(plan.offsets[i])
                if self.tp == 1:
                    good = copy_verify(rows[i], c.view(off, sb), lease.checksums[i]) if lease else False
                else:
                    good = True
                    if lease is not None:  # rank 0 verifies the whole block (all shards)
                        good = checksum(c.view(off, self.block_bytes)) == lease.checksums[i]
                    np.copyto(rows[i], c.view(off + r * sb, sb))
                codes[i] = _C_OK if good else _C_CORRUPT
        except _FAULTS as e:
            self._fault("load", e)
            codes[:hit] = np.minimum(codes[:hit], _C_MISS)

    def _drop_corrupt(self, keys: list[bytes], codes: np.ndarray) -> None:
        """Remove blocks that failed their checksum, so a later save rewrites them."""
        bad = [keys[i] for i in np.flatnonzero(codes == _C_CORRUPT).tolist()]
        c = self.client()
        if c is None or not bad:
            return
        try:
            c.remove(self.ns, bad)
        except _FAULTS as e:
            self._fault("remove", e)
        log.warning("kvstore: %d block(s) failed their checksum and were dropped", len(bad))

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _scatter(self, views: tuple[torch.Tensor, ...], pages: torch.Tensor, src: torch.Tensor) -> None:
        device = views[0].device
        if device.type != "cuda":
            self.layout.scatter(views, pages, src)
            return
        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.layout.scatter(views, pages, src.to(device, non_blocking=True))
        torch.cuda.current_stream(device).wait_stream(stream)
        stream.synchronize()  # staging is reused by the next call

    def _gather(self, views: tuple[torch.Tensor, ...], pages: torch.Tensor, out: torch.Tensor) -> None:
        device = views[0].device
        if device.type != "cuda":
            self.layout.gather(views, pages, out)
            return
        n = out.shape[0]
        if self._dev_staging is None or self._dev_staging.shape[0] < n:
            self._dev_staging = torch.empty((max(n, 1), *self.layout.shard_shape), dtype=self.layout.dtype,
                                            device=device)
        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            dev = self._dev_staging[:n]
            self.layout.gather(views, pages, dev)
            out.copy_(dev, non_blocking=True)
        stream.synchronize()

    # ---------------------------------------------------------------- save
    def save(self, tokens: TokenInput, page_table: Any, kv: KVTensors, *, start_block: int = 0,
             end_block: int | None = None) -> SaveResult:
        """Store the full blocks ``[start_block, end_block)`` of ``tokens``
        from the pages ``page_table[i]`` (default: every full block). Blocks
        the store already has are skipped (EXISTS). With ``start_block > 0``
        block ``start_block - 1`` must be stored already (it is the parent).

        Collective under TP: every rank calls it with the same tokens. Never
        raises for daemon faults."""
        if isinstance(start_block, bool) or not isinstance(start_block, int) or start_block < 0:
            raise InvalidArgument(f"start_block must be an int >= 0, got {start_block!r}")
        views, keys, pages = self._prepare(tokens, page_table, kv, end_block)
        start = min(start_block, len(keys))
        parent = keys[start - 1] if start else None
        keys, pages = keys[start:], pages[start:]
        m = len(keys)
        self.stats.saves += 1
        if m == 0:
            return SaveResult(start, ())
        statuses = np.full(m, int(KeyStatus.MISS), np.int32)
        resv: Reservation | None = None
        fault: str | None = None
        plan = Plan.empty(m)
        if self.rank == 0:
            c = self.client()
            if c is None:
                fault = self.stats.last_fault or "daemon unreachable"
            elif c.slab is None:
                if self.tp == 1:
                    return self._save_inline(c, keys, pages, views, parent, start)
                fault = self._fault("save", "TP > 1 needs the daemon's shared-memory slab (same host)")
            else:
                try:
                    resv = c.reserve(self.ns, keys, self.block_bytes, parent=parent)
                    statuses[:] = [int(s) for s in resv.statuses]
                    write = (statuses == int(KeyStatus.OK)).astype(np.int64)
                    offsets = np.zeros(m, np.int64)
                    offsets[write == 1] = np.asarray(resv.offsets, np.int64)[write == 1]
                    plan = Plan(PLAN_OK, int(write.sum()), slab_identity(c), offsets, write)
                except _FAULTS as e:
                    fault = self._fault("save", e)
        plan = plan.share(self.group, m)
        if plan.count:
            code = self._write_shards(plan, pages, views)
            if self.tp > 1:
                code = int(self.group.all_reduce_min(torch.tensor([code], dtype=torch.int32))[0])
            if self.rank == 0:
                fault = self._finish_save(resv, code, statuses) or fault
            elif code != 1:
                fault = _ABORTED
        if self.tp > 1:
            statuses = self.group.broadcast(torch.from_numpy(statuses)).numpy()
            if plan.status == PLAN_FAULT and self.rank != 0:
                fault = "rank 0 could not use the daemon"
        return self._save_result(start, statuses, fault)

    def _save_result(self, start: int, statuses: np.ndarray, fault: str | None) -> SaveResult:
        res = SaveResult(start, tuple(KeyStatus(int(s)) for s in statuses), fault)
        self.stats.saved_blocks += res.stored_blocks
        self.stats.existing_blocks += res.existing_blocks
        BLOCKS.labels("save").inc(res.stored_blocks)
        return res

    def _write_shards(self, plan: Plan, pages: torch.Tensor, views: tuple[torch.Tensor, ...]) -> int:
        """Gather the blocks to write and copy this rank's shards into their
        slots. Returns 1 on success, 0 on failure; rank 0 keeps checksums."""
        sel = np.flatnonzero(plan.write == 1)
        self._csums = []
        c = self._mapped_client(plan.slab)
        if c is None:
            return 0
        typed, raw = self._staging(sel.shape[0], views[0].device)
        self._gather(views, pages[torch.from_numpy(sel).to(pages.device)], typed)
        sb, r = self.shard_bytes, self.rank
        rows = raw.numpy()
        try:
            for j, i in enumerate(sel.tolist()):
                dst = c.view(int(plan.offsets[i]) + r * sb, sb)
                if self.tp == 1:
                    self._csums.append(copy_checksum(dst, rows[j]))
                else:
                    np.copyto(dst, rows[j])
        except _FAULTS as e:
            self._fault("save", e)
            return 0
        return 1

    def _finish_save(self, resv: Reservation | None, code: int, statuses: np.ndarray) -> str | None:
        """Rank 0: commit when every rank wrote its shards, else abort."""
        c = self._client
        if resv is None or c is None:
            statuses[statuses == int(KeyStatus.OK)] = int(KeyStatus.MISS)
            return "the daemon connection was lost before commit"
        try:
            if code == 1:
                done = c.commit(resv, self._csums if self.tp == 1 else None)
                statuses[:] = [int(s) for s in done]
                return None
            c.abort(resv)
        except _FAULTS as e:
            statuses[statuses == int(KeyStatus.OK)] = int(KeyStatus.MISS)
            return self._fault("save", e)
        statuses[statuses == int(KeyStatus.OK)] = int(KeyStatus.MISS)
        return _ABORTED

    def _save_inline(self, c: Client, keys: list[bytes], pages: torch.Tensor, views: tuple[torch.Tensor, ...],
                     parent: bytes | None, start: int) -> SaveResult:
        """TP=1 without a shared slab: inline Put of every block."""
        m = len(keys)
        typed, raw = self._staging(m, views[0].device)
        self._gather(views, pages, typed)
        rows = raw.numpy()
        try:
            st = c.put(self.ns, keys, [rows[i] for i in range(m)], parent=parent)
        except _FAULTS as e:
            return self._save_result(start, np.full(m, int(KeyStatus.MISS), np.int32), self._fault("save", e))
        return self._save_result(start, np.asarray([int(s) for s in st], np.int32), None)
