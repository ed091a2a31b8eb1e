"""Bad input against a real ``kvstore serve`` (auth on, SSD tier on): every
RPC of both services is fed random well-typed messages (hypothesis, built
from the proto descriptors), mutated serialized messages and fields sent
with the wrong wire type (raw bytes through a generic channel), oversized
messages, huge batches and invalid namespaces and salts. Every call gets a
status code, the daemon never crashes or hits an internal error, and its
memory stays bounded (peak RSS reported)."""

from __future__ import annotations

import collections
import random
import time
from typing import Any, Callable

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.client import Client, ns_pb
from kvstore.errors import KeyStatus
from kvstore.keys import Namespace, block_keys
from proto import kvstore_pb2 as pb
from tests.faults.faultlib import Sampler, Serve, isetting, mib, record, rss_bytes

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
TOKENS = {"tenant": "tok-acme", "admin": "tok-admin"}
MAX_MSG = 24 << 20
CODES: collections.Counter[str] = collections.Counter()
CORPUS: dict[str, list[bytes]] = collections.defaultdict(list)
"""Serialized requests of the structured fuzz run: seeds for the mutation run."""
INPUTS: collections.Counter[str] = collections.Counter()

METHODS: list[tuple[str, str, Any, bool]] = []  # (name, path, request class, server streaming)
for _svc in ("KVStore", "Admin"):
    _sd = pb.DESCRIPTOR.services_by_name[_svc]
    for _m in _sd.methods:
        METHODS.append((_m.name, f"/{_sd.full_name}/{_m.name}", getattr(pb, _m.input_type.name), _m.server_streaming))
METHOD_NAMES = [m[0] for m in METHODS]
INFINITE = {"WatchEvents", "KeepAlive"}  # streams that never end by themselves


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    tenants = tmp / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n\n'
                       '[[tenant]]\nname = "ops"\ntoken = "tok-admin"\nadmin = true\n')
    log = open(tmp / "daemon.log", "w+")
    s = Serve(str(tmp / "kv.sock"), "--dram", "16MiB", "--ssd", "32MiB", "--ssd-path", str(tmp / "ssd"),
              env={"KVSTORE_SERVER_TENANTS_FILE": str(tenants), "KVSTORE_SERVER_MAX_MESSAGE_BYTES": str(MAX_MSG),
                   "KVSTORE_SSD_SYNC": "false", "KVSTORE_SSD_ADMIT_MIN_HITS": "0", "KVSTORE_DRAM_PAGE_SIZE": "1MiB",
                   "KVSTORE_LOG_LEVEL": "info", "KVSTORE_SERVER_RESERVATION_TIMEOUT": "2s",
                   "KVSTORE_SERVER_LEASE_CHECK_INTERVAL": "0.2s"}, stderr=log)
    s.wait_healthy()
    # some real blocks, so fuzzed keys sometimes hit
    keys = block_keys(NS, list(range(16 * 16)))
    with Client(s.target, token=TOKENS["tenant"]) as c:
        assert c.put(NS, keys, [bytes([i]) * 4096 for i in range(len(keys))]) == [KeyStatus.OK] * 16
    sampler = Sampler(s.pid)
    ch = grpc.insecure_channel(s.target, options=[("grpc.max_receive_message_length", -1),
                                                  ("grpc.max_send_message_length", -1)])
    start_rss = rss_bytes(s.pid)
    yield {"serve": s, "channel": ch, "keys": keys, "sampler": sampler, "log": log, "start_rss": start_rss}
    ch.close()
    sampler.stop()
    s.terminate()
    log.close()


def _call(served: dict[str, Any], name: str, payload: bytes, who: str = "tenant") -> str:
    """Send raw request bytes to one method; the status code's name."""
    _, path, _, streaming = METHODS[METHOD_NAMES.index(name)]
    ch: grpc.Channel = served["channel"]
    md = [("authorization", f"Bearer {TOKENS[who]}")] if who in TOKENS else (
        [("authorization", who)] if who else [])
    INPUTS[name] += 1
    try:
        if not streaming:
            ch.unary_unary(path)(payload, metadata=md, timeout=30)
        else:  # an endless stream that is open and idle answers with its deadline
            call = ch.unary_stream(path)(payload, metadata=md, timeout=0.5 if name in INFINITE else 30)
            n = 0
            for _ in call:
                n += 1
                if name in INFINITE or n >= 64:
                    call.cancel()  # it answered; an endless stream is not read to its end
                    break
    except grpc.RpcError as e:
        code = e.code()
        if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED) and name in INFINITE:
            code = grpc.StatusCode.OK
        CODES[code.name] += 1
        return code.name
    CODES["OK"] += 1
    return "OK"


# ------------------------------------------------------- message strategies
_STRINGS = st.sampled_from(["", "acme", "ops", "llama", "bfloat16", "float16", "fp8", "sha256", "xxh3_128",
                            "opaque", "layer_kv_page", "lru", "lfu", "cost", "dram", "ssd", "x" * 257, "é" * 200,
                            "\x00", "s-" + "0" * 24, "r-0000000000000000", "l-0000000000000000", "../../etc"])
_TEXT = st.one_of(_STRINGS, st.text(max_size=40))
_U32 = st.one_of(st.sampled_from([0, 1, 2, 15, 16, 17, 4096, 65536, 65537, 2**31 - 1, 2**32 - 1]),
                 st.integers(0, 2**32 - 1))
_U64 = st.one_of(_U32, st.sampled_from([2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
_I32 = st.integers(-(2**31), 2**31 - 1)
_I64 = st.integers(-(2**63), 2**63 - 1)
_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=32)
_DOUBLE = st.floats(allow_nan=True, allow_infinity=True)


def _bytes_strategy(keys: list[bytes]) -> st.SearchStrategy[bytes]:
    key = st.sampled_from(keys)
    return st.one_of(
        st.binary(max_size=40), key, st.binary(min_size=16, max_size=16),
        st.lists(key, max_size=20).map(b"".join),   # keys_packed of real keys
        st.integers(0, 300).map(lambda n: bytes(16 * n + n % 3)),
        st.sampled_from([b"x" * 4096, b"\x00" * 70000]))


def _field(f: Any, depth: int, keys: list[bytes]) -> st.SearchStrategy[Any]:
    t = f.type
    if t == FD.TYPE_MESSAGE:
        inner = _message(f.message_type, depth + 1, keys)
        base: st.SearchStrategy[Any] = inner
    elif t == FD.TYPE_STRING:
        base = _TEXT
    elif t == FD.TYPE_BYTES:
        base = _bytes_strategy(keys)
    elif t == FD.TYPE_BOOL:
        base = st.booleans()
    elif t == FD.TYPE_ENUM:
        base = st.integers(-3, 12)
    elif t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        base = _U32
    elif t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        base = _U64
    elif t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        base = _I32
    elif t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        base = _I64
    elif t == FD.TYPE_FLOAT:
        base = _FLOAT
    elif t == FD.TYPE_DOUBLE:
        base = _DOUBLE
    else:  # pragma: no cover - a new field type: fail loudly
        raise AssertionError(f"field type {t} of {f.full_name}")
    if f.is_repeated:  # a few of anything, or many small ones
        many = st.sampled_from(keys) if t == FD.TYPE_BYTES else base
        return st.one_of(st.lists(base, max_size=6), st.lists(many, min_size=100, max_size=300))
    return base


def _namespace(keys: list[bytes]) -> st.SearchStrategy[pb.Namespace]:
    """Mostly valid namespaces of the caller's tenant, some invalid in one field."""
    valid = st.builds(lambda m, bs, salt, algo, dt: pb.Namespace(tenant="", model_id=m, block_size=bs, salt=salt,
                                                                  hash_algo=algo, kv_dtype=dt),
                      st.sampled_from(["llama", "qwen", "m"]), st.sampled_from([16, 4, 1]),
                      st.sampled_from(["", "", "u1", "x" * 256]), st.sampled_from(["", "sha256"]),
                      st.sampled_from(["", "float16"]))
    good = st.just(ns_pb(NS))
    return st.one_of(good, good, valid, _message(pb.Namespace.DESCRIPTOR, 1, keys, plain=True))


def _message(desc: Any, depth: int, keys: list[bytes], plain: bool = False) -> st.SearchStrategy[Any]:
    cls = getattr(pb, desc.name)
    if depth > 2:
        return st.just(cls())
    fields = {}
    for f in desc.fields:
        if f.type == FD.TYPE_MESSAGE and f.message_type.name == "Namespace" and not plain:
            fields[f.name] = _namespace(keys)
        else:
            fields[f.name] = _field(f, depth, keys)

    def build(values: dict[str, Any]) -> Any:
        m = cls()
        for name, v in values.items():
            fd = desc.fields_by_name[name]
            if fd.is_repeated:
                if fd.type == FD.TYPE_MESSAGE:
                    getattr(m, name).extend(v)
                else:
                    getattr(m, name).extend(v)
            elif fd.type == FD.TYPE_MESSAGE:
                getattr(m, name).CopyFrom(v)
            else:
                setattr(m, name, v)
        return m

    return st.fixed_dictionaries({}, optional=fields).map(build)


# --------------------------------------------------------------- the tests
def test_fuzz_well_typed_messages(served) -> None:
    n = isetting("fuzz_inputs", 1000)
    keys = served["keys"]
    strategies = {name: _message(cls.DESCRIPTOR, 0, keys) for name, _, cls, _ in METHODS}
    seen: list[str] = []

    @settings(max_examples=n, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(METHOD_NAMES), label="method")
        msg = data.draw(strategies[name], label="request")
        who = data.draw(st.sampled_from(["tenant", "tenant", "tenant", "admin", "", "Bearer nope"]), label="token")
        data_ = msg.SerializeToString()
        if len(CORPUS[name]) < 16 and len(data_) < 4096:
            CORPUS[name].append(data_)
        code = _call(served, name, data_, who)
        seen.append(code)
        assert code not in ("UNKNOWN", "INTERNAL"), (name, msg, code)

    run()
    assert served["serve"].alive()
    record("fuzz", structured_inputs=len(seen))


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        if op == 0 and b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and b:
            i = rng.randrange(len(b))
            del b[i:i + rng.randint(1, 16)]
        elif op == 4 and b:
            del b[rng.randrange(len(b)):]
        elif op == 5 and b:
            i = rng.randrange(len(b))
            b[i:i] = b[i:i + rng.randint(1, 32)] * rng.randint(1, 8)
        else:  # a field with an arbitrary number and wire type
            b += _varint((rng.randint(1, 40) << 3) | rng.choice([0, 1, 2, 5])) + rng.randbytes(rng.randint(0, 9))
    return bytes(b)


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        x = v & 0x7F
        v >>= 7
        out.append(x | (0x80 if v else 0))
        if not v:
            return bytes(out)


def test_fuzz_mutated_and_wrongly_typed_bytes(served) -> None:
    n = isetting("fuzz_inputs", 1000) * 2
    rng = random.Random(1234)
    keys = served["keys"]
    good = ns_pb(NS)
    golden = {"Lookup": pb.LookupRequest(ns=good, keys=keys[:4]), "Get": pb.GetRequest(ns=good, keys=keys[:2]),
              "Put": pb.PutRequest(ns=good, keys=[b"n" * 16], payloads=[b"p" * 64]),
              "Reserve": pb.ReserveRequest(ns=good, keys_packed=b"".join(keys[:3]), block_bytes=4096),
              "Acquire": pb.AcquireRequest(ns=good, keys_packed=b"".join(keys[:3]), promote=True),
              "Admit": pb.AdmitRequest(ns=good, keys=keys[:2], n_tokens=64, ttft_target_s=0.5),
              "WatchEvents": pb.WatchRequest(ns=good, after_seq=1)}
    seeds: dict[str, list[bytes]] = {}
    for name, _, cls, _ in METHODS:
        seeds[name] = [cls().SerializeToString()] + CORPUS.get(name, [])
        if name in golden:
            seeds[name].append(golden[name].SerializeToString())
    mutated = undecodable = 0
    classes = {name: cls for name, _, cls, _ in METHODS}
    for i in range(n):
        name = METHOD_NAMES[i % len(METHOD_NAMES)]
        data = _mutate(rng.choice(seeds[name]), rng)
        code = _call(served, name, data, rng.choice(["tenant", "tenant", "admin"]))
        if _decodes(classes[name], data):
            assert code not in ("UNKNOWN", "INTERNAL"), (name, data, code)
        else:  # gRPC's own answer to bytes that do not parse as the request type
            assert code == "UNKNOWN", (name, data, code)
            undecodable += 1
        mutated += 1
    # every field number 1..16 of every request with every wire type
    typed = 0
    for name, _, cls, _ in METHODS:
        for fno in range(1, 17):
            for wt, body in ((0, _varint(2**64 - 1)), (1, b"\xff" * 8), (2, _varint(5) + b"\xfe" * 5),
                             (5, b"\x01" * 4), (2, _varint(2**31) + b"x"), (3, b""), (0, b"\x80" * 11)):
                data = _varint((fno << 3) | wt) + body
                code = _call(served, name, data, "tenant")
                if _decodes(cls, data):
                    assert code not in ("UNKNOWN", "INTERNAL"), (name, data, code)
                else:
                    undecodable += 1
                typed += 1
    assert served["serve"].alive()
    record("fuzz", mutated_inputs=mutated, wrong_wire_type_inputs=typed, undecodable_inputs=undecodable)


def _decodes(cls: Any, data: bytes) -> bool:
    try:
        cls.FromString(data)
    except Exception:  # noqa: BLE001 - DecodeError, or a bad UTF-8 string
        return False
    return True


def test_oversized_messages_and_huge_batches(served) -> None:
    s = served
    good = ns_pb(NS)
    expect: list[tuple[str, Callable[[], bytes], set[str]]] = [
        # over the message limit
        ("Put", lambda: pb.PutRequest(ns=good, keys=[b"k" * 16], payloads=[b"x" * (MAX_MSG + 1)]).SerializeToString(),
         {"RESOURCE_EXHAUSTED"}),
        ("Lookup", lambda: pb.LookupRequest(ns=good, keys_packed=b"\x01" * (MAX_MSG + 16)).SerializeToString(),
         {"RESOURCE_EXHAUSTED"}),
        # more keys than one call may carry (1,048,577 keys = 16 MiB)
        ("Lookup", lambda: pb.LookupRequest(ns=good, keys_packed=bytes(16 * ((1 << 20) + 1))).SerializeToString(),
         {"INVALID_ARGUMENT"}),
        # the most it may carry: a miss at the first key, fast
        ("Lookup", lambda: pb.LookupRequest(ns=good, keys_packed=bytes(16 * (1 << 20))).SerializeToString(),
         {"OK"}),
        ("Acquire", lambda: pb.AcquireRequest(ns=good, keys_packed=bytes(16 * (1 << 20))).SerializeToString(),
         {"OK"}),
        ("Prefetch", lambda: pb.PrefetchRequest(ns=good, keys_packed=bytes(16 * (1 << 20))).SerializeToString(),
         {"OK"}),
        ("Admit", lambda: pb.AdmitRequest(ns=good, keys_packed=bytes(16 * (1 << 20)), n_tokens=2**32 - 1,
                                          ttft_target_s=1.0).SerializeToString(), {"OK", "RESOURCE_EXHAUSTED"}),
        # a huge reservation: far more than the tier holds
        ("Reserve", lambda: pb.ReserveRequest(ns=good, keys_packed=random.Random(1).randbytes(16 * 200_000),
                                              block_bytes=4096).SerializeToString(), {"OK"}),
        ("Reserve", lambda: pb.ReserveRequest(ns=good, keys_packed=random.Random(2).randbytes(16 * 1000),
                                              block_bytes=2**63 - 1).SerializeToString(), {"OK", "INVALID_ARGUMENT"}),
        ("Reserve", lambda: pb.ReserveRequest(ns=good, keys_packed=random.Random(3).randbytes(16 * 1000),
                                              sizes=[1] * 999).SerializeToString(), {"INVALID_ARGUMENT"}),
        ("Put", lambda: pb.PutRequest(ns=good, keys=[bytes([i % 256, i // 256]) * 8 for i in range(60_000)],
                                      payloads=[b"p"] * 60_000).SerializeToString(), {"OK"}),
        ("Put", lambda: pb.PutRequest(ns=good, keys=[b"q" * 16] * 3, payloads=[b"p"] * 3,
                                      checksums=[1] * 2).SerializeToString(), {"INVALID_ARGUMENT"}),
        ("Get", lambda: pb.GetRequest(ns=good, keys=[b"\x02" * 16] * 300_000).SerializeToString(), {"OK"}),
        ("Remove", lambda: pb.RemoveRequest(ns=good, keys=[b"\x03" * 16] * 300_000).SerializeToString(), {"OK"}),
        ("Commit", lambda: pb.CommitRequest(reservation_id="r-x", checksums=[1] * 1_000_000).SerializeToString(),
         {"NOT_FOUND"}),
        ("Get", lambda: pb.GetRequest(ns=good, keys=[s["keys"][0]], max_chunk_bytes=1).SerializeToString(), {"OK"}),
        # invalid namespaces and salts
        ("Lookup", lambda: pb.LookupRequest(ns=pb.Namespace(model_id="m", block_size=0)).SerializeToString(),
         {"INVALID_ARGUMENT"}),
        ("Lookup", lambda: pb.LookupRequest(ns=pb.Namespace(model_id="m", salt="s" * 257)).SerializeToString(),
         {"INVALID_ARGUMENT"}),
        ("Lookup", lambda: pb.LookupRequest(ns=pb.Namespace(model_id="", block_size=16)).SerializeToString(),
         {"INVALID_ARGUMENT"}),
        ("Lookup", lambda: pb.LookupRequest(ns=pb.Namespace(tenant="ops", model_id="m")).SerializeToString(),
         {"PERMISSION_DENIED"}),
        ("Lookup", lambda: pb.LookupRequest(ns=pb.Namespace(model_id="m", block_size=70000)).SerializeToString(),
         {"INVALID_ARGUMENT"}),
        ("Lookup", lambda: pb.LookupRequest(ns=pb.Namespace(model_id="m", kv_dtype="int4")).SerializeToString(),
         {"INVALID_ARGUMENT"}),
        ("Lookup", lambda: (pb.LookupRequest(ns=pb.Namespace(model_id="m")).SerializeToString()[:-1]
                            + b"\xff"), {"UNKNOWN"}),  # bad UTF-8 in a string: gRPC cannot parse it
    ]
    t_max = 0.0
    for name, build, want in expect:
        t0 = time.perf_counter()
        code = _call(s, name, build(), "tenant")
        t_max = max(t_max, time.perf_counter() - t0)
        assert code in want, (name, code)
    # a flood of sessions that never open their KeepAlive
    for _ in range(isetting("fuzz_handshakes", 2000)):
        _call(s, "Handshake", pb.HandshakeRequest(client_name="x").SerializeToString(), "tenant")
    assert s["serve"].alive()
    record("fuzz", oversized_and_huge_cases=len(expect), slowest_huge_call_s=round(t_max, 2))


def test_daemon_survived_with_bounded_memory(served) -> None:
    """Runs last in this module: the daemon is alive and serving, logged no
    internal error, and its memory stayed bounded."""
    s = served
    assert s["serve"].alive()
    keys = s["keys"]
    with Client(s["serve"].target, token=TOKENS["tenant"]) as c:
        got = c.get(NS, keys)
        assert all(g is None or g.tobytes() == bytes([i]) * 4096 for i, g in enumerate(got))
        # sessions that never opened their KeepAlive end after reservation_timeout (2 s here)
        t_end = time.monotonic() + 30
        while (st := c._call(c.stub.Stats, pb.StatsRequest())).sessions > 10 and time.monotonic() < t_end:
            time.sleep(0.2)
    peak = s["sampler"].stop()
    end = rss_bytes(s["serve"].pid)
    s["log"].flush()
    s["log"].seek(0)
    text = s["log"].read()
    internal = text.count("ERROR kvstore.daemon.server:")  # a handler's unexpected exception
    total = sum(INPUTS.values())
    record("fuzz", inputs_total=total, crashes=0 if s["serve"].alive() else 1, internal_errors=internal,
           status_codes=dict(sorted(CODES.items())), rss_start_mib=mib(s["start_rss"]), rss_peak_mib=mib(peak),
           rss_end_mib=mib(end), sessions_open_after=st.sessions)
    assert internal == 0, text[-3000:]
    assert peak < s["start_rss"] + (512 << 20)  # bounded: the largest messages are 24 MiB
    assert st.sessions < 100  # sessions that never opened a KeepAlive do not pile up
