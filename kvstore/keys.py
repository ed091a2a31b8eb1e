"""Namespaces and chained block keys.

A :class:`Namespace` names everything that makes two KV tensors
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

import hashlib
import operator
import os
import struct
import sys
from dataclasses import dataclass, field, replace
from enum import Enum
from types import ModuleType
from typing import Any, Callable, Final, Mapping, Sequence, TypeVar, Union, cast

import numpy as np
import numpy.typing as npt
import xxhash

from kvstore.checksum import load_native
from kvstore.errors import InvalidArgument

__all__ = [
    "KEY_LEN",
    "MAX_BLOCK_SIZE",
    "HAVE_NATIVE",
    "KVDtype",
    "KVLayout",
    "HashAlgo",
    "Namespace",
    "Divergence",
    "TokenInput",
    "block_keys",
    "block_keys_array",
    "first_divergence",
    "as_token_array",
]


_native: Final = load_native()
HAVE_NATIVE: Final[bool] = _native is not None
"""Whether the XXH3 chain runs in the C extension (results are identical)."""

KEY_LEN: Final = 16
"""Bytes in a block key and in a namespace digest."""
MAX_BLOCK_SIZE: Final = 65536
"""Largest allowed ``Namespace.block_size`` (tokens)."""
MAX_STR_BYTES: Final = 256
"""Longest allowed namespace string, in UTF-8 bytes."""
_MAX_I64: Final = 2**63 - 1
_LITTLE_ENDIAN: Final = sys.byteorder == "little"
_TOKEN_LIMIT: Final = 2**32

NS_MAGIC: Final = b"KVNS"
"""First bytes of every namespace frame."""
NS_FRAME_VERSION: Final = 1
"""Version of the namespace frame layout (u16le after the magic)."""
TAG_TOKENS: Final = 0x0100
"""Tag of a block frame (the tokens of one block)."""

_E = TypeVar("_E", bound=Enum)


# --------------------------------------------------------------------------
# Enums.  The integer codes written into frames are explicit tables below,
# never Python enum ordinals; changing one changes every key.
# --------------------------------------------------------------------------


def _parse_enum(cls: type[_E], value: object, what: str) -> _E:
    """``value`` as a member of ``cls``: the member itself, or its name or
    value as a string (case-insensitive).  Raises InvalidArgument naming
    ``what`` and the allowed values."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        wanted = value.strip().lower()
        for member in cls:
            if wanted in (str(member.value).lower(), member.name.lower()):
                return member
    allowed = ", ".join(str(m.value) for m in cls)
    raise InvalidArgument(f"{what}: {value!r} is not one of: {allowed}")


class KVDtype(Enum):
    """Element type of the cached K/V tensors (part of the namespace)."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"
    INT8 = "int8"
    UINT8 = "uint8"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _DTYPE_ITEMSIZE[self]

    @property
    def code(self) -> int:
        """Fixed integer code used in the namespace frame (docs/keys.md)."""
        return _DTYPE_CODE[self]

    @classmethod
    def parse(cls, value: str | KVDtype, what: str = "kv_dtype") -> KVDtype:
        """A dtype from its name (``"bfloat16"``, ``"BFLOAT16"``; a
        ``"torch."`` prefix is ignored).  Raises InvalidArgument listing the
        allowed values."""
        if isinstance(value, str) and value.strip().lower().startswith("torch."):
            value = value.strip()[len("torch."):]
        return _parse_enum(cls, value, what)


class KVLayout(Enum):
    """How the bytes of one block are arranged (part of the namespace)."""

    OPAQUE = "opaque"
    """The caller only moves bytes; the store never interprets them."""
    LAYER_KV_PAGE = "layer_kv_page"
    """All layers in one buffer: ``[layers, 2, pages, page_size, kv_heads, head_dim]``."""
    PER_LAYER_KV_PAGE = "per_layer_kv_page"
    """One buffer per layer, each ``[2, pages, page_size, kv_heads, head_dim]``."""

    @property
    def dims(self) -> tuple[str, ...]:
        """Dimension names of the layout (empty for OPAQUE)."""
        return _LAYOUT_DIMS[self]

    @property
    def code(self) -> int:
        """Fixed integer code used in the namespace frame (docs/keys.md)."""
        return _LAYOUT_CODE[self]

    @classmethod
    def parse(cls, value: str | KVLayout, what: str = "layout") -> KVLayout:
        """A layout from its name; raises InvalidArgument listing the allowed values."""
        return _parse_enum(cls, value, what)


class HashAlgo(Enum):
    """The hash ``H`` of the key chain."""

    XXH3_128 = "xxh3_128"
    """XXH3-128, seed 0, canonical (big-endian) 16 bytes.  The default."""
    SHA256 = "sha256"
    """The first 16 bytes of SHA-256."""

    @property
    def code(self) -> int:
        """Fixed integer code used in the namespace frame (docs/keys.md)."""
        return _ALGO_CODE[self]

    def digest(self, data: bytes | bytearray | memoryview) -> bytes:
        """``H(data)``: 16 bytes."""
        if self is HashAlgo.XXH3_128:
            return xxhash.xxh3_128_digest(data)
        return hashlib.sha256(data).digest()[:KEY_LEN]

    @classmethod
    def parse(cls, value: str | HashAlgo, what: str = "hash_algo") -> HashAlgo:
        """An algorithm from its name; raises InvalidArgument listing the allowed values."""
        return _parse_enum(cls, value, what)


_DTYPE_ITEMSIZE: Final[dict[KVDtype, int]] = {
    KVDtype.FLOAT16: 2,
    KVDtype.BFLOAT16: 2,
    KVDtype.FLOAT32: 4,
    KVDtype.FLOAT8_E4M3FN: 1,
    KVDtype.FLOAT8_E5M2: 1,
    KVDtype.INT8: 1,
    KVDtype.UINT8: 1,
}
_DTYPE_CODE: Final[dict[KVDtype, int]] = {
    KVDtype.FLOAT16: 1,
    KVDtype.BFLOAT16: 2,
    KVDtype.FLOAT32: 3,
    KVDtype.FLOAT8_E4M3FN: 4,
    KVDtype.FLOAT8_E5M2: 5,
    KVDtype.INT8: 6,
    KVDtype.UINT8: 7,
}
_LAYOUT_CODE: Final[dict[KVLayout, int]] = {
    KVLayout.OPAQUE: 1,
    KVLayout.LAYER_KV_PAGE: 2,
    KVLayout.PER_LAYER_KV_PAGE: 3,
}
_LAYOUT_DIMS: Final[dict[KVLayout, tuple[str, ...]]] = {
    KVLayout.OPAQUE: (),
    KVLayout.LAYER_KV_PAGE: ("layers", "kv", "pages", "page_size", "kv_heads", "head_dim"),
    KVLayout.PER_LAYER_KV_PAGE: ("kv", "pages", "page_size", "kv_heads", "head_dim"),
}
_ALGO_CODE: Final[dict[HashAlgo, int]] = {
    HashAlgo.XXH3_128: 1,
    HashAlgo.SHA256: 2,
}
for _table, _enum in ((_DTYPE_CODE, KVDtype), (_LAYOUT_CODE, KVLayout), (_ALGO_CODE, HashAlgo)):
    # every member has a code and no two members share one
    assert set(_table) == set(_enum) and len(set(_table.values())) == len(_table)


# --------------------------------------------------------------------------
# Namespace
# --------------------------------------------------------------------------

# Field tags of the namespace frame, in frame order (docs/keys.md).
_TAG_TENANT: Final = 0x0001
_TAG_MODEL_ID: Final = 0x0002
_TAG_WEIGHTS_DIGEST: Final = 0x0003
_TAG_ADAPTER_ID: Final = 0x0004
_TAG_KV_DTYPE: Final = 0x0005
_TAG_LAYOUT: Final = 0x0006
_TAG_BLOCK_SIZE: Final = 0x0007
_TAG_TP_SIZE: Final = 0x0008
_TAG_PP_STAGE: Final = 0x0009
_TAG_SCHEMA_VERSION: Final = 0x000A
_TAG_HASH_ALGO: Final = 0x000B
_TAG_SALT: Final = 0x000C
"""Written only when the salt is non-empty, after every other field, so a
namespace without a salt frames exactly as before salts existed."""

_FIELD_HDR: Final = struct.Struct("<HI")
_I64: Final = struct.Struct("<q")

_STR_FIELDS: Final = ("tenant", "model_id", "weights_digest", "adapter_id", "salt")
_REQUIRED_STR: Final = ("tenant", "model_id")
# name -> (min, max) inclusive
_INT_FIELDS: Final[dict[str, tuple[int, int]]] = {
    "block_size": (1, MAX_BLOCK_SIZE),
    "tp_size": (1, _MAX_I64),
    "pp_stage": (0, _MAX_I64),
    "schema_version": (0, _MAX_I64),
}
_ENUM_FIELDS: Final[dict[str, Callable[[Any, str], Enum]]] = {
    "kv_dtype": KVDtype.parse,
    "layout": KVLayout.parse,
    "hash_algo": HashAlgo.parse,
}
_PUBLIC_FIELDS: Final = (
    "tenant", "model_id", "weights_digest", "adapter_id", "kv_dtype", "layout",
    "block_size", "tp_size", "pp_stage", "schema_version", "hash_algo", "salt",
)


def _field_bytes(tag: int, value: bytes) -> bytes:
    """One frame field: ``tag:u16le || len:u32le || value``."""
    return _FIELD_HDR.pack(tag, len(value)) + value


def _i64(value: int) -> bytes:
    return _I64.pack(value)


@dataclass(slots=True, frozen=True)
class Namespace:
    """Everything that makes two KV tensors interchangeable.

    Two requests share blocks only inside one namespace: any field that
    differs gives a different :attr:`digest` and so a disjoint key chain.
    Enum fields also accept their name as a string (normalised on
    construction); invalid values raise :class:`~kvstore.errors.InvalidArgument`
    naming the field.  Strings are used exactly as given (no Unicode
    normalisation).
    """

    tenant: str
    """Owner of the cache entries; the server sets it from the caller's identity. Non-empty."""
    model_id: str
    """Model name or path as the engine knows it. Non-empty."""
    weights_digest: str = ""
    """Digest of the model weights (e.g. a checkpoint hash); "" when unknown."""
    adapter_id: str = ""
    """LoRA/adapter id; "" for the base model."""
    kv_dtype: KVDtype = KVDtype.BFLOAT16
    """Element type of the cached K/V."""
    layout: KVLayout = KVLayout.OPAQUE
    """Arrangement of a block's bytes."""
    block_size: int = 16
    """Tokens per block, 1..65536."""
    tp_size: int = 1
    """Tensor-parallel world size (>= 1); each rank stores its own shard."""
    pp_stage: int = 0
    """Pipeline-parallel stage (>= 0)."""
    schema_version: int = 1
    """Version of the cached tensors' schema, bumped by the engine adapter (>= 0)."""
    hash_algo: HashAlgo = HashAlgo.XXH3_128
    """The hash ``H`` of the key chain."""
    salt: str = ""
    """Cache-isolation salt (as vLLM's ``cache_salt``): requests share blocks
    only when their salts are equal, e.g. one salt per user or per request
    that must not reveal, by its hit rate, what others have cached. "" (the
    default) adds nothing to the frame."""
    _frame: bytes = field(init=False, repr=False, compare=False)
    _digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        for name in _STR_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidArgument(f"{name} must be a str, got {type(value).__name__}")
            try:
                n = len(value.encode("utf-8"))
            except UnicodeEncodeError as e:
                raise InvalidArgument(f"{name} is not valid Unicode text: {e}") from None
            if n > MAX_STR_BYTES:
                raise InvalidArgument(f"{name} must be at most {MAX_STR_BYTES} UTF-8 bytes, got {n}")
            if n == 0 and name in _REQUIRED_STR:
                raise InvalidArgument(f"{name} must not be empty")
        for name, parse in _ENUM_FIELDS.items():
            setattr_(self, name, parse(getattr(self, name), name))
        for name, (lo, hi) in _INT_FIELDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")
            value = operator.index(value)
            if not lo <= value <= hi:
                bound = f">= {lo}" if hi == _MAX_I64 else f"in {lo}..{hi}"
                raise InvalidArgument(f"{name} must be {bound}, got {value}")
            setattr_(self, name, value)
        frame = self._build_frame()
        setattr_(self, "_frame", frame)
        setattr_(self, "_digest", self.hash_algo.digest(frame))

    def _build_frame(self) -> bytes:
        parts = [
            NS_MAGIC,
            struct.pack("<H", NS_FRAME_VERSION),
            _field_bytes(_TAG_TENANT, self.tenant.encode("utf-8")),
            _field_bytes(_TAG_MODEL_ID, self.model_id.encode("utf-8")),
            _field_bytes(_TAG_WEIGHTS_DIGEST, self.weights_digest.encode("utf-8")),
            _field_bytes(_TAG_ADAPTER_ID, self.adapter_id.encode("utf-8")),
            _field_bytes(_TAG_KV_DTYPE, _i64(self.kv_dtype.code)),
            _field_bytes(_TAG_LAYOUT, _i64(self.layout.code)),
            _field_bytes(_TAG_BLOCK_SIZE, _i64(self.block_size)),
            _field_bytes(_TAG_TP_SIZE, _i64(self.tp_size)),
            _field_bytes(_TAG_PP_STAGE, _i64(self.pp_stage)),
            _field_bytes(_TAG_SCHEMA_VERSION, _i64(self.schema_version)),
            _field_bytes(_TAG_HASH_ALGO, _i64(self.hash_algo.code)),
        ]
        if self.salt:
            parts.append(_field_bytes(_TAG_SALT, self.salt.encode("utf-8")))
        return b"".join(parts)

    def framed(self) -> bytes:
        """The canonical namespace frame (docs/keys.md), computed once."""
        return self._frame

    @property
    def digest(self) -> bytes:
        """``H(framed())``: 16 bytes, the chain's ``key[-1]``.  Computed once."""
        return self._digest

    def with_tenant(self, tenant: str) -> Namespace:
        """A copy with ``tenant`` replaced (the server's identity override)."""
        return replace(self, tenant=tenant)

    def to_dict(self) -> dict[str, str | int]:
        """A plain JSON-able dict; enums as their lowercase names; ``salt``
        only when it is set."""
        out: dict[str, str | int] = {}
        for name in _PUBLIC_FIELDS:
            value = getattr(self, name)
            if name == "salt" and not value:
                continue
            out[name] = value.value if isinstance(value, Enum) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Namespace:
        """The inverse of :meth:`to_dict`.  Unknown or missing required keys
        raise InvalidArgument naming the key."""
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"namespace must be a mapping, got {type(data).__name__}")
        for key in data:
            if key not in _PUBLIC_FIELDS:
                raise InvalidArgument(
                    f"unknown namespace field {key!r}; allowed: {', '.join(_PUBLIC_FIELDS)}")
        for key in _REQUIRED_STR:
            if key not in data:
                raise InvalidArgument(f"namespace field {key!r} is required")
        return cls(**dict(data))


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
    frame = bytearray(KEY_LEN + _FIELD_HDR.size + payload)
    frame[KEY_LEN:KEY_LEN + _FIELD_HDR.size] = _FIELD_HDR.pack(TAG_TOKENS, payload)
    out = bytearray(n_blocks * KEY_LEN)
    h = algo.digest
    prev = seed
    start = KEY_LEN + _FIELD_HDR.size
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
