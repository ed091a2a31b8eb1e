"""Security: nothing unsafe crosses a process boundary, listeners are local
by default, auth is enforced on every RPC, tenants are isolated (even when
a weakened hash makes their keys and namespace digests collide), files are
private, and namespace framing resists crafted field values."""

from __future__ import annotations

import ast
import os
import stat
import struct
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.client import Client, ns_pb
from kvstore.config import load_config
from kvstore.errors import KeyStatus, PermissionDenied
from kvstore.core import keytable
from kvstore.keys import HashAlgo, KVDtype, KVLayout, Namespace, block_keys
from kvstore.results import EventKind
from proto import kvstore_pb2 as pb
from tests.conftest import payload_for
from tests.faults.faultlib import ROOT, isetting, record

PRODUCT_DIRS = ("kvstore", "tiers", "transport", "engine_adapter", "admission")
BS = 16 * 1024


def P(tag: bytes, k: bytes) -> bytes:
    return payload_for(tag, k, BS)


# ------------------------------------------------------------ static checks
_BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "jsonpickle"}
_BANNED_CALLS = {"eval", "exec"}


def parse(src: str, name: str, tries: int = 5) -> ast.Module:
    """``ast.parse``, tried again on CPython 3.11's ``SystemError: AST
    constructor recursion depth mismatch``: its AST-to-object depth count is
    shared by the interpreter's threads (cpython gh-106905), and a thread of
    an earlier test formatting a traceback (3.11's caret anchors parse the
    line) can trip it. Two full test runs on this machine hit it once each."""
    for i in range(tries):
        try:
            return ast.parse(src, name)
        except SystemError:
            if i == tries - 1:
                raise
    raise AssertionError("unreachable")


def scan_source(src: str, name: str) -> list[str]:
    """Unsafe deserialisation / dynamic code in one module's source."""
    out: list[str] = []
    tree = parse(src, name)
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in _BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in _BANNED_MODULES:
                out.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in _BANNED_CALLS:
                out.append(f"{where}: {f.id}(...)")
            if isinstance(f, ast.Attribute):
                base = f.value.id if isinstance(f.value, ast.Name) else ""
                if base == "torch" and f.attr == "load":
                    out.append(f"{where}: torch.load(...)")
                if base in ("builtins",) and f.attr in _BANNED_CALLS:
                    out.append(f"{where}: builtins.{f.attr}(...)")
                if f.attr in ("load", "loads") and base in ("np", "numpy") and any(
                        k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                        for k in node.keywords):
                    out.append(f"{where}: {base}.{f.attr}(allow_pickle=...)")
                if f.attr == "Options" and base == "rocksdict" and not any(
                        k.arg == "raw_mode" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in node.keywords):
                    out.append(f"{where}: rocksdict.Options without raw_mode=True (pickles values)")
        elif isinstance(node, ast.Attribute) and node.attr in ("recv_pyobj", "send_pyobj"):
            out.append(f"{where}: .{node.attr}")
    return out


def product_files() -> list[Path]:
    files: list[Path] = []
    for d in PRODUCT_DIRS:
        files += sorted(p for p in (Path(ROOT) / d).rglob("*.py") if "_vendor" not in p.parts)
    return files


def test_scanner_catches_each_banned_construct() -> None:
    bad = ("import pickle\nfrom cPickle import loads\nimport dill\nsock.recv_pyobj()\ntorch.load(f)\n"
           "eval('1')\nexec('x=1')\nnp.load(f, allow_pickle=True)\nrocksdict.Options()\n")
    assert len(scan_source(bad, "bad.py")) == 9
    ok = ("import json\nx = ast.literal_eval('1')\nre.compile('a')\ntorch.frombuffer(b)\n"
          "np.load(f)\nrocksdict.Options(raw_mode=True)\nmodel.eval()\n")
    assert scan_source(ok, "ok.py") == []


def test_product_code_never_unpickles_or_evals() -> None:
    files = product_files()
    assert len(files) > 20
    found: list[str] = []
    for p in files:
        found += scan_source(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))
    # a plain-text pass too, for anything the AST pass cannot see (strings handed to a shell, ...)
    for p in files:
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if "recv_pyobj" in code or "torch.load(" in code or "pickle.load" in code:
                found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    record("security", static_scan_files=len(files), static_scan_findings=len(found))
    assert not found, "unsafe deserialisation or dynamic code:\n" + "\n".join(found)


def test_default_listeners_are_local() -> None:
    cfg = load_config(None, {}, {})
    local = {"127.0.0.1", "::1", "localhost", ""}
    assert cfg.server.host in local, cfg.server.host
    assert cfg.metrics.host in local, cfg.metrics.host
    assert cfg.server.unix_socket == "" or cfg.server.unix_socket.startswith("/")
    # and the in-code defaults of the CLI and the client agree
    from kvstore.client import sync as client
    assert client.DEFAULT_TARGET.split(":")[0] in local


# --------------------------------------------------------------- auth, tenants
TENANTS = ('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n\n'
           '[[tenant]]\nname = "{beta}"\ntoken = "tok-beta"\n\n'
           '[[tenant]]\nname = "ops"\ntoken = "tok-admin"\nadmin = true\n')


def _tenants_file(tmp_path: Path, beta: str = "beta") -> str:
    p = tmp_path / "tenants.toml"
    p.write_text(TENANTS.replace("{beta}", beta))
    return str(p)


def _all_methods() -> list[tuple[str, str, Any]]:
    """(path, kind, request class) of every KVStore and Admin RPC."""
    out = []
    for svc in ("KVStore", "Admin"):
        sd = pb.DESCRIPTOR.services_by_name[svc]
        for m in sd.methods:
            kind = "stream" if m.server_streaming else "unary"
            out.append((f"/{sd.full_name}/{m.name}", kind, getattr(pb, m.input_type.name)))
    return out


def _code(channel: grpc.Channel, path: str, kind: str, req: bytes, md: list[tuple[str, str]]) -> grpc.StatusCode:
    try:
        if kind == "unary":
            channel.unary_unary(path)(req, metadata=md, timeout=10)
        else:
            for _ in channel.unary_stream(path)(req, metadata=md, timeout=2):
                pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_every_rpc_needs_a_valid_token(make_daemon, tmp_path) -> None:
    d = make_daemon(server__tenants_file=_tenants_file(tmp_path))
    ch = grpc.insecure_channel(d.target)
    methods = _all_methods()
    assert len(methods) >= 20
    bad_headers: list[list[tuple[str, str]]] = [
        [], [("authorization", "tok-acme")], [("authorization", "Bearer ")], [("authorization", "Bearer nope")],
        [("authorization", "Basic dG9rLWFjbWU=")], [("authorization", "Bearer tok-acm")],
        [("authorization", "Bearer tok-acmee")], [("authorization", "bearer tok-acme")]]
    calls = 0
    for path, kind, _ in methods:
        for md in bad_headers:
            assert _code(ch, path, kind, b"", md) == grpc.StatusCode.UNAUTHENTICATED, (path, md)
            calls += 1
    # the admin service needs an admin token even with a valid tenant token
    for path, kind, _ in methods:
        if "/kvstore.v1.Admin/" in path:
            assert _code(ch, path, kind, b"", [("authorization", "Bearer tok-acme")]) == \
                grpc.StatusCode.PERMISSION_DENIED
    # health stays open (load balancers probe it); it reveals nothing else
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
    ch.close()
    record("security", unauthenticated_calls_refused=calls)


def _isolation_checks(d: Any, ns_a: Namespace, ns_b: Namespace, tag: bytes, n: int = 6,
                      colliding: bool = False) -> dict[str, int]:
    """acme stores a chain in ns_a; beta, with ns_b (same fields and keys,
    tenant from its token), must not hit, read, pin, remove, drop or watch it.
    (When the two namespaces' digests collide, events of that digest go to
    neither tenant.)"""
    keys = block_keys(ns_a, np.arange(n * ns_a.block_size, dtype=np.int64) * 7 % 5000)
    leaks = 0
    with Client(d.target, token="tok-acme") as a, Client(d.target, token="tok-beta") as b, \
            Client(d.target, token="tok-beta", use_shm=False) as b_inline:
        assert a.server_tenant == "acme" and b.server_tenant != "acme"
        seq0 = d.daemon.events.seq
        assert a.put(ns_a, keys, [P(tag, k) for k in keys]) == [KeyStatus.OK] * n
        # the namespace a tenant sends cannot name another tenant
        with pytest.raises(PermissionDenied):
            b.lookup(ns_a, keys)
        ns_b_wire = ns_pb(ns_b)
        ns_b_wire.tenant = ""  # "whatever my token says"
        look = b._call(b.stub.Lookup, pb.LookupRequest(ns=ns_b_wire, keys_packed=b"".join(keys)))
        leaks += look.hit_blocks
        leaks += sum(g is not None for g in b.get(ns_b, keys))
        leaks += sum(g is not None for g in b_inline.get(ns_b, keys))
        outs = [np.zeros(BS, np.uint8) for _ in keys]
        leaks += sum(s is KeyStatus.OK for s in b.get_into(ns_b, keys, outs))
        lease = b.acquire(ns_b, keys)  # "pin"
        leaks += lease.hit_blocks
        lease.release()
        r = b._call(b.stub.Prefetch, pb.PrefetchRequest(ns=ns_b_wire, keys=keys))
        leaks += r.hit_blocks
        r = b._call(b.stub.Admit, pb.AdmitRequest(ns=ns_b_wire, keys=keys, n_tokens=n * ns_b.block_size,
                                                  ttft_target_s=1.0, block_bytes=BS, dry_run=True))
        leaks += r.hit_blocks
        leaks += sum(s is KeyStatus.OK for s in b.remove(ns_b, keys))
        leaks += b.report_corrupt(ns_b, keys)
        b.clear(ns_b)
        b.clear(None)  # "all namespaces" = all of beta's
        st = b.stats()
        leaks += sum(1 for n_ in st.namespaces if n_.label.startswith("acme"))
        # beta's watch sees none of acme's events; acme's sees its own
        theirs = list(b.watch_events(after_seq=seq0, timeout=1.5))
        leaks += sum(1 for e in theirs if e.kind is EventKind.STORED and set(e.keys) & set(keys))
        mine = list(a.watch_events(after_seq=seq0, timeout=1.5))
        assert colliding or any(e.kind is EventKind.STORED and set(e.keys) & set(keys) for e in mine)
        # beta cannot act on acme's lease or reservation ids, nor use acme's session
        la = a.acquire(ns_a, keys[:2])
        for call, req in ((b.stub.Release, pb.ReleaseRequest(lease_id=la.lease_id)),):
            with pytest.raises(grpc.RpcError) as ei:
                call(req, metadata=[("authorization", "Bearer tok-beta")], timeout=10)
            assert ei.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND)
        with pytest.raises(grpc.RpcError) as ei:
            b.stub.Acquire(pb.AcquireRequest(ns=ns_b_wire, keys=keys), timeout=10,
                           metadata=[("authorization", "Bearer tok-beta"), ("x-kvstore-session", a.session)])
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
        la.release()
        # and acme still has every block, byte-exact
        got = a.get(ns_a, keys)
        assert [g.tobytes() if g is not None else None for g in got] == [P(tag, k) for k in keys]
    return {"leaks": leaks}


def test_a_tenant_never_sees_another_tenants_blocks(make_daemon, tmp_path) -> None:
    d = make_daemon(server__tenants_file=_tenants_file(tmp_path), dram__capacity="16MiB")
    ns_a = Namespace(tenant="acme", model_id="llama", block_size=16)
    ns_b = Namespace(tenant="beta", model_id="llama", block_size=16)
    out = _isolation_checks(d, ns_a, ns_b, b"iso")
    record("security", cross_tenant_leaks=out["leaks"])
    assert out["leaks"] == 0


def _weak_digest(self: HashAlgo, data: Any) -> bytes:
    """A deliberately weak H: 16 bits of XXH3 (the rest zero)."""
    return _STRONG(self, data)[:2] + bytes(14)


_STRONG = HashAlgo.digest


def _colliding_tenant(model: str) -> str:
    """A tenant name whose namespace digest collides with acme's under the weak H."""
    want = Namespace(tenant="acme", model_id=model, block_size=16).digest
    for i in range(1_000_000):
        name = f"beta{i}"
        if Namespace(tenant=name, model_id=model, block_size=16).digest == want:
            return name
    raise AssertionError("no collision found")


def test_weakened_16_bit_hash_collisions_are_misses(make_daemon, tmp_path, monkeypatch) -> None:
    """Under a 16-bit H, two tenants' namespaces get the same digest and
    their chains the same keys; the index's own hash table is also cut to a
    handful of buckets. The store compares full keys and full namespaces, so
    every collision is a miss."""
    monkeypatch.setattr(HashAlgo, "digest", _weak_digest)
    # the key table's numpy path (the C one hashes on its own) with 4 home buckets
    monkeypatch.setattr(keytable, "HASHTAB", None)
    monkeypatch.setattr(keytable.KeyTable, "home", lambda self, k0, ns: (np.asarray(k0, np.uint64) & np.uint64(3))
                        .astype(np.int64) & (self.table.size - 1))
    beta = _colliding_tenant("llama")
    ns_a = Namespace(tenant="acme", model_id="llama", block_size=16)
    ns_b = Namespace(tenant=beta, model_id="llama", block_size=16)
    assert ns_a.digest == ns_b.digest and ns_a != ns_b
    d = make_daemon(server__tenants_file=_tenants_file(tmp_path, beta), dram__capacity="16MiB")
    out = _isolation_checks(d, ns_a, ns_b, b"weak", colliding=True)
    # keys that share the 16-bit bucket hash but differ elsewhere are distinct blocks
    with Client(d.target, token="tok-acme") as a:
        keys = [bytes([i % 4]) + bytes(7) + struct.pack("<Q", i) for i in range(64)]
        for i, k in enumerate(keys):
            assert a.put(ns_a, [k], [P(b"bucket", k)]) == [KeyStatus.OK], i
        near = [bytes([i % 4]) + bytes(7) + struct.pack("<Q", i + 1000) for i in range(64)]
        assert a.lookup(ns_a, near[:1]).hit_blocks == 0
        got = a.get(ns_a, keys)
        wrong = sum(g is not None and g.tobytes() != P(b"bucket", k) for g, k in zip(got, keys))
    record("security", weak_hash_collision_leaks=out["leaks"] + wrong)
    assert out["leaks"] == 0 and wrong == 0


def test_weakened_hash_namespace_collision_in_one_store(tmp_path, monkeypatch) -> None:
    """The same, at the store with an SSD tier: a colliding namespace never
    reads the other's blocks, before or after a restart."""
    from kvstore.core.store import StoreConfig, TieredStore
    from kvstore.core.ssd_mover import SsdSpec

    monkeypatch.setattr(HashAlgo, "digest", _weak_digest)
    beta = _colliding_tenant("m")
    ns_a = Namespace(tenant="acme", model_id="m", block_size=16)
    ns_b = Namespace(tenant=beta, model_id="m", block_size=16)
    keys = block_keys(ns_a, np.arange(64, dtype=np.int64))
    cfg = StoreConfig(dram_bytes=1 << 20, dram_page_bytes=256 << 10,
                      ssd=SsdSpec(path=str(tmp_path / "ssd"), capacity_bytes=8 << 20, admit_min_hits=0,
                                  write_mode="through", sync=False))
    with TieredStore(cfg) as s:
        assert s.put(ns_a, keys, [P(b"a", k) for k in keys]).ok
        assert s.lookup(ns_b, keys).hit_blocks == 0
        assert s.put(ns_b, keys, [P(b"b", k) for k in keys]).ok
        for _ in range(100):
            if not s.background():
                break
        for ns, tag in ((ns_a, b"a"), (ns_b, b"b")):
            got = s.get(ns, keys).payloads
            assert all(g is None or g.tobytes() == P(tag, k) for g, k in zip(got, keys))
    with TieredStore(cfg) as s:
        for ns, tag in ((ns_a, b"a"), (ns_b, b"b")):
            got = s.get(ns, keys).payloads
            assert all(g is None or g.tobytes() == P(tag, k) for g, k in zip(got, keys)), ns.tenant


# ---------------------------------------------------------- files and modes
def test_sockets_are_private_from_their_bind_not_from_a_chmod_after(make_daemon, tmp_path, monkeypatch) -> None:
    """With a umask of 0 a socket is bound 0777: the chmod that follows
    leaves a window in which anyone could connect and keep the connection.
    With every chmod of the sockets skipped (the window held open), both are
    0600 all the same: they are bound under a private umask."""
    real = os.chmod

    def chmod(path, mode, *a, **kw):
        if str(path).endswith((".sock", ".lookup")):
            return None  # as if the daemon had not got to its chmod yet
        return real(path, mode, *a, **kw)

    monkeypatch.setattr(os, "chmod", chmod)
    sock = str(tmp_path / "kv.sock")
    old = os.umask(0)
    try:
        d = make_daemon(server__host="", server__unix_socket=sock)
    finally:
        os.umask(old)
    for path in (sock, sock + ".lookup"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert d.store is not None and os.umask(old) == old  # the daemon left the process's umask as it was


def test_shm_ssd_and_socket_are_private(make_daemon, tmp_path) -> None:
    old = os.umask(0)  # modes must not depend on the operator's umask
    try:
        sock = str(tmp_path / "kv.sock")
        d = make_daemon(server__host="", server__unix_socket=sock, ssd__capacity="16MiB",
                        ssd__path=str(tmp_path / "ssd"), ssd__write_mode="through", ssd__admit_min_hits=0)
    finally:
        os.umask(old)
    uid = os.getuid()
    slab = os.stat(d.store.dram.path)
    assert stat.S_IMODE(slab.st_mode) == 0o600 and slab.st_uid == uid
    s = os.stat(sock)
    assert stat.S_IMODE(s.st_mode) == 0o600 and s.st_uid == uid
    ns = Namespace(tenant="t", model_id="m", block_size=16)
    keys = block_keys(ns, np.arange(64, dtype=np.int64))
    with Client(d.target) as c:
        assert c.put(ns, keys, [P(b"m", k) for k in keys]) == [KeyStatus.OK] * 4
    from tests.integration.conftest import wait_until

    wait_until(lambda: d.call(lambda: int((d.store.index.ssd_loc[d.store.index.used_rows()] >= 0).sum())) == 4,
               what="write-through copies")
    root = tmp_path / "ssd"
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and os.stat(root).st_uid == uid
    checked = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames:
            m = os.stat(os.path.join(dirpath, n))
            assert stat.S_IMODE(m.st_mode) == 0o700 and m.st_uid == uid, n
        for n in filenames:
            m = os.stat(os.path.join(dirpath, n))
            assert m.st_uid == uid
            if dirpath == str(root):  # the tier's own files; RocksDB's sit in index/ (0700)
                assert stat.S_IMODE(m.st_mode) == 0o600, n
            checked += 1
    record("security", private_files_checked=checked)


# ---------------------------------------------------- keys and namespaces
def parse_frame(frame: bytes) -> dict[str, Any]:
    """Decode a namespace frame (docs/keys.md): a left inverse of framing,
    so two namespaces with equal frames are equal (framing is injective)."""
    codes_dtype = {1: "float16", 2: "bfloat16", 3: "float32", 4: "float8_e4m3fn", 5: "float8_e5m2",
                   6: "int8", 7: "uint8"}
    codes_layout = {1: "opaque", 2: "layer_kv_page", 3: "per_layer_kv_page"}
    codes_algo = {1: "xxh3_128", 2: "sha256"}
    names = ["tenant", "model_id", "weights_digest", "adapter_id", "kv_dtype", "layout", "block_size",
             "tp_size", "pp_stage", "schema_version", "hash_algo", "salt"]
    assert frame[:4] == b"KVNS" and struct.unpack_from("<H", frame, 4)[0] == 1
    pos, out = 6, {}
    for i, name in enumerate(names):
        if pos == len(frame) and name == "salt":
            break
        tag, n = struct.unpack_from("<HI", frame, pos)
        assert tag == i + 1, (tag, name)
        val = frame[pos + 6:pos + 6 + n]
        assert len(val) == n
        pos += 6 + n
        if name in ("tenant", "model_id", "weights_digest", "adapter_id", "salt"):
            out[name] = val.decode("utf-8")
        else:
            assert n == 8
            v = struct.unpack("<q", val)[0]
            out[name] = {"kv_dtype": codes_dtype, "layout": codes_layout, "hash_algo": codes_algo}.get(
                name, {}).get(v, v)
    assert pos == len(frame), "trailing bytes"
    if out.get("salt") == "":
        raise AssertionError("an empty salt must not be framed")
    return out


def _frame_piece(tag: int, value: bytes) -> str:
    """Frame bytes of one field, as text (to plant inside another field)."""
    return (struct.pack("<HI", tag, len(value)) + value).decode("latin-1")


_CRAFTED = st.sampled_from([
    "", "a", "acme", "x" * 256, "ü" * 128,
    _frame_piece(0x000C, b"user-1"),               # a string that looks like a salt field
    _frame_piece(0x0004, b"lora") + _frame_piece(0x000C, b"s"),
    "\x00" * 8, "\x0c\x00\x01\x00\x00\x00x",
    "KVNS\x01\x00", _frame_piece(0x0002, b"llama"),
])
_TEXT = st.one_of(_CRAFTED, st.text(max_size=12))
_NAMESPACES = st.builds(
    Namespace, tenant=st.one_of(_CRAFTED, st.text(min_size=1, max_size=12)).filter(bool),
    model_id=st.one_of(_CRAFTED, st.text(min_size=1, max_size=12)).filter(bool),
    weights_digest=_TEXT, adapter_id=_TEXT, salt=_TEXT,
    kv_dtype=st.sampled_from(list(KVDtype)), layout=st.sampled_from(list(KVLayout)),
    block_size=st.sampled_from([1, 2, 16, 17, 65536]), tp_size=st.sampled_from([1, 2, 8, 2**40]),
    pp_stage=st.sampled_from([0, 1, 3]), schema_version=st.sampled_from([0, 1, 2]),
    hash_algo=st.sampled_from(list(HashAlgo)))

_FIELDS = ("tenant", "model_id", "weights_digest", "adapter_id", "kv_dtype", "layout", "block_size",
           "tp_size", "pp_stage", "schema_version", "hash_algo", "salt")


@settings(max_examples=isetting("key_examples", 300), deadline=None, database=None)
@given(a=_NAMESPACES, b=_NAMESPACES)
def test_different_namespaces_never_share_a_frame_digest_or_key(a: Namespace, b: Namespace) -> None:
    fa, fb = a.framed(), b.framed()
    assert parse_frame(fa) == {k: v for k, v in a.to_dict().items() if k != "salt" or v} | (
        {"salt": a.salt} if a.salt else {})
    same = all(getattr(a, f) == getattr(b, f) for f in _FIELDS)
    assert (fa == fb) == same
    if not same:
        assert a.digest != b.digest
        toks = list(range(max(a.block_size, b.block_size)))
        ka, kb = block_keys(a, toks), block_keys(b, toks)
        assert not ka or not kb or ka[0] != kb[0]


def test_single_field_changes_and_concatenation_attacks_never_collide() -> None:
    base = Namespace(tenant="acme", model_id="llama", weights_digest="w", adapter_id="", salt="")
    variants = [
        # adapter named like a salt field, and the salt itself
        dict(adapter_id=_frame_piece(0x000C, b"s")), dict(salt="s"),
        dict(adapter_id="", salt=_frame_piece(0x0004, b"")),
        # bytes moved between neighbouring strings
        dict(tenant="acm", model_id="ellama"), dict(tenant="acmel", model_id="lama"),
        dict(weights_digest="", adapter_id="w"), dict(adapter_id="w"),
        dict(weights_digest="w" + _frame_piece(0x0004, b"x")), dict(adapter_id="x"),
        dict(model_id="llama" + _frame_piece(0x0003, b"w")), dict(weights_digest="", model_id="llama"),
        # every single identity field
        dict(tenant="acme2"), dict(model_id="llama2"), dict(weights_digest="w2"), dict(adapter_id="a"),
        dict(kv_dtype=KVDtype.FLOAT16), dict(layout=KVLayout.LAYER_KV_PAGE), dict(block_size=32),
        dict(tp_size=2), dict(pp_stage=1), dict(schema_version=2), dict(hash_algo=HashAlgo.SHA256),
        dict(salt="x"), dict(salt="y"), dict(salt="\x00"),
    ]
    nss = [base] + [Namespace(**{**{f: getattr(base, f) for f in _FIELDS}, **v}) for v in variants]
    toks = list(range(32))
    frames = {n.framed() for n in nss}
    digests = {n.digest for n in nss}
    firsts = {block_keys(n, toks)[0] for n in nss}
    # namespaces that share a frame, a digest or a first key with another (all distinct: none)
    collisions = 3 * len(nss) - len(frames) - len(digests) - len(firsts)
    record("security", crafted_namespace_pairs=len(nss) * (len(nss) - 1) // 2, crafted_collisions=collisions)
    assert len(frames) == len(digests) == len(firsts) == len(set(nss)) == len(nss)


def test_salt_travels_over_the_wire_and_isolates(make_daemon) -> None:
    d = make_daemon()
    plain = Namespace(tenant="t", model_id="m", block_size=16)
    salted = Namespace(tenant="t", model_id="m", block_size=16, salt="user-7")
    assert ns_pb(salted).salt == "user-7"
    keys = block_keys(plain, np.arange(32, dtype=np.int64))
    with Client(d.target) as c:
        assert c.put(salted, keys, [P(b"s", k) for k in keys]) == [KeyStatus.OK] * 2
        assert c.lookup(plain, keys).hit_blocks == 0
        assert c.lookup(Namespace(tenant="t", model_id="m", block_size=16, salt="user-8"), keys).hit_blocks == 0
        assert c.lookup(salted, keys).hit_blocks == 2
        # an invalid salt (over 256 UTF-8 bytes) is INVALID_ARGUMENT, not a crash
        bad = ns_pb(plain)
        bad.salt = "s" * 257
        with pytest.raises(grpc.RpcError) as ei:
            c.stub.Lookup(pb.LookupRequest(ns=bad, keys=keys), timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "salt" in ei.value.details()
