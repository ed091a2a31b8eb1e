"""Namespaces: everything that makes two KV tensors interchangeable.

A :class:`Namespace` names the tenant, model, adapter, KV dtype, layout,
block size, TP size, PP stage, schema version, hash algorithm and salt of a
cache; its canonical byte framing (:meth:`Namespace.framed`) is hashed into
the 16-byte digest that seeds the chain of block keys (:mod:`kvstore.keys`).
The frame layout, its field tags and the integer codes of the enums below
are part of the key spec (``docs/keys.md``, ``tests/unit/kvstore/keys_vectors.json``):
changing one changes every key.  :mod:`kvstore.keys` re-exports every name
here, so ``from kvstore.keys import Namespace`` keeps working.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable, Final, Mapping, TypeVar

import xxhash

from kvstore.errors import InvalidArgument

__all__ = [
    "FIELD_HDR",
    "KEY_LEN",
    "MAX_BLOCK_SIZE",
    "MAX_STR_BYTES",
    "NS_FRAME_VERSION",
    "NS_MAGIC",
    "HashAlgo",
    "KVDtype",
    "KVLayout",
    "Namespace",
]

KEY_LEN: Final = 16
"""Bytes in a block key and in a namespace digest."""
MAX_BLOCK_SIZE: Final = 65536
"""Largest allowed ``Namespace.block_size`` (tokens)."""
MAX_STR_BYTES: Final = 256
"""Longest allowed namespace string, in UTF-8 bytes."""
_MAX_I64: Final = 2**63 - 1

NS_MAGIC: Final = b"KVNS"
"""First bytes of every namespace frame."""
NS_FRAME_VERSION: Final = 1
"""Version of the namespace frame layout (u16le after the magic)."""
FIELD_HDR: Final = struct.Struct("<HI")
"""Header of every frame field (namespace fields and block frames alike):
``tag:u16le || len:u32le``, then ``len`` bytes of value."""

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
    return FIELD_HDR.pack(tag, len(value)) + value


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
