"""The ``kvstore`` command line, without a daemon: pure formatting functions,
argument -> config mapping, token files, exit codes and messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict

from kvstore.tools import commands
from kvstore.tools.cli import main, parse_args
from kvstore.tools.commands import serve_overrides
from kvstore.tools.format import capacity_table, diff_report, format_capacity, format_lookup, format_stats
from kvstore.tools.inputs import load_request, make_namespace
from kvstore.config import load_config
from kvstore.keys import Namespace, block_keys
from kvstore.results import DaemonStats, PolicyChange, ResizeResult
from proto import kvstore_pb2 as pb

ROOT = Path(__file__).resolve().parents[3]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ------------------------------------------------------------------ stats


def _stats_dict() -> dict[str, Any]:
    msg = pb.StatsResponse(
        tiers=[pb.TierStats(tier=pb.TIER_DRAM, capacity_bytes=1 << 30, used_bytes=256 << 20,
                            blocks=4096, pinned_bytes=1 << 20, evictions=12),
               pb.TierStats(tier=pb.TIER_SSD, capacity_bytes=0)],
        lookups=10, hit_blocks=300, miss_blocks=100, hit_tokens=4800, miss_tokens=1600,
        puts=500, gets=250, bytes_written=500 * 65536, bytes_read=250 * 65536,
        checksum_failures=2, active_reservations=1, active_leases=3, sessions=2,
        reservations_expired=4, leases_expired=5, uptime_seconds=3725.0,
        namespaces=[pb.NamespaceStats(namespace_label="acme/llama", lookups=8, hit_blocks=300,
                                      queried_blocks=320, blocks=4000),
                    pb.NamespaceStats(namespace_label="beta/qwen", lookups=2, queried_blocks=80)])
    # exactly what Client.stats() returns
    return MessageToDict(msg, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


def test_format_stats() -> None:
    text = format_stats(_stats_dict())
    lines = text.splitlines()
    assert lines[0] == "kvstore stats (up 1h02m05s)"
    dram = next(line for line in lines if line.startswith("dram"))
    for cell in ("256.0 MiB", "1.0 GiB", "25.0%", "4,096", "1.0 MiB", "12"):
        assert cell in dram
    ssd = next(line for line in lines if line.startswith("ssd"))
    assert " - " in f"{ssd} "  # no capacity: no percentage
    assert "prefix hit ratio" in text and "75.0%  (300 of 400 blocks queried; 4,800 of 6,400 tokens)" in text
    assert "500 / 250 blocks" in text
    assert "31.2 MiB / 15.6 MiB" in text
    assert "checksum failures                 2" in text
    assert "expired reservations / leases     4 / 5" in text  # the holds nobody ended in time
    acme = next(line for line in lines if line.startswith("acme/llama"))
    assert "93.8%" in acme and "4,000" in acme
    beta = next(line for line in lines if line.startswith("beta/qwen"))
    assert "0.0%" in beta
    assert lines.index(acme) < lines.index(beta)  # busiest namespace first


def test_format_stats_empty_response() -> None:
    d = MessageToDict(pb.StatsResponse(), preserving_proto_field_name=True)
    text = format_stats(d)
    assert "(no tiers reported)" in text and "prefix hit ratio" in text and " -  " in text
    assert "expired reservations / leases     0 / 0" in text


def test_stats_json_and_unreachable_daemon(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeClient:
        def __init__(self, target: str | None, **kw: Any) -> None:
            self.target = target

        def __enter__(self) -> "FakeClient":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def stats(self) -> DaemonStats:
            return DaemonStats.from_dict(_stats_dict())

    import kvstore.client

    with monkeypatch.context() as m:
        m.setattr(kvstore.client, "Client", FakeClient)
        code, out, _ = run(capsys, "stats", "--json")
        assert code == 0 and json.loads(out)["lookups"] == "10"
        assert (json.loads(out)["reservations_expired"], json.loads(out)["leases_expired"]) == ("4", "5")
        code, out, _ = run(capsys, "stats")
        assert code == 0 and "prefix hit ratio" in out
    # nothing listens on port 1: a clear message, exit 1, no traceback
    code, out, err = run(capsys, "stats", "--target", "127.0.0.1:1")
    assert code == 1 and out == ""
    assert err.startswith("kvstore: stats failed") and "Traceback" not in err
    assert "UNAVAILABLE" in err


def test_token_file_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "stats", "--token-file", str(tmp_path / "nope"))
    assert code == 2 and "cannot read token file" in err
    code, _, err = run(capsys, "stats", "--token-file", write(tmp_path, "empty", "\n"))
    assert code == 2 and "is empty" in err


# --------------------------------------------------------------- capacity


def test_capacity_table_llama70b_tp8() -> None:
    t = capacity_table(80, 8, 128, "bfloat16", tp=8, block_size=16,
                       tiers={"dram": 64 << 30, "ssd": 2 << 40})
    assert t["bytes_per_token_model"] == 2 * 80 * 8 * 128 * 2 == 327_680
    assert t["bytes_per_token_per_rank"] == 327_680 // 8
    assert t["bytes_per_token_node"] == 327_680          # all 8 ranks' shards on this node
    assert t["bytes_per_block_node"] == 327_680 * 16
    dram = t["tiers"][0]
    # 5 MiB blocks: three to a 16 MiB slab page (not 64 GiB / 5 MiB = 13,107)
    assert dram["blocks"] == (64 << 30) // (16 << 20) * 3 == 12_288
    assert dram["tokens"] == 12_288 * 16
    assert t["tiers"][1]["blocks"] == (2 << 40) // (327_680 * 16 + 88)
    text = format_capacity(t)
    assert "40,960 per rank, 327,680 whole model" in text
    assert "12,288" in text and "196,608" in text


@pytest.mark.parametrize("layers, kv_heads, head_dim, dtype, tp, bs, page", [
    (80, 8, 128, "bfloat16", 8, 16, 16 << 20),    # 5 MiB blocks: 3 per page, 1 MiB of each page unused
    (2, 1, 64, "bfloat16", 1, 1, 16 << 20),       # 256-byte blocks: one 4 KiB slot each
    (3, 2, 80, "float8_e4m3fn", 1, 16, 1 << 20),  # 15,360-byte blocks in 16 KiB slots
    (32, 8, 128, "bfloat16", 1, 16, 16 << 20),    # 2 MiB blocks: no waste
])
def test_capacity_is_what_the_slab_allocator_places(layers, kv_heads, head_dim, dtype, tp, bs, page) -> None:
    """The DRAM/HBM figure is what tiers.slots places in a fresh slab of that
    size (4 KiB-aligned slots, whole slots per page, whole pages), not
    capacity / block bytes, which promised up to 16x the blocks that fit."""
    from kvstore.errors import InvalidArgument
    from tiers.slots import SLOT_ALIGN, PagedSlots

    class Slab(PagedSlots):
        def __init__(self, capacity: int) -> None:
            self._init_slots(capacity, page, SLOT_ALIGN, ())

    cap = (1 << 30) + (5 << 20)
    t = capacity_table(layers, kv_heads, head_dim, dtype, tp=tp, block_size=bs,
                       tiers={"dram": cap, "hbm": 3 << 20}, page_size=page)
    block = t["bytes_per_block_node"]
    for row in t["tiers"]:
        slab = Slab(row["capacity_bytes"])
        if block > slab.page_bytes:  # the tier refuses a block larger than a page
            assert row["blocks"] == 0
            with pytest.raises(InvalidArgument):
                slab.free_slots(block)
        else:
            assert row["blocks"] == slab.free_slots(block), row


def test_capacity_gqa_replication_and_ranks_per_node() -> None:
    # 8 KV heads over TP 16: each rank holds one (replicated) head, not half of one
    t = capacity_table(32, 8, 128, "float16", tp=16, tiers={"dram": 1 << 30}, ranks_per_node=8)
    assert t["kv_heads_per_rank"] == 1
    assert t["bytes_per_token_per_rank"] == 2 * 32 * 1 * 128 * 2
    assert t["bytes_per_token_node"] == 8 * t["bytes_per_token_per_rank"]
    fp8 = capacity_table(32, 8, 128, "float8_e4m3fn")
    assert fp8["bytes_per_token_model"] == 2 * 32 * 8 * 128 and fp8["tiers"] == []


def test_capacity_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim",
                       "128", "--dram", "1GiB", "--json")
    assert code == 0
    t = json.loads(out)
    assert t["bytes_per_token_model"] == 131_072 and t["tiers"][0]["tokens"] == 8192
    code, out, err = run(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim",
                         "128", "--dram", "12 parsecs")
    assert code == 2 and out == "" and err.startswith("kvstore: --dram: invalid size")
    code, _, err = run(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim",
                       "128", "--dtype", "fp7")
    assert code == 2 and "--dtype" in err and "bfloat16" in err
    code, _, err = run(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim",
                       "128", "--tp", "2", "--ranks-per-node", "4")
    assert code == 2 and "--ranks-per-node" in err
    with pytest.raises(SystemExit) as e:  # argparse: exit 2, one line
        main(["capacity", "--layers", "0", "--kv-heads", "8", "--head-dim", "128"])
    assert e.value.code == 2


# ------------------------------------------------------------ token files


def test_load_request_formats(tmp_path: Path) -> None:
    want = [1, 2, 3, 4294967295]
    for name, text in (("ws.txt", "1 2\n3\t4294967295\n"), ("comma.txt", "1, 2,3,4294967295"),
                       ("list.json", json.dumps(want)),
                       ("req.json", json.dumps({"tokens": want, "namespace": {"tenant": "x"}}))):
        req = load_request(write(tmp_path, name, text))
        assert req.tokens.dtype == np.uint32 and req.tokens.tolist() == want, name
    assert load_request(str(tmp_path / "req.json")).namespace == {"tenant": "x"}
    assert load_request(write(tmp_path, "empty.txt", "")).tokens.size == 0


@pytest.mark.parametrize("text, needle", [
    ("1 2 x3 4", "item 2 ('x3') is not an integer"),
    ("1 2 -3", "token 2 = -3 is out of range"),
    ("[1, 2.5]", '"tokens" must be a list of integers'),
    ('{"prompt": [1]}', 'needs a "tokens" list (keys found: prompt)'),
    ("[1, 2", "not valid JSON"),
    ("[4294967296]", "out of range"),
])
def test_load_request_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                             text: str, needle: str) -> None:
    path = write(tmp_path, "bad.txt", text)
    code, out, err = run(capsys, "diff", path, path)
    assert code == 2 and out == "" and needle in err and "Traceback" not in err


def test_namespace_precedence(tmp_path: Path) -> None:
    args = parse_args(["diff", "a", "b", "--namespace-json", '{"tenant": "j", "model_id": "mj", '
                       '"block_size": 32}', "--model", "flag-model"])
    ns = make_namespace(args, {"tenant": "file", "model_id": "mf", "tp_size": 2})
    assert (ns.tenant, ns.model_id, ns.block_size, ns.tp_size) == ("j", "flag-model", 32, 2)
    nsfile = write(tmp_path, "ns.json", '{"tenant": "t2", "model_id": "m2", "kv_dtype": "float16"}')
    ns = make_namespace(parse_args(["diff", "a", "b", "--namespace-json", nsfile]))
    assert ns.kv_dtype.value == "float16"
    default = make_namespace(parse_args(["diff", "a", "b"]))
    assert (default.tenant, default.model_id, default.block_size) == ("default", "default", 16)


def test_bad_namespace_is_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write(tmp_path, "t.txt", "1 2 3")
    code, _, err = run(capsys, "diff", path, path, "--namespace-json", '{"colour": "red"}')
    assert code == 2 and "unknown namespace field 'colour'" in err
    code, _, err = run(capsys, "diff", path, path, "--block-size", "0")
    assert code == 2 and "block_size" in err


# ------------------------------------------------------------------- diff


def _prompts() -> tuple[list[int], list[int]]:
    """A system prompt with a timestamp, then an identical long body."""
    rng = np.random.default_rng(3)
    system = rng.integers(1000, 32000, size=40).tolist()
    body = rng.integers(1000, 32000, size=300).tolist()
    a = system + [2024, 11, 5, 10, 31, 7] + body
    b = system + [2024, 11, 5, 10, 32, 44] + body
    return a, b


def test_diff_finds_the_timestamp(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a, b = _prompts()
    pa = write(tmp_path, "a.txt", " ".join(map(str, a)))
    pb_ = write(tmp_path, "b.json", json.dumps({"tokens": b}))
    code, out, err = run(capsys, "diff", pa, pb_, "--context", "4")
    assert code == 1 and err == ""
    assert "shared prefix: 2 blocks = 32 tokens reusable (first 44 tokens equal)" in out
    assert "first divergent block: #2 (tokens 32..47)" in out
    assert f"position 44: {pa} has 31, {pb_} has 32" in out
    assert "... 2024 11 5 10 [31] 7 " in out and "... 2024 11 5 10 [32] 44 " in out
    assert "tokens differing at the same position: 2 of 346 (positions 44..45)" in out
    assert "hint: only 2 token(s) differ" in out
    # and the keys agree with what block_keys computes
    ns = Namespace(tenant="default", model_id="default")
    ka, kb = block_keys(ns, a), block_keys(ns, b)
    assert ka[:2] == kb[:2] and ka[2] != kb[2]


def test_diff_identical_prefix_and_tail(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a, _ = _prompts()
    pa = write(tmp_path, "a.txt", " ".join(map(str, a)))
    code, out, _ = run(capsys, "diff", pa, pa)
    assert code == 0 and "identical: all 21 full blocks (336 tokens) shared" in out
    pshort = write(tmp_path, "short.json", json.dumps(a[:100]))
    code, out, _ = run(capsys, "diff", pshort, pa)
    assert code == 0 and f"{pshort} is a prefix of {pa}" in out
    assert "shared prefix: 6 blocks = 96 tokens" in out and "last 4 token(s)" in out
    # a difference only in a trailing partial block loses no keyed block
    ns = Namespace(tenant="t", model_id="m", block_size=16)
    x = np.arange(40, dtype=np.uint32)
    y = x.copy()
    y[35] = 9
    rep = diff_report(ns, x, y)
    assert rep.exit_code == 1 and rep.shared_blocks == 2 and rep.position == 35
    assert "trailing partial block" in rep.text


def test_diff_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 2 and out == ""
    assert err == f"kvstore: token file {str(tmp_path / 'a')!r} not found\n"


# ----------------------------------------------------------------- lookup


def test_lookup_with_fake_client(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    class Result:
        hit_blocks = 3
        tiers = ["dram", "dram", "ssd"]

    class FakeClient:
        def __init__(self, target: str | None, **kw: Any) -> None:
            seen["target"], seen["token"] = target, kw.get("token")

        def __enter__(self) -> "FakeClient":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def lookup(self, ns: Namespace, keys: list[bytes]) -> Result:
            seen["ns"], seen["keys"] = ns, keys
            return Result()

    import kvstore.client

    monkeypatch.setattr(kvstore.client, "Client", FakeClient)
    tokens = list(range(100))
    path = write(tmp_path, "p.json", json.dumps({"tokens": tokens,
                                                 "namespace": {"tenant": "acme", "model_id": "m"}}))
    tok = write(tmp_path, "tok", "secret\n")
    code, out, _ = run(capsys, "lookup", "--tokens", path, "--block-size", "8", "--target",
                       "host:1", "--token-file", tok)
    assert code == 0
    assert seen["target"] == "host:1" and seen["token"] == "secret"
    ns = Namespace(tenant="acme", model_id="m", block_size=8)
    assert seen["ns"] == ns and seen["keys"] == block_keys(ns, tokens)
    assert "prompt: 100 tokens, 12 full blocks of 8" in out
    assert "prefix hit: 3 blocks = 24 tokens (25.0% of full blocks); 76 tokens to compute" in out
    assert format_lookup(100, 8, 3, ["TIER_DRAM", "TIER_DRAM", "TIER_SSD"]) == out
    code, out, _ = run(capsys, "lookup", "--tokens", path, "--json")
    assert code == 0 and json.loads(out)["tiers"] == ["dram", "dram", "ssd"]


# ------------------------------------------------------------------ serve


def test_serve_overrides_mapping() -> None:
    args = parse_args(["serve", "--host", "0.0.0.0", "--port", "6000", "--unix-socket", "/tmp/s",
                       "--metrics-host", "::", "--metrics-port", "0", "--dram", "2GiB",
                       "--ssd", "100GiB", "--ssd-path", "/data", "--hbm", "0",
                       "--policy", "lfu", "--log-level", "debug", "--auth-token-file", "/tok"])
    assert serve_overrides(args) == {
        "server.host": "0.0.0.0", "server.port": "6000", "server.unix_socket": "/tmp/s",
        "metrics.host": "::", "metrics.port": "0", "dram.capacity": "2GiB",
        "ssd.capacity": "100GiB", "ssd.path": "/data", "hbm.capacity": "0",
        "eviction.policy": "lfu", "log.level": "debug", "server.auth_token_file": "/tok"}
    assert serve_overrides(parse_args(["serve"])) == {}
    # every key is a real config key
    cfg = load_config(None, {}, serve_overrides(args))
    assert cfg.dram.capacity == 2 << 30 and cfg.server.port == 6000


def test_serve_precedence_and_exit_code(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.daemon.server

    got: list[Any] = []

    def fake_serve(config: Any) -> int:
        got.append(config)
        return 3

    monkeypatch.setattr(kvstore.daemon.server, "serve", fake_serve)
    toml = write(tmp_path, "kv.toml", '[dram]\ncapacity = "64MiB"\n[server]\nport = 7000\n'
                 '[metrics]\nport = 7001\n')
    monkeypatch.setenv("KVSTORE_CONFIG", toml)
    monkeypatch.setenv("KVSTORE_SERVER_PORT", "7100")
    code, _, _ = run(capsys, "serve", "--dram", "128MiB")
    assert code == 3
    cfg = got[-1]
    assert cfg.dram.capacity == 128 << 20     # flag > file
    assert cfg.server.port == 7100            # env > file
    assert cfg.metrics.port == 7001           # file > default
    code, _, _ = run(capsys, "serve", "--config", write(tmp_path, "o.toml", "[server]\nport = 1\n"))
    assert code == 3 and got[-1].server.port == 7100 and got[-1].dram.capacity == 1 << 30


@pytest.mark.parametrize("argv, needle", [
    (["--dram", "lots"], "dram.capacity"),
    (["--policy", "fifo"], "eviction.policy"),
    (["--port", "70000"], "server.port"),
    (["--config", "/nonexistent/kv.toml"], "not found"),
])
def test_serve_bad_config_is_exit_2(capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                    needle: str) -> None:
    import kvstore.daemon.server

    monkeypatch.setattr(kvstore.daemon.server, "serve", lambda config: pytest.fail("must not serve"))
    monkeypatch.delenv("KVSTORE_CONFIG", raising=False)
    code, out, err = run(capsys, "serve", *argv)
    assert code == 2 and out == "" and needle in err and "Traceback" not in err


# ------------------------------------------------------------ admin, bench


def test_admin_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "admin", "resize", "dram", "huge")
    assert code == 2 and "invalid size 'huge'" in err
    for tier in ("floppy", "remote"):  # remote is a tier, but not one to resize
        with pytest.raises(SystemExit) as e:
            main(["admin", "resize", tier, "1GiB"])
        assert e.value.code == 2 and f"invalid choice: '{tier}'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["admin", "policy", "fifo"])
    assert e.value.code == 2


def test_admin_with_fake_client(capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeClient:
        def __init__(self, target: str | None, **kw: Any) -> None:
            pass

        def __enter__(self) -> "FakeClient":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def admin_get_config(self) -> str:
            return "[dram]\ncapacity = \"1GiB\"\n"

        def admin_resize(self, tier: str, capacity_bytes: int) -> ResizeResult:
            return ResizeResult(old_capacity_bytes=1 << 30, new_capacity_bytes=capacity_bytes, evicted_blocks=7)

        def admin_set_policy(self, name: str) -> PolicyChange:
            return PolicyChange(old_policy="lru", new_policy=name)

    import kvstore.client

    monkeypatch.setattr(kvstore.client, "Client", FakeClient)
    assert run(capsys, "admin", "config")[1] == '[dram]\ncapacity = "1GiB"\n'
    assert run(capsys, "admin", "resize", "dram", "512MiB")[1] == \
        "dram: 1.0 GiB -> 512.0 MiB, 7 block(s) evicted to fit\n"
    assert run(capsys, "admin", "policy", "cost")[1] == "eviction policy: lru -> cost\n"


def test_bench_runs_the_scripts_quick(capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[list[str]] = []
    def fake_call(cmd: list[str], cwd: Any = None) -> int:
        calls.append(cmd)
        return 0

    monkeypatch.setattr(commands.subprocess, "call", fake_call)
    code, out, _ = run(capsys, "bench", "--json-dir", str(tmp_path))
    assert code == 0 and calls
    assert calls[0][1].endswith("bench/core.py") and "--quick" in calls[0]
    assert calls[0][-2:] == ["--json", str(tmp_path / "core.json")]
    calls.clear()
    (tmp_path / "file").write_text("")
    code, _, err = run(capsys, "bench", "--json-dir", str(tmp_path / "file" / "x"))  # was a traceback
    assert code == 2 and not calls and "--json-dir" in err and "Traceback" not in err


@pytest.mark.subprocess
def test_python_dash_m(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvstore", "capacity", "--layers", "2",
                        "--kv-heads", "1", "--head-dim", "64"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "KV bytes per token: 512 per rank" in r.stdout
    r = subprocess.run([sys.executable, "-m", "kvstore", "nope"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.parametrize("argv", [
    ["serve", "--bogus"],                                                   # unknown flag
    ["capacity", "--layers", "0", "--kv-heads", "8", "--head-dim", "128"],  # a value out of range
    ["admin", "policy", "fifo"],                                            # not one of the choices
    ["route", "--policy", "fastest"],
    ["frobnicate"],                                                         # unknown command
])
def test_bad_flags_are_one_kvstore_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """docs/operations.md: bad input (an unknown flag too) is exit 2 with a one-line
    ``kvstore: ...`` message on stderr (argparse printed its usage block first)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("kvstore: ") and "--help" in err, err


@pytest.mark.parametrize("text", ["tok1\ntok2\n", "tok\x01\n", "tök\n"])
def test_a_token_that_cannot_be_sent_is_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                   text: str) -> None:
    """A --token-file holding several tokens (the daemon's own file) or a
    control character was sent as it was: gRPC logged 'Illegal header value'
    and the call failed INTERNAL (exit 1). It is bad input: one line, exit 2,
    before any connection."""
    path = write(tmp_path, "tokens", text)
    code, out, err = run(capsys, "stats", "--target", "127.0.0.1:1", "--token-file", path)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "token" in err and "INTERNAL" not in err
