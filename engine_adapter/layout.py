"""Paged KV layouts, declared explicitly, and the index-tensor moves between
an engine's pages and block payloads.

An engine declares how its KV cache is laid out with :class:`PagedKVLayout`
(never guessed from the tensors):

- ``KVLayout.LAYER_KV_PAGE``: one tensor ``[layers, 2, num_pages, page_size, kv_heads, head_dim]``;
- ``KVLayout.PER_LAYER_KV_PAGE``: ``layers`` tensors ``[2, num_pages, page_size, kv_heads, head_dim]``.

``kv_heads`` are *this rank's* heads (under tensor parallelism each rank
holds ``total_kv_heads / tp_size`` of them). A store block is exactly one
page (``Namespace.block_size == page_size``), and one rank's part of a
block (its *shard*) is the fixed, page-size-independent payload
``[layers, 2, page_size, kv_heads, head_dim]`` in the KV dtype, C order.
A TP=k block is k such shards back to back, shard r from rank r.

Moving data is one index op per layer tensor per batch: ``index_select``
from a page-major view of the tensor straight into a block-major staging
tensor (``gather``), and ``index_copy_`` back (``scatter``); no Python loop
per token or per block here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np
import torch

from kvstore.client.sinks import LayerScatter
from kvstore.errors import InvalidArgument
from kvstore.keys import KVDtype, KVLayout

__all__ = ["KVTensors", "PagedKVLayout", "StagingPool", "kv_dtype_of", "torch_dtype_of"]

KVTensors = Union[torch.Tensor, Sequence[torch.Tensor]]
"""The engine's KV cache: one tensor (LAYER_KV_PAGE) or one per layer (PER_LAYER_KV_PAGE)."""

_TORCH_DTYPES: dict[KVDtype, torch.dtype] = {
    KVDtype.FLOAT16: torch.float16,
    KVDtype.BFLOAT16: torch.bfloat16,
    KVDtype.FLOAT32: torch.float32,
    KVDtype.FLOAT8_E4M3FN: torch.float8_e4m3fn,
    KVDtype.FLOAT8_E5M2: torch.float8_e5m2,
    KVDtype.INT8: torch.int8,
    KVDtype.UINT8: torch.uint8,
}
_KV_DTYPES: dict[torch.dtype, KVDtype] = {v: k for k, v in _TORCH_DTYPES.items()}


def torch_dtype_of(kv_dtype: KVDtype | str) -> torch.dtype:
    """The torch dtype of a namespace's ``kv_dtype``."""
    return _TORCH_DTYPES[KVDtype.parse(kv_dtype)]


def kv_dtype_of(dtype: torch.dtype) -> KVDtype:
    """The namespace ``KVDtype`` of a torch dtype; InvalidArgument if it has none."""
    try:
        return _KV_DTYPES[dtype]
    except KeyError:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in _KV_DTYPES)
        raise InvalidArgument(f"KV dtype {dtype} is not storable; allowed: {allowed}") from None


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"PagedKVLayout.{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(slots=True, frozen=True)
class PagedKVLayout:
    """How an engine's paged KV cache is laid out (this rank's part of it)."""

    kind: KVLayout
    """LAYER_KV_PAGE (one tensor) or PER_LAYER_KV_PAGE (one tensor per layer)."""
    num_layers: int
    """Transformer layers whose KV the tensors hold."""
    num_pages: int
    """Pages in the engine's pool (the page-table ids are in ``[0, num_pages)``)."""
    page_size: int
    """Tokens per page; must equal the namespace's ``block_size``."""
    kv_heads: int
    """KV heads held by this rank (total KV heads / TP size)."""
    head_dim: int
    """Elements per head."""
    dtype: torch.dtype
    """Element type of the KV tensors."""

    def __post_init__(self) -> None:
        kind = KVLayout.parse(self.kind, "PagedKVLayout.kind")
        if kind is KVLayout.OPAQUE:
            raise InvalidArgument("PagedKVLayout.kind must be layer_kv_page or per_layer_kv_page, got opaque")
        object.__setattr__(self, "kind", kind)
        for name in ("num_layers", "num_pages", "page_size", "kv_heads", "head_dim"):
            _positive(name, getattr(self, name))
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgument(f"PagedKVLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        kv_dtype_of(self.dtype)

    # ------------------------------------------------------------ shapes
    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """Shape of the one tensor (LAYER_KV_PAGE) or of each layer's tensor."""
        tail = (self.num_pages, self.page_size, self.kv_heads, self.head_dim)
        if self.kind is KVLayout.LAYER_KV_PAGE:
            return (self.num_layers, 2, *tail)
        return (2, *tail)

    @property
    def shard_shape(self) -> tuple[int, int, int, int, int]:
        """One rank's part of one block: ``[layers, 2, page_size, kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.page_size, self.kv_heads, self.head_dim)

    @property
    def shard_bytes(self) -> int:
        """Bytes of one shard (the block payload is ``tp_size`` times this)."""
        return math.prod(self.shard_shape) * self.dtype.itemsize

    @property
    def kv_dtype(self) -> KVDtype:
        return kv_dtype_of(self.dtype)

    def describe(self) -> str:
        dims = "x".join(map(str, self.tensor_shape))
        if self.kind is KVLayout.PER_LAYER_KV_PAGE:
            dims = f"{self.num_layers} x [{dims}]"
        return f"{self.kind.value} {dims} {str(self.dtype).removeprefix('torch.')}"

    # -------------------------------------------------------- validation
    def page_major(self, kv: KVTensors) -> tuple[torch.Tensor, ...]:
        """Check ``kv`` against this declaration and return page-major views
        (no copies): LAYER_KV_PAGE -> one ``[pages, layers, 2, S, H, D]``;
        PER_LAYER_KV_PAGE -> one ``[pages, 2, S, H, D]`` per layer.

        Raises InvalidArgument naming the first mismatch (kind, count, shape,
        dtype, device)."""
        if self.kind is KVLayout.LAYER_KV_PAGE:
            if not isinstance(kv, torch.Tensor):
                raise InvalidArgument(f"layout {self.describe()} expects one tensor, got "
                                      f"{type(kv).__name__}")
            self._check(kv, "kv")
            return (kv.permute(2, 0, 1, 3, 4, 5),)
        if isinstance(kv, torch.Tensor):
            if kv.dim() == 6:
                raise InvalidArgument(f"layout {self.describe()} expects {self.num_layers} per-layer tensors, "
                                      f"got one tensor of shape {tuple(kv.shape)}")
            raise InvalidArgument(f"layout {self.describe()} expects a sequence of per-layer tensors")
        tensors = list(kv)
        if len(tensors) != self.num_layers:
            raise InvalidArgument(f"layout {self.describe()} expects {self.num_layers} layer tensors, "
                                  f"got {len(tensors)}")
        device = None
        for i, t in enumerate(tensors):
            self._check(t, f"kv[{i}]")
            if device is None:
                device = t.device
            elif t.device != device:
                raise InvalidArgument(f"kv[{i}] is on {t.device}, kv[0] on {device}: all layers "
                                      "must be on one device")
        return tuple(t.permute(1, 0, 2, 3, 4) for t in tensors)

    def _check(self, t: Any, what: str) -> None:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        want = self.tensor_shape
        if tuple(t.shape) != want:
            names = ("layers, 2, " if self.kind is KVLayout.LAYER_KV_PAGE else "2, ") + \
                "num_pages, page_size, kv_heads, head_dim"
            raise InvalidArgument(f"{what} has shape {tuple(t.shape)} but the declared layout "
                                  f"{self.kind.value} is {list(want)} ([{names}])")
        if t.dtype != self.dtype:
            raise InvalidArgument(f"{what} has dtype {t.dtype} but the layout declares {self.dtype}")

    @staticmethod
    def device_of(views: Sequence[torch.Tensor]) -> torch.device:
        return views[0].device

    # ----------------------------------------------------- data movement
    def gather(self, views: Sequence[torch.Tensor], pages: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the pages ``pages`` (int64 ids on the KV device) into ``out``
        (``[n, *shard_shape]`` on the same device), one op per layer tensor."""
        if self.kind is KVLayout.LAYER_KV_PAGE:
            torch.index_select(views[0], 0, pages, out=out)
            return
        for layer, v in enumerate(views):
            torch.index_select(v, 0, pages, out=out[:, layer])

    def scatter(self, views: Sequence[torch.Tensor], pages: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` (``[n, *shard_shape]``) into the pages ``pages``, one
        ``index_copy_`` per layer tensor."""
        if self.kind is KVLayout.LAYER_KV_PAGE:
            views[0].index_copy_(0, pages, src)
            return
        for layer, v in enumerate(views):
            v.index_copy_(0, pages, src[:, layer])


class StagingPool:
    """A growing, reused host buffer of whole shards: ``get(n)`` returns
    (typed ``[n, *shard_shape]`` tensor, ``[n, shard_bytes]`` uint8 tensor)
    over the same memory. Pinned when the engine's KV lives on CUDA, so
    host<->device copies can run asynchronously on a side stream."""

    def __init__(self, layout: PagedKVLayout, pin_memory: bool = False) -> None:
        self.layout = layout
        self.pin_memory = pin_memory
        self._buf = torch.empty(0, dtype=torch.uint8)

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        sb = self.layout.shard_bytes
        need = n * sb
        if self._buf.numel() < need:
            cap = max(need, 2 * self._buf.numel())
            self._buf = torch.empty(cap, dtype=torch.uint8, pin_memory=self.pin_memory)
        raw = self._buf[:need].view(n, sb)
        typed = raw.view(self.layout.dtype).view(n, *self.layout.shard_shape)
        return typed, raw


def block_runs(ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Starts of the runs where both the destination block ids and the
    source rows go up by one, plus ``len(ids)`` at the end: each run is one
    slice copy (vLLM gives a new request consecutive blocks more often than
    not)."""
    brk = np.flatnonzero((np.diff(ids) != 1) | (np.diff(rows) != 1)) + 1
    return np.concatenate(([0], brk, [ids.size])).astype(np.int64)


def scatter_blocks(layers: list[torch.Tensor], srcs: list[torch.Tensor], ids: np.ndarray, rows: np.ndarray) -> None:
    """``layer[ids[i]] = src[rows[i]]`` for every layer. On the CPU one
    ``copy_`` per run of consecutive blocks (``block_runs``): ``index_copy_``
    of bfloat16 blocks ran at about a quarter of that here (1.1 ms against
    0.1-0.33 ms for 15 blocks x 4 layers of 64 KiB); on a device, one
    ``index_copy_`` per layer (one transfer)."""
    starts = block_runs(ids, rows).tolist()
    for t, src in zip(layers, srcs):
        if t.device.type != "cpu":
            part = src.index_select(0, torch.from_numpy(rows)) if rows.size != src.shape[0] else src
            t.index_copy_(0, torch.from_numpy(ids).to(t.device), part.to(t.device))
            continue
        for a, b in zip(starts[:-1], starts[1:]):
            i, r, n = int(ids[a]), int(rows[a]), b - a
            t[i:i + n].copy_(src[r:r + n])


def scatter_layout(originals: list[torch.Tensor], layers: list[torch.Tensor], at: int,
                   layer_bytes: int, block_bytes: int, threads: int = 2) -> LayerScatter | None:
    """How this rank's shard of a stored block (bytes ``[at, at + L *
    layer_bytes)``, layer-major) lands in the engine's KV tensors, for reads
    that put each block in place (``kvstore.client.sinks``): one piece per
    layer when a block of the block-major view ``layers[i]`` is contiguous,
    one per K/V half when the view is the transpose of a ``[2, blocks, ...]``
    tensor. None (the caller stages and scatters) for device tensors, a
    non-contiguous tensor, or any other layout."""
    pieces: list[tuple[int, int, int, int, int]] = []
    dsts = []
    for i, (o, t) in enumerate(zip(originals, layers)):
        if o.device.type != "cpu" or not o.is_contiguous() or o.dim() < 1 or t.shape[0] < 1:
            return None
        item = o.element_size()
        origin = o.data_ptr()
        first = t[0]
        src = at + i * layer_bytes
        stride = int(t.stride(0)) * item
        if first.is_contiguous():
            pieces.append((src, layer_bytes, i, t.data_ptr() - origin, stride))
        elif first.dim() >= 1 and 0 < first.shape[0] <= 4 and all(first[k].is_contiguous()
                                                                  for k in range(first.shape[0])):
            part = layer_bytes // first.shape[0]
            for k in range(first.shape[0]):
                pieces.append((src + k * part, part, i, first[k].data_ptr() - origin, stride))
        else:
            return None
        dsts.append(o.detach().view(torch.uint8).reshape(-1).numpy())
    return LayerScatter(block_bytes, np.asarray(pieces, dtype=np.int64), dsts, threads)
