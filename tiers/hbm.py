"""HBM tier: one slab of device memory, allocated once at start, carved into
slots exactly like the DRAM slab (``tiers.slots.PagedSlots``).

The tier takes a torch device. On CUDA the slab is one ``torch.empty`` of
``capacity_bytes`` on that device; with ``device="cpu"`` (tests,
development) it is a host tensor and *the same code* runs: slot allocation,
copies through ``copy_fn`` on the tier's two streams, the fence table, and
checksums. Only three things are CUDA-only and are no-ops (or a clear error)
on CPU: streams and events (``None``), pinning the DRAM slab
(``register_host``), and exporting the slab through CUDA IPC
(``ipc_export``).

Copies and ordering
-------------------
- Host -> device (puts into HBM, promotions from DRAM) run on the *load*
  stream, device -> host (demotions to DRAM, inline reads) on the *store*
  stream. The load stream is created with the higher priority (CUDA: a lower
  number): a block an engine is about to use overtakes offloads queued ahead
  of it.
- Each batch records one event on its stream after its copies. Every slot a
  batch *reads* is fenced with that event in the :class:`FenceTable`: ``free``
  of a fenced slot is deferred, and the slot is handed out again only once
  the event has completed (``allocate`` reaps completed fences first). A
  batch's caller waits for its event before it publishes the destination
  (verifies checksums, updates the index), so a reader never sees a slot
  whose bytes are still in flight.
- Checksums (xxh3_64) are computed on the host side of every copy: of the
  source for host -> device (so a DRAM block that went bad is caught when it
  crosses), of the destination for device -> host. A copy that raises (a
  CUDA error) makes that block fail; the error is logged with the device
  and the stream, and the caller treats the block as a miss.

IPC (why torch's ``_share_cuda_``)
----------------------------------
The daemon exports the slab with ``UntypedStorage._share_cuda_()``, the call
``torch.multiprocessing`` itself uses: it returns the raw
``cudaIpcMemHandle_t`` bytes of the allocation that holds the storage *and*
the storage's byte offset inside it (the caching allocator may place a
tensor inside a larger ``cudaMalloc`` block, so a handle alone is not
enough). Only those raw bytes, the offset, the size and the device ordinal
travel in ``DeviceMemInfo`` (never a pickled object). The engine side opens
the handle with ``cudaIpcOpenMemHandle`` (``kvstore.wire.hbm_ipc``), so it needs
no torch.multiprocessing ref-counting protocol: the slab lives as long as
the daemon. cupy would work the same way but is not a dependency.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.buffers import as_u8
from kvstore.checksum import checksum_many
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, Unavailable
from tiers.base import BlockMeta, Buffer, TierKind
from tiers.slots import SLOT_ALIGN, PagedSlots

log = logging.getLogger("kvstore.tiers.hbm")

CopyFn = Callable[[Any, Any, Any], None]
"""copy_fn(dst_tensor, src_tensor, stream): enqueue one copy (tests inject failures)."""
MemInfo = Callable[[Any], tuple[int, int]]
"""mem_get_info(device) -> (free bytes, total bytes)."""


def _fmt(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB ({n} bytes)"


def default_copy(dst: Any, src: Any, stream: Any) -> None:
    """``dst.copy_(src)``, on ``stream`` when there is one (non-blocking).
    Host to host (the cpu device) is a numpy copy: torch's CPU copy of
    uint8 goes through its intra-op thread pool, which is far slower on a
    loaded machine."""
    if stream is None:
        if dst.device.type == "cpu" and src.device.type == "cpu":
            np.copyto(dst.numpy(), src.numpy())
        else:
            dst.copy_(src)
        return
    import torch

    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)


class FenceTable:
    """Per-slot events of in-flight copies that read a slot.

    An event is anything with ``query() -> bool`` (completed?) and
    ``synchronize()``; ``None`` means "already complete" (CPU). A freed slot
    that still has a pending event waits in ``deferred`` until ``reap``
    finds all its events complete."""

    def __init__(self) -> None:
        self._events: dict[int, list[Any]] = {}
        self.deferred: list[int] = []

    def fence(self, locs: Sequence[int] | np.ndarray, event: Any) -> None:
        if event is None:
            return
        for loc in np.asarray(locs, dtype=np.int64).tolist():
            self._events.setdefault(loc, []).append(event)

    def busy(self, loc: int) -> bool:
        evs = self._events.get(loc)
        if not evs:
            return False
        evs[:] = [e for e in evs if not e.query()]
        if not evs:
            del self._events[loc]
            return False
        return True

    def split_free(self, locs: np.ndarray) -> np.ndarray:
        """The locations that may be freed now; the others are deferred."""
        now = []
        for loc in np.asarray(locs, dtype=np.int64).tolist():
            if self.busy(loc):
                self.deferred.append(loc)
            else:
                now.append(loc)
        return np.asarray(now, dtype=np.int64)

    def reap(self) -> np.ndarray:
        """Deferred locations whose copies have all completed (removed)."""
        if not self.deferred:
            return np.zeros(0, dtype=np.int64)
        done = [loc for loc in self.deferred if not self.busy(loc)]
        if done:
            gone = set(done)
            self.deferred = [loc for loc in self.deferred if loc not in gone]
        return np.asarray(done, dtype=np.int64)

    def wait(self, locs: Sequence[int] | np.ndarray | None = None) -> None:
        """Block until the copies reading ``locs`` (all, when None) are done."""
        keys = list(self._events) if locs is None else np.asarray(locs, dtype=np.int64).tolist()
        for loc in keys:
            for e in self._events.pop(loc, []):
                e.synchronize()

    @property
    def pending(self) -> int:
        return sum(len(v) for v in self._events.values())


@dataclass(slots=True, frozen=True)
class IpcExport:
    """What an engine needs to map the slab: raw CUDA IPC handle bytes, the
    slab's byte offset inside the exported allocation, its size and device."""

    device: int
    handle: bytes
    offset: int
    size: int


class CopyError(KVStoreError):
    """A device copy failed (the blocks involved are misses)."""


class HbmTier(PagedSlots):
    """Device-memory slab with paged size classes. See the module docstring."""

    kind = TierKind.HBM
    label = "hbm"

    def __init__(self, capacity_bytes: int, *, device: Any = "cpu", page_bytes: int = 16 << 20,
                 slot_align: int = SLOT_ALIGN, slot_sizes: Sequence[int] = (),
                 mem_get_info: MemInfo | None = None, copy_fn: CopyFn | None = None,
                 hash_threads: int = 0) -> None:
        import torch

        self._init_slots(capacity_bytes, page_bytes, slot_align, slot_sizes)
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if mem_get_info is None and self.is_cuda:
            mem_get_info = torch.cuda.mem_get_info
        if mem_get_info is not None:
            free, total = mem_get_info(self.device)
            if self._capacity > free:
                raise CapacityError(
                    f"hbm.capacity {_fmt(self._capacity)} is larger than the free memory of {self.device}: "
                    f"{_fmt(int(free))} free of {_fmt(int(total))}")
        self.slab = torch.empty(self._capacity, dtype=torch.uint8, device=self.device)
        self._allocated = self._capacity
        """Bytes of the slab (fixed at start: the IPC handle names this allocation)."""
        self.copy_fn: CopyFn = copy_fn or default_copy
        self.hash_threads = hash_threads or max(2, min(8, (os.cpu_count() or 2) - 1))
        """Threads hashing one batch on the host (xxh3 releases the GIL)."""
        self.load_stream: Any = None
        self.store_stream: Any = None
        if self.is_cuda:
            # (least, greatest) priority: hi < lo; a static method (the stubs say otherwise)
            lo, hi = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
            self.load_stream = torch.cuda.Stream(self.device, priority=hi)
            self.store_stream = torch.cuda.Stream(self.device, priority=lo)
        self.fences = FenceTable()
        self.copy_errors = 0
        self._registered: list[int] = []
        self._ipc: IpcExport | None = None
        self._closed = False

    # ----------------------------------------------------------- properties
    @property
    def device_index(self) -> int:
        return int(self.device.index or 0) if self.is_cuda else 0

    @property
    def size(self) -> int:
        """Bytes of the slab (what an engine maps)."""
        return self._allocated

    # ----------------------------------------------------------- allocation
    def allocate(self, nbytes: int, count: int) -> np.ndarray:
        done = self.fences.reap()
        if done.size:
            super().free(done)
        return super().allocate(nbytes, count)

    def free(self, locs: np.ndarray) -> None:
        """Free slots; a slot still read by an in-flight copy is freed when
        that copy's event completes."""
        now = self.fences.split_free(np.asarray(locs, dtype=np.int64))
        if now.size:
            super().free(now)

    # ------------------------------------------------------------ streams
    def _event(self, stream: Any) -> Any:
        if stream is None:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _stream(self, role: str) -> Any:
        return self.load_stream if role == "load" else self.store_stream

    def _stream_name(self, role: str) -> str:
        handle = getattr(self._stream(role), "cuda_stream", None)
        return f"{role} stream" + (f" {handle:#x}" if isinstance(handle, int) else " (cpu: synchronous)")

    def _copy_batch(self, pairs: list[tuple[Any, Any]], role: str, reads: np.ndarray | None,
                    what: str, during: Callable[[], None] | None = None) -> tuple[np.ndarray, Any]:
        """Enqueue copies on the ``role`` ("load"/"store") stream, run
        ``during`` (host work overlapping the DMA), and wait for them; returns
        (ok mask, event). Fences ``reads`` (slab offsets these copies read)
        with the batch's event until it completes."""
        stream = self._stream(role)
        ok = np.ones(len(pairs), dtype=bool)
        for i, (dst, src) in enumerate(pairs):
            try:
                self.copy_fn(dst, src, stream)
            except Exception as e:  # a CUDA error surfaces as RuntimeError
                ok[i] = False
                self.copy_errors += 1
                log.error("hbm %s copy %d failed on device %s, %s: %s", what, i, self.device,
                          self._stream_name(role), e)
        ev = self._event(stream)
        if reads is not None:
            self.fences.fence(reads[ok], ev)
        if during is not None:
            during()
        if ev is not None:
            try:
                ev.synchronize()
            except Exception as e:
                self.copy_errors += 1
                ok[:] = False
                log.error("hbm %s batch failed on device %s, %s: %s", what, self.device,
                          self._stream_name(role), e)
        return ok, ev

    # ------------------------------------------------------------- data path
    def view(self, loc: int, nbytes: int) -> Any:
        """The slot's first ``nbytes`` bytes as a tensor on the tier's device."""
        return self.slab[int(loc) : int(loc) + int(nbytes)]

    def write_masked(self, locs: np.ndarray, payloads: Sequence[Buffer]) -> tuple[np.ndarray, np.ndarray]:
        """Host payloads into slots (load stream). Returns (xxh3_64 of each
        source, ok mask); the copies are complete when this returns."""
        import torch

        srcs = [as_u8(p) for p in payloads]
        csums = np.zeros(len(srcs), dtype=np.uint64)

        def hash_sources() -> None:  # while the DMA reads the same (pinned) bytes
            csums[:] = checksum_many(srcs, self.hash_threads)

        with warnings.catch_warnings():  # read-only sources: torch warns, we only read them
            warnings.simplefilter("ignore", UserWarning)
            pairs = [(self.view(off, s.size), torch.from_numpy(s)) for off, s in
                     zip(np.asarray(locs).tolist(), srcs)]
        ok, _ = self._copy_batch(pairs, "load", None, "host->device", during=hash_sources)
        return csums, ok

    def write(self, locs: np.ndarray, payloads: Sequence[Buffer],
              owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        csums, ok = self.write_masked(locs, payloads)
        if not ok.all():
            raise CopyError(f"{int((~ok).sum())} of {ok.size} copies into {self.device} failed")
        return csums

    def read_into(self, locs: np.ndarray, sizes: np.ndarray, checksums: np.ndarray,
                  outs: Sequence[Buffer], owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        """Slots into host buffers (store stream); False where the copy failed
        or the bytes do not match their checksum. Source slots stay fenced
        until the batch's event completes."""
        import torch

        locs = np.asarray(locs, dtype=np.int64)
        dsts = [as_u8(o) for o in outs]
        pairs = [(torch.from_numpy(d), self.view(off, n)) for off, n, d in
                 zip(locs.tolist(), np.asarray(sizes).tolist(), dsts)]
        ok, _ = self._copy_batch(pairs, "store", locs, "device->host")
        at = np.nonzero(ok)[0]
        if at.size:
            got = checksum_many([dsts[i] for i in at.tolist()], self.hash_threads)
            ok[at] = got == np.asarray(checksums, dtype=np.uint64)[at]
        return ok

    def checksums(self, locs: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """xxh3_64 of slots written by someone else (an engine through IPC):
        copied to the host first. Returns (checksums, ok mask)."""
        sizes = np.asarray(sizes, dtype=np.int64)
        outs = [np.empty(int(n), dtype=np.uint8) for n in sizes.tolist()]
        import torch

        locs = np.asarray(locs, dtype=np.int64)
        pairs = [(torch.from_numpy(o), self.view(off, o.size)) for off, o in zip(locs.tolist(), outs)]
        ok, _ = self._copy_batch(pairs, "store", locs, "device->host")
        return checksum_many(outs, self.hash_threads), ok

    def move(self, dst_locs: np.ndarray, src_locs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Device-to-device copies inside the slab (a shrink relocating
        blocks); returns the ok mask."""
        pairs = [(self.view(d, n), self.view(s, n)) for d, s, n in
                 zip(np.asarray(dst_locs).tolist(), np.asarray(src_locs).tolist(), np.asarray(sizes).tolist())]
        ok, _ = self._copy_batch(pairs, "store", np.asarray(src_locs, dtype=np.int64), "device->device")
        return ok

    # --------------------------------------------------------- host memory
    def register_host(self, buf: np.ndarray) -> bool:
        """Register a host buffer (the DRAM slab) as pinned memory so that
        copies to and from it run at full PCIe speed and asynchronously.
        No-op (False) without CUDA."""
        if not self.is_cuda or buf.size == 0:
            return False
        import torch

        ptr = int(buf.__array_interface__["data"][0])
        rc = torch.cuda.cudart().cudaHostRegister(ptr, int(buf.nbytes), 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister of %d bytes failed (error %s); DRAM copies stay pageable",
                        buf.nbytes, rc)
            return False
        self._registered.append(ptr)
        return True

    def unregister_hosts(self) -> None:
        if not self._registered:
            return
        import torch

        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered = []

    # ------------------------------------------------------------------ IPC
    def ipc_export(self) -> IpcExport:
        """The slab's CUDA IPC handle (raw bytes), offset, size and device.
        Raises Unavailable on a CPU device."""
        if not self.is_cuda:
            raise Unavailable(f"the hbm tier is on {self.device}: no CUDA IPC handle to share "
                              "(engines read its blocks through DRAM)")
        if self._ipc is None:
            info = self.slab.untyped_storage()._share_cuda_()
            # (device, handle, storage size, storage offset, ref counter handle,
            #  ref counter offset, event handle, event sync required)
            self._ipc = IpcExport(device=int(info[0]), handle=bytes(info[1]), offset=int(info[3]),
                                  size=self._allocated)
        return self._ipc

    # ---------------------------------------------------------------- resize
    def resize(self, capacity_bytes: int) -> None:
        """Change the budget within the slab allocated at start: the device
        allocation (and the IPC handle engines mapped) never changes, so the
        tier cannot grow beyond its start size."""
        if int(capacity_bytes) > self._allocated:
            raise InvalidArgument(
                f"hbm cannot grow beyond the {_fmt(self._allocated)} allocated at start "
                f"(asked for {_fmt(int(capacity_bytes))}); restart with a larger hbm.capacity")
        self._resize_pages(capacity_bytes)

    def corrupt_for_test(self, loc: int, bit: int = 0) -> None:
        """Flip one bit of a slot (fault-injection hook for tests)."""
        i = int(loc) + bit // 8
        self.slab[i] ^= 1 << (bit % 8)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.fences.wait()
        self.unregister_hosts()
        import torch

        self.slab = torch.empty(0, dtype=torch.uint8, device=self.device)
