"""The wire protocol: generated modules are fresh and enums mirror Python's."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvstore.errors import KeyStatus
from proto import generate, kvstore_pb2, kvstore_pb2_grpc
from tiers.base import TierKind


def test_generated_modules_are_not_stale() -> None:
    problems = generate.stale_files()
    assert not problems, (
        "proto/*_pb2* are stale; run `python -m proto.generate` (make proto):\n"
        + "\n".join(f"{name}: {why}" for name, why in problems.items())
    )


def test_check_command_passes() -> None:
    assert generate.main(["--check"]) == 0


def test_check_detects_a_stale_file(tmp_path: Path) -> None:
    for name in generate.GENERATED:
        shutil.copy(generate.PROTO_DIR / name, tmp_path / name)
    target = tmp_path / "kvstore_pb2.pyi"
    target.write_text(target.read_text().replace("TIER_DRAM", "TIER_DRAMX", 1))
    (tmp_path / "kvstore_pb2_grpc.py").unlink()
    problems = generate.stale_files(tmp_path)
    assert set(problems) == {"kvstore_pb2.pyi", "kvstore_pb2_grpc.py"}
    assert "TIER_DRAMX" in problems["kvstore_pb2.pyi"]
    assert problems["kvstore_pb2_grpc.py"] == "missing"


def test_version_stamps_alone_are_not_staleness(tmp_path: Path) -> None:
    for name in generate.GENERATED:
        shutil.copy(generate.PROTO_DIR / name, tmp_path / name)
    grpc_file = tmp_path / "kvstore_pb2_grpc.py"
    text = grpc_file.read_text()
    stamped = "\n".join(
        "GRPC_GENERATED_VERSION = '0.0.1'" if line.startswith("GRPC_GENERATED_VERSION") else line
        for line in text.split("\n")
    )
    assert stamped != text
    grpc_file.write_text(stamped)
    assert generate.stale_files(tmp_path) == {}


def test_status_enum_mirrors_key_status() -> None:
    wire = {
        name.removeprefix("STATUS_"): value for name, value in kvstore_pb2.Status.items()
    }
    python = {member.name: member.value for member in KeyStatus}
    assert wire == python


def test_tier_enum_is_tier_kind_plus_one() -> None:
    assert kvstore_pb2.TIER_UNSPECIFIED == 0
    for kind in TierKind:
        assert kvstore_pb2.Tier.Value(f"TIER_{kind.name}") == kind.value + 1
    assert len(kvstore_pb2.Tier.keys()) == len(TierKind) + 1


def test_grpc_module_imports_its_messages_package_relative() -> None:
    source = (generate.PROTO_DIR / "kvstore_pb2_grpc.py").read_text()
    assert "from . import kvstore_pb2 as kvstore__pb2" in source
    assert "\nimport kvstore_pb2" not in source
    assert kvstore_pb2_grpc.kvstore__pb2 is kvstore_pb2
    for name in ("KVStoreStub", "KVStoreServicer", "add_KVStoreServicer_to_server",
                 "AdminStub", "AdminServicer", "add_AdminServicer_to_server"):
        assert hasattr(kvstore_pb2_grpc, name)


def test_services_and_messages_round_trip() -> None:
    service = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]
    methods = {m.name: m for m in service.methods}
    assert {"Handshake", "Lookup", "Reserve", "Commit", "Abort", "Acquire", "Release",
            "Put", "Get", "Remove", "Clear", "Stats", "WatchEvents"} <= set(methods)
    assert methods["Get"].server_streaming and methods["WatchEvents"].server_streaming
    admin = kvstore_pb2.DESCRIPTOR.services_by_name["Admin"]
    assert {m.name for m in admin.methods} == {"GetConfig", "ResizeTier", "SetEvictionPolicy"}
    assert kvstore_pb2.DESCRIPTOR.package == "kvstore.v1"

    ns = kvstore_pb2.Namespace(tenant="t", model_id="m", block_size=16, tp_size=8,
                               hash_algo="xxh3_128")
    req = kvstore_pb2.ReserveRequest(ns=ns, keys=[b"\x01" * 16, b"\x02" * 16],
                                     block_bytes=4096, parent=b"\x00" * 16)
    back = kvstore_pb2.ReserveRequest.FromString(req.SerializeToString())
    assert back == req and back.ns.tp_size == 8
    event = kvstore_pb2.Event(seq=7, gap=kvstore_pb2.Gap(first_available_seq=3))
    assert event.WhichOneof("kind") == "gap"
    result = kvstore_pb2.KeyResult(
        key=b"k" * 16, status=kvstore_pb2.STATUS_OK,
        slot=kvstore_pb2.SlotRef(tier=kvstore_pb2.TIER_DRAM, offset=4096, length=100))
    assert KeyStatus(result.status) is KeyStatus.OK
    assert TierKind(result.slot.tier - 1) is TierKind.DRAM
