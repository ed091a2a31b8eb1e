"""Tensor-parallel groups and the mirrored-shard plan.

Under TP=k a block of the namespace is **one** index entry and **one** slot
in the daemon whose payload is the k shards back to back (shard r = rank r's
KV heads). So a block is present only when all its shards are, and its
shards are evicted together, by construction: there is nothing per rank in
the index to go out of step.

The protocol (``engine_adapter.connector`` runs it):

1. rank 0 alone talks to the daemon's control plane (lookup, acquire or
   reserve) for the whole group;
2. it broadcasts the plan as **one int32 tensor** (:class:`Plan`: a header
   plus one int64 slab offset per block, each sent as a pair of int32);
3. every rank moves its own shard at ``offset + rank * shard_bytes``
   through its own mapping of the slab (TP ranks share a host);
4. the ranks agree on what worked with a MIN all-reduce (a block counts
   only if every rank moved its shard, and, on load, rank 0 verified the
   whole block's checksum);
5. rank 0 commits or aborts the reservation / releases the lease (every
   rank has finished with the slab once the all-reduce returns).

:class:`TPGroup` is the small collective interface this needs;
:class:`LocalGroup` is TP=1 and :class:`TorchDistGroup` wraps a
``torch.distributed`` process group (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import xxhash

from kvstore.errors import InvalidArgument

__all__ = ["Collective", "LocalGroup", "Plan", "TPGroup", "TorchDistGroup", "head_slice", "shard_heads",
           "slab_identity"]


@runtime_checkable
class TPGroup(Protocol):
    """The collectives the mirrored-shard protocol needs. All ranks call each
    method in the same order with same-shaped tensors (int32, CPU)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``t`` from ``src`` on every rank (in place; returns it)."""
        ...

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise MIN over ranks (in place; returns it)."""
        ...

    def barrier(self) -> None: ...


class Collective(Enum):
    """The two collectives of the plan protocol."""

    BROADCAST = "broadcast"
    """The plan, from group rank 0 to every rank."""
    ALL_REDUCE_MIN = "all_reduce_min"
    """Element-wise MIN of the per-block codes over the ranks (worst wins)."""


class LocalGroup:
    """TP=1: every collective is the identity."""

    rank = 0
    size = 1

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return t

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass


class TorchDistGroup:
    """A ``torch.distributed`` process group (default: the world).

    Collectives run on ``device``: CPU for gloo; for NCCL pass the rank's
    CUDA device (the small plan tensors are copied there and back)."""

    def __init__(self, group: Any = None, device: torch.device | str | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgument("TorchDistGroup needs torch.distributed.init_process_group() first")
        self.dist = dist
        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        if device is None:
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        self.device = torch.device(device)
        # broadcast's ``src`` is a global rank
        self._src0 = dist.get_global_rank(group, 0) if group is not None else 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def _run(self, t: torch.Tensor, op: Collective) -> torch.Tensor:
        x = t if t.device == self.device else t.to(self.device)
        if op is Collective.BROADCAST:
            self.dist.broadcast(x, src=self._src0, group=self.group)
        else:
            self.dist.all_reduce(x, op=self.dist.ReduceOp.MIN, group=self.group)
        if x is not t:
            t.copy_(x)
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if src != 0:
            raise InvalidArgument("the plan is always broadcast from group rank 0")
        return self._run(t, Collective.BROADCAST)

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        return self._run(t, Collective.ALL_REDUCE_MIN)

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In-place SUM over ranks on ``t``'s own device (the model's
        row-parallel outputs; not part of the plan protocol)."""
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM, group=self.group)
        return t


# --------------------------------------------------------------------------
# Heads
# --------------------------------------------------------------------------


def shard_heads(num_heads: int, tp_size: int, what: str = "KV heads") -> int:
    """Heads per rank; InvalidArgument unless ``num_heads`` divides evenly."""
    if tp_size < 1:
        raise InvalidArgument(f"tp_size must be >= 1, got {tp_size}")
    if num_heads % tp_size:
        raise InvalidArgument(f"{what}: {num_heads} heads cannot be split evenly over {tp_size} "
                              f"tensor-parallel ranks")
    return num_heads // tp_size


def head_slice(num_heads: int, tp_size: int, rank: int) -> slice:
    """The heads rank ``rank`` holds: ``[rank * h, (rank + 1) * h)``."""
    h = shard_heads(num_heads, tp_size)
    return slice(rank * h, (rank + 1) * h)


# --------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------

PLAN_OK = 1
"""Header status: the daemon answered; the per-block fields are meaningful."""
PLAN_FAULT = 0
"""Header status: the daemon could not be used; every rank treats it as a miss."""
_HEADER = 3  # status, count, slab identity


def slab_identity(client: Any) -> int:
    """A nonzero int64 naming the slab ``client`` (a ``kvstore.client.Client``
    or None) maps, 0 for none: a ``Plan`` carries it, so a rank never writes
    at offsets reserved in another slab (a restarted daemon)."""
    slab = getattr(client, "slab", None)
    if slab is None:
        return 0
    h = xxhash.xxh3_64_intdigest(f"{slab.path}|{slab.slab_id}".encode())
    h = h - (1 << 64) if h >= 1 << 63 else h
    return h or 1


@dataclass(slots=True)
class Plan:
    """What rank 0 decided, for ``n`` blocks: ``count`` leading blocks to move
    (load) or the blocks flagged in ``write`` (save), each at ``offsets[i]``
    in the slab whose identity is ``slab``. Encoded as int64 fields viewed as
    pairs of int32, so it travels as one int32 tensor."""

    status: int
    count: int
    slab: int
    offsets: np.ndarray  # int64 [n]
    write: np.ndarray  # int64 [n], 1 = this rank writes its shard there (save only)

    @staticmethod
    def size_for(n: int) -> int:
        """int32 elements of an encoded plan for ``n`` blocks (fixed per
        request, so every rank can allocate the receive buffer)."""
        return 2 * (_HEADER + 2 * n)

    @classmethod
    def empty(cls, n: int, status: int = PLAN_FAULT) -> "Plan":
        return cls(status, 0, 0, np.zeros(n, np.int64), np.zeros(n, np.int64))

    def encode(self) -> torch.Tensor:
        n = self.offsets.shape[0]
        buf = np.empty(_HEADER + 2 * n, np.int64)
        buf[:_HEADER] = (self.status, self.count, self.slab)
        buf[_HEADER:_HEADER + n] = self.offsets
        buf[_HEADER + n:] = self.write
        return torch.from_numpy(buf).view(torch.int32)

    @classmethod
    def decode(cls, t: torch.Tensor) -> "Plan":
        buf = t.contiguous().view(torch.int64).numpy()
        n = (buf.shape[0] - _HEADER) // 2
        return cls(int(buf[0]), int(buf[1]), int(buf[2]), buf[_HEADER:_HEADER + n].copy(),
                   buf[_HEADER + n:].copy())

    def share(self, group: TPGroup, n: int) -> "Plan":
        """Broadcast from rank 0 (whose ``self`` is the plan); every rank gets it."""
        if group.size == 1:
            return self
        t = self.encode() if group.rank == 0 else torch.zeros(self.size_for(n), dtype=torch.int32)
        return Plan.decode(group.broadcast(t))
