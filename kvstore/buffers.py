"""Byte views and packed keys: the few buffer helpers every package shares.

``as_u8`` gives a flat uint8 view of any ``Buffer`` without copying;
``as_u8_writable`` the same for a destination (a ``bytes`` object is not
writable, a ``bytearray``/``memoryview``/array is). ``pack_keys`` puts
16-byte block keys back to back (``keys_packed`` on the wire) and
``split_keys`` undoes it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from tiers.base import Buffer

KEY_BYTES = 16
"""Length of one block key."""


def as_u8(buf: Buffer) -> np.ndarray:
    """A flat uint8 view of ``buf`` (no copy)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def as_u8_writable(buf: Buffer) -> np.ndarray:
    """A flat uint8 view of ``buf`` that writes through to it (no copy).
    An array that is not C-contiguous is refused (``InvalidArgument``): its
    flat form may be a copy, and bytes written there would be lost."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InvalidArgument(f"an output buffer must be C-contiguous (shape {buf.shape}, strides {buf.strides})")
        if buf.ndim == 1 and buf.dtype == np.uint8:
            return buf  # already one (the common case: a slice of a byte array)
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def pack_keys(keys: Sequence[bytes] | bytes, *, check: bool = False) -> bytes:
    """Keys back to back; already packed bytes pass through. ``check``: raise
    ``InvalidArgument`` naming the first key that is not 16 bytes (for
    packed bytes: a length that is not a multiple of 16)."""
    if isinstance(keys, bytes):
        if check and len(keys) % KEY_BYTES:
            raise InvalidArgument(f"packed keys must be {KEY_BYTES} bytes each: {len(keys)} bytes")
        return keys
    if check and keys and set(map(len, keys)) != {KEY_BYTES}:
        bad = next(i for i, k in enumerate(keys) if len(k) != KEY_BYTES)
        raise InvalidArgument(f"key {bad} must be {KEY_BYTES} bytes, got {len(keys[bad])}")
    return b"".join(keys)


def split_keys(packed: bytes) -> list[bytes]:
    """``pack_keys`` undone: one 16-byte key per entry."""
    return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


def keys_at(packed: bytes, idx: Sequence[int]) -> list[bytes]:
    """The keys at positions ``idx`` of packed keys (e.g. the few a report names)."""
    return [packed[KEY_BYTES * i : KEY_BYTES * (i + 1)] for i in idx]
