"""One typed config tree for the daemon, and the size/duration parsers.

Layers, lowest first: defaults written here < a TOML file < ``KVSTORE_*``
environment variables < CLI flags (dotted overrides)::

    cfg = load_config("kvstore.toml", overrides={"dram.capacity": "2GiB"})
    cfg.dram.capacity               # 2147483648: sizes are ints of bytes
    cfg.server.reservation_timeout  # 30.0: durations are float seconds

Env vars are ``KVSTORE_<SECTION>_<FIELD>`` (``KVSTORE_DRAM_CAPACITY=4GiB``);
lists are comma-separated, booleans true/false/1/0/yes/no. Unknown keys and
bad values raise :class:`ConfigError` (an ``InvalidArgument``) naming the
dotted key, the value and what is allowed.

The fields are validated by pydantic (kvstore/config_fields.py); the layers
are pydantic-settings sources (a TOML source, an env source with nested
names, the overrides as init arguments), behind an allow-list of
``KVSTORE_*`` names. A new section is a ``@dataclass(slots=True,
frozen=True)`` subclass of ``Section`` with ``SECTION = "<name>"`` and a
docstring per field, plus a field of that type on :class:`Config`; loading,
env names, validation, ``to_dict`` and ``to_toml`` follow from the annotations.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, get_type_hints

from pydantic import BaseModel

from kvstore.config_fields import (
    ConfigError,
    Duration,
    GiB,
    KiB,
    MiB,
    Port,
    Section,
    Size,
    SizeList,
    TiB,
    bounds,
    field_docs,
    field_kind,
    field_names,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
    plain,
    toml_value,
)
from kvstore.config_cluster import ClusterConfig, ClusterMode
from kvstore.config_sources import (
    ENV_ALLOWLIST,
    ENV_PREFIX,
    Origin,
    SettingsBase,
    load_layers,
    settings_class,
    split_key,
    unknown_section,
    validate_tree,
)

__all__ = [
    "ClusterConfig", "ClusterMode", "Config", "ConfigError", "DramConfig", "ENV_ALLOWLIST", "ENV_PREFIX", "EvictionConfig",
    "EvictionPolicyName", "HbmConfig", "LogConfig", "LogLevel", "MetricsConfig", "Section", "ServerConfig",
    "SsdConfig", "describe", "format_duration", "format_size", "load_config", "parse_duration",
    "parse_size", "KiB", "MiB", "GiB", "TiB",
]

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SHM_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


@dataclass(slots=True, frozen=True)
class ServerConfig(Section):
    """The gRPC listener, authentication, and request lifetimes."""

    SECTION: ClassVar[str] = "server"

    host: str = "127.0.0.1"
    """Address to listen on for gRPC. Keep 127.0.0.1 unless the daemon must be
    reachable from other hosts (then configure auth and TLS). Empty: no TCP
    listener (requires unix_socket)."""
    port: Port = 50051
    """TCP port for gRPC; 0 picks a free port (tests)."""
    unix_socket: str = ""
    """Path of a Unix socket to listen on as well (mode 0600); empty: none."""
    lookup_socket: str = ""
    """Same-host socket for Lookup and the shared-memory path's control calls
    (mode 0600, kvstore/daemon/socket_server.py), on by default: empty means
    ``<unix_socket>.lookup`` when unix_socket is set, else a new socket in a
    private directory (0700) of the daemon's user (``$XDG_RUNTIME_DIR/kvstore``
    or ``/tmp/kvstore-<uid>``); clients find it through Handshake. "off": none."""
    shared_index: bool = True
    """With the same-host socket on: keep the index columns a prefix lookup
    reads in ``/dev/shm`` (files mode 0600) so same-host clients answer
    ``lookup`` without a round trip (kvstore/wire/shared_index.py). Off, or
    with DRAM admission on, every lookup goes to the daemon."""
    max_message_bytes: Annotated[Size, bounds(4 * KiB, 2**31 - 1)] = 64 * MiB
    """Largest gRPC message either way; bounds inline Put/Get payloads."""
    auth_token_file: str = ""
    """File holding accepted bearer tokens, one per line; empty: no token file."""
    auth_token_env: str = ""
    """Name of an environment variable holding accepted bearer token(s),
    comma-separated; empty: none. With neither this nor auth_token_file, the
    daemon accepts unauthenticated calls (fine on 127.0.0.1 or a Unix socket)."""
    tls_cert_file: str = ""
    """PEM certificate chain for TLS; set together with tls_key_file."""
    tls_key_file: str = ""
    """PEM private key for TLS; set together with tls_cert_file."""
    tls_client_ca_file: str = ""
    """PEM CA bundle: when set (with TLS on), every client must present a
    certificate signed by it (mutual TLS); peers present their own."""
    drain_seconds: Duration = 10.0
    """On shutdown, how long in-flight calls may finish before they are cut."""
    reservation_timeout: Duration = 30.0
    """An uncommitted Reserve is aborted after this long."""
    lease_check_interval: Duration = 1.0
    """How often reservations, leases and sessions are checked for expiry."""
    event_buffer: Annotated[int, bounds(0, None)] = 65536
    """Events kept for WatchEvents replay; a watcher further behind gets a Gap."""
    tenants_file: str = ""
    """TOML file mapping bearer tokens to tenants; empty: one tenant for all."""
    workers: Annotated[int, bounds(1, 1024)] = 2
    """Threads for data copies (promotion, inline Put/Get)."""

    def _validate(self) -> None:
        if not self.host and not self.unix_socket:
            self._fail("host", "is empty and server.unix_socket is unset: nothing to listen on")
        if self.auth_token_env and not _ENV_NAME_RE.match(self.auth_token_env):
            self._fail("auth_token_env", f"invalid value {self.auth_token_env!r}: expected an "
                       "environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            missing = "tls_key_file" if self.tls_cert_file else "tls_cert_file"
            self._fail(missing, "server.tls_cert_file and server.tls_key_file must be set together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            self._fail("tls_client_ca_file", "needs TLS on (server.tls_cert_file and server.tls_key_file)")
        if self.reservation_timeout <= 0:
            self._fail("reservation_timeout", "must be > 0")
        if self.lease_check_interval <= 0:
            self._fail("lease_check_interval", "must be > 0")


@dataclass(slots=True, frozen=True)
class MetricsConfig(Section):
    """The Prometheus endpoint."""

    SECTION: ClassVar[str] = "metrics"

    host: str = "127.0.0.1"
    """Address the /metrics HTTP endpoint listens on."""
    port: Port = 9400
    """Port of the /metrics endpoint; 0 disables it."""
    namespace_series: Annotated[int, bounds(0, 100_000)] = 64
    """Namespace labels with series of their own in kvstore_namespace_lookup_*_total (the busiest when
    first seen, kept for the daemon's life); every other namespace is summed into namespace="_other"."""


@dataclass(slots=True, frozen=True)
class DramConfig(Section):
    """The DRAM tier: a shared-memory slab that same-host clients map."""

    SECTION: ClassVar[str] = "dram"

    capacity: Annotated[Size, bounds(1, None)] = 1 * GiB
    """Size of the shared-memory slab."""
    shm_name: str = ""
    """POSIX shared-memory name of the slab; empty: "kvstore-<uid>-<pid>"."""
    slot_sizes: SizeList = ()
    """Slot size classes of the slab, e.g. ["64KiB", "1MiB"]: a payload takes
    the smallest class that holds it. "auto" (the empty list): each payload
    size, rounded up to 4 KiB, is its own class (no waste for the uniform
    blocks of a namespace)."""
    page_size: Annotated[Size, bounds(4 * KiB, None)] = 16 * MiB
    """Slab page: the unit of memory that moves between size classes and that
    a resize adds or retires. Capped at the capacity; the largest block must
    fit in one page."""
    populate: bool = False
    """Back the whole slab with memory at start (and what a resize adds), as
    an engine's pinned pool is: the daemon takes ``capacity`` at once, and no
    put later pays for the host's page allocation (a first write into a
    sparse slab runs at a fraction of a copy's speed). false: the slab is
    backed page by page as blocks first land."""

    def _validate(self) -> None:
        if self.shm_name and not _SHM_NAME_RE.match(self.shm_name):
            self._fail("shm_name", f"invalid value {self.shm_name!r}: expected letters, digits, "
                       "'.', '_' or '-' (no '/'), at most 201 characters")
        if self.slot_sizes and self.slot_sizes[-1] > self.capacity:
            self._fail("slot_sizes", f"slot size {format_size(self.slot_sizes[-1])} exceeds "
                       f"dram.capacity {format_size(self.capacity)}")

    def resolved_shm_name(self, pid: int | None = None) -> str:
        """``shm_name``, or the automatic "kvstore-<uid>-<pid>" when empty."""
        if self.shm_name:
            return self.shm_name
        uid = os.getuid() if hasattr(os, "getuid") else 0
        return f"kvstore-{uid}-{os.getpid() if pid is None else pid}"


class HbmAdmit(StrEnum):
    """Which puts land in HBM (``hbm.admit``)."""

    RESERVE = "reserve"
    ALL = "all"


@dataclass(slots=True, frozen=True)
class HbmConfig(Section):
    """The HBM tier: GPU memory shared with engines through CUDA IPC."""

    SECTION: ClassVar[str] = "hbm"

    capacity: Size = 0
    """Bytes of GPU memory for the tier; 0: no HBM tier (always so without CUDA)."""
    device: Annotated[int, bounds(0, None)] = 0
    """CUDA device ordinal."""
    admit: HbmAdmit = HbmAdmit.RESERVE
    """Which new blocks land in HBM: "reserve" (only Reserve calls that ask
    for tier hbm; every other put goes to DRAM) or "all" (every put, while
    HBM has room after demoting its coldest blocks to DRAM)."""
    page_size: Annotated[Size, bounds(4 * KiB, None)] = 16 * MiB
    """Slab page of the HBM tier (as dram.page_size)."""
    on_cpu: bool = False
    """Run the tier on a host tensor instead of a GPU (tests and development:
    the whole tier logic without CUDA; no IPC, engines read through DRAM)."""


class SsdWriteMode(StrEnum):
    """When blocks are written to the SSD tier (``ssd.write_mode``)."""

    BACK = "back"
    THROUGH = "through"


@dataclass(slots=True, frozen=True)
class SsdConfig(Section):
    """The SSD tier: blocks demoted from DRAM, promoted back on use."""

    SECTION: ClassVar[str] = "ssd"

    capacity: Size = 0
    """Disk budget; 0: the SSD tier is disabled."""
    path: str = ""
    """Directory for the tier's files; empty: $XDG_DATA_HOME/kvstore, or
    ~/.local/share/kvstore."""
    admit_min_hits: Annotated[int, bounds(0, None)] = 2
    """A block evicted from DRAM is written to SSD only if it was hit at least
    this many times; 0 admits every evicted block."""
    write_budget_mbps: Annotated[int, bounds(0, None)] = 0
    """Cap on the average SSD write rate, in megabytes (10^6 bytes) per
    second; 0: unlimited."""
    write_mode: SsdWriteMode = SsdWriteMode.BACK
    """"back": write a block to SSD when it is evicted from DRAM (and keep DRAM
    free above low_watermark in the background); "through": copy admitted
    blocks to SSD in the background soon after they are stored, so eviction
    only drops the DRAM copy."""
    low_watermark: Annotated[float, bounds(0, 0.5)] = 0.05
    """Share of DRAM that write-back demotion keeps free in the background."""
    sync: bool = True
    """fsync data and index on every write batch (crash-safe). false is for
    tests and throwaway caches only."""
    shutdown_flush_seconds: Annotated[Duration, bounds(0, 3600)] = 5.0
    """On SIGTERM, write the blocks that live only in DRAM (write-back: not
    demoted yet; write-through: not copied yet) to SSD, parents first, for at
    most this long before exiting, so that a clean restart finds them; 0:
    flush nothing (docs/reliability.md)."""

    def resolved_path(self, env: Mapping[str, str] | None = None) -> Path:
        """``path``, or the default data directory when empty."""
        if self.path:
            return Path(self.path).expanduser()
        environ = os.environ if env is None else env
        xdg = environ.get("XDG_DATA_HOME", "")
        if xdg and os.path.isabs(xdg):
            return Path(xdg) / "kvstore"
        return Path.home() / ".local" / "share" / "kvstore"


@dataclass(slots=True, frozen=True)
class AdmissionSection(Section):
    """SLO-aware admission (Admit/Report) and QoS of the daemon's calls."""

    SECTION: ClassVar[str] = "admission"

    prefill_tokens_per_s: Annotated[float, bounds(1, None)] = 20000.0
    """Initial prefill speed of one engine; recalibrated from reported TTFTs."""
    attention_s_per_token2: Annotated[float, bounds(0, None)] = 0.0
    """Attention term of the prefill model: seconds per (new x context) token pair."""
    qos_max_concurrency: Annotated[int, bounds(1, 1_000_000)] = 64
    """Calls in progress at once before calls queue by priority class
    (foreground > write > prefetch > background); full queues fail fast with
    RESOURCE_EXHAUSTED and a retry-after-ms trailer."""
    qos_queue_limit: Annotated[int, bounds(1, 1_000_000)] = 1024
    """Queued calls allowed for the foreground class (write: half, prefetch: a
    quarter, background: an eighth)."""
    default_tenant_share: Annotated[float, bounds(0, 1)] = 1.0
    """Share of each tier a tenant without its own `share` in
    server.tenants_file may hold before its blocks are evicted first."""


class EvictionPolicyName(StrEnum):
    """Eviction policies ``eviction.policy`` may name."""

    LRU = "lru"
    LFU = "lfu"
    COST = "cost"


@dataclass(slots=True, frozen=True)
class EvictionConfig(Section):
    """Which blocks leave a full tier first."""

    SECTION: ClassVar[str] = "eviction"

    policy: EvictionPolicyName = EvictionPolicyName.LRU
    """lru (least recently used), lfu (least frequently used) or cost
    (cheapest to recompute or refetch first)."""
    dram_admission: bool = False
    """When DRAM is full, store a new block only if it was looked up at least
    as often as the block it would evict (TinyLFU-style; docs/replay.md:
    better on shared-prompt, agent and document workloads, worse on chat)."""


class LogLevel(StrEnum):
    """Levels ``log.level`` may name."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def logging_level(self) -> int:
        """The matching ``logging`` module level."""
        return int(getattr(logging, self.name))


@dataclass(slots=True, frozen=True)
class LogConfig(Section):
    """Logging."""

    SECTION: ClassVar[str] = "log"

    level: LogLevel = LogLevel.INFO
    """debug, info, warning or error."""


@dataclass(slots=True, frozen=True)
class Config:
    """The whole daemon config. Build it with :func:`load_config`."""

    server: ServerConfig = field(default_factory=ServerConfig)
    """gRPC listener and request lifetimes."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Prometheus endpoint."""
    dram: DramConfig = field(default_factory=DramConfig)
    """Shared-memory DRAM tier."""
    hbm: HbmConfig = field(default_factory=HbmConfig)
    """GPU HBM tier."""
    ssd: SsdConfig = field(default_factory=SsdConfig)
    """SSD tier."""
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    """Eviction policy."""
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    """Admission control and QoS."""
    log: LogConfig = field(default_factory=LogConfig)
    """Logging."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Peers, directory and peer fetch."""

    def __post_init__(self) -> None:
        for name, cls in _sections().items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise ConfigError(f"{name}: expected a {cls.__name__}, got {value!r}", key=name)
        s = self.server
        if (self.cluster.mode is not ClusterMode.OFF and not self.cluster.allow_insecure_unauthenticated
                and not (s.tenants_file or s.auth_token_file or s.auth_token_env)):
            raise ConfigError(
                f"cluster.mode is {self.cluster.mode.value} but auth is off: any host that reaches this node "
                "could read every tenant's blocks. Configure server.tenants_file (or auth_token_file / "
                "auth_token_env), or set cluster.allow_insecure_unauthenticated = true on a closed network "
                "(docs/security.md)", key="cluster.allow_insecure_unauthenticated")
        if (self.metrics.port != 0 and self.server.host
                and self.metrics.port == self.server.port
                and self.metrics.host == self.server.host):
            raise ConfigError(
                f"metrics.port: {self.metrics.port} is also server.port on "
                f"{self.server.host}: use different ports (metrics.port = 0 disables metrics)",
                key="metrics.port")

    @staticmethod
    def keys() -> list[str]:
        """Every dotted key, in tree order."""
        return [f"{name}.{f}" for name, cls in _sections().items() for f in field_names(cls)]

    def get(self, key: str) -> Any:
        """The value at a dotted key ("dram.capacity")."""
        section, name = _split_key(key, "")
        return getattr(getattr(self, section), name)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (JSON-ready): sizes in bytes, durations in
        seconds, enums as their names, lists for tuples."""
        out: dict[str, dict[str, Any]] = {}
        for name, cls in _sections().items():
            section = getattr(self, name)
            out[name] = {f: plain(getattr(section, f)) for f in field_names(cls)}
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """``to_dict()`` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def to_toml(self, comments: bool = True) -> str:
        """The whole tree as TOML that :func:`load_config` reads back equal.
        Sizes and durations are spelled for people ("1GiB", "30s"); with
        ``comments``, every key carries its docstring."""
        docs = describe() if comments else {}
        lines: list[str] = []
        for name, cls in _sections().items():
            if lines:
                lines.append("")
            if comments and cls.__doc__:
                lines.append(f"# {inspect.cleandoc(cls.__doc__).splitlines()[0]}")
            lines.append(f"[{name}]")
            section = getattr(self, name)
            for f in field_names(cls):
                for doc_line in docs.get(f"{name}.{f}", "").splitlines():
                    lines.append(f"# {doc_line}".rstrip())
                lines.append(f"{f} = {toml_value(field_kind(cls, f), getattr(section, f))}")
        return "\n".join(lines) + "\n"

    def replace(self, **changes: Any) -> Config:
        """A copy with some keys changed, validated like a load::

            cfg.replace(**{"dram.capacity": "2GiB", "server.port": 0})
            cfg.replace(dram={"capacity": "2GiB"})   # a mapping or a DramConfig
        """
        values = {name: _raw(getattr(self, name)) for name in _sections()}
        for key, value in changes.items():
            if "." in key:
                section, name = _split_key(key, "")
                values[section][name] = value
            elif key not in values:
                unknown_section(key, "", _sections())
            elif isinstance(value, Section):
                values[key] = _raw(value)
            elif isinstance(value, Mapping):
                values[key].update(value)
            else:
                raise ConfigError(f"{key}: expected a mapping or a section, got {value!r}",
                                  key=key)
        return _build(values, {})


@cache
def _sections() -> dict[str, type[Section]]:
    hints = get_type_hints(Config)
    found: dict[str, type[Section]] = {}
    for f in dataclasses.fields(Config):
        cls = hints[f.name]
        if not (isinstance(cls, type) and issubclass(cls, Section)) or cls.SECTION != f.name:
            raise TypeError(f"Config.{f.name}: expected a Section with SECTION = {f.name!r}")
        found[f.name] = cls
    return found


def _raw(section: Section) -> dict[str, Any]:
    return {f: getattr(section, f) for f in field_names(type(section))}


@cache
def _settings_class() -> type[SettingsBase]:
    return settings_class(_sections())


def _split_key(key: str, where: str) -> tuple[str, str]:
    return split_key(key, where, _sections())


def _to_config(tree: BaseModel, origin: Origin) -> Config:
    """The dataclass tree from validated settings; cross-field errors name
    where a value came from."""
    try:
        built: dict[str, Any] = {name: cls(**dict(getattr(tree, name))) for name, cls in _sections().items()}
        return Config(**built)
    except ConfigError as exc:
        if exc.key in origin:
            raise ConfigError(f"{exc} (set by {origin[exc.key][0]})", key=exc.key) from None
        raise


def _build(values: Mapping[str, Mapping[str, Any]], origin: Origin) -> Config:
    """Sections from raw values, validated like a load."""
    return _to_config(validate_tree(_settings_class(), values, origin), origin)


@cache
def describe() -> dict[str, str]:
    """{dotted key: its docstring}, for help texts and the commented TOML.
    Empty strings where the source is unavailable."""
    return {f"{name}.{f}": doc for name, cls in _sections().items() for f, doc in field_docs(cls).items()}


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Build the config: defaults < TOML file < KVSTORE_* env < ``overrides``.

    ``path``: the TOML file; None uses ``$KVSTORE_CONFIG`` if set, else none.
    ``env``: the environment to read (default ``os.environ``).
    ``overrides``: dotted keys from CLI flags, {"dram.capacity": "2GiB"};
    None values are skipped (a flag that was not given).
    Raises ConfigError naming the key on any unknown key or bad value.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    if path is None and environ.get("KVSTORE_CONFIG"):
        path = environ["KVSTORE_CONFIG"]
    tree, origin = load_layers(_settings_class(), _sections(), path, environ, overrides or {})
    return _to_config(tree, origin)
