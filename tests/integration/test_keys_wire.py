"""The namespace over gRPC (docs/keys.md, section 3.1) against a real daemon:
every value the key spec allows reaches the key frame unchanged (schema_version
0, the i64 maximum), the wire's defaults are the documented ones, values
beyond the frame's i64 are refused naming the field; the numbers docs/keys.md
quotes are the code's; the proto's kv_dtype example is a name the daemon
accepts (issue 19, items 12 and 13)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import pytest

from kvstore.client import ns_pb
from kvstore.keys import Namespace
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
I64_MAX = 2**63 - 1


def _stored_digest(stub: pb_grpc.KVStoreStub, msg: pb.Namespace) -> bytes:
    """Put one block in ``msg``'s namespace; the digest the daemon stored it under."""
    before = {n.ns_digest for n in stub.Stats(pb.StatsRequest(include_namespaces=True), timeout=10).namespaces}
    r = stub.Put(pb.PutRequest(ns=msg, keys=[b"\x07" * 16], payloads=[b"x" * 64]), timeout=10)
    assert r.results[0].status == pb.STATUS_OK, r.results[0].detail
    after = {n.ns_digest for n in stub.Stats(pb.StatsRequest(include_namespaces=True), timeout=10).namespaces}
    (digest,) = after - before
    return digest


def test_every_spec_value_reaches_the_frame(daemon) -> None:
    with grpc.insecure_channel(daemon.target) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        for kw in ({"schema_version": 0}, {"tp_size": I64_MAX, "pp_stage": I64_MAX, "schema_version": I64_MAX},
                   {"kv_dtype": "float8_e4m3fn", "schema_version": 7, "tp_size": 2**40}):
            ns = Namespace(tenant="acme", model_id="m", **kw)
            assert _stored_digest(stub, ns_pb(ns)) == ns.digest, kw
        # the wire's defaults: tp_size 0 -> 1, schema_version unset -> 1, empty tenant -> "default"
        bare = pb.Namespace(model_id="m2", block_size=16)
        assert not bare.HasField("schema_version")
        assert _stored_digest(stub, bare) == Namespace(tenant="default", model_id="m2").digest
        # beyond the frame's i64: refused, naming the field
        for field in ("tp_size", "pp_stage", "schema_version"):
            msg = pb.Namespace(model_id="m", block_size=16, **{field: I64_MAX + 1})
            with pytest.raises(grpc.RpcError) as ei:
                stub.Lookup(pb.LookupRequest(ns=msg, keys=[b"k" * 16]), timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in ei.value.details(), ei.value.details()


def test_keys_md_numbers_are_the_codes() -> None:
    text = (ROOT / "docs" / "keys.md").read_text()
    vectors = json.loads((ROOT / "tests" / "unit" / "kvstore" / "keys_vectors.json").read_text())["vectors"]
    ns1 = Namespace.from_dict(vectors[0]["namespace"])
    m = re.search(r"`H` of these (\d+) bytes is `([0-9a-f]{32})`", text)
    assert m, "docs/keys.md lost the frame-length sentence of vector 1"
    assert int(m.group(1)) == len(ns1.framed()) == 164
    assert m.group(2) == ns1.digest.hex()
    # the example frame dump is vector 1's frame, byte for byte
    dump = text[text.index("4b 56 4e 53 01 00"):m.start()]
    hexbytes = "".join(re.findall(r"^\s*((?:[0-9a-f]{2} )*[0-9a-f]{2})", dump, re.M)).replace(" ", "")
    assert bytes.fromhex(hexbytes) == ns1.framed()
    # the salt vector: vector 1's frame followed by the salt field
    m = re.search(r"vector 1's\s+(\d+) bytes followed by `([0-9a-f ]+)`", text)
    assert m
    salted = Namespace.from_dict({**vectors[0]["namespace"], "salt": "user-42"})
    assert int(m.group(1)) == len(ns1.framed())
    assert salted.framed() == ns1.framed() + bytes.fromhex(m.group(2).replace(" ", ""))


def test_proto_kv_dtype_comment_names_accepted_dtypes() -> None:
    """Every dtype name the proto's comment on Namespace.kv_dtype gives is
    one the daemon accepts (it once gave "fp8_e4m3", which is refused)."""
    proto = (ROOT / "proto" / "kvstore.proto").read_text()
    start = proto.index("string kv_dtype = 5;")
    lines = proto[start:].splitlines()
    comment = lines[0].split("//", 1)[1]
    for line in lines[1:]:  # continuation lines of the same comment
        if not line.strip().startswith("//"):
            break
        comment += line.strip()[2:]
    names = re.findall(r'"([a-z0-9_]+)"', comment)
    assert "float8_e4m3fn" in names and "fp8_e4m3" not in names
    for name in names:
        Namespace(tenant="t", model_id="m", kv_dtype=name)  # raises InvalidArgument for a wrong name
