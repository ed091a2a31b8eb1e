from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_OK: _ClassVar[Status]
    STATUS_MISS: _ClassVar[Status]
    STATUS_EXISTS: _ClassVar[Status]
    STATUS_CAPACITY: _ClassVar[Status]
    STATUS_INVALID: _ClassVar[Status]
    STATUS_PARENT_MISSING: _ClassVar[Status]
    STATUS_CORRUPT: _ClassVar[Status]
    STATUS_BUSY: _ClassVar[Status]
    STATUS_NOT_OWNER: _ClassVar[Status]

class RemoveReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REMOVE_REASON_UNSPECIFIED: _ClassVar[RemoveReason]
    REMOVE_REASON_EVICTED: _ClassVar[RemoveReason]
    REMOVE_REASON_REMOVED: _ClassVar[RemoveReason]
    REMOVE_REASON_CORRUPT: _ClassVar[RemoveReason]
    REMOVE_REASON_MOVED: _ClassVar[RemoveReason]
    REMOVE_REASON_ABORTED: _ClassVar[RemoveReason]

class AdmitKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADMIT_KIND_UNSPECIFIED: _ClassVar[AdmitKind]
    ADMIT_KIND_ADMIT: _ClassVar[AdmitKind]
    ADMIT_KIND_ADMIT_DEGRADED: _ClassVar[AdmitKind]
    ADMIT_KIND_REJECT: _ClassVar[AdmitKind]

class ChainDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHAIN_DECISION_UNSPECIFIED: _ClassVar[ChainDecision]
    CHAIN_DECISION_LOCAL: _ClassVar[ChainDecision]
    CHAIN_DECISION_FETCH: _ClassVar[ChainDecision]
    CHAIN_DECISION_RECOMPUTE: _ClassVar[ChainDecision]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_SSD: Tier
TIER_REMOTE: Tier
STATUS_OK: Status
STATUS_MISS: Status
STATUS_EXISTS: Status
STATUS_CAPACITY: Status
STATUS_INVALID: Status
STATUS_PARENT_MISSING: Status
STATUS_CORRUPT: Status
STATUS_BUSY: Status
STATUS_NOT_OWNER: Status
REMOVE_REASON_UNSPECIFIED: RemoveReason
REMOVE_REASON_EVICTED: RemoveReason
REMOVE_REASON_REMOVED: RemoveReason
REMOVE_REASON_CORRUPT: RemoveReason
REMOVE_REASON_MOVED: RemoveReason
REMOVE_REASON_ABORTED: RemoveReason
ADMIT_KIND_UNSPECIFIED: AdmitKind
ADMIT_KIND_ADMIT: AdmitKind
ADMIT_KIND_ADMIT_DEGRADED: AdmitKind
ADMIT_KIND_REJECT: AdmitKind
CHAIN_DECISION_UNSPECIFIED: ChainDecision
CHAIN_DECISION_LOCAL: ChainDecision
CHAIN_DECISION_FETCH: ChainDecision
CHAIN_DECISION_RECOMPUTE: ChainDecision

class Namespace(_message.Message):
    __slots__ = ("tenant", "model_id", "weights_digest", "adapter_id", "kv_dtype", "layout", "block_size", "tp_size", "pp_stage", "schema_version", "hash_algo", "salt")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_STAGE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model_id: str
    weights_digest: str
    adapter_id: str
    kv_dtype: str
    layout: str
    block_size: int
    tp_size: int
    pp_stage: int
    schema_version: int
    hash_algo: str
    salt: str
    def __init__(self, tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., weights_digest: _Optional[str] = ..., adapter_id: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., layout: _Optional[str] = ..., block_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_stage: _Optional[int] = ..., schema_version: _Optional[int] = ..., hash_algo: _Optional[str] = ..., salt: _Optional[str] = ...) -> None: ...

class SlotRef(_message.Message):
    __slots__ = ("tier", "device", "offset", "length")
    TIER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    device: int
    offset: int
    length: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., device: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class SlotArray(_message.Message):
    __slots__ = ("status", "tier", "offset", "length", "checksum", "device")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[Status]
    tier: _containers.RepeatedScalarFieldContainer[Tier]
    offset: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    checksum: _containers.RepeatedScalarFieldContainer[int]
    device: int
    def __init__(self, status: _Optional[_Iterable[_Union[Status, str]]] = ..., tier: _Optional[_Iterable[_Union[Tier, str]]] = ..., offset: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ..., checksum: _Optional[_Iterable[int]] = ..., device: _Optional[int] = ...) -> None: ...

class KeyResult(_message.Message):
    __slots__ = ("key", "status", "slot", "checksum", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    status: Status
    slot: SlotRef
    checksum: int
    detail: str
    def __init__(self, key: _Optional[bytes] = ..., status: _Optional[_Union[Status, str]] = ..., slot: _Optional[_Union[SlotRef, _Mapping]] = ..., checksum: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class ShmInfo(_message.Message):
    __slots__ = ("name", "path", "size_bytes", "slot_sizes", "alignment", "slab_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_SIZES_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    SLAB_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    size_bytes: int
    slot_sizes: _containers.RepeatedScalarFieldContainer[int]
    alignment: int
    slab_id: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., slot_sizes: _Optional[_Iterable[int]] = ..., alignment: _Optional[int] = ..., slab_id: _Optional[str] = ...) -> None: ...

class DeviceMemInfo(_message.Message):
    __slots__ = ("device", "ipc_handle", "size_bytes", "base_offset", "ipc", "slab_id", "device_name")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    SLAB_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    device: int
    ipc_handle: bytes
    size_bytes: int
    base_offset: int
    ipc: bool
    slab_id: str
    device_name: str
    def __init__(self, device: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., base_offset: _Optional[int] = ..., ipc: _Optional[bool] = ..., slab_id: _Optional[str] = ..., device_name: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("client_name", "pid", "host_id", "protocol_version")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    host_id: str
    protocol_version: int
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ..., host_id: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("session_id", "shm", "same_host", "max_message_bytes", "protocol_version", "server_version", "host_id", "tenant", "hbm", "reservation_timeout_ms", "lookup_socket")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    HBM_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    shm: ShmInfo
    same_host: bool
    max_message_bytes: int
    protocol_version: int
    server_version: str
    host_id: str
    tenant: str
    hbm: _containers.RepeatedCompositeFieldContainer[DeviceMemInfo]
    reservation_timeout_ms: int
    lookup_socket: str
    def __init__(self, session_id: _Optional[str] = ..., shm: _Optional[_Union[ShmInfo, _Mapping]] = ..., same_host: _Optional[bool] = ..., max_message_bytes: _Optional[int] = ..., protocol_version: _Optional[int] = ..., server_version: _Optional[str] = ..., host_id: _Optional[str] = ..., tenant: _Optional[str] = ..., hbm: _Optional[_Iterable[_Union[DeviceMemInfo, _Mapping]]] = ..., reservation_timeout_ms: _Optional[int] = ..., lookup_socket: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("time_unix_ns", "interval_ms")
    TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    time_unix_ns: int
    interval_ms: int
    def __init__(self, time_unix_ns: _Optional[int] = ..., interval_ms: _Optional[int] = ...) -> None: ...

class TTFTParts(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "load_hbm_s", "load_dram_s", "load_ssd_s", "load_remote_s", "remote_fetch_s", "total_s", "cached_tokens", "uncached_tokens")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_HBM_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_DRAM_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_SSD_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_REMOTE_S_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FETCH_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    load_hbm_s: float
    load_dram_s: float
    load_ssd_s: float
    load_remote_s: float
    remote_fetch_s: float
    total_s: float
    cached_tokens: int
    uncached_tokens: int
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., load_hbm_s: _Optional[float] = ..., load_dram_s: _Optional[float] = ..., load_ssd_s: _Optional[float] = ..., load_remote_s: _Optional[float] = ..., remote_fetch_s: _Optional[float] = ..., total_s: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., uncached_tokens: _Optional[int] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("ns", "keys", "keys_packed", "n_tokens", "ttft_target_s", "queue_wait_s", "klass", "dry_run", "block_bytes")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    KLASS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    keys_packed: bytes
    n_tokens: int
    ttft_target_s: float
    queue_wait_s: float
    klass: str
    dry_run: bool
    block_bytes: int
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., keys_packed: _Optional[bytes] = ..., n_tokens: _Optional[int] = ..., ttft_target_s: _Optional[float] = ..., queue_wait_s: _Optional[float] = ..., klass: _Optional[str] = ..., dry_run: _Optional[bool] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("kind", "predicted", "full", "reason", "reason_code", "hit_blocks", "use_blocks", "decision_id", "retry_after_ms", "starved")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    STARVED_FIELD_NUMBER: _ClassVar[int]
    kind: AdmitKind
    predicted: TTFTParts
    full: TTFTParts
    reason: str
    reason_code: str
    hit_blocks: int
    use_blocks: int
    decision_id: int
    retry_after_ms: int
    starved: bool
    def __init__(self, kind: _Optional[_Union[AdmitKind, str]] = ..., predicted: _Optional[_Union[TTFTParts, _Mapping]] = ..., full: _Optional[_Union[TTFTParts, _Mapping]] = ..., reason: _Optional[str] = ..., reason_code: _Optional[str] = ..., hit_blocks: _Optional[int] = ..., use_blocks: _Optional[int] = ..., decision_id: _Optional[int] = ..., retry_after_ms: _Optional[int] = ..., starved: _Optional[bool] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("decision_id", "actual_ttft_s", "queue_s")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    decision_id: int
    actual_ttft_s: float
    queue_s: float
    def __init__(self, decision_id: _Optional[int] = ..., actual_ttft_s: _Optional[float] = ..., queue_s: _Optional[float] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("matched", "error_s")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_S_FIELD_NUMBER: _ClassVar[int]
    matched: bool
    error_s: float
    def __init__(self, matched: _Optional[bool] = ..., error_s: _Optional[float] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("ns", "keys", "cluster", "to_hbm", "block_bytes", "keys_packed")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    TO_HBM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    cluster: bool
    to_hbm: bool
    block_bytes: int
    keys_packed: bytes
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., cluster: _Optional[bool] = ..., to_hbm: _Optional[bool] = ..., block_bytes: _Optional[int] = ..., keys_packed: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_blocks", "tiers", "locations", "decision", "fetch_s", "recompute_s", "local_blocks", "remote_blocks", "cluster_status", "tiers_packed")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_STATUS_FIELD_NUMBER: _ClassVar[int]
    TIERS_PACKED_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    decision: ChainDecision
    fetch_s: float
    recompute_s: float
    local_blocks: int
    remote_blocks: int
    cluster_status: str
    tiers_packed: bytes
    def __init__(self, hit_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., decision: _Optional[_Union[ChainDecision, str]] = ..., fetch_s: _Optional[float] = ..., recompute_s: _Optional[float] = ..., local_blocks: _Optional[int] = ..., remote_blocks: _Optional[int] = ..., cluster_status: _Optional[str] = ..., tiers_packed: _Optional[bytes] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("tier", "peer", "load_s")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    peer: str
    load_s: float
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., peer: _Optional[str] = ..., load_s: _Optional[float] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("ns", "keys", "sizes", "block_bytes", "parent", "tier", "keys_packed")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    parent: bytes
    tier: Tier
    keys_packed: bytes
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., sizes: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., parent: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., keys_packed: _Optional[bytes] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "expires_in_ms", "slots", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    expires_in_ms: int
    slots: SlotArray
    details: _containers.ScalarMap[int, str]
    def __init__(self, reservation_id: _Optional[str] = ..., expires_in_ms: _Optional[int] = ..., slots: _Optional[_Union[SlotArray, _Mapping]] = ..., details: _Optional[_Mapping[int, str]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "keys", "checksums")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KeyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[KeyResult, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id", "keys")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, reservation_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted", "results")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    results: _containers.RepeatedCompositeFieldContainer[KeyResult]
    def __init__(self, aborted: _Optional[int] = ..., results: _Optional[_Iterable[_Union[KeyResult, _Mapping]]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("ns", "keys", "promote", "tier", "cluster", "to_hbm", "peer", "peer_from", "peer_blocks", "keys_packed")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    TO_HBM_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PEER_FROM_FIELD_NUMBER: _ClassVar[int]
    PEER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    promote: bool
    tier: Tier
    cluster: bool
    to_hbm: bool
    peer: str
    peer_from: int
    peer_blocks: int
    keys_packed: bytes
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., promote: _Optional[bool] = ..., tier: _Optional[_Union[Tier, str]] = ..., cluster: _Optional[bool] = ..., to_hbm: _Optional[bool] = ..., peer: _Optional[str] = ..., peer_from: _Optional[int] = ..., peer_blocks: _Optional[int] = ..., keys_packed: _Optional[bytes] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "hit_blocks", "slots", "fetched_blocks", "decision")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    hit_blocks: int
    slots: SlotArray
    fetched_blocks: int
    decision: ChainDecision
    def __init__(self, lease_id: _Optional[str] = ..., hit_blocks: _Optional[int] = ..., slots: _Optional[_Union[SlotArray, _Mapping]] = ..., fetched_blocks: _Optional[int] = ..., decision: _Optional[_Union[ChainDecision, str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("ns", "keys", "payloads", "parent", "checksums")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., payloads: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KeyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[KeyResult, _Mapping]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("ns", "keys", "max_chunk_bytes")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    max_chunk_bytes: int
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("index", "key", "status", "data", "checksum", "offset", "total", "tier")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    index: int
    key: bytes
    status: Status
    data: bytes
    checksum: int
    offset: int
    total: int
    tier: Tier
    def __init__(self, index: _Optional[int] = ..., key: _Optional[bytes] = ..., status: _Optional[_Union[Status, str]] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., offset: _Optional[int] = ..., total: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("ns", "keys", "keys_packed")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    keys_packed: bytes
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., keys_packed: _Optional[bytes] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("hit_blocks", "in_dram", "queued")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_DRAM_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    in_dram: int
    queued: int
    def __init__(self, hit_blocks: _Optional[int] = ..., in_dram: _Optional[int] = ..., queued: _Optional[int] = ...) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("ns", "keys")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReportCorruptResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("ns", "keys")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("results", "removed")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KeyResult]
    removed: int
    def __init__(self, results: _Optional[_Iterable[_Union[KeyResult, _Mapping]]] = ..., removed: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("ns", "all_namespaces")
    NS_FIELD_NUMBER: _ClassVar[int]
    ALL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    all_namespaces: bool
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., all_namespaces: _Optional[bool] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("include_namespaces",)
    INCLUDE_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    include_namespaces: bool
    def __init__(self, include_namespaces: _Optional[bool] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "blocks", "pinned_bytes", "evictions", "promotions", "demotions", "hits", "disk_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    pinned_bytes: int
    evictions: int
    promotions: int
    demotions: int
    hits: int
    disk_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., hits: _Optional[int] = ..., disk_bytes: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_label", "ns_digest", "lookups", "hit_blocks", "queried_blocks", "blocks")
    NAMESPACE_LABEL_FIELD_NUMBER: _ClassVar[int]
    NS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUERIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace_label: str
    ns_digest: bytes
    lookups: int
    hit_blocks: int
    queried_blocks: int
    blocks: int
    def __init__(self, namespace_label: _Optional[str] = ..., ns_digest: _Optional[bytes] = ..., lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., queried_blocks: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "lookups", "hit_blocks", "miss_blocks", "hit_tokens", "miss_tokens", "puts", "gets", "bytes_written", "bytes_read", "bytes_promoted", "bytes_demoted", "checksum_failures", "active_reservations", "active_leases", "sessions", "uptime_seconds", "namespaces", "admitted", "admitted_degraded", "rejected", "prefill_tokens_per_s", "ttft_error_ewma_s", "reservations_expired", "leases_expired", "cluster_members", "cluster_status", "tenant")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_ERROR_EWMA_S_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_STATUS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    lookups: int
    hit_blocks: int
    miss_blocks: int
    hit_tokens: int
    miss_tokens: int
    puts: int
    gets: int
    bytes_written: int
    bytes_read: int
    bytes_promoted: int
    bytes_demoted: int
    checksum_failures: int
    active_reservations: int
    active_leases: int
    sessions: int
    uptime_seconds: float
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    admitted: int
    admitted_degraded: int
    rejected: int
    prefill_tokens_per_s: float
    ttft_error_ewma_s: float
    reservations_expired: int
    leases_expired: int
    cluster_members: int
    cluster_status: str
    tenant: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., miss_tokens: _Optional[int] = ..., puts: _Optional[int] = ..., gets: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_promoted: _Optional[int] = ..., bytes_demoted: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., active_reservations: _Optional[int] = ..., active_leases: _Optional[int] = ..., sessions: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., admitted: _Optional[int] = ..., admitted_degraded: _Optional[int] = ..., rejected: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., ttft_error_ewma_s: _Optional[float] = ..., reservations_expired: _Optional[int] = ..., leases_expired: _Optional[int] = ..., cluster_members: _Optional[int] = ..., cluster_status: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("after_seq", "ns", "run_id")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    NS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    ns: Namespace
    run_id: int
    def __init__(self, after_seq: _Optional[int] = ..., ns: _Optional[_Union[Namespace, _Mapping]] = ..., run_id: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("ns_digest", "keys", "tier", "parent")
    NS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    ns_digest: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tier: Tier
    parent: bytes
    def __init__(self, ns_digest: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[Tier, str]] = ..., parent: _Optional[bytes] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("ns_digest", "keys", "tier", "reason")
    NS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ns_digest: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tier: Tier
    reason: RemoveReason
    def __init__(self, ns_digest: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[Tier, str]] = ..., reason: _Optional[_Union[RemoveReason, str]] = ...) -> None: ...

class Cleared(_message.Message):
    __slots__ = ("ns_digest", "all_namespaces")
    NS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ALL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    ns_digest: bytes
    all_namespaces: bool
    def __init__(self, ns_digest: _Optional[bytes] = ..., all_namespaces: _Optional[bool] = ...) -> None: ...

class Gap(_message.Message):
    __slots__ = ("first_available_seq",)
    FIRST_AVAILABLE_SEQ_FIELD_NUMBER: _ClassVar[int]
    first_available_seq: int
    def __init__(self, first_available_seq: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "time_unix_ns", "run_id", "stored", "removed", "cleared", "gap")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time_unix_ns: int
    run_id: int
    stored: BlockStored
    removed: BlockRemoved
    cleared: Cleared
    gap: Gap
    def __init__(self, seq: _Optional[int] = ..., time_unix_ns: _Optional[int] = ..., run_id: _Optional[int] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[Cleared, _Mapping]] = ..., gap: _Optional[_Union[Gap, _Mapping]] = ...) -> None: ...

class GetConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetConfigResponse(_message.Message):
    __slots__ = ("toml", "json")
    TOML_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    toml: str
    json: str
    def __init__(self, toml: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...

class ResizeTierRequest(_message.Message):
    __slots__ = ("tier", "capacity_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...

class ResizeTierResponse(_message.Message):
    __slots__ = ("old_capacity_bytes", "new_capacity_bytes", "evicted_blocks")
    OLD_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEW_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    old_capacity_bytes: int
    new_capacity_bytes: int
    evicted_blocks: int
    def __init__(self, old_capacity_bytes: _Optional[int] = ..., new_capacity_bytes: _Optional[int] = ..., evicted_blocks: _Optional[int] = ...) -> None: ...

class SetEvictionPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...

class SetEvictionPolicyResponse(_message.Message):
    __slots__ = ("old_policy", "new_policy")
    OLD_POLICY_FIELD_NUMBER: _ClassVar[int]
    NEW_POLICY_FIELD_NUMBER: _ClassVar[int]
    old_policy: str
    new_policy: str
    def __init__(self, old_policy: _Optional[str] = ..., new_policy: _Optional[str] = ...) -> None: ...

class NodeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfoResponse(_message.Message):
    __slots__ = ("node_id", "grpc_address", "block_address", "capacity_bytes", "block_wire")
    class CapacityBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_WIRE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    grpc_address: str
    block_address: str
    capacity_bytes: _containers.ScalarMap[str, int]
    block_wire: int
    def __init__(self, node_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., block_address: _Optional[str] = ..., capacity_bytes: _Optional[_Mapping[str, int]] = ..., block_wire: _Optional[int] = ...) -> None: ...

class DirectoryUpdate(_message.Message):
    __slots__ = ("ns_digest", "keys_packed", "removed", "cleared", "block_bytes")
    NS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ns_digest: bytes
    keys_packed: bytes
    removed: bool
    cleared: bool
    block_bytes: int
    def __init__(self, ns_digest: _Optional[bytes] = ..., keys_packed: _Optional[bytes] = ..., removed: _Optional[bool] = ..., cleared: _Optional[bool] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("node_id", "updates", "resync")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    updates: _containers.RepeatedCompositeFieldContainer[DirectoryUpdate]
    resync: bool
    def __init__(self, node_id: _Optional[str] = ..., updates: _Optional[_Iterable[_Union[DirectoryUpdate, _Mapping]]] = ..., resync: _Optional[bool] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("applied",)
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: int
    def __init__(self, applied: _Optional[int] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("ns_digest", "keys_packed")
    NS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    ns_digest: bytes
    keys_packed: bytes
    def __init__(self, ns_digest: _Optional[bytes] = ..., keys_packed: _Optional[bytes] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("nodes", "holders", "block_bytes")
    NODES_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    holders: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    def __init__(self, nodes: _Optional[_Iterable[str]] = ..., holders: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class BlockFetchHeader(_message.Message):
    __slots__ = ("ns", "credential", "keys_packed", "node_id")
    NS_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    credential: str
    keys_packed: bytes
    node_id: str
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., credential: _Optional[str] = ..., keys_packed: _Optional[bytes] = ..., node_id: _Optional[str] = ...) -> None: ...
