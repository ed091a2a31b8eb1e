"""Engine side of the HBM tier: map the daemon's device slab through CUDA IPC,
once per process, and copy blocks by slot offset.

The daemon sends raw ``cudaIpcMemHandle_t`` bytes, the region's offset
inside the allocation the handle names, its size and the device ordinal in
``DeviceMemInfo`` (see ``tiers.hbm``: exported with torch's
``_share_cuda_``). Here the handle is opened with ``cudaIpcOpenMemHandle``
from the CUDA runtime that torch already loaded (ctypes, no pickle, no
torch.multiprocessing protocol), and the mapping is wrapped as a ``uint8``
torch tensor through ``__cuda_array_interface__`` (zero copy). Slot views are
slices of it; the engine copies with ``tensor.copy_`` on its own stream.

A process cannot open its own IPC handle (CUDA refuses), so the daemon and
the engine are always two processes. Mappings are cached by handle and live
until the process exits (the slab lives as long as the daemon; a client that
sees a new ``slab_id`` maps again).
"""

from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass
from typing import Any

from kvstore.errors import Unavailable

IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1
_MAPS: dict[bytes, "HbmMapping"] = {}
_CUDART: Any = None


@dataclass(slots=True)
class HbmMapping:
    device: int
    size: int
    slab_id: str
    tensor: Any
    """uint8 tensor over the whole region, on cuda:<device>."""

    def view(self, offset: int, length: int) -> Any:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise IndexError(f"hbm slot [{offset}, {offset + length}) outside the {self.size}-byte region")
        return self.tensor[offset : offset + length]


class _CudaArray:
    """Just enough of ``__cuda_array_interface__`` for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _cudart() -> Any:
    global _CUDART
    if _CUDART is not None:
        return _CUDART
    names = ["libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so"]
    try:  # the copy shipped with torch's CUDA wheels
        import nvidia.cuda_runtime  # type: ignore[import-not-found]

        for d in nvidia.cuda_runtime.__path__:
            names += sorted(glob.glob(os.path.join(d, "lib", "libcudart.so*")))
    except ImportError:
        pass
    for name in names:
        try:
            _CUDART = ctypes.CDLL(name)
            return _CUDART
        except OSError:
            continue
    raise Unavailable("the CUDA runtime (libcudart) is not loadable: cannot map the hbm slab")


def open_region(device: int, handle: bytes, base_offset: int, size: int, slab_id: str = "",
                ipc: bool = True) -> HbmMapping:
    """Map a ``DeviceMemInfo`` region (cached: once per process and handle)."""
    if not ipc:
        raise Unavailable("the daemon's hbm tier runs on the host (hbm.on_cpu): it has no CUDA IPC handle; "
                          "read its blocks through DRAM (Acquire without tier=hbm)")
    if len(handle) != IPC_HANDLE_BYTES:
        raise Unavailable(f"hbm IPC handle is {len(handle)} bytes; expected {IPC_HANDLE_BYTES}")
    hit = _MAPS.get(handle)
    if hit is not None:
        return hit
    import torch

    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        raise Unavailable(f"this process sees no CUDA device {device}: cannot map the hbm slab")
    torch.cuda.init()
    rt = _cudart()
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # make the primary context current
        ptr = ctypes.c_void_p()
        raw = (ctypes.c_char * IPC_HANDLE_BYTES).from_buffer_copy(handle)

        class _Handle(ctypes.Structure):
            _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]

        h = _Handle()
        ctypes.memmove(ctypes.addressof(h), raw, IPC_HANDLE_BYTES)
        rc = rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS))
        if rc != 0:
            raise Unavailable(f"cudaIpcOpenMemHandle failed with CUDA error {rc} on device {device}")
        base = int(ptr.value or 0) + int(base_offset)
        t = torch.as_tensor(_CudaArray(base, int(size)), device=torch.device("cuda", device))
    m = HbmMapping(device, int(size), slab_id, t)
    _MAPS[handle] = m
    return m
