"""Chained block keys (and, re-exported, the namespaces that seed them).

A :class:`~kvstore.namespace.Namespace` (defined in :mod:`kvstore.namespace`,
re-exported here with its enums) names everything that makes two KV tensors
interchangeable; its canonical byte framing (:meth:`Namespace.framed`) is
hashed into a 16-byte digest that seeds the chain of block keys::

    key[-1] = H(namespace frame)
    key[i]  = H(key[i-1] || u16le(0x0100) || u32le(4 * block_size) || tokens_i as u32le)

where ``H`` is XXH3-128 (canonical big-endian 16 bytes, seed 0) or the first
16 bytes of SHA-256, chosen by ``Namespace.hash_algo``.  Only full blocks get
keys.  The byte-exact specification and test vectors are in ``docs/keys.md``
(and ``tests/unit/kvstore/keys_vectors.json``) so another language can compute the
same keys.  Nothing here uses Python's salted ``hash()``.

A whole prompt is hashed with one call: token ids are validated and
converted with numpy (no Python loop per token) and the XXH3 chain runs in
``kvstore._native`` when that extension is built; without it the chain is a
Python loop per *block* with identical results.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Final, Sequence, Union, cast

import numpy as np
import numpy.typing as npt

from kvstore.checksum import load_native
from kvstore.errors import InvalidArgument
from kvstore.namespace import (FIELD_HDR, KEY_LEN, MAX_BLOCK_SIZE, MAX_STR_BYTES, NS_FRAME_VERSION, NS_MAGIC,
                               HashAlgo, KVDtype, KVLayout, Namespace)

__all__ = [
    # the chain
    "HAVE_NATIVE", "TAG_TOKENS", "Divergence", "TokenInput", "as_token_array", "block_keys",
    "block_keys_array", "first_divergence",
    # re-exported from kvstore.namespace
    "KEY_LEN", "MAX_BLOCK_SIZE", "MAX_STR_BYTES", "NS_FRAME_VERSION", "NS_MAGIC", "HashAlgo", "KVDtype",
    "KVLayout", "Namespace",
]


_native: Final = load_native()
HAVE_NATIVE: Final[bool] = _native is not None
"""Whether the XXH3 chain runs in the C extension (results are identical)."""

_LITTLE_ENDIAN: Final = sys.byteorder == "little"
_TOKEN_LIMIT: Final = 2**32

TAG_TOKENS: Final = 0x0100
"""Tag of a block frame (the tokens of one block)."""


# --------------------------------------------------------------------------
# Tokens
# --------------------------------------------------------------------------

TokenInput = Union[npt.NDArray[np.integer[Any]], Sequence[int], Any]
"""A 1-D numpy integer array, a list/tuple of ints, or anything with a
``.numpy()`` method returning one (a CPU torch tensor)."""

_EMPTY_TOKENS: Final = np.zeros(0, dtype="<u4")
_EMPTY_TOKENS.setflags(write=False)


def _int_array(tokens: TokenInput, what: str) -> np.ndarray[Any, Any]:
    """``tokens`` as a 1-D native-byte-order integer numpy array (no copy
    when it already is one); ids are *not* range-checked yet."""
    arr: Any
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (list, tuple)):
        if len(tokens) == 0:
            return _EMPTY_TOKENS
        arr = np.asarray(tokens)
    elif callable(getattr(tokens, "numpy", None)):  # torch.Tensor, without importing torch
        try:
            arr = cast(Any, tokens).numpy()
        except (TypeError, RuntimeError, ValueError) as e:
            raise InvalidArgument(
                f"{what}: cannot read {type(tokens).__name__} as a CPU array ({e}); "
                "pass a CPU tensor or a numpy array") from None
        if not isinstance(arr, np.ndarray):
            raise InvalidArgument(f"{what}: {type(tokens).__name__}.numpy() did not return an array")
    else:
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"{what}: cannot read {type(tokens).__name__} as an array ({e})") from None

    kind = arr.dtype.kind
    if kind not in "iu":
        if kind in "fO" and isinstance(tokens, (list, tuple)):
            # numpy widens ints beyond int64/uint64 to float/object: say so
            raise InvalidArgument(
                f"{what} must be integer ids in [0, 2**32); a list with "
                f"non-integers or ids that large became dtype {arr.dtype}")
        raise InvalidArgument(f"{what} must be integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} must be 1-D, got shape {tuple(arr.shape)}")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    checked: np.ndarray[Any, Any] = arr
    return checked


def _out_of_range(arr: np.ndarray[Any, Any], what: str) -> InvalidArgument:
    """The error for the first id outside [0, 2**32) (error path only)."""
    i = int(np.flatnonzero((arr < 0) | (arr >= _TOKEN_LIMIT))[0])
    return InvalidArgument(f"{what}[{i}] = {arr[i]} is out of range; token ids must be in [0, 2**32)")


def _narrow(arr: np.ndarray[Any, Any], what: str) -> npt.NDArray[np.uint32]:
    """Range-check an :func:`_int_array` result and convert it to C-contiguous
    little-endian uint32 (vectorised; no copy when it already is one)."""
    if arr.size:
        if arr.dtype.itemsize == 8:
            # one pass: negative int64 ids wrap to >= 2**63 in the unsigned view
            bad = int(arr.view(np.uint64).max()) >= _TOKEN_LIMIT
        elif arr.dtype.kind == "i":
            bad = int(arr.min()) < 0
        else:
            bad = False  # uint8/16/32 always fit
        if bad:
            raise _out_of_range(arr, what)
    if arr.dtype == np.dtype("<u4") and arr.flags.c_contiguous:
        return arr
    return arr.astype("<u4", order="C")


def as_token_array(tokens: TokenInput, what: str = "tokens") -> npt.NDArray[np.uint32]:
    """Validate token ids and return them as a 1-D C-contiguous little-endian
    uint32 array (no copy when they already are one).

    Accepts a 1-D numpy array of any integer dtype, a list/tuple of ints, or
    an object with ``.numpy()`` (a CPU torch tensor).  Rejects, with
    InvalidArgument: float, bool, object and string dtypes; arrays that are
    not 1-D; ids < 0 or >= 2**32.  Vectorised: no Python loop per token.
    (A list mixing bools with ints is read as ints, as numpy does.)
    """
    return _narrow(_int_array(tokens, what), what)


# --------------------------------------------------------------------------
# Chains
# --------------------------------------------------------------------------


def _chain_python(seed: bytes, tokens: npt.NDArray[np.uint32], block_size: int,
                  algo: HashAlgo) -> bytes:
    """The key chain with one Python hash call per block (both algorithms).
    ``tokens`` must be little-endian uint32 and C-contiguous."""
    n_blocks = tokens.shape[0] // block_size
    payload = 4 * block_size
    body = tokens[: n_blocks * block_size].view(np.uint8).data
    frame = bytearray(KEY_LEN + FIELD_HDR.size + payload)
    frame[KEY_LEN:KEY_LEN + FIELD_HDR.size] = FIELD_HDR.pack(TAG_TOKENS, payload)
    out = bytearray(n_blocks * KEY_LEN)
    h = algo.digest
    prev = seed
    start = KEY_LEN + FIELD_HDR.size
    for i in range(n_blocks):
        frame[:KEY_LEN] = prev
        frame[start:] = body[i * payload:(i + 1) * payload]
        prev = h(frame)
        out[i * KEY_LEN:(i + 1) * KEY_LEN] = prev
    return bytes(out)


def _chain(ns: Namespace, tokens: npt.NDArray[np.uint32]) -> bytes:
    """The concatenated keys of every full block of validated uint32 ``tokens``."""
    if ns.hash_algo is HashAlgo.XXH3_128 and _native is not None:
        return bytes(_native.chain_keys(ns.digest, tokens, ns.block_size, 0))
    return _chain_python(ns.digest, tokens, ns.block_size, ns.hash_algo)


def _chain_input(ns: Namespace, tokens: TokenInput, what: str = "tokens") -> bytes:
    """Validate ``tokens`` and return the concatenated keys of its full blocks.

    64-bit ids (torch's and numpy's default) go to the native chain as they
    are: it narrows them to uint32 and range-checks them on the way, saving
    two passes over the prompt.  Everything else is checked and converted
    with numpy first.
    """
    arr = _int_array(tokens, what)
    if (_native is not None and ns.hash_algo is HashAlgo.XXH3_128
            and arr.dtype.itemsize == 8 and _LITTLE_ENDIAN and arr.flags.c_contiguous):
        try:
            return bytes(_native.chain_keys(ns.digest, arr, ns.block_size, 0, 8))
        except ValueError:
            raise _out_of_range(arr, what) from None
    u32 = _narrow(arr, what)
    return _chain(ns, u32[: u32.shape[0] - u32.shape[0] % ns.block_size])


def block_keys_array(ns: Namespace, tokens: TokenInput) -> npt.NDArray[np.uint8]:
    """Keys of every full block of ``tokens`` as an ``(n_blocks, 16)`` uint8
    array (a read-only view over one bytes object: no per-key objects).

    ``n_blocks = len(tokens) // ns.block_size``; a trailing partial block gets
    no key, so fewer tokens than ``block_size`` give shape ``(0, 16)``.
    """
    return np.frombuffer(_chain_input(ns, tokens), dtype=np.uint8).reshape(-1, KEY_LEN)


def block_keys(ns: Namespace, tokens: TokenInput) -> list[bytes]:
    """Keys of every full block of ``tokens``, 16 bytes each, in order.

    ``key[i]`` identifies block ``i`` *and its whole prefix* in namespace
    ``ns``.  Fewer tokens than ``block_size`` give ``[]``.
    """
    blob = _chain_input(ns, tokens)
    # 'V16' items convert to full 16-byte bytes objects in one C loop ('S16'
    # would strip trailing NUL bytes).
    keys: list[bytes] = np.frombuffer(blob, dtype="V16").tolist()
    return keys


@dataclass(slots=True, frozen=True)
class Divergence:
    """Where two token sequences stop sharing blocks (see :func:`first_divergence`)."""

    block: int
    """Index of the first block that differs; also the number of shared leading blocks."""
    token_start: int
    """First token of that block (``block * block_size``)."""
    token_end: int
    """One past its last token (``token_start + block_size``)."""
    position: int
    """First token index where the sequences differ (the shorter one's length
    when one is a prefix of the other)."""
    key_a: bytes | None
    """Key of that block in ``tokens_a``; None when ``tokens_a`` has no full block there."""
    key_b: bytes | None
    """Key of that block in ``tokens_b``; None when ``tokens_b`` has no full block there."""


def first_divergence(ns: Namespace, tokens_a: TokenInput,
                     tokens_b: TokenInput) -> Divergence | None:
    """The first block where ``tokens_a`` and ``tokens_b`` differ, or None
    when the sequences are identical.

    Blocks before ``Divergence.block`` have equal keys in both; the keys at
    that block differ whenever both sequences have it in full.  A difference
    only in a trailing partial block is still reported (with ``key_a`` /
    ``key_b`` None for the side whose block is partial).  Vectorised.
    """
    a = as_token_array(tokens_a, "tokens_a")
    b = as_token_array(tokens_b, "tokens_b")
    common = min(a.shape[0], b.shape[0])
    if common:
        neq = a[:common] != b[:common]
        first = int(np.argmax(neq))
        position = first if neq[first] else common
    else:
        position = 0
    if position == common and a.shape[0] == b.shape[0]:
        return None
    bs = ns.block_size
    block = position // bs
    start, end = block * bs, (block + 1) * bs

    def key_at(arr: npt.NDArray[np.uint32]) -> bytes | None:
        if arr.shape[0] < end:
            return None
        return _chain(ns, arr[:end])[block * KEY_LEN:]

    return Divergence(block=block, token_start=start, token_end=end, position=position,
                      key_a=key_at(a), key_b=key_at(b))
