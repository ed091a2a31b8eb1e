"""The router's config: one typed TOML tree plus flags (``docs/router.md``).

Layers, lowest first: defaults written here < a TOML file < command-line
flags. Every section is a frozen dataclass; unknown keys and bad values raise
:class:`~kvstore.errors.InvalidArgument` naming the dotted key, the value and
what is allowed::

    listen = "127.0.0.1:8000"

    [[backend]]
    name = "a"
    url = "http://127.0.0.1:8101"
    daemon = "127.0.0.1:50051"

    [[model]]
    name = "tiny"                     # the served model name clients ask for
    path = "/models/tiny"             # tokenizer, chat template, config.json
    block_size = 128                  # vLLM's block size (128 on the CPU backend)
    kv_dtype = "float32"

    [[api_key]]
    key = "sk-team-a"
    tenant = "team-a"
    class = "interactive"

    [[class]]
    name = "interactive"
    ttft_slo = 0.5                    # seconds

    [[tenant]]
    name = "team-a"
    requests_per_s = 20
    tokens_per_s = 50000
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.identity import CONFIG_FORMATS
from kvstore.keys import KVDtype

__all__ = ["ApiKey", "BackendSpec", "ModelSpec", "PDSpec", "PredictorSpec", "RouterConfig", "RoutingPolicy", "ServiceClass",
           "TenantQuota", "load_router_config", "parse_backend_flag", "parse_key_flag", "parse_model_flag"]


class RoutingPolicy(StrEnum):
    """How backends are ranked (admission applies to the best prediction either way)."""

    COST = "cost"
    """Smallest predicted TTFT (queue + load by tier + prefill)."""
    PREFIX = "prefix"
    """Longest cached prefix; ties: fewest requests in flight (baseline)."""
    ROUND_ROBIN = "round_robin"
    """In turn, ignoring cache and load (baseline)."""


def _bad(key: str, value: object, allowed: str) -> InvalidArgument:
    return InvalidArgument(f"router config: {key} = {value!r} is invalid; {allowed}")


def _finite(key: str, value: object, *, positive: bool = False) -> None:
    """``value`` must be a finite number >= 0 (> 0 with ``positive``): NaN or
    infinity from TOML would otherwise pass every ``< 0`` check and break the
    router later (a 500 per request, a wait that never ends)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and (value > 0 if positive else value >= 0)):  # type: ignore[operator]
        raise _bad(key, value, f"a finite number {'> 0' if positive else '>= 0'}")


_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "str": ((str,), "a string"), "bool": ((bool,), "true or false"),
    "int": ((int,), "an integer"), "float": ((int, float), "a number"),
}
"""A scalar field's annotation -> the TOML value types it takes, and how to say so."""


def _typed(cls: type, key: str, name: str, value: Any) -> Any:
    """``value`` for field ``name`` of ``cls`` as TOML gave it: the type its
    annotation names (a bool is not a number, and "false" is not a bool) or
    an error naming ``key``; fields of other types are checked by their class."""
    ftype = next(str(f.type) for f in dataclasses.fields(cls) if f.name == name)
    want = _TYPES.get(ftype)
    if want is not None and (not isinstance(value, want[0]) or (ftype != "bool" and isinstance(value, bool))):
        raise _bad(key, value, want[1])
    return value


def _addr(key: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise _bad(key, value, "allowed: HOST:PORT with a port 0..65535")
    return host, int(port)


@dataclass(slots=True, frozen=True)
class BackendSpec:
    """One vLLM OpenAI server and the kvstore daemon beside it."""

    name: str
    """Label in headers, logs and metrics."""
    url: str
    """Base URL of the vLLM OpenAI server (``http://host:port``)."""
    daemon: str = ""
    """The kvstore daemon beside it (``host:port``); "" = no cache state (cold only)."""
    daemon_token: str = ""
    """Bearer token for a daemon with auth."""
    cluster: bool = False
    """Ask the daemon a cluster-mode Lookup for blocks its peers could supply."""
    api_key: str = dataclasses.field(default="", repr=False)
    """The router's credential at this vLLM server (its ``--api-key``), sent as ``Authorization: Bearer``
    on every request the router makes there; "" = none. A client's own key never reaches a backend."""

    def auth_headers(self) -> dict[str, str]:
        """The headers that carry :attr:`api_key` (none without one)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __post_init__(self) -> None:
        if not self.name:
            raise _bad("backend.name", self.name, "a non-empty label")
        if not self.url.startswith(("http://", "https://")):
            raise _bad(f"backend[{self.name}].url", self.url, "allowed: http://HOST:PORT or https://...")
        if self.daemon:
            _addr(f"backend[{self.name}].daemon", self.daemon)


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """A model the backends serve, and how its KV namespace is derived."""

    name: str
    """Served model name (the request's ``model``)."""
    path: str
    """Model directory: tokenizer, chat template and config (the same files the backends load)."""
    block_size: int = 128
    """Tokens per KV block of the backends (vLLM's ``--block-size``; 128 on CPU)."""
    kv_dtype: str = "bfloat16"
    """KV cache dtype of the backends (``float32``, ``bfloat16``, ``float16``, ``fp8``...)."""
    tp_size: int = 1
    """Tensor-parallel size of each backend."""
    namespace_tenant: str = "default"
    """The connector's ``tenant`` (its ``kv_connector_extra_config``), not the API tenant."""
    weights_digest: str = ""
    """The connector's explicit ``weights_digest`` override, when it has one."""
    max_model_len: int = 0
    """Longest prompt + completion accepted (tokens); 0 = the model config's."""
    device: str = "cuda"
    """The backends' vLLM platform device type (``cuda``, ``cpu``, ...): part of the KV layout schema."""
    kv_cache_layout: str = ""
    """The KV cache layout vLLM resolves on the backends (``LBHNC`` on the CPU backend; "" when unset)."""
    layout_tag: str = ""
    """The connector's ``layout_tag`` extra config, when it has one."""
    dtype: str = ""
    """The backends' compute dtype (``--dtype``, e.g. ``float32``); "" = the KV dtype."""
    model_id: str = ""
    """The connector's explicit ``model_id`` override, when it has one."""
    hf_overrides: Mapping[str, Any] | None = None
    """The backends' ``--hf-overrides`` (they change the config digest)."""
    disable_sliding_window: bool = False
    """The backends run with ``--disable-sliding-window`` (it changes the config digest)."""
    quantization: str = ""
    """The ``quant=`` value of the connector's logged schema (the backends' ``--quantization`` when their
    ``config.json`` has none, and their ``--quantization-config``); "" when it has none."""
    engine_version: str = ""
    """The vLLM version named in the namespace (the connector's ``engine_version``, or the backends'
    ``vllm.__version__``); "" = each backend's own, from its ``GET /version``."""
    config_format: str = "auto"
    """The backends' ``--config-format``: ``mistral`` reads ``params.json`` over ``config.json`` (``auto``
    does so, as vLLM does, in a directory with ``params.json`` and ``consolidated*.safetensors``)."""

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise _bad("model", (self.name, self.path), "a model needs a name and a path")
        if not 1 <= self.block_size <= 65536:
            raise _bad(f"model[{self.name}].block_size", self.block_size, "allowed: 1..65536")
        KVDtype.parse(self.kv_dtype, f"model[{self.name}].kv_dtype")
        if self.config_format not in CONFIG_FORMATS:
            raise _bad(f"model[{self.name}].config_format", self.config_format,
                       f"allowed: {', '.join(CONFIG_FORMATS)}")
        if len(self.engine_version) > 200:
            raise _bad(f"model[{self.name}].engine_version", self.engine_version[:40], "at most 200 characters")
        if self.tp_size < 1 or self.max_model_len < 0:
            raise _bad(f"model[{self.name}]", (self.tp_size, self.max_model_len),
                       "tp_size must be >= 1 and max_model_len >= 0")


@dataclass(slots=True, frozen=True)
class ServiceClass:
    """A QoS class: the TTFT target its requests are admitted against."""

    name: str
    ttft_slo: float = 2.0
    """TTFT target (seconds): a request whose best predicted TTFT misses it is refused (429)."""

    def __post_init__(self) -> None:
        _finite(f"class[{self.name}].ttft_slo", self.ttft_slo, positive=True)


@dataclass(slots=True, frozen=True)
class ApiKey:
    """A bearer key and who it is."""

    key: str
    tenant: str
    klass: str = "default"
    """Service class name (``class`` in TOML)."""


@dataclass(slots=True, frozen=True)
class TenantQuota:
    """Per-tenant request rate and prompt-token rate; 0 = unlimited."""

    name: str
    requests_per_s: float = 0.0
    request_burst: float = 0.0
    """0 = one second's worth (at least 1)."""
    tokens_per_s: float = 0.0
    token_burst: float = 0.0
    """0 = one second's worth of tokens or the longest prompt a model takes, whichever is more; a
    longer prompt is refused (400)."""

    def __post_init__(self) -> None:
        for f in ("requests_per_s", "request_burst", "tokens_per_s", "token_burst"):
            _finite(f"tenant[{self.name}].{f}", getattr(self, f))


@dataclass(slots=True, frozen=True)
class PredictorSpec:
    """Seeds of the TTFT model (calibrated from measured TTFTs as requests complete)."""

    prefill_tokens_per_s: float = 5000.0
    """Initial prefill throughput of one backend."""
    prefill_overhead_s: float = 0.02
    """Fixed per-request cost (HTTP, tokenization, scheduling, the first step)."""
    decode_penalty_s: float = 0.005
    """Added to the queue wait per request running (decoding) on the backend."""
    block_bytes: int = 0
    """Bytes of one cached block (all layers); 0 = from the model config."""
    calibrate_alpha: float = 0.2
    """EWMA weight of one measured TTFT in the throughput estimate."""
    dram_Bps: float = 10e9
    """DRAM tier -> engine bandwidth (the connector's copy); SSD and remote from ``transport.cost`` defaults."""
    ssd_Bps: float = 2e9
    remote_Bps: float = 0.0
    """Remote (peer) fetch bandwidth; 0 = the cost model's link seed."""

    def __post_init__(self) -> None:
        for f in ("prefill_tokens_per_s", "dram_Bps", "ssd_Bps"):
            _finite(f"predictor.{f}", getattr(self, f), positive=True)
        for f in ("prefill_overhead_s", "decode_penalty_s", "block_bytes", "remote_Bps"):
            _finite(f"predictor.{f}", getattr(self, f))
        if not 0 < self.calibrate_alpha <= 1:
            raise _bad("predictor.calibrate_alpha", self.calibrate_alpha, "allowed: (0, 1]")


def _names(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, Sequence) or not value or not all(isinstance(v, str) and v for v in value):
        raise _bad(key, value, "a non-empty list of backend names")
    return tuple(value)


@dataclass(slots=True, frozen=True)
class PDSpec:
    """Prefill/decode disaggregation (``[pd]``; router/pd.py, docs/pd.md):
    every request is prefilled on a backend of ``prefill`` (max_tokens 1),
    then decoded on one of ``decode``, which loads the blocks through its
    daemon's cluster fetch."""

    prefill: tuple[str, ...] = ()
    """Backend names of the prefill pool (``kv_producer`` vLLMs)."""
    decode: tuple[str, ...] = ()
    """Backend names of the decode pool (``kv_consumer`` vLLMs)."""
    visible_timeout: float = 1.0
    """Seconds to wait, after the prefill, for the decode daemon to see its blocks (0: do not wait)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", _names("pd.prefill", self.prefill))
        object.__setattr__(self, "decode", _names("pd.decode", self.decode))
        _finite("pd.visible_timeout", self.visible_timeout)


@dataclass(slots=True, frozen=True)
class RouterConfig:
    """The whole tree."""

    listen: str = "127.0.0.1:8000"
    """HOST:PORT to serve on; loopback unless configured otherwise."""
    backends: tuple[BackendSpec, ...] = ()
    models: tuple[ModelSpec, ...] = ()
    api_keys: tuple[ApiKey, ...] = ()
    """Empty = no authentication (every request is tenant ``anonymous``, class ``default``)."""
    classes: tuple[ServiceClass, ...] = (ServiceClass("default"),)
    tenants: tuple[TenantQuota, ...] = ()
    default_tenant_quota: TenantQuota = TenantQuota("*")
    predictor: PredictorSpec = PredictorSpec()
    policy: RoutingPolicy = RoutingPolicy.COST
    """How backends are ranked: ``cost``, ``prefix`` or ``round_robin``."""
    admission: bool = True
    """Refuse (429) requests whose best prediction misses their class SLO."""
    headroom: float = 0.0
    """Admit only when predicted <= slo * (1 - headroom)."""
    hit_class_share: float = 0.1
    """Fairness between hit classes (Preble, seed 002): each class of requests by
    cached share of the prompt (none < 5%, low < 50%, medium < 90%, high) is
    guaranteed this share of the admissions while it asks for them; 0 = off."""
    connect_timeout: float = 5.0
    first_byte_timeout: float = 120.0
    """Seconds until the backend's response headers (the prefill)."""
    read_timeout: float = 120.0
    """Seconds between two chunks of a response; the wait is at least ``first_byte_timeout`` (one
    read timeout of the upstream client covers the first byte and the chunks after it)."""
    request_timeout: float = 1800.0
    """Seconds a backend may take for its whole answer, first byte to last (vllm-router's
    ``--request-timeout-secs``, 30 minutes by default): a backend that trickles its answer, each chunk
    within ``read_timeout``, is cut there. A non-streamed answer then gets 504 ``backend_timeout``; a
    stream ends with an error event. The backend stays in the pool and the request is not retried."""
    retries: int = 1
    """Retries on the next-best backend for a request that fails before its first byte."""
    health_interval: float = 1.0
    """Seconds between health checks and ``/metrics`` polls of each backend."""
    health_failures: int = 2
    """Consecutive failed checks that take a backend out of the pool."""
    max_prompt_tokens: int = 0
    """Refuse longer prompts (400); 0 = the model's ``max_model_len``."""
    max_body_bytes: int = 16 << 20
    """Refuse longer request bodies (413) before reading them whole."""
    max_response_bytes: int = 64 << 20
    """Longest non-streamed backend answer the router buffers: a longer one is cut (the upstream
    response closed) and the client gets a 502 ``response_too_large``. Streamed answers are relayed
    chunk by chunk and not limited. A P/D prefill answer is read up to ``min(this, 1 MiB)``."""
    log_decisions: bool = True
    """One debug log line per decision."""
    pd: PDSpec | None = None
    """Prefill/decode disaggregation (``[pd]``); None: every request goes to one backend."""

    def __post_init__(self) -> None:
        _addr("listen", self.listen)
        try:
            object.__setattr__(self, "policy", RoutingPolicy(self.policy))
        except ValueError:
            raise _bad("policy", self.policy, f"allowed: {', '.join(p.value for p in RoutingPolicy)}") from None
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise _bad("backend.name", names, "names must be distinct")
        cls = {c.name for c in self.classes}
        for k in self.api_keys:
            if k.klass not in cls:
                raise _bad("api_key.class", k.klass, f"allowed: {', '.join(sorted(cls))}")
        if not 0.0 <= self.headroom < 1.0:
            raise _bad("headroom", self.headroom, "allowed: [0, 1)")
        for f in ("connect_timeout", "first_byte_timeout", "read_timeout", "request_timeout", "health_interval"):
            _finite(f, getattr(self, f), positive=True)
        _finite("max_prompt_tokens", self.max_prompt_tokens)
        _finite("max_response_bytes", self.max_response_bytes, positive=True)
        if self.max_body_bytes < 1:
            raise _bad("max_body_bytes", self.max_body_bytes, "must be >= 1")
        if self.retries < 0 or self.health_failures < 1:
            raise _bad("retries/health_failures", (self.retries, self.health_failures), "retries >= 0, failures >= 1")
        if not 0.0 <= self.hit_class_share <= 0.25:
            raise _bad("hit_class_share", self.hit_class_share, "allowed: 0..0.25 (four hit classes)")
        if self.pd is not None:
            unknown = sorted(set(self.pd.prefill + self.pd.decode) - set(names))
            if unknown:
                raise _bad("pd", unknown, f"unknown backend names; configured: {', '.join(names)}")

    @property
    def listen_addr(self) -> tuple[str, int]:
        return _addr("listen", self.listen)

    def klass(self, name: str) -> ServiceClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise InvalidArgument(f"unknown service class {name!r}")

    def model(self, name: str) -> ModelSpec | None:
        for m in self.models:
            if m.name == name:
                return m
        return None


_LISTS = {"backend": ("backends", BackendSpec), "model": ("models", ModelSpec), "api_key": ("api_keys", ApiKey),
          "class": ("classes", ServiceClass), "tenant": ("tenants", TenantQuota)}
_TABLES = {"predictor": PredictorSpec, "default_tenant_quota": TenantQuota, "pd": PDSpec}


def _build(cls: type, key: str, data: Any) -> Any:
    if not isinstance(data, Mapping):
        raise _bad(key, data, "a table")
    names = {f.name for f in dataclasses.fields(cls)}
    kw: dict[str, Any] = {}
    for k, v in data.items():
        name = "klass" if k == "class" else k
        if name not in names:
            raise _bad(f"{key}.{k}", v, f"unknown key; allowed: {', '.join(sorted(names))}")
        kw[name] = _typed(cls, f"{key}.{k}", name, v)
    try:
        return cls(**kw)
    except TypeError as e:
        raise _bad(key, data, str(e)) from None


def _from_mapping(doc: Mapping[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    top = {f.name for f in dataclasses.fields(RouterConfig)}
    for k, v in doc.items():
        if k in _LISTS:
            name, cls = _LISTS[k]
            if not isinstance(v, list):
                raise _bad(k, v, f"an array of tables ([[{k}]])")
            kw[name] = tuple(_build(cls, f"{k}[{i}]", item) for i, item in enumerate(v))
        elif k in _TABLES:
            if k == "default_tenant_quota":
                v = {"name": "*", **v} if isinstance(v, Mapping) else v
            kw[k] = _build(_TABLES[k], k, v)
        elif k in top and k not in {"backends", "models", "api_keys", "classes", "tenants"}:
            kw[k] = _typed(RouterConfig, k, k, v)
        else:
            allowed = sorted((top - {"backends", "models", "api_keys", "classes", "tenants"}) | set(_LISTS))
            raise _bad(k, v, f"unknown key; allowed: {', '.join(allowed)}")
    return kw


def parse_backend_flag(text: str, index: int) -> BackendSpec:
    """``URL[=DAEMON]`` or ``NAME=URL=DAEMON`` (``--backend``)."""
    parts = text.split("=")
    if len(parts) == 1:
        return BackendSpec(name=f"b{index}", url=parts[0])
    if len(parts) == 2:
        return BackendSpec(name=f"b{index}", url=parts[0], daemon=parts[1])
    if len(parts) == 3:
        return BackendSpec(name=parts[0], url=parts[1], daemon=parts[2])
    raise _bad("--backend", text, "allowed: URL, URL=DAEMON or NAME=URL=DAEMON")


def parse_model_flag(text: str) -> dict[str, Any]:
    """``NAME=PATH[,block_size=N][,kv_dtype=D][,tp_size=N]`` (``--model``)."""
    head, *opts = text.split(",")
    name, sep, path = head.partition("=")
    if not sep:
        raise _bad("--model", text, "allowed: NAME=PATH[,block_size=N][,kv_dtype=D][,tp_size=N]")
    out: dict[str, Any] = {"name": name, "path": path}
    for o in opts:
        k, _, v = o.partition("=")
        out[k] = int(v) if v.isdigit() else v
    return out


def parse_key_flag(text: str) -> ApiKey:
    """``KEY=TENANT[:CLASS]`` (``--api-key``)."""
    key, sep, rest = text.partition("=")
    if not sep or not key or not rest:
        raise _bad("--api-key", "***", "allowed: KEY=TENANT[:CLASS]")
    tenant, _, klass = rest.partition(":")
    return ApiKey(key=key, tenant=tenant, klass=klass or "default")


def load_router_config(path: str | None = None, *, listen: str | None = None,
                       backends: Sequence[str] = (), models: Sequence[str] = (), api_keys: Sequence[str] = (),
                       overrides: Mapping[str, Any] | None = None) -> RouterConfig:
    """The config from ``path`` (TOML) with flags on top: ``--backend`` and
    ``--model`` and ``--api-key`` entries add to (or replace, by name) the
    file's; ``overrides`` set top-level keys."""
    doc: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:  # TOML is UTF-8
            raise InvalidArgument(f"router config {path}: {e}") from None
    kw = _from_mapping(doc)
    if listen:
        kw["listen"] = listen
    if backends:
        flag = [parse_backend_flag(b, i) for i, b in enumerate(backends)]
        names = {b.name for b in flag}
        kw["backends"] = tuple(b for b in kw.get("backends", ()) if b.name not in names) + tuple(flag)
    if models:
        flag_m = [_build(ModelSpec, "--model", parse_model_flag(m)) for m in models]
        names = {m.name for m in flag_m}
        kw["models"] = tuple(m for m in kw.get("models", ()) if m.name not in names) + tuple(flag_m)
    if api_keys:
        kw["api_keys"] = tuple(kw.get("api_keys", ())) + tuple(parse_key_flag(k) for k in api_keys)
        classes = {c.name for c in kw.get("classes", RouterConfig().classes)}
        extra = {k.klass for k in kw["api_keys"]} - classes
        if extra:
            kw["classes"] = tuple(kw.get("classes", RouterConfig().classes)) + tuple(
                ServiceClass(n) for n in sorted(extra))
    kw.update(overrides or {})
    return RouterConfig(**kw)


def replace_config(cfg: RouterConfig, **changes: Any) -> RouterConfig:
    """A copy with ``changes`` (tests, the benchmark)."""
    return dataclasses.replace(cfg, **changes)



