"""What both halves of the vLLM connector share: the namespace (the cache
identity of this deployment), the scheduler -> worker plan, and the link to
the daemon (client, fault handling, stats). See ``engine_adapter.vllm``.

Namespace: :func:`kvstore.identity.engine_namespace` (the function the
router calls too) over the model directory vLLM loads: a digest of the
weight files (or ``weights_digest`` from the extra config), a digest of the
KV-affecting ``config.json`` fields after vLLM's ``hf_overrides`` (and its
``--disable-sliding-window``), tenant,
KV dtype, block size, TP size, and a schema version over the vLLM KV layout
(platform, resolved KV cache layout, vLLM version or ``engine_version``,
layers, KV heads, head size, block size, dtypes). The weights are hashed in a background thread started when
the connector is constructed and joined when the namespace is first needed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, is_dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvstore import identity
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.keys import KVDtype, KVLayout, Namespace
from kvstore.weights import code_digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "DUMMY_WEIGHTS",
    "FAULTS",
    "FAULT_TYPES",
    "PEER_DECISIONS",
    "PEER_FETCHED_BYTES",
    "TORCH_KV",
    "BlockMove",
    "ClusterMode",
    "ConnectorIdentity",
    "DaemonLink",
    "KVStoreConnectorMetadata",
    "KVStoreWorkerMetadata",
    "connector_namespace",
    "engine_version",
    "extra_config",
    "flag",
    "kv_dtype",
    "layout_descriptor",
    "local_dir",
    "cluster_mode",
    "request_ns",
]

log = logging.getLogger("kvstore.vllm")

try:
    FAULTS = Counter("kvstore_engine_store_faults_total",
                     "Store calls from the engine adapter that failed (daemon down, timeout, refused) "
                     "and were served as a miss", ["op"])
except ValueError:  # engine_adapter.connector registered it first in this process
    from engine_adapter.connector import FAULTS

PEER_DECISIONS = Counter("kvstore_engine_cluster_decisions_total",
                         "Cluster lookups of the vLLM connector by the daemon's chain decision", ["decision"])
PEER_FETCHED_BYTES = Counter("kvstore_engine_fetched_bytes_total",
                             "Bytes the vLLM connector loaded that its daemon fetched from a peer")

FAULT_TYPES: tuple[type[BaseException], ...] = (KVStoreError, OSError, ValueError, RuntimeError)
"""Exceptions of a store call served as a miss (or an unsaved block)."""

CACHE_DTYPES = {"fp8": KVDtype.FLOAT8_E4M3FN, "fp8_e4m3": KVDtype.FLOAT8_E4M3FN,
                "fp8_e5m2": KVDtype.FLOAT8_E5M2, "bfloat16": KVDtype.BFLOAT16, "float16": KVDtype.FLOAT16,
                "half": KVDtype.FLOAT16, "float32": KVDtype.FLOAT32, "float": KVDtype.FLOAT32}
TORCH_KV = {torch.float16: KVDtype.FLOAT16, torch.bfloat16: KVDtype.BFLOAT16, torch.float32: KVDtype.FLOAT32,
            torch.float8_e4m3fn: KVDtype.FLOAT8_E4M3FN, torch.float8_e5m2: KVDtype.FLOAT8_E5M2,
            torch.int8: KVDtype.INT8, torch.uint8: KVDtype.UINT8}


# --------------------------------------------------------------------------
# Namespace
# --------------------------------------------------------------------------


EXTRA_KEYS = frozenset({"target", "tenant", "token", "token_file", "weights_digest", "model_id", "digest_cache",
                        "timeout", "retry_interval", "load", "save", "use_shm", "prefault", "layout_tag", "cluster",
                        "stats_path", "engine_version"})
"""The ``kv_connector_extra_config`` keys the connector reads (``KVStoreConnector``'s docstring)."""


def extra_config(vllm_config: VllmConfig) -> dict[str, Any]:
    """The connector's ``kv_connector_extra_config`` (a copy; {} when unset).
    A key it does not read is refused (ValueError at vLLM's start, naming
    it): a misspelt ``tenant`` or ``target`` would otherwise share blocks
    under the default tenant, or talk to the default daemon, without a word."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    unknown = sorted(str(k) for k in extra if k not in EXTRA_KEYS)
    if unknown:
        raise ValueError(f"kvstore connector: unknown kv_connector_extra_config key(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(sorted(EXTRA_KEYS))}")
    return extra


def kv_dtype(vllm_config: VllmConfig) -> KVDtype:
    """The element type of vLLM's KV cache."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        try:
            return CACHE_DTYPES[cache_dtype]
        except KeyError:
            raise ValueError(f"kvstore connector: KV cache dtype {cache_dtype!r} is not supported; "
                             f"allowed: auto, {', '.join(CACHE_DTYPES)}") from None
    return TORCH_KV[vllm_config.model_config.dtype]


def engine_version(extra: dict[str, Any]) -> str:
    """The vLLM version the namespace names: ``vllm.__version__``, or the
    ``engine_version`` extra config (an operator who knows that two versions
    compute the same KV gives both the same string); a non-string or empty
    one is refused (InvalidArgument, a ValueError)."""
    if "engine_version" not in extra:
        import vllm

        return str(vllm.__version__)
    return identity.given_engine_version(extra["engine_version"], "vLLM")


def _layout_tag(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    from vllm.platforms import current_platform

    resolved = getattr(kv_cache_config, "kv_cache_layout", None) or ""
    extra = extra_config(vllm_config)
    return identity.vllm_layout_tag(str(current_platform.device_type), str(resolved),
                                    str(extra.get("layout_tag", "")),
                                    int(vllm_config.parallel_config.tensor_parallel_size), engine_version(extra))


def _geometry(vllm_config: VllmConfig) -> tuple[int, int, int]:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    return int(mc.get_num_layers(pc)), int(mc.get_num_kv_heads(pc)), int(mc.get_head_size())


def layout_descriptor(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """The vLLM KV layout a stored block's bytes follow (both roles compute
    the same string from the config alone; the worker checks its tensors
    against it)."""
    mc = vllm_config.model_config
    desc, _ = identity.kv_schema({}, block_size=int(vllm_config.cache_config.block_size),
                                 kv_dtype=kv_dtype(vllm_config), layout_tag=_layout_tag(vllm_config, kv_cache_config),
                                 compute_dtype=str(mc.dtype), geometry=_geometry(vllm_config))
    return desc


DUMMY_WEIGHTS = "vllm-dummy-weights"
"""The weights digest of ``load_format="dummy"`` (vLLM's seeded random
weights: the same for the same config, which ``model_id`` names)."""


def local_dir(name: str, revision: str | None = None, cache_dir: str | None = None) -> str | None:
    """The local directory (or GGUF file) of a model path or Hugging Face
    repository id: the path itself, or the cache snapshot of the repository
    at ``revision``; None when neither is on this host."""
    if os.path.exists(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a cached repository (or no hub library): unknown
        return None


def _model_dir(mc: Any, download_dir: str | None) -> str | None:
    """The local directory (or GGUF file) vLLM loads the model from."""
    return local_dir(str(mc.model), getattr(mc, "revision", None), download_dir)


def _config_dir(mc: Any, model_dir: str | None) -> str | None:
    """The directory of the ``config.json`` vLLM computes with: the model's,
    or ``--hf-config-path`` (a directory, or the cache snapshot of a
    repository at the revision vLLM resolved for it); None when that is not
    on this host (vLLM's loaded config then stands for it)."""
    path = getattr(mc, "hf_config_path", None)
    if not path or str(path) == str(mc.model):
        return model_dir
    # vLLM keeps the revision it resolved for a config repository in a private field; without it
    # the model's revision applies (a revision that repository lacks finds no snapshot: vLLM's config)
    revision = getattr(mc, "_hf_config_revision", None) or getattr(mc, "revision", None)
    found = local_dir(str(path), revision)
    return found if found is not None and os.path.isdir(found) else None


def _code_revision(mc: Any, model_dir: str | None) -> str | None:
    """The remote code vLLM runs from another revision than the weights':
    with ``--code-revision`` and ``--trust-remote-code`` on a repository
    id, :func:`kvstore.weights.code_digest` of that revision's cache
    snapshot; "" when none applies (a local directory's code is hashed with
    its weights); None when that snapshot is not on this host."""
    rev, model = getattr(mc, "code_revision", None), str(mc.model)
    if not rev or not getattr(mc, "trust_remote_code", False) or os.path.exists(model):
        return ""
    code_dir = local_dir(model, str(rev))
    if code_dir is None or not os.path.isdir(code_dir):
        return None
    if model_dir is not None and os.path.realpath(code_dir) == os.path.realpath(model_dir):
        return ""
    return code_digest(code_dir)


def _overrides(mc: Any) -> dict[str, Any]:
    """vLLM's ``hf_overrides`` as a mapping. A callable override cannot be
    replayed by a router: its effect (the KV fields of the config vLLM ended
    with) stands in for it."""
    ov = getattr(mc, "hf_overrides", None) or {}
    if callable(ov):
        final = mc.hf_config.to_dict()
        return {name: final[name] for name, _ in identity.KV_CONFIG_FIELDS if final.get(name) is not None}
    return dict(ov)


def _quantization(mc: Any, in_config: bool) -> str | None:
    """The engine-side quantization of the KV schema: ``--quantization``
    when the checkpoint's config names none, and ``cfg:`` + a digest of
    ``--quantization-config`` (online quantization specs and ignore
    patterns, as vLLM resolved them) when set; None for neither."""
    quant = getattr(mc, "quantization", None)
    parts = [str(quant)] if quant and not in_config else []
    qargs = getattr(mc, "quantization_config", None)
    if qargs is not None:
        data = asdict(qargs) if is_dataclass(qargs) and not isinstance(qargs, type) else qargs
        parts.append("cfg:" + xxhash.xxh3_64_hexdigest(json.dumps(data, sort_keys=True, default=repr).encode()))
    return "+".join(parts) or None


class ConnectorIdentity:
    """The namespace of this deployment, resolved in the background.

    Construction checks, at once, that the weights can be identified (a
    local model directory with weight files, or ``weights_digest`` in the
    extra config; otherwise ValueError: vLLM refuses to start) and starts
    hashing them (:func:`kvstore.identity.weights_digest_async`, shared by
    both connector instances of the process, remembered in the sidecar
    cache); :attr:`ns` joins it. Should the hash itself fail (an I/O error),
    :attr:`ns` is None and the connector serves every request as a miss."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        extra = extra_config(vllm_config)
        mc = vllm_config.model_config
        self.given_digest = str(extra.get("weights_digest") or "")
        self.engine_version = engine_version(extra)
        self.kv_dtype = kv_dtype(vllm_config)
        load = getattr(vllm_config, "load_config", None)
        self.model_dir = _model_dir(mc, getattr(load, "download_dir", None))
        if not self.given_digest and str(getattr(load, "load_format", "")) == "dummy":
            self.given_digest = DUMMY_WEIGHTS
        cfg_dir = _config_dir(mc, self.model_dir)
        self.config_format = str(getattr(mc, "config_format", None) or "auto")
        if cfg_dir is not None and self.config_format in identity.CONFIG_FORMATS:
            self.hf_config: dict[str, Any] = identity.load_config(cfg_dir, self.config_format)
        else:  # not on this host, or a custom config parser: what vLLM loaded stands for it
            get = getattr(getattr(mc, "hf_config", None), "to_diff_dict", None)
            self.hf_config = dict(get()) if callable(get) else {}
        self.future: Future[str]
        if self.given_digest:
            self.future = Future()
            self.future.set_result(self.given_digest)
        elif self.model_dir is None or not identity.weight_files(self.model_dir):
            raise ValueError(f"kvstore connector: cannot identify the weights of {mc.model!r} (no local model "
                             "directory with weight files); set \"weights_digest\" in kv_connector_extra_config "
                             "(see docs/vllm.md, cache identity)")
        else:
            self.future = identity.weights_digest_async(self.model_dir,
                                                        cache=extra.get("digest_cache") or None)
        self.failed = False
        code = _code_revision(mc, self.model_dir)
        self.code = code or ""
        """The digest of remote code from another revision (``--code-revision``), added to the weights'."""
        if code is None:
            log.warning("kvstore connector: the code of %s at code revision %s is not on this host; the store is "
                        "unused", mc.model, mc.code_revision)
            self.failed = True
        if getattr(mc, "model_class_overrides", None):  # another class: code the namespace cannot name
            log.warning("kvstore connector: model_class_overrides %s runs code the cache identity cannot name; "
                        "the store is unused", mc.model_class_overrides)
            self.failed = True
        self.waited_s = 0.0
        """Seconds the first use of the namespace waited for the weights hash."""
        self.layout_tag = ""
        self.descriptor = ""
        self._ns: Namespace | None = None

    def namespace(self, weights: str) -> Namespace:
        """The namespace for a weights digest (no waiting)."""
        vc, extra = self.vllm_config, extra_config(self.vllm_config)
        mc = vc.model_config
        overrides = _overrides(mc)
        geometry = _geometry(vc)
        from_config = identity.config_geometry(self.hf_config, overrides, int(vc.parallel_config.tensor_parallel_size))
        if from_config != geometry:
            log.warning("kvstore connector: config.json gives (layers, KV heads, head size) %s but vLLM %s; using "
                        "vLLM's (a router computing keys from config.json will not match)", from_config, geometry)
        in_config = any(k in self.hf_config for k in ("quantization_config", "compression_config"))
        self.layout_tag = _layout_tag(vc, self.kv_cache_config)
        schema: dict[str, Any] = {"block_size": int(vc.cache_config.block_size), "kv_dtype": self.kv_dtype,
                                  "tp_size": int(vc.parallel_config.tensor_parallel_size),
                                  "layout_tag": self.layout_tag, "compute_dtype": str(mc.dtype),
                                  "quantization": _quantization(mc, in_config),
                                  "geometry": None if from_config == geometry else geometry}
        self.descriptor = identity.kv_schema(self.hf_config, overrides=overrides, **schema)[0]
        weights = f"{weights}+{self.code}" if self.code else weights
        return identity.engine_namespace(
            self.model_dir, hf_config=self.hf_config, weights_digest=weights, tenant=str(extra.get("tenant", "default")),
            hf_overrides=overrides, layout=KVLayout.OPAQUE,
            model_id=str(extra["model_id"]) if extra.get("model_id") else None,
            disable_sliding_window=bool(getattr(mc, "disable_sliding_window", False)), **schema)

    @property
    def ns(self) -> Namespace | None:
        """The namespace (joins the weights hash the first time); None when the weights could not be hashed
        or vLLM runs code the namespace cannot name (``model_class_overrides``)."""
        if self._ns is None and not self.failed:
            t0 = time.perf_counter()
            try:
                weights = self.future.result()
            except Exception as e:  # noqa: BLE001 - reported, and the store is then unused
                log.error("kvstore connector: hashing the weights of %s failed (%s); the store is unused",
                          self.model_dir, e)
                self.failed = True
                return None
            self._ns = self.namespace(weights)
            self.waited_s = time.perf_counter() - t0
        return self._ns


def connector_namespace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None) -> Namespace:
    """The base namespace of this vLLM deployment (the request's LoRA and
    ``cache_salt`` are added per request); hashes the weights if needed."""
    ns = ConnectorIdentity(vllm_config, kv_cache_config).ns
    if ns is None:
        raise ValueError("kvstore connector: the weights could not be hashed")
    return ns


def request_ns(base: Namespace, adapter: str, salt: str) -> Namespace:
    """``base`` with a request's LoRA name and ``cache_salt``."""
    if not adapter and not salt:
        return base
    return Namespace(**{**base.to_dict(), "adapter_id": adapter, "salt": salt})  # type: ignore[arg-type]


def flag(extra: dict[str, Any], name: str) -> bool:
    """A boolean extra-config entry (default true); accepts JSON booleans and "true"/"false"."""
    v = extra.get(name, True)
    if isinstance(v, str):
        if v.strip().lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"kvstore connector: {name} must be true or false, got {v!r}")
        return v.strip().lower() in ("true", "1", "yes")
    return bool(v)


class ClusterMode(Enum):
    """The connector's ``cluster`` extra config: whether lookups ask the
    daemon in cluster mode (blocks peers hold, fetch or recompute)."""

    AUTO = "auto"
    """Cluster lookups while the daemon answers that it has a cluster (the default)."""
    ON = "on"
    OFF = "off"


def cluster_mode(extra: dict[str, Any]) -> ClusterMode:
    """The ``cluster`` extra-config entry: true, false or "auto" (default)."""
    v = extra.get("cluster", "auto")
    if isinstance(v, bool):
        return ClusterMode.ON if v else ClusterMode.OFF
    text = str(v).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return ClusterMode.ON
    if text in ("false", "0", "no", "off"):
        return ClusterMode.OFF
    if text == "auto":
        return ClusterMode.AUTO
    raise ValueError(f"kvstore connector: cluster must be true, false or \"auto\", got {v!r}")


# --------------------------------------------------------------------------
# Scheduler -> worker plan
# --------------------------------------------------------------------------


@dataclass(slots=True)
class BlockMove:
    """Blocks of one request to load or to store: ``keys`` packed (16 bytes
    each), ``block_ids`` the vLLM blocks they live in, ``parent`` the key of
    the block before the first (saves; empty at the chain's start)."""

    req_id: str
    adapter: str
    salt: str
    keys: bytes
    block_ids: list[int]
    first: int = 0
    """Index of the first block in the request's chain."""
    parent: bytes = b""
    final: bool = False
    """The tail save of a finished request whose blocks vLLM keeps until
    the worker reports it done (``get_finished``)."""
    cluster: bool = False
    """A load whose blocks a peer holds: ``Acquire(cluster=True)`` fetches
    them into the local daemon first (the lookup's decision was fetch)."""
    peer: tuple[str, int, int] = ("", 0, 0)
    """With ``cluster``: the peer, first index and length in ``keys`` of the
    run the lookup found there (``Client.acquire``'s ``peer``)."""


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockMove] = field(default_factory=list)
    saves: list[BlockMove] = field(default_factory=list)


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per request, the chain ranges [first, end) now stored."""

    stored: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVStoreWorkerMetadata):
            for k, v in other.stored.items():
                self.stored.setdefault(k, []).extend(v)
        return self


# --------------------------------------------------------------------------
# The daemon link
# --------------------------------------------------------------------------


class DaemonLink:
    """The daemon client of one connector instance: connects lazily, turns
    a failed call into a counted, logged fault that closes the client and
    waits ``retry_interval`` before reconnecting; keeps the stats and the
    optional JSON-lines record (``stats_path``)."""

    def __init__(self, extra: dict[str, Any], role_name: str) -> None:
        self.target = extra.get("target") or None
        self.token = extra.get("token") or None
        self.token_file = extra.get("token_file") or None
        self.timeout = float(extra.get("timeout", 5.0))
        self.retry_interval = float(extra.get("retry_interval", 1.0))
        self.use_shm = flag(extra, "use_shm")
        self.prefault = flag(extra, "prefault") and role_name == "worker"
        """The worker reads the slab: map its resident pages when it attaches."""
        self.stats_path = extra.get("stats_path") or None
        self.role_name = role_name
        self.current: Client | None = None
        self.retry_at = 0.0
        self.stats: dict[str, int] = {"lookups": 0, "hit_tokens": 0, "loaded_blocks": 0, "failed_blocks": 0,
                                      "saved_blocks": 0, "existing_blocks": 0, "faults": 0,
                                      "cluster_lookups": 0, "decision_local": 0, "decision_fetch": 0,
                                      "decision_recompute": 0, "remote_blocks": 0, "fetched_blocks": 0,
                                      "fetched_bytes": 0, "fetch_failed_blocks": 0,
                                      "lora_changed_requests": 0}

    def fault(self, op: str, e: BaseException | str) -> None:
        FAULTS.labels(op).inc()
        self.stats["faults"] += 1
        log.warning("kvstore %s failed (%s); serving it as a miss", op, e)
        self.record(event="fault", op=op, error=str(e)[:200])
        if isinstance(e, BaseException) and self.current is not None:
            try:
                self.current.close()
            except Exception:  # noqa: BLE001, S110 - closing a client that already failed
                pass
            self.current = None
            self.retry_at = time.monotonic() + self.retry_interval

    def client(self) -> Client | None:
        """The daemon client, connecting if needed; None while the daemon is unusable."""
        if self.current is None:
            if time.monotonic() < self.retry_at:
                return None
            try:
                self.current = Client(self.target, token=self.token, token_file=self.token_file,
                                      timeout=self.timeout, use_shm=self.use_shm, name=f"vllm-{self.role_name}",
                                      prefault=self.prefault, hold_counts=self.role_name == "worker")
            except FAULT_TYPES as e:
                self.retry_at = time.monotonic() + self.retry_interval
                self.fault("connect", e)
                return None
        return self.current

    def record(self, **fields: Any) -> None:
        self.record_all([fields])

    def record_all(self, recs: list[dict[str, Any]]) -> None:
        """Append one line per record, in one write (a load step's lines
        are written after its timing, in one go)."""
        if self.stats_path and recs:
            head = {"role": self.role_name, "pid": os.getpid()}
            with open(self.stats_path, "a") as f:
                f.write("".join(json.dumps({**head, **r}) + "\n" for r in recs))

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None
