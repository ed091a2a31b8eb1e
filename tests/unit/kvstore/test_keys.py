"""kvstore.keys and kvstore.namespace (namespaces, chained block keys).

(kvstore.checksum has its own tests: test_checksum.py.)

The test vectors in keys_vectors.json are the contract with other
implementations (docs/keys.md); a from-the-spec reference implementation
below recomputes them independently of kvstore.keys.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import checksum as cks
from kvstore import keys as K
from kvstore.errors import InvalidArgument
from kvstore.keys import (
    Divergence,
    HashAlgo,
    KVDtype,
    KVLayout,
    Namespace,
    as_token_array,
    block_keys,
    block_keys_array,
    first_divergence,
)

VECTORS_PATH = Path(__file__).with_name("keys_vectors.json")
VECTORS: list[dict[str, Any]] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))["vectors"]
REPO = Path(__file__).resolve().parents[3]

needs_native = pytest.mark.skipif(not K.HAVE_NATIVE, reason="kvstore._native is not built")


@pytest.fixture(params=["native", "python"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once with the C extension (when built) and once without."""
    if request.param == "native":
        if not K.HAVE_NATIVE:
            pytest.skip("kvstore._native is not built")
    else:
        monkeypatch.setattr(K, "_native", None)
        monkeypatch.setattr(cks, "_native", None)
    return str(request.param)


# --------------------------------------------------------------------------
# A reference implementation written from docs/keys.md, sharing no code
# with kvstore.keys.
# --------------------------------------------------------------------------

_REF_DTYPE = {"float16": 1, "bfloat16": 2, "float32": 3, "float8_e4m3fn": 4, "float8_e5m2": 5,
              "int8": 6, "uint8": 7}
_REF_LAYOUT = {"opaque": 1, "layer_kv_page": 2, "per_layer_kv_page": 3}
_REF_ALGO = {"xxh3_128": 1, "sha256": 2}


def _ref_field(tag: int, value: bytes) -> bytes:
    return struct.pack("<HI", tag, len(value)) + value


def ref_namespace_frame(d: dict[str, Any]) -> bytes:
    def i64(v: int) -> bytes:
        return struct.pack("<q", v)

    return b"".join([
        b"KVNS", struct.pack("<H", 1),
        _ref_field(0x0001, d["tenant"].encode()),
        _ref_field(0x0002, d["model_id"].encode()),
        _ref_field(0x0003, d["weights_digest"].encode()),
        _ref_field(0x0004, d["adapter_id"].encode()),
        _ref_field(0x0005, i64(_REF_DTYPE[d["kv_dtype"]])),
        _ref_field(0x0006, i64(_REF_LAYOUT[d["layout"]])),
        _ref_field(0x0007, i64(d["block_size"])),
        _ref_field(0x0008, i64(d["tp_size"])),
        _ref_field(0x0009, i64(d["pp_stage"])),
        _ref_field(0x000A, i64(d["schema_version"])),
        _ref_field(0x000B, i64(_REF_ALGO[d["hash_algo"]])),
        # the salt: written only when set, so frames without one are unchanged
        _ref_field(0x000C, d["salt"].encode()) if d.get("salt") else b"",
    ])


def ref_h(algo: str, data: bytes) -> bytes:
    if algo == "xxh3_128":
        return xxhash.xxh3_128_digest(data)
    return hashlib.sha256(data).digest()[:16]


def ref_block_keys(d: dict[str, Any], tokens: list[int]) -> list[bytes]:
    bs, algo = d["block_size"], d["hash_algo"]
    prev = ref_h(algo, ref_namespace_frame(d))
    out = []
    for i in range(len(tokens) // bs):
        body = struct.pack(f"<{bs}I", *tokens[i * bs:(i + 1) * bs])
        prev = ref_h(algo, prev + _ref_field(0x0100, body))
        out.append(prev)
    return out


# --------------------------------------------------------------------------
# Test vectors
# --------------------------------------------------------------------------


def test_vectors_cover_the_required_cases() -> None:
    assert len(VECTORS) >= 5
    namespaces = [v["namespace"] for v in VECTORS]
    assert any(n["hash_algo"] == "sha256" for n in namespaces)
    assert any(not n["tenant"].isascii() for n in namespaces)
    assert any(n["block_size"] == 1 for n in namespaces)
    assert any(len(v["tokens"]) % v["namespace"]["block_size"] for v in VECTORS)  # partial block
    assert any(v["tokens"] and not v["block_keys_hex"] for v in VECTORS)  # fewer than one block


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"][:40] for v in VECTORS])
def test_vector(vec: dict[str, Any], impl: str) -> None:
    ns = Namespace.from_dict(vec["namespace"])
    assert ns.to_dict() == vec["namespace"]
    assert ns.framed().hex() == vec["namespace_frame_hex"]
    assert ns.digest.hex() == vec["namespace_digest_hex"]
    keys = block_keys(ns, vec["tokens"])
    assert [k.hex() for k in keys] == vec["block_keys_hex"]
    arr = block_keys_array(ns, np.asarray(vec["tokens"], dtype=np.int64))
    assert [bytes(r).hex() for r in arr] == vec["block_keys_hex"]
    assert len(keys) == len(vec["tokens"]) // ns.block_size


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"][:40] for v in VECTORS])
def test_reference_implementation_reproduces_vectors(vec: dict[str, Any]) -> None:
    d = vec["namespace"]
    assert ref_namespace_frame(d).hex() == vec["namespace_frame_hex"]
    assert ref_h(d["hash_algo"], ref_namespace_frame(d)).hex() == vec["namespace_digest_hex"]
    assert [k.hex() for k in ref_block_keys(d, vec["tokens"])] == vec["block_keys_hex"]


def test_docs_list_the_vectors() -> None:
    doc = (REPO / "docs" / "keys.md").read_text(encoding="utf-8")
    for vec in VECTORS:
        assert vec["namespace_digest_hex"] in doc
        for k in vec["block_keys_hex"]:
            assert k in doc


_SUBPROCESS_CODE = """
import json, sys
import numpy as np
from kvstore import keys, checksum
vecs = json.load(open(sys.argv[1], encoding="utf-8"))["vectors"]
out = {"native": keys.HAVE_NATIVE and checksum.HAVE_NATIVE, "digests": [], "keys": []}
for v in vecs:
    ns = keys.Namespace.from_dict(v["namespace"])
    out["digests"].append(ns.digest.hex())
    out["keys"].append([k.hex() for k in keys.block_keys(ns, v["tokens"])])
ns = keys.Namespace("tenant-" + "x" * 7, "model", block_size=7)
toks = np.arange(1000, dtype=np.int64) * 7919 % 50000
out["extra"] = [k.hex() for k in keys.block_keys(ns, toks)]
out["checksum"] = checksum.checksum(toks)
print(json.dumps(out))
"""


@pytest.mark.parametrize("hashseed,no_native", [("1", "0"), ("987654", "0"), ("random", "1")])
def test_keys_identical_in_fresh_process(hashseed: str, no_native: str) -> None:
    env = dict(os.environ, PYTHONHASHSEED=hashseed, NO_KVSTORE_NATIVE=no_native)
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS_CODE, str(VECTORS_PATH)],
                          env=env, cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    if no_native == "1":
        assert got["native"] is False
    assert got["digests"] == [v["namespace_digest_hex"] for v in VECTORS]
    assert got["keys"] == [v["block_keys_hex"] for v in VECTORS]
    ns = Namespace("tenant-" + "x" * 7, "model", block_size=7)
    toks = np.arange(1000, dtype=np.int64) * 7919 % 50000
    assert got["extra"] == [k.hex() for k in block_keys(ns, toks)]
    assert got["checksum"] == xxhash.xxh3_64_intdigest(toks.tobytes())


# --------------------------------------------------------------------------
# Native == fallback
# --------------------------------------------------------------------------

_block_sizes = st.one_of(st.integers(1, 70), st.sampled_from([128, 255, 256, 257, 1000, 4096]))


@needs_native
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bs=_block_sizes, n_blocks=st.integers(0, 40), extra=st.integers(0, 3),
       seed=st.binary(min_size=16, max_size=16), data=st.data())
def test_native_chain_equals_python(bs: int, n_blocks: int, extra: int, seed: bytes,
                                    data: st.DataObject) -> None:
    n = bs * n_blocks + min(extra, bs - 1)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    toks = rng.integers(0, 2**32, size=n, dtype=np.uint64)
    u32 = toks.astype("<u4")
    expected = K._chain_python(seed, u32, bs, HashAlgo.XXH3_128)
    assert K._native is not None
    assert K._native.chain_keys(seed, u32, bs) == expected
    assert K._native.chain_keys(seed, toks, bs, 0, 8) == expected
    assert K._native.chain_keys(seed, toks.astype(np.int64), bs, id_size=8) == expected


@needs_native
@settings(max_examples=100, deadline=None)
@given(bs=st.integers(1, 300), toks=st.lists(st.integers(0, 2**32 - 1), max_size=700),
       algo=st.sampled_from(list(HashAlgo)), dtype=st.sampled_from(["<u4", "<i8", "<u8", ">i8"]))
def test_public_api_native_equals_fallback(bs: int, toks: list[int], algo: HashAlgo,
                                           dtype: str) -> None:
    ns = Namespace("t", "m", block_size=bs, hash_algo=algo)
    arr = np.asarray(toks, dtype=dtype)
    native = block_keys(ns, arr)
    saved = K._native
    try:
        K._native = None  # type: ignore[misc]
        python = block_keys(ns, arr)
    finally:
        K._native = saved  # type: ignore[misc]
    assert native == python == ref_block_keys(ns.to_dict(), toks)


@needs_native
def test_native_chain_is_thread_safe() -> None:
    ns = Namespace("t", "m", block_size=16)
    toks = np.random.default_rng(3).integers(0, 2**31, size=1 << 16, dtype=np.int64)
    want = block_keys_array(ns, toks).tobytes()
    results: list[bytes] = []

    def work() -> None:
        for _ in range(20):
            results.append(block_keys_array(ns, toks).tobytes())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 80 and all(r == want for r in results)


@needs_native
def test_native_argument_errors() -> None:
    nat = K._native
    assert nat is not None
    seed = bytes(16)
    toks = np.arange(32, dtype="<u4")
    with pytest.raises(ValueError, match="seed must be exactly 16 bytes"):
        nat.chain_keys(b"short", toks, 16)
    with pytest.raises(ValueError, match="block_size must be in"):
        nat.chain_keys(seed, toks, 0)
    with pytest.raises(ValueError, match="block_size must be in"):
        nat.chain_keys(seed, toks, 65537)
    with pytest.raises(ValueError, match="algo must be 0"):
        nat.chain_keys(seed, toks, 16, 1)
    with pytest.raises(ValueError, match="id_size must be 4"):
        nat.chain_keys(seed, toks, 16, 0, 2)
    with pytest.raises(ValueError, match="multiple of 4"):
        nat.chain_keys(seed, b"12345", 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        nat.chain_keys(seed, toks[::2], 1)
    with pytest.raises(TypeError, match="buffer protocol"):
        nat.chain_keys(seed, [1, 2, 3], 1)
    with pytest.raises(ValueError, match="outside"):
        nat.chain_keys(seed, np.array([1, -1], dtype=np.int64), 1, 0, 8)
    with pytest.raises(ValueError, match="outside"):  # in the trailing partial block
        nat.chain_keys(seed, np.array([1, 2, 2**32], dtype=np.int64), 2, 0, 8)
    assert nat.chain_keys(seed, b"", 16) == b""


# --------------------------------------------------------------------------
# Namespace
# --------------------------------------------------------------------------

_BASE = dict(tenant="acme", model_id="llama")
_CHANGES: list[dict[str, Any]] = [
    {"tenant": "acme2"}, {"tenant": "Acme"}, {"model_id": "llama2"},
    {"weights_digest": "abc"}, {"adapter_id": "abc"},
    *({"kv_dtype": d} for d in KVDtype if d is not KVDtype.BFLOAT16),
    *({"layout": lay} for lay in KVLayout if lay is not KVLayout.OPAQUE),
    {"block_size": 17}, {"block_size": 1}, {"tp_size": 2}, {"pp_stage": 1},
    {"schema_version": 2}, {"schema_version": 0}, {"hash_algo": HashAlgo.SHA256},
    # length prefixes: moving bytes between adjacent strings must matter
    {"tenant": "acm", "model_id": "ellama"}, {"tenant": "acmel", "model_id": "lama"},
    {"weights_digest": "", "adapter_id": "x"}, {"weights_digest": "x", "adapter_id": ""},
    {"salt": "x"}, {"salt": "X"}, {"adapter_id": "x", "salt": "x"}, {"salt": "xx"},
]


def test_every_field_change_changes_the_digest() -> None:
    base = Namespace(**_BASE)
    digests = {base.digest}
    frames = {base.framed()}
    for change in _CHANGES:
        ns = Namespace(**{**_BASE, **change})
        assert ns != base
        digests.add(ns.digest)
        frames.add(ns.framed())
    assert len(digests) == len(_CHANGES) + 1
    assert len(frames) == len(_CHANGES) + 1
    # and so does every block key of the same tokens
    toks = list(range(64))
    firsts = {block_keys(Namespace(**{**_BASE, **c}), toks)[0] for c in _CHANGES}
    assert len(firsts) == len(_CHANGES)


def test_namespace_fields_validated() -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tenant": ""}, "tenant"), ({"model_id": ""}, "model_id"),
        ({"tenant": "x" * 257}, "tenant"), ({"adapter_id": "é" * 129}, "adapter_id"),
        ({"weights_digest": 5}, "weights_digest"), ({"tenant": "\ud800"}, "tenant"),
        ({"block_size": 0}, "block_size"), ({"block_size": 65537}, "block_size"),
        ({"block_size": "16"}, "block_size"), ({"block_size": True}, "block_size"),
        ({"block_size": 16.0}, "block_size"), ({"tp_size": 0}, "tp_size"),
        ({"pp_stage": -1}, "pp_stage"), ({"schema_version": -1}, "schema_version"),
        ({"tp_size": 2**63}, "tp_size"),
        ({"kv_dtype": "fp17"}, "kv_dtype"), ({"layout": "nhd"}, "layout"),
        ({"hash_algo": "md5"}, "hash_algo"), ({"kv_dtype": 2}, "kv_dtype"),
    ]
    for change, field_name in bad:
        with pytest.raises(InvalidArgument, match=field_name):
            Namespace(**{**_BASE, **change})
    with pytest.raises(InvalidArgument, match="bfloat16"):  # names the allowed values
        Namespace(**_BASE, kv_dtype="fp17")  # type: ignore[arg-type]
    # limits are inclusive
    assert Namespace(tenant="x" * 256, model_id="é" * 128, block_size=65536).block_size == 65536


def test_namespace_enum_strings_and_ints_normalised() -> None:
    ns = Namespace(tenant="t", model_id="m", kv_dtype="FLOAT16", layout="Layer_KV_Page",  # type: ignore[arg-type]
                   hash_algo="sha256", block_size=np.int64(32))  # type: ignore[arg-type]
    assert ns.kv_dtype is KVDtype.FLOAT16 and ns.layout is KVLayout.LAYER_KV_PAGE
    assert ns.hash_algo is HashAlgo.SHA256
    assert type(ns.block_size) is int and ns.block_size == 32
    same = Namespace(tenant="t", model_id="m", kv_dtype=KVDtype.FLOAT16, layout=KVLayout.LAYER_KV_PAGE,
                     hash_algo=HashAlgo.SHA256, block_size=32)
    assert ns == same and ns.digest == same.digest and len({ns, same}) == 1
    assert KVDtype.parse("torch.bfloat16") is KVDtype.BFLOAT16
    assert [d.itemsize for d in KVDtype] == [2, 2, 4, 1, 1, 1, 1]
    assert KVLayout.LAYER_KV_PAGE.dims == ("layers", "kv", "pages", "page_size", "kv_heads", "head_dim")
    assert KVLayout.PER_LAYER_KV_PAGE.dims == ("kv", "pages", "page_size", "kv_heads", "head_dim")


def test_namespace_dict_roundtrip_and_errors() -> None:
    ns = Namespace(tenant="Zürich", model_id="m", adapter_id="lora", kv_dtype=KVDtype.INT8,
                   layout=KVLayout.PER_LAYER_KV_PAGE, block_size=8, tp_size=4, pp_stage=2,
                   schema_version=5, hash_algo=HashAlgo.SHA256)
    d = ns.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["kv_dtype"] == "int8" and d["layout"] == "per_layer_kv_page" and d["hash_algo"] == "sha256"
    assert Namespace.from_dict(d) == ns and Namespace.from_dict(d).digest == ns.digest
    assert Namespace.from_dict({"tenant": "t", "model_id": "m"}) == Namespace("t", "m")
    with pytest.raises(InvalidArgument, match="'colour'"):
        Namespace.from_dict({**d, "colour": "blue"})
    with pytest.raises(InvalidArgument, match="'model_id'"):
        Namespace.from_dict({"tenant": "t"})
    with pytest.raises(InvalidArgument, match="mapping"):
        Namespace.from_dict([("tenant", "t")])  # type: ignore[arg-type]


def test_namespace_digest_cached_and_frozen() -> None:
    ns = Namespace("t", "m")
    assert ns.digest is ns.digest and len(ns.digest) == 16
    assert ns.framed() is ns.framed() and ns.framed().startswith(b"KVNS\x01\x00")
    with pytest.raises(AttributeError):
        ns.tenant = "other"  # type: ignore[misc]
    other = ns.with_tenant("other")
    assert other.tenant == "other" and other.model_id == "m" and other.digest != ns.digest
    assert ns.with_tenant("t") == ns
    assert " _digest=" not in repr(ns) and "_frame=" not in repr(ns)


# --------------------------------------------------------------------------
# Framing: no collisions between different inputs
# --------------------------------------------------------------------------


def test_prefix_sharing_and_length_extension() -> None:
    ns1 = Namespace("t", "m", block_size=1)
    ab = block_keys(ns1, [1, 2])
    abz = block_keys(ns1, [1, 2, 0])
    assert abz[:2] == ab and abz[2] not in ab  # a longer prompt shares its prefix's keys
    ns2 = Namespace("t", "m", block_size=2)
    assert block_keys(ns2, [1, 2, 0]) == block_keys(ns2, [1, 2])  # partial block: no key
    assert block_keys(ns2, [1, 2])[0] != ab[1]  # same tokens, other block size
    assert block_keys(ns2, [1, 2, 0, 0])[1] != block_keys(ns2, [1, 2, 0])[0:1]


def test_all_distinct_prefixes_get_distinct_keys() -> None:
    # every prefix (block-aligned) of every sequence over a small alphabet, at
    # several block sizes: key i names tokens[: (i+1)*bs] exactly
    alphabet = [0, 1, 256, 2**32 - 1]
    seen: dict[bytes, tuple[int, tuple[int, ...]]] = {}
    for bs in (1, 2, 3):
        ns = Namespace("t", "m", block_size=bs)
        for length in range(1, 7):
            for seq in itertools.product(alphabet, repeat=length):
                keys = block_keys(ns, list(seq))
                for i, k in enumerate(keys):
                    prefix = (bs, seq[: (i + 1) * bs])
                    assert seen.setdefault(k, prefix) == prefix
        assert ns.digest not in seen
    assert len(seen) > 1000


def test_block_boundary_shift_changes_keys() -> None:
    ns = Namespace("t", "m", block_size=4)
    toks = list(range(100, 120))
    base = block_keys(ns, toks)
    shifted = block_keys(ns, [0] + toks[:-1])  # same tokens, one position later
    assert not set(base) & set(shifted)
    assert block_keys(ns, toks[:8] + [999] + toks[9:])[:2] == base[:2]  # change in block 2
    assert block_keys(ns, toks[:8] + [999] + toks[9:])[2:] != base[2:]


# --------------------------------------------------------------------------
# Token inputs
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64", "int16", "int32", "int64",
                                   ">i4", ">u8"])
def test_any_integer_dtype_gives_the_same_keys(dtype: str, impl: str) -> None:
    ns = Namespace("t", "m", block_size=4)
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    want = ref_block_keys(ns.to_dict(), toks)
    assert block_keys(ns, np.asarray(toks, dtype=dtype)) == want
    assert block_keys(ns, np.repeat(np.asarray(toks, dtype=dtype), 2)[::2]) == want  # strided
    assert block_keys(ns, toks) == want and block_keys(ns, tuple(toks)) == want


def test_torch_tensor_input(impl: str) -> None:
    torch = pytest.importorskip("torch")
    ns = Namespace("t", "m", block_size=4)
    toks = list(range(50, 70))
    want = ref_block_keys(ns.to_dict(), toks)
    for dt in (torch.int64, torch.int32):
        assert block_keys(ns, torch.tensor(toks, dtype=dt)) == want
    with pytest.raises(InvalidArgument, match="integer"):
        block_keys(ns, torch.tensor([1.0, 2.0]))
    with pytest.raises(InvalidArgument, match="out of range"):
        block_keys(ns, torch.tensor([1, -2, 3, 4]))


def test_short_and_empty_inputs(impl: str) -> None:
    ns = Namespace("t", "m", block_size=16)
    assert block_keys(ns, []) == [] and block_keys(ns, ()) == []
    assert block_keys(ns, np.zeros(0, np.int64)) == []
    assert block_keys(ns, list(range(15))) == []
    arr = block_keys_array(ns, list(range(15)))
    assert arr.shape == (0, 16) and arr.dtype == np.uint8
    assert len(block_keys(ns, list(range(16)))) == 1


def test_block_keys_array_is_a_view(impl: str) -> None:
    ns = Namespace("t", "m", block_size=8)
    toks = np.arange(8 * 5 + 3)
    arr = block_keys_array(ns, toks)
    assert arr.shape == (5, 16) and arr.dtype == np.uint8 and not arr.flags.writeable
    assert isinstance(arr.base, bytes) or arr.base is not None
    assert [bytes(r) for r in arr] == block_keys(ns, toks)


@pytest.mark.parametrize("bad,match", [
    (np.array([1.0, 2.0]), "integer"),
    (np.array([True, False]), "integer"),
    (np.array([1, "a"], dtype=object), "integer"),
    (np.array(["1", "2"]), "integer"),
    ([1.5, 2], "integer"),
    ([1, None], "integer"),
    (["a"], "integer"),
    (np.zeros((2, 16), dtype=np.int64), "1-D"),
    (np.int64(5), "1-D"),
    ([-1, 2], r"tokens\[0\] = -1 is out of range"),
    (np.array([5, 2**32], dtype=np.int64), r"tokens\[1\] = 4294967296"),
    (np.array([5, 2**32], dtype=np.uint64), "out of range"),
    (np.array([0, -3], dtype=np.int8), "out of range"),
    (np.array([0, -3], dtype=np.int32), "out of range"),
    ([1, 2**64], r"\[0, 2\*\*32\)"),
    ([1, 2**63], r"\[0, 2\*\*32\)"),
    (list(range(16)) + [-1], "out of range"),  # in the trailing partial block
    (12345, "1-D"),
])
def test_bad_tokens_rejected(bad: Any, match: str, impl: str) -> None:
    for algo in HashAlgo:
        ns = Namespace("t", "m", hash_algo=algo)
        with pytest.raises(InvalidArgument, match=match):
            block_keys(ns, bad)
        with pytest.raises(InvalidArgument, match=match):
            block_keys_array(ns, bad)
    with pytest.raises(InvalidArgument, match=match):
        as_token_array(bad)


def test_as_token_array_no_copy_when_possible() -> None:
    a = np.arange(10, dtype="<u4")
    assert as_token_array(a) is a
    b = as_token_array(np.arange(10, dtype=np.int64))
    assert b.dtype == np.dtype("<u4") and b.flags.c_contiguous and b.tolist() == list(range(10))


# --------------------------------------------------------------------------
# first_divergence
# --------------------------------------------------------------------------


def test_first_divergence(impl: str) -> None:
    ns = Namespace("t", "m", block_size=4)
    a = np.arange(20)
    assert first_divergence(ns, a, a.copy()) is None
    assert first_divergence(ns, [], []) is None

    b = a.copy()
    b[9] = 999
    d = first_divergence(ns, a, b)
    assert d == Divergence(block=2, token_start=8, token_end=12, position=9,
                           key_a=block_keys(ns, a)[2], key_b=block_keys(ns, b)[2])
    assert d is not None and d.key_a != d.key_b
    assert block_keys(ns, a)[:2] == block_keys(ns, b)[:2]

    # b is a's prefix ending mid-block: the divergent block is full only in a
    d = first_divergence(ns, a, a[:10])
    assert d is not None and (d.block, d.position, d.token_start, d.token_end) == (2, 10, 8, 12)
    assert d.key_a == block_keys(ns, a)[2] and d.key_b is None

    # difference only in a trailing partial block: reported, no keys
    d = first_divergence(ns, list(range(10)), list(range(9)) + [0])
    assert d is not None and d.block == 2 and d.key_a is None and d.key_b is None

    d = first_divergence(ns, [], [1])
    assert d is not None and (d.block, d.position) == (0, 0)

    with pytest.raises(InvalidArgument, match="tokens_b"):
        first_divergence(ns, a, [1.5])
