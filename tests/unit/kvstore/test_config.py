"""kvstore.config: layering, parsing, error messages, round trips."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore import config as cfgmod
from kvstore.config import (
    Config, ConfigError, DramConfig, EvictionPolicyName, LogLevel, ServerConfig, describe,
    format_duration, format_size, load_config, parse_duration, parse_size,
)
from kvstore.errors import InvalidArgument

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


def write(tmp_path: Path, text: str, name: str = "kvstore.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- defaults ---------------------------------------------------------------


def test_defaults_listen_on_localhost_only() -> None:
    cfg = load_config(env={})
    assert cfg == Config()
    assert cfg.server.host == "127.0.0.1"
    assert cfg.metrics.host == "127.0.0.1"
    assert cfg.server.port == 50051 and cfg.metrics.port == 9400
    assert cfg.server.unix_socket == ""
    assert cfg.server.max_message_bytes == 64 * MiB
    assert cfg.dram.capacity == 1 * GiB and cfg.dram.slot_sizes == ()
    assert cfg.hbm.capacity == 0 and cfg.ssd.capacity == 0
    assert cfg.ssd.admit_min_hits == 2
    assert cfg.eviction.policy is EvictionPolicyName.LRU and cfg.eviction.policy == "lru"
    assert cfg.log.level is LogLevel.INFO
    assert cfg.server.reservation_timeout == 30.0 and cfg.server.drain_seconds == 10.0
    assert cfg.server.event_buffer == 65536 and cfg.server.workers == 2


def test_every_key_has_a_docstring() -> None:
    docs = describe()
    assert set(docs) == set(Config.keys())
    assert all(docs.values()), [k for k, v in docs.items() if not v]


def test_sections_are_slotted_and_frozen() -> None:
    cfg = Config()
    for name in ("server", "metrics", "dram", "hbm", "ssd", "eviction", "log"):
        section = getattr(cfg, name)
        assert not hasattr(section, "__dict__"), name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, next(iter(dataclasses.asdict(section))), None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server = ServerConfig()  # type: ignore[misc]


# --- layering ---------------------------------------------------------------


def test_precedence_file_then_env_then_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, """
[server]
port = 6000
reservation_timeout = "45s"
[dram]
capacity = "2GiB"
[ssd]
capacity = "10GiB"
path = "/var/lib/kvstore"
""")
    env = {"KVSTORE_DRAM_CAPACITY": "3GiB", "KVSTORE_SERVER_PORT": "6001", "HOME": "/x"}
    cfg = load_config(path, env=env, overrides={"dram.capacity": "4GiB", "log.level": None})
    assert cfg.dram.capacity == 4 * GiB          # override beats env and file
    assert cfg.server.port == 6001               # env beats file
    assert cfg.ssd.capacity == 10 * GiB          # file beats defaults
    assert cfg.server.reservation_timeout == 45.0
    assert cfg.ssd.path == "/var/lib/kvstore"
    assert cfg.log.level is LogLevel.INFO        # None override = flag not given

    assert load_config(path, env={}).dram.capacity == 2 * GiB
    assert load_config(path, env=env).dram.capacity == 3 * GiB


def test_kvstore_config_env_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 7000\n")
    other = write(tmp_path, "[server]\nport = 7001\n", name="other.toml")
    assert load_config(env={"KVSTORE_CONFIG": str(path)}).server.port == 7000
    assert load_config(other, env={"KVSTORE_CONFIG": str(path)}).server.port == 7001


def test_env_types_lists_and_enums() -> None:
    cfg = load_config(env={
        "KVSTORE_DRAM_SLOT_SIZES": "1MiB, 64KiB",
        "KVSTORE_SERVER_MAX_MESSAGE_BYTES": "16MiB",
        "KVSTORE_SERVER_LEASE_CHECK_INTERVAL": "250ms",
        "KVSTORE_EVICTION_POLICY": "LFU",
        "KVSTORE_LOG_LEVEL": "debug",
        "KVSTORE_SSD_WRITE_BUDGET_MBPS": "200",
        "KVSTORE_METRICS_PORT": "0",
    })
    assert cfg.dram.slot_sizes == (64 * KiB, 1 * MiB)
    assert cfg.server.max_message_bytes == 16 * MiB
    assert cfg.server.lease_check_interval == 0.25
    assert cfg.eviction.policy is EvictionPolicyName.LFU
    assert cfg.log.level.logging_level == logging.DEBUG
    assert cfg.ssd.write_budget_mbps == 200
    assert cfg.metrics.port == 0
    assert load_config(env={"KVSTORE_DRAM_SLOT_SIZES": "auto"}).dram.slot_sizes == ()


def test_ignores_other_and_allowlisted_env_vars(tmp_path: Path) -> None:
    env = {"PATH": "/bin", "KVSTORE_TOKEN": "t", "KVSTORE_ADDRESS": "x:1",
           "kvstore_lowercase": "1"}
    assert load_config(env=env) == Config()
    # the variable that server.auth_token_env names holds tokens, not config
    env = {"KVSTORE_SERVER_AUTH_TOKEN_ENV": "KVSTORE_SECRET_TOKENS", "KVSTORE_SECRET_TOKENS": "a,b"}
    assert load_config(env=env).server.auth_token_env == "KVSTORE_SECRET_TOKENS"
    env = {"KVSTORE_SERVER_AUTH_TOKEN_ENV": "KVSTORE_SERVER_TOKENS", "KVSTORE_SERVER_TOKENS": "a"}
    assert load_config(env=env).server.auth_token_env == "KVSTORE_SERVER_TOKENS"


# --- errors name the key ----------------------------------------------------

ERROR_CASES: list[tuple[str, str, dict[str, str], dict[str, Any], list[str]]] = [
    # (id, toml, env, overrides, substrings the message must contain)
    ("unknown section", "[dramm]\ncapacity = 1\n", {}, {},
     ["'dramm'", "did you mean 'dram'", "allowed sections", "server, metrics, dram"]),
    ("unknown file key", "[dram]\ncapacityy = 1\n", {}, {},
     ["'dram.capacityy'", "kvstore.toml", "allowed keys in [dram]: capacity, shm_name, slot_sizes, page_size"]),
    ("section not a table", "dram = 5\n", {}, {}, ["'dram'", "expected a table"]),
    # a higher layer setting a key of the section used to replace the bad section without a word
    ("section not a table, a flag in it", "dram = 5\n", {}, {"dram.capacity": "16MiB"},
     ["'dram'", "expected a table"]),
    ("array of tables, env in it", "[[server]]\nport = 1\n", {"KVSTORE_SERVER_PORT": "7"}, {},
     ["'server'", "expected a table"]),
    ("unknown env key", "", {"KVSTORE_DRAM_CAPCITY": "1GiB"}, {},
     ["KVSTORE_DRAM_CAPCITY", "dram.capcity", "KVSTORE_DRAM_CAPACITY"]),
    ("unknown env section", "", {"KVSTORE_BOGUS": "1"}, {},
     ["KVSTORE_BOGUS", "KVSTORE_<SECTION>_<FIELD>", "SERVER", "KVSTORE_CONFIG"]),
    ("unknown override", "", {}, {"dram.nope": 1},
     ["'dram.nope'", "overrides", "allowed keys in [dram]"]),
    ("override without section", "", {}, {"capacity": 1}, ["'capacity'", "section.field"]),
    ("bad size from env", "", {"KVSTORE_DRAM_CAPACITY": "lots"}, {},
     ["dram.capacity", "'lots'", "GiB", "KVSTORE_DRAM_CAPACITY"]),
    ("bad size in file", "[hbm]\ncapacity = -5\n", {}, {}, ["hbm.capacity", "-5", "kvstore.toml"]),
    ("port range", "", {}, {"server.port": 70000}, ["server.port", "70000", "0..65535"]),
    ("port not int", "", {"KVSTORE_SERVER_PORT": "abc"}, {},
     ["server.port", "'abc'", "expected an integer"]),
    ("policy", "", {}, {"eviction.policy": "fifo"},
     ["eviction.policy", "'fifo'", "lru, lfu, cost", "override"]),
    ("log level", "[log]\nlevel = \"loud\"\n", {}, {},
     ["log.level", "'loud'", "debug, info, warning, error"]),
    ("str type", "[server]\nhost = 5\n", {}, {}, ["server.host", "5", "expected a string"]),
    ("negative duration", "", {"KVSTORE_SERVER_DRAIN_SECONDS": "-1s"}, {},
     ["server.drain_seconds", "'-1s'", "500ms"]),
    ("zero timeout", "", {}, {"server.reservation_timeout": "0s"},
     ["server.reservation_timeout", "> 0"]),
    ("tls half", "", {}, {"server.tls_cert_file": "/c.pem"},
     ["server.tls_key_file", "set together"]),
    ("workers", "", {}, {"server.workers": 0}, ["server.workers", "0", "1..1024"]),
    ("token env name", "", {}, {"server.auth_token_env": "not a name"},
     ["server.auth_token_env", "'not a name'"]),
    ("nothing to listen on", "", {}, {"server.host": ""}, ["server.host", "unix_socket"]),
    ("slot bigger than slab", "", {}, {"dram.capacity": "1MiB", "dram.slot_sizes": "2MiB"},
     ["dram.slot_sizes", "2MiB", "1MiB"]),
    ("slot sizes distinct", "", {}, {"dram.slot_sizes": "1MiB,1024KiB"},
     ["dram.slot_sizes", "distinct"]),
    ("slot list junk", "", {"KVSTORE_DRAM_SLOT_SIZES": "big"}, {}, ["dram.slot_sizes", "'big'"]),
    ("shm name", "", {}, {"dram.shm_name": "a/b"}, ["dram.shm_name", "'a/b'"]),
    ("zero dram", "", {}, {"dram.capacity": 0}, ["dram.capacity", ">= 1"]),
    ("port clash", "", {}, {"metrics.port": 50051}, ["metrics.port", "server.port"]),
    ("mbps negative", "", {"KVSTORE_SSD_WRITE_BUDGET_MBPS": "-3"}, {},
     ["ssd.write_budget_mbps", ">= 0"]),
]


@pytest.mark.parametrize(("toml", "env", "overrides", "needles"),
                         [case[1:] for case in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_errors_name_the_key(tmp_path: Path, toml: str, env: dict[str, str],
                             overrides: dict[str, Any], needles: list[str]) -> None:
    path = write(tmp_path, toml) if toml else None
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env, overrides=overrides)
    assert isinstance(info.value, InvalidArgument)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_file_problems_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="missing.toml.*not found"):
        load_config(tmp_path / "missing.toml", env={})
    bad = write(tmp_path, "[server\nport = 1\n", name="broken.toml")
    with pytest.raises(InvalidArgument, match="broken.toml.*not valid TOML"):
        load_config(bad, env={})
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[server]\n")  # not UTF-8: was a UnicodeDecodeError traceback
    with pytest.raises(InvalidArgument, match="binary.toml.*not valid TOML.*UTF-8"):
        load_config(binary, env={})


# --- sizes and durations ----------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("0", 0), (0, 0), (4096, 4096), ("100", 100), ("100B", 100), ("100b", 100),
    ("1KiB", 1024), ("1kib", 1024), ("1Ki", 1024), ("1K", 1000), ("1kb", 1000),
    ("512MiB", 512 * MiB), ("1GiB", GiB), ("1gib", GiB), (" 2 GiB ", 2 * GiB),
    ("4GB", 4_000_000_000), ("4gb", 4_000_000_000), ("1TiB", 1 << 40), ("3TB", 3 * 10**12),
    ("1.5GiB", 3 * GiB // 2), ("0.5KB", 500), (".5KiB", 512), ("16MB", 16_000_000),
])
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", [
    "", "GiB", "-1", -1, "1.5B", "1PiB", "1 GiBs", "1e9", "1,000", "ten", True, 1.5, None,
    "0x10", "1 G i B",
])
def test_parse_size_rejects(text: Any) -> None:
    with pytest.raises(InvalidArgument, match="size"):
        parse_size(text)


@pytest.mark.parametrize(("value", "text"), [
    (0, "0"), (1, "1"), (1000, "1KB"), (1024, "1KiB"), (GiB, "1GiB"), (3 * GiB // 2, "1536MiB"),
    (4_000_000_000, "4GB"), (1 << 40, "1TiB"), (1_000_001, "1000001"), (64 * MiB, "64MiB"),
])
def test_format_size(value: int, text: str) -> None:
    assert format_size(value) == text
    assert parse_size(text) == value


@given(st.integers(min_value=0, max_value=1 << 62))
def test_format_size_round_trips(n: int) -> None:
    assert parse_size(format_size(n)) == n


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), ("1h30m", 5400.0),
    ("1.5s", 1.5), ("250us", 0.00025), ("10", 10.0), (10, 10.0), (0.25, 0.25), ("0", 0.0),
    (" 2M ", 120.0), ("1d", 86400.0), ("100ns", 1e-7), ("1m30s", 90.0), ("0.1s", 0.1),
])
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", [
    "-1s", -1, "abc", "1x", "", "s", "ms", float("nan"), float("inf"), True, None, "1 s s",
])
def test_parse_duration_rejects(text: Any) -> None:
    with pytest.raises(InvalidArgument, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(("seconds", "text"), [
    (0.0, "0s"), (30.0, "30s"), (120.0, "2m"), (3600.0, "1h"), (0.5, "500ms"), (1.5, "1500ms"),
    (0.1, "100ms"), (90.0, "90s"),
])
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False))
def test_format_duration_round_trips(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


# --- round trips and API ----------------------------------------------------


def _unusual() -> Config:
    return Config().replace(**{
        "server.host": "0.0.0.0",
        "server.port": 0,
        "server.unix_socket": "/run/kv \"store\"\\sock\n\u00e9\U0001f600\x7f",
        "server.max_message_bytes": 1_000_001,
        "server.drain_seconds": 0.125,
        "server.reservation_timeout": 1e-05,
        "server.lease_check_interval": 7200,
        "server.tls_cert_file": "c.pem",
        "server.tls_key_file": "k.pem",
        "dram.capacity": "3GB",
        "dram.slot_sizes": [4096, "1MiB", 65536],
        "hbm.capacity": "8GiB",
        "hbm.device": 3,
        "ssd.capacity": 12345,
        "eviction.policy": "cost",
        "log.level": "warning",
    })


@pytest.mark.parametrize("comments", [True, False])
@pytest.mark.parametrize("make", [Config, _unusual])
def test_to_toml_round_trips(tmp_path: Path, make: Any, comments: bool) -> None:
    cfg = make()
    text = cfg.to_toml(comments=comments)
    assert ("# " in text) == comments
    assert load_config(write(tmp_path, text), env={}) == cfg


def test_to_toml_is_readable() -> None:
    text = _unusual().to_toml()
    assert 'capacity = "3GB"' in text
    assert 'slot_sizes = ["4KiB", "64KiB", "1MiB"]' in text
    assert 'drain_seconds = "125ms"' in text
    assert 'lease_check_interval = "2h"' in text
    assert "max_message_bytes = 1000001" in text
    assert 'slot_sizes = "auto"' in Config().to_toml()


def test_to_dict_is_plain_json_and_reloads() -> None:
    cfg = _unusual()
    data = json.loads(cfg.to_json())
    assert data == cfg.to_dict()
    assert data["dram"]["slot_sizes"] == [4096, 65536, MiB]
    assert data["eviction"]["policy"] == "cost"
    flat = {f"{section}.{key}": value for section, fields in data.items()
            for key, value in fields.items()}
    assert Config().replace(**flat) == cfg
    assert load_config(env={}, overrides=flat) == cfg


def test_replace() -> None:
    base = Config()
    changed = base.replace(**{"dram.capacity": "2GiB", "server.port": "0"})
    assert changed.dram.capacity == 2 * GiB and changed.server.port == 0
    assert base.dram.capacity == GiB  # unchanged
    assert changed.server.host == base.server.host
    assert base.replace(dram={"shm_name": "kv-test"}).dram == DramConfig(shm_name="kv-test")
    assert base.replace(dram=DramConfig(capacity=MiB)).dram.capacity == MiB
    with pytest.raises(ConfigError, match="'dram.nope'"):
        base.replace(**{"dram.nope": 1})
    with pytest.raises(ConfigError, match="'dramm'"):
        base.replace(dramm={})
    with pytest.raises(ConfigError, match="dram.capacity"):
        base.replace(dram={"capacity": "huge"})


def test_get_and_keys() -> None:
    cfg = Config()
    assert cfg.get("dram.capacity") == GiB
    assert "server.port" in Config.keys() and "log.level" in Config.keys()
    with pytest.raises(ConfigError):
        cfg.get("dram.nope")


def test_direct_construction_coerces_and_validates() -> None:
    assert DramConfig(capacity="2GiB").capacity == 2 * GiB  # type: ignore[arg-type]
    assert ServerConfig(drain_seconds=5).drain_seconds == 5.0
    with pytest.raises(ConfigError, match="server.port"):
        ServerConfig(port=-1)


def test_resolved_helpers(tmp_path: Path) -> None:
    cfg = Config()
    assert cfg.ssd.resolved_path({"XDG_DATA_HOME": str(tmp_path)}) == tmp_path / "kvstore"
    assert cfg.ssd.resolved_path({}).parts[-3:] == (".local", "share", "kvstore")
    assert cfg.replace(**{"ssd.path": "/data/kv"}).ssd.resolved_path({}) == Path("/data/kv")
    assert cfg.dram.resolved_shm_name(pid=42).startswith("kvstore-")
    assert cfg.dram.resolved_shm_name(pid=42).endswith("-42")
    assert DramConfig(shm_name="mine").resolved_shm_name() == "mine"


@dataclass(slots=True, frozen=True)
class _ExtraSection(cfgmod.Section):
    """A section a later issue might add: new fields get parsing for free."""

    SECTION: ClassVar[str] = "extra"

    enabled: bool = False
    """A switch."""
    ratio: float = 0.5
    """A fraction."""


@pytest.mark.parametrize(("raw", "value"), [
    ("true", True), ("YES", True), ("1", True), (1, True), ("false", False), ("no", False),
    ("0", False), (False, False),
])
def test_extension_section_bools(raw: Any, value: bool) -> None:
    assert _ExtraSection(enabled=raw).enabled is value


def test_extension_section_errors() -> None:
    with pytest.raises(ConfigError, match=r"extra\.enabled.*'maybe'.*true/false"):
        _ExtraSection(enabled="maybe")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"extra\.ratio.*finite number"):
        _ExtraSection(ratio="nan")  # type: ignore[arg-type]
    assert _ExtraSection(ratio="0.25").ratio == 0.25  # type: ignore[arg-type]


# --- the pydantic / pydantic-settings layers ---------------------------------


def test_nested_env_names_split_at_the_section() -> None:
    # field names hold underscores too: only the first one after the section splits
    cfg = load_config(env={
        "KVSTORE_SERVER_AUTH_TOKEN_ENV": "MY_TOKENS",
        "KVSTORE_SERVER_MAX_MESSAGE_BYTES": "8MiB",
        "KVSTORE_CLUSTER_PEER_BANDWIDTH_GBPS": "25",
        "KVSTORE_ADMISSION_QOS_MAX_CONCURRENCY": "8",
        "KVSTORE_SSD_SYNC": "off",
    })
    assert cfg.server.auth_token_env == "MY_TOKENS"
    assert cfg.server.max_message_bytes == 8 * MiB
    assert cfg.cluster.peer_bandwidth_gbps == 25.0
    assert cfg.admission.qos_max_concurrency == 8
    assert cfg.ssd.sync is False
    with pytest.raises(ConfigError, match="KVSTORE_server_port"):  # names are upper case
        load_config(env={"KVSTORE_server_port": "1"})


def test_env_argument_replaces_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_DRAM_CAPACITY", "2GiB")
    assert load_config(env={}).dram.capacity == GiB
    assert load_config().dram.capacity == 2 * GiB


@pytest.mark.parametrize(("layers", "expected"), [
    ((), ()),
    (("toml",), (64 * KiB,)),
    (("toml", "env"), (MiB,)),
    (("env",), (MiB,)),
    (("toml", "env", "override"), (4 * KiB, 8 * KiB)),
    (("toml", "override"), (4 * KiB, 8 * KiB)),
])
def test_every_layer_beats_the_one_below(tmp_path: Path, layers: tuple[str, ...],
                                         expected: tuple[int, ...]) -> None:
    path = write(tmp_path, '[dram]\nslot_sizes = ["64KiB"]\n') if "toml" in layers else None
    env = {"KVSTORE_DRAM_SLOT_SIZES": "1MiB"} if "env" in layers else {}
    overrides = {"dram.slot_sizes": [8192, "4KiB"]} if "override" in layers else {}
    cfg = load_config(path, env=env, overrides=overrides)
    assert cfg.dram.slot_sizes == expected
    assert cfg.dram.capacity == GiB  # keys no layer sets keep their defaults


def test_layers_merge_per_key_not_per_section(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 6000\nworkers = 3\n")
    cfg = load_config(path, env={"KVSTORE_SERVER_WORKERS": "4"}, overrides={"server.drain_seconds": "1s"})
    assert (cfg.server.port, cfg.server.workers, cfg.server.drain_seconds) == (6000, 4, 1.0)


@pytest.mark.parametrize(("toml", "needles"), [
    ('[server]\nport = "x"\n', ["server.port: invalid value 'x': expected an integer", "(set by config file"]),
    ("[server]\nworkers = true\n", ["server.workers: invalid value True", "not a boolean"]),
    ("[ssd]\nlow_watermark = 0.9\n", ["ssd.low_watermark: invalid value 0.9: expected a value in 0..0.5"]),
    ("[ssd]\nsync = \"maybe\"\n", ["ssd.sync: invalid value 'maybe': expected true/false"]),
    ('[server]\nport = "x"\nworkers = 0\n', ["server.port", "[and 1 more error]"]),
])
def test_pydantic_errors_read_like_ours(tmp_path: Path, toml: str, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, toml), env={})
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"
    assert info.value.key == needles[0].split(":")[0]


def test_replace_with_a_mapping_names_unknown_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'dram.capacityy' \(did you mean 'capacity'\?\)"):
        Config().replace(dram={"capacityy": 1})


def test_a_directory_is_not_a_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path, env={})


def test_dram_populate_reaches_the_store() -> None:
    """``dram.populate`` (off by default) is read from the environment and
    handed to the store that creates the slab."""
    from kvstore.daemon.state import store_config

    assert load_config(env={}).dram.populate is False
    cfg = load_config(env={"KVSTORE_DRAM_POPULATE": "true"})
    assert cfg.dram.populate is True and store_config(cfg).dram_populate is True
    assert store_config(load_config(env={})).dram_populate is False
