"""kvstore.identity: the namespace of a model's KV changes whenever its KV
would (weights, every KV-affecting config field, overrides), stays equal
for the same weights and config elsewhere, and the weights digest is cheap
on a later start (sidecar cache) yet never stale."""

from __future__ import annotations

import builtins
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore import identity, weights
from kvstore.errors import InvalidArgument
from kvstore.identity import (
    KV_CONFIG_FIELDS,
    DigestCache,
    config_digest,
    config_geometry,
    engine_namespace,
    kv_schema,
    weights_digest,
    weights_digest_async,
    window_off,
)

BASE: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                        "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 1024, "rope_theta": 10000.0,
                        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
                        "bos_token_id": 1, "eos_token_id": 2, "transformers_version": "4.57.0"}


class Reads:
    """Counts the files ``kvstore.identity`` (and ``kvstore.weights``, which hashes the weights) opens
    for reading bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []

        def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if "b" in mode:
                self.paths.append(str(file))
            return builtins.open(file, mode, *args, **kwargs)

        for module in (identity, weights):
            monkeypatch.setattr(module, "open", counting_open, raising=False)


def make_model(d: Path, weights: dict[str, bytes], config: dict[str, Any] | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, data in weights.items():
        (d / name).write_bytes(data)
    (d / "config.json").write_text(json.dumps(config if config is not None else BASE))
    return d


def fresh_ok(path: Path) -> DigestCache:
    """A cache that remembers files however recently they changed (the
    files of a test are seconds old)."""
    return DigestCache(path, racy_window_ns=0)


def ns_of(d: Path, cache: Path, **kw: Any) -> Any:
    return engine_namespace(d, block_size=16, kv_dtype="float32", digest_cache=str(cache), **kw)


# ---------------------------------------------------------------- config fields


def _variants(name: str) -> tuple[Any, Any]:
    if name == "text_config":
        return {"rope_theta": 1.0}, {"rope_theta": 2.0}
    if name == "rope_scaling":
        return {"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 4.0}
    return "a", "b"


@pytest.mark.parametrize("name", [n for n, _ in KV_CONFIG_FIELDS])
def test_each_listed_field_changes_the_config_digest_and_the_namespace(name: str, tmp_path: Path) -> None:
    a, b = _variants(name)
    assert config_digest({**BASE, name: a}) != config_digest({**BASE, name: b})
    absent = {k: v for k, v in BASE.items() if k != name}
    assert config_digest(absent) != config_digest({**absent, name: b})
    # the namespace follows (model id derived from the config digest)
    w = {"model.safetensors": b"\x01" * 64}
    na = ns_of(make_model(tmp_path / "a", w, {**BASE, name: a}), tmp_path / "c.json")
    nb = ns_of(make_model(tmp_path / "b", w, {**BASE, name: b}), tmp_path / "c.json")
    assert na.digest != nb.digest


def test_fields_that_do_not_change_kv_do_not_split_the_cache() -> None:
    for name, value in (("bos_token_id", 7), ("eos_token_id", 9), ("transformers_version", "9.9"),
                        ("_name_or_path", "/somewhere/else"), ("use_cache", False)):
        assert config_digest({**BASE, name: value}) == config_digest(BASE), name
    # key order and absent-vs-null do not matter
    assert config_digest(dict(reversed(list(BASE.items())))) == config_digest(BASE)
    assert config_digest({**BASE, "sliding_window": None}) == config_digest(BASE)


def test_hf_overrides_enter_the_digest() -> None:
    base = config_digest(BASE)
    assert config_digest(BASE, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}) != base
    assert config_digest(BASE, {"rope_theta": 20000.0}) != base
    # an overridden field counts even when not listed
    assert config_digest(BASE, {"some_new_knob": 3}) != base
    # overriding a listed field to the value it has is the same model
    assert config_digest(BASE, {"rope_theta": 10000.0}) == base
    # nested overrides update a nested config (transformers writes its model_type)
    nested = {**BASE, "text_config": {"model_type": "llama", "rope_theta": 1.0, "hidden_size": 8}}
    assert config_digest(nested, {"text_config": {"rope_theta": 2.0}}) == \
        config_digest({**BASE, "text_config": {"model_type": "llama", "rope_theta": 2.0, "hidden_size": 8}})
    # a dict-valued field is replaced by vLLM: leaving out a key of the config's dict is another model,
    # although the dict merged into the config's would be the config's
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    cfg = {**BASE, "rope_scaling": {**yarn, "beta_fast": 64.0}}
    assert config_digest(cfg, {"rope_scaling": yarn}) != config_digest(cfg)
    assert config_digest(cfg, {"rope_scaling": yarn}) == config_digest(cfg, {"rope_scaling": dict(yarn)})


def test_a_disabled_sliding_window_is_another_config() -> None:
    # vLLM's --disable-sliding-window: full attention, other KV past the window
    win = {**BASE, "sliding_window": 256}
    assert config_digest(win, window_off(win)) != config_digest(win)
    assert window_off(win, {"rope_theta": 2.0}) == {"rope_theta": 2.0, "sliding_window": None}
    mm = {**BASE, "text_config": {"sliding_window": 256}}
    assert window_off(mm) == {"text_config": {"sliding_window": None}}
    assert config_digest(mm, window_off(mm)) != config_digest(mm)
    for none in (BASE, {**BASE, "sliding_window": 0}):  # no window: nothing to turn off
        assert window_off(none) == {}


def test_nested_override_of_an_unlisted_field_enters_the_digest() -> None:
    # a multimodal model's language model: an unlisted field of text_config
    # (Gemma 3's local-layer RoPE base) overridden through hf_overrides
    # changes the KV, so it must change the namespace like a top-level one
    mm = {**BASE, "text_config": {"model_type": "gemma3_text", "rope_theta": 1.0, "rope_local_base_freq": 10000.0}}
    base = config_digest(mm)
    assert config_digest(mm, {"text_config": {"rope_local_base_freq": 20000.0}}) != base
    assert config_digest(mm, {"text_config": {"rope_local_base_freq": 20000.0}}) != \
        config_digest(mm, {"text_config": {"rope_local_base_freq": 40000.0}})
    # a listed nested field still counts once, as it would edited in config.json
    assert config_digest(mm, {"text_config": {"rope_theta": 2.0}}) == \
        config_digest({**BASE, "text_config": {"model_type": "gemma3_text", "rope_theta": 2.0,
                                               "rope_local_base_freq": 10000.0}})


def test_kv_schema_follows_the_config_geometry() -> None:
    assert config_geometry(BASE) == (4, 2, 64)
    assert config_geometry(BASE, tp_size=2) == (4, 1, 64)
    assert config_geometry({**BASE, "head_dim": 32}) == (4, 2, 32)
    desc, v = kv_schema(BASE, block_size=16, kv_dtype="bfloat16")
    assert desc == "vllm-v1|cuda|||layers=4|kv_heads=2|head=64|block=16|bfloat16" and 0 <= v < 2**31
    assert kv_schema(BASE, block_size=16, kv_dtype="bfloat16", compute_dtype="torch.bfloat16")[1] == v
    others = [kv_schema(BASE, block_size=32, kv_dtype="bfloat16")[1],
              kv_schema(BASE, block_size=16, kv_dtype="float16")[1],
              kv_schema({**BASE, "num_key_value_heads": 4}, block_size=16, kv_dtype="bfloat16")[1],
              kv_schema(BASE, block_size=16, kv_dtype="float8_e4m3fn",
                        compute_dtype="bfloat16")[1],
              kv_schema(BASE, block_size=16, kv_dtype="bfloat16", quantization="fp8")[1],
              kv_schema(BASE, block_size=16, kv_dtype="bfloat16",
                        layout_tag=identity.vllm_layout_tag("cpu"))[1],
              # TP > 1 blocks end in a seal of per-shard checksums: other bytes, another schema
              kv_schema(BASE, block_size=16, kv_dtype="bfloat16", geometry=(4, 2, 64),
                        layout_tag=identity.vllm_layout_tag(tp_size=2))[1]]
    assert len({v, *others}) == 1 + len(others)
    assert identity.vllm_layout_tag("cpu", "NHD", "x", tp_size=1) == "vllm-v1|cpu|NHD|x"
    assert identity.vllm_layout_tag("cpu", "NHD", "x", tp_size=4) == "vllm-v1+seal|cpu|NHD|x"
    assert identity.vllm_layout_tag("cpu", "NHD", "x", 1, "0.32.0") == "vllm-v1|cpu|NHD|x|vllm=0.32.0"


# ---------------------------------------------------------------- the namespace


def test_same_weights_and_config_elsewhere_share_a_namespace(tmp_path: Path) -> None:
    w = {"model-00001-of-00002.safetensors": os.urandom(4096), "model-00002-of-00002.safetensors": os.urandom(999),
         "model.safetensors.index.json": b"{}"}
    a = ns_of(make_model(tmp_path / "models" / "m", w), tmp_path / "c.json")
    b = ns_of(make_model(tmp_path / "elsewhere" / "copy", w), tmp_path / "c.json")
    assert a == b and a.digest == b.digest
    assert "models" not in a.model_id and a.model_id.startswith("LlamaForCausalLM/")
    assert a.weights_digest.startswith("xxh3:")


def test_new_weights_at_the_same_path_get_a_new_namespace(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m", {"model.safetensors": b"A" * 1000})
    before = ns_of(d, tmp_path / "c.json")
    (d / "model.safetensors").write_bytes(b"B" * 1000)
    after = ns_of(d, tmp_path / "c.json")
    assert before.weights_digest != after.weights_digest and before.digest != after.digest
    assert before.model_id == after.model_id  # same config


def test_an_added_or_renamed_weight_file_counts(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m", {"a.safetensors": b"x" * 10})
    one = weights_digest(d, cache=tmp_path / "c.json")
    (d / "b.bin").write_bytes(b"y")
    two = weights_digest(d, cache=tmp_path / "c.json")
    (d / "a.safetensors").rename(d / "c.safetensors")
    three = weights_digest(d, cache=tmp_path / "c.json")
    assert len({one, two, three}) == 3
    (d / "README.md").write_text("not weights")
    assert weights_digest(d, cache=tmp_path / "c.json") == three


def test_explicit_weights_digest_overrides_and_reads_nothing(tmp_path: Path, monkeypatch) -> None:
    d = make_model(tmp_path / "m", {"model.safetensors": b"A" * 100})
    reads = Reads(monkeypatch)
    ns = ns_of(d, tmp_path / "c.json", weights_digest="release-2024-06")
    assert ns.weights_digest == "release-2024-06" and reads.paths == []
    assert ns_of(d, tmp_path / "c.json", model_id="my-model").model_id == "my-model"


def test_remote_code_of_the_model_directory_is_part_of_the_weights(tmp_path: Path) -> None:
    # with trust_remote_code, vLLM's Transformers backend runs the directory's modeling code:
    # code edited in place computes other KV, so it is another namespace (like new weights)
    d = make_model(tmp_path / "m", {"model.safetensors": b"A" * 100},
                   {**BASE, "auto_map": {"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}})
    (d / "modeling_tiny.py").write_text("SCALE = 1.0\n")
    before = ns_of(d, tmp_path / "c.json")
    (d / "modeling_tiny.py").write_text("SCALE = 2.0\n")
    after = ns_of(d, tmp_path / "c.json")
    assert before.weights_digest != after.weights_digest and before.digest != after.digest
    # code alone is no weights
    code_only = make_model(tmp_path / "code-only", {})
    (code_only / "modeling_tiny.py").write_text("SCALE = 1.0\n")
    with pytest.raises(InvalidArgument, match="no weight files"):
        weights_digest(code_only, cache=tmp_path / "c.json")


def test_no_weight_files_is_an_error(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m", {})
    with pytest.raises(InvalidArgument, match="no weight files"):
        weights_digest(d, cache=tmp_path / "c.json")
    with pytest.raises(InvalidArgument, match="does not exist"):
        weights_digest(tmp_path / "missing")


# ---------------------------------------------------------------- sidecar cache


def test_second_digest_reads_no_weight_bytes(tmp_path: Path, monkeypatch) -> None:
    d = make_model(tmp_path / "m", {"a.safetensors": os.urandom(3 << 20), "b.safetensors": os.urandom(1 << 20)})
    cache = tmp_path / "cache" / "weights-digest.json"
    reads = Reads(monkeypatch)
    first = weights_digest(d, cache=fresh_ok(cache))
    assert sorted(Path(p).name for p in reads.paths) == ["a.safetensors", "b.safetensors"]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
    reads.paths.clear()
    assert weights_digest(d, cache=fresh_ok(cache)) == first
    assert reads.paths == []
    assert weights_digest(d, use_cache=False) == first  # the cache changes speed, never the answer


def test_touched_file_is_hashed_again(tmp_path: Path, monkeypatch) -> None:
    d = make_model(tmp_path / "m", {"a.safetensors": b"a" * 100, "b.safetensors": b"b" * 100})
    cache = tmp_path / "c.json"
    first = weights_digest(d, cache=fresh_ok(cache))
    st = (d / "a.safetensors").stat()
    os.utime(d / "a.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    reads = Reads(monkeypatch)
    assert weights_digest(d, cache=fresh_ok(cache)) == first  # same bytes, same digest
    assert [Path(p).name for p in reads.paths] == ["a.safetensors"]  # only the touched one


def test_replaced_file_is_never_served_from_the_cache(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m", {"a.safetensors": b"a" * 100})
    cache = tmp_path / "c.json"
    first = weights_digest(d, cache=fresh_ok(cache))
    # replaced by rename (new inode), same size, same mtime
    st = (d / "a.safetensors").stat()
    (tmp_path / "new").write_bytes(b"z" * 100)
    os.utime(tmp_path / "new", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp_path / "new", d / "a.safetensors")
    second = weights_digest(d, cache=fresh_ok(cache))
    assert second != first
    # rewritten in place (same inode, same size) with its mtime put back: the
    # ctime still changes; and a file changed within the racy window of its
    # hash (as here: same clock tick possible) was not remembered at all
    st = (d / "a.safetensors").stat()
    with open(d / "a.safetensors", "r+b") as f:
        f.write(b"q")
    os.utime(d / "a.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (d / "a.safetensors").stat().st_mtime_ns == st.st_mtime_ns
    assert weights_digest(d, cache=cache) not in (first, second)
    assert weights_digest(d, cache=cache) == weights_digest(d, use_cache=False)


def test_corrupt_cache_is_ignored_and_rewritten(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m", {"a.safetensors": b"a" * 100})
    cache = tmp_path / "c.json"
    want = weights_digest(d, use_cache=False)
    for junk in (b"{not json", b"[]", b'{"version": 1, "files": {"x": 3}}', b"\xff\xfe", b""):
        cache.write_bytes(junk)
        assert weights_digest(d, cache=fresh_ok(cache)) == want
        assert json.loads(cache.read_text())["version"] == 1
    # a cache entry with a forged digest but a wrong stamp is not trusted
    data = json.loads(cache.read_text())
    for e in data["files"].values():
        e["digest"], e["stamp"][0] = "0" * 32, e["stamp"][0] + 1
    cache.write_text(json.dumps(data))
    assert weights_digest(d, cache=fresh_ok(cache)) == want


def test_default_cache_location(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("KVSTORE_DIGEST_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert DigestCache.default_path() == tmp_path / "xdg" / "kvstore" / "weights-digest.json"
    d = make_model(tmp_path / "m", {"a.safetensors": b"a"})
    weights_digest(d, cache=DigestCache(racy_window_ns=0))
    assert (tmp_path / "xdg" / "kvstore" / "weights-digest.json").is_file()
    monkeypatch.setenv("KVSTORE_DIGEST_CACHE", str(tmp_path / "elsewhere.json"))
    assert DigestCache.default_path() == tmp_path / "elsewhere.json"


def test_async_digest_equals_the_sync_one(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m", {"a.safetensors": os.urandom(1 << 20)})
    f1 = weights_digest_async(d, cache=str(tmp_path / "c.json"))
    f2 = weights_digest_async(d, cache=str(tmp_path / "c.json"))
    assert f1.result(timeout=60) == f2.result(timeout=60) == weights_digest(d, use_cache=False)


# ---------------------------------------------------------------- HF cache snapshots


def _snapshot(root: Path, commit: str, files: dict[str, bytes]) -> Path:
    repo = root / "models--org--m"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / xxhash.xxh3_128_hexdigest(data)
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (snap / "config.json").write_text(json.dumps(BASE))
    return snap


def test_hf_snapshot_is_named_by_its_blobs_without_reading_them(tmp_path: Path, monkeypatch) -> None:
    w = {"model.safetensors": os.urandom(2048)}
    s1 = _snapshot(tmp_path, "a" * 40, w)
    s2 = _snapshot(tmp_path, "b" * 40, w)  # a later commit that changed only the README
    s3 = _snapshot(tmp_path, "c" * 40, {"model.safetensors": os.urandom(2048)})
    reads = Reads(monkeypatch)
    d1, d2, d3 = (weights_digest(s, cache=tmp_path / "c.json") for s in (s1, s2, s3))
    assert reads.paths == []
    assert d1.startswith("hf:") and d1 == d2 != d3
    # a weight file replaced by a plain file: the content is hashed instead
    (s1 / "model.safetensors").unlink()
    (s1 / "model.safetensors").write_bytes(b"edited")
    assert weights_digest(s1, cache=tmp_path / "c.json").startswith("xxh3:")


def test_a_file_changed_just_before_its_hash_is_not_remembered(tmp_path: Path, monkeypatch) -> None:
    d = make_model(tmp_path / "m", {"a.safetensors": b"a" * 100})
    cache = tmp_path / "c.json"
    reads = Reads(monkeypatch)
    weights_digest(d, cache=DigestCache(cache, racy_window_ns=3600 * 10**9))
    weights_digest(d, cache=DigestCache(cache, racy_window_ns=3600 * 10**9))
    assert [Path(p).name for p in reads.paths] == ["a.safetensors"] * 2


def test_empty_and_large_files_hash_like_their_bytes(tmp_path: Path) -> None:
    big = os.urandom((64 << 20) + 123)  # more than one mapped chunk
    d = make_model(tmp_path / "m", {"empty.bin": b"", "big.safetensors": big})
    got = weights_digest(d, use_cache=False)
    rows = [("big.safetensors", len(big), xxhash.xxh3_128_hexdigest(big)),
            ("empty.bin", 0, xxhash.xxh3_128_hexdigest(b""))]
    want = "xxh3:" + xxhash.xxh3_128_hexdigest(json.dumps(rows, separators=(",", ":")).encode())
    assert got == want


def test_mistral_format_params_json_is_the_config(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "consolidated.safetensors").write_bytes(b"w")
    (d / "params.json").write_text(json.dumps({"dim": 4096, "rope_theta": 1e6}))
    assert identity.load_config(d) == {"dim": 4096, "rope_theta": 1e6}
    a = ns_of(d, tmp_path / "c.json")
    (d / "params.json").write_text(json.dumps({"dim": 4096, "rope_theta": 1e4}))
    assert ns_of(d, tmp_path / "c.json").model_id != a.model_id


def test_kv_fields_of_mistral_params_json_and_gemma3_change_the_namespace(tmp_path: Path) -> None:
    # config edits that change the KV with the weights untouched: a
    # params.json's YaRN factor and norm epsilon, Gemma 3's local RoPE base
    params = {"dim": 64, "n_layers": 2, "head_dim": 16, "hidden_dim": 128, "n_heads": 4, "n_kv_heads": 2,
              "norm_eps": 1e-5, "vocab_size": 256, "rope_theta": 1e6,
              "yarn": {"factor": 4.0, "original_max_position_embeddings": 4096, "beta": 32, "alpha": 1}}
    gemma = {**BASE, "architectures": ["Gemma3ForCausalLM"], "rope_local_base_freq": 10000.0}
    for cfg, edited in ((params, {**params, "yarn": {**params["yarn"], "factor": 8.0}}),
                        (params, {**params, "norm_eps": 1e-6}),
                        (params, {**params, "llama_4_scaling": {"original_max_position_embeddings": 8192,
                                                                "beta": 0.1}}),
                        (gemma, {**gemma, "rope_local_base_freq": 20000.0})):
        assert config_digest(cfg) != config_digest(edited)
    d = tmp_path / "m"
    d.mkdir()
    (d / "consolidated.safetensors").write_bytes(b"w")
    (d / "params.json").write_text(json.dumps(params))
    a = ns_of(d, tmp_path / "c.json")
    (d / "params.json").write_text(json.dumps({**params, "yarn": {**params["yarn"], "factor": 8.0}}))
    assert ns_of(d, tmp_path / "c.json").digest != a.digest


def test_adapter_digest_names_a_lora_by_its_files(tmp_path: Path) -> None:
    def lora(d: Path, weights: bytes, **cfg: Any) -> Path:
        d.mkdir(parents=True, exist_ok=True)
        (d / "adapter_model.safetensors").write_bytes(weights)
        (d / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, **cfg}))
        return d

    a = identity.adapter_digest(lora(tmp_path / "a", b"v1", base_model_name_or_path="/x"), cache=tmp_path / "c")
    assert a.startswith("lora:")
    assert identity.adapter_digest(lora(tmp_path / "elsewhere", b"v1", base_model_name_or_path="/y"),
                                   cache=tmp_path / "c") == a
    assert identity.adapter_digest(lora(tmp_path / "b", b"v2"), cache=tmp_path / "c") != a
    assert identity.adapter_digest(lora(tmp_path / "c2", b"v1", lora_alpha=32), cache=tmp_path / "c") != a


def test_docs_list_every_field() -> None:
    root = Path(__file__).resolve().parents[3]
    text = (root / "docs" / "keys.md").read_text(encoding="utf-8")
    for name, why in KV_CONFIG_FIELDS:
        assert f"| `{name}` | {why} |" in text, name


def test_the_mistral_format_reads_params_json_as_vllm_does(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m", {"model.safetensors": b"w"})
    (d / "params.json").write_text(json.dumps({"dim": 256, "n_layers": 4, "norm_eps": 1e-5}))
    hf = identity.load_config(d)
    assert hf == BASE == identity.load_config(d, "hf")  # auto: config.json (no consolidated weights)
    mistral = identity.load_config(d, "mistral")
    assert mistral["norm_eps"] == 1e-5 and mistral["rms_norm_eps"] == BASE["rms_norm_eps"]
    assert mistral["config_format"] == "mistral"
    assert identity.config_digest(mistral) != identity.config_digest(hf)
    (d / "consolidated.safetensors").write_bytes(b"w")  # vLLM's auto detection: params.json + consolidated
    assert identity.load_config(d) == mistral and identity.load_config(d, "hf") == BASE
    with pytest.raises(InvalidArgument, match="config format"):
        identity.load_config(d, "gguf")
