"""What the sync and asyncio clients share (``ClientBase``): settings and
credentials, the session's handshake results (the shared-memory slab, HBM
regions, the same-host socket), and the request building and response
handling of put and get. ``Client`` (``kvstore.client.sync``) and
``AsyncClient`` (``kvstore.client.aio``) differ only in how they call.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Iterator, Sequence

import grpc
import numpy as np

from kvstore.buffers import as_u8, as_u8_writable, pack_keys
from kvstore.checksum import checksum_many, copy_many
from kvstore.client.sinks import BlockSink
from kvstore.errors import InvalidArgument, KeyStatus, Unavailable
from kvstore.keys import Namespace
from kvstore.results import HbmRegion
from kvstore.wire.answers import hbm_region_from_pb
from kvstore.wire.convert import ns_pb
from kvstore.wire.shm import SlabMapping
from proto import kvstore_pb2 as pb
from tiers.base import Buffer, TierKind

DEFAULT_TARGET = "127.0.0.1:50051"

log = logging.getLogger("kvstore.client")
_warned: set[tuple[str, int | None]] = set()


def _warn_once(path: str, e: OSError) -> None:
    """A slab this host's daemon offered could not be mapped: a warning the
    first time for this path and errno (a process opening many clients
    says it once), debug after."""
    key = (path, e.errno)
    level = logging.DEBUG if key in _warned else logging.WARNING
    if len(_warned) >= 1024:
        _warned.clear()
    _warned.add(key)
    log.log(level, "the daemon's slab %s cannot be mapped ([errno %s] %s): this client sends its bytes "
            "inline over gRPC (slower)", path, e.errno, e.strerror)


def tier_field(tier: str | None) -> Any:
    """A request's tier field from "hbm"/"dram"/None."""
    if tier is None:
        return 0
    t = TierKind.parse(tier)
    if t not in (TierKind.HBM, TierKind.DRAM):
        raise InvalidArgument(f"tier {tier!r} cannot be asked for; allowed: hbm, dram")
    return int(t) + 1


def _read_token(token: str | None, token_file: str | None) -> str | None:
    """The bearer token: given, from ``token_file``, else ``$KVSTORE_TOKEN``.
    It goes in a header, so it must be one line of printable ASCII (a file of
    several tokens, as the daemon reads, is refused here, not by gRPC)."""
    if not token and token_file:
        with open(token_file) as f:
            token = f.read().strip() or None
    elif not token:
        token = os.environ.get("KVSTORE_TOKEN") or None
    if token is not None and not (token.isascii() and token.isprintable()):
        raise InvalidArgument("the bearer token must be one line of printable ASCII (one token, not a file of several)")
    return token


class ClientBase:
    """What ``Client`` and ``AsyncClient`` share: settings, the session's
    results (slab, HBM regions, fast socket), request building and response
    handling. The two differ only in how they call."""

    def __init__(self, target: str | None, token: str | None, token_file: str | None,
                 tls_ca_file: str | None, name: str, use_shm: bool, timeout: float) -> None:
        self.target = target or os.environ.get("KVSTORE_ADDRESS") or DEFAULT_TARGET
        self.token = _read_token(token, token_file)
        self.tls_ca = open(tls_ca_file, "rb").read() if tls_ca_file else None
        self.name = name
        self.use_shm = use_shm
        self.prefault = False
        """Map the slab's resident pages at attach, on a background thread
        (``SlabMapping.prefault``): for long-lived engine clients."""
        self.timeout = timeout
        self.session = ""
        self.slab: SlabMapping | None = None
        self.slab_error = ""
        """Why a same-host slab could not be mapped (the OSError), else ""."""
        self._fast_path = ""  # the daemon's fast Lookup socket, when same host
        self._fast: Any = None
        self._ns_wire: dict[Namespace, bytes] = {}
        self._ns_msgs: dict[Namespace, pb.Namespace] = {}
        self.max_message_bytes = 4 << 20
        self.server_tenant = ""
        self.copy_threads = 2
        """Threads that copy one large batch in and out of the slab."""
        self.hbm_regions: list[HbmRegion] = []
        """The daemon's HBM tier regions (same host only); map with map_hbm()."""
        self.hbm: Any = None
        """The mapped HBM region (kvstore.wire.hbm_ipc.HbmMapping), once map_hbm() ran."""

    def _creds(self) -> grpc.ChannelCredentials | None:
        return grpc.ssl_channel_credentials(self.tls_ca) if self.tls_ca is not None else None

    def _options(self) -> list[tuple[str, Any]]:
        return [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]

    def _md(self) -> list[tuple[str, str]]:
        md = []
        if self.token:
            md.append(("authorization", f"Bearer {self.token}"))
        if self.session:
            md.append(("x-kvstore-session", self.session))
        return md

    def _after_handshake(self, resp: pb.HandshakeResponse) -> None:
        self.session = resp.session_id
        self.max_message_bytes = resp.max_message_bytes or self.max_message_bytes
        self.server_tenant = resp.tenant
        self.slab_error = ""
        if self.use_shm and resp.same_host and resp.HasField("shm"):
            try:
                self.slab = SlabMapping(resp.shm.path, resp.shm.size_bytes, resp.shm.slab_id)
            except OSError as e:  # e.g. another container: fall back to inline bytes, and say why
                self.slab = None
                self.slab_error = f"the slab {resp.shm.path} cannot be mapped here ([errno {e.errno}] {e.strerror})"
                _warn_once(resp.shm.path, e)
            if self.slab is not None and self.prefault:
                self.slab.prefault_in_background()
        self.hbm_regions = [hbm_region_from_pb(m) for m in resp.hbm] if resp.same_host else []
        self._fast_path = resp.lookup_socket if resp.same_host else ""

    def no_slab_reason(self) -> str:
        """Why this client has no shared-memory slab ("" when it has one)."""
        if self.slab is not None:
            return ""
        if not self.use_shm:
            return "use_shm=False"
        if self.slab_error:
            return self.slab_error
        if not self.session:
            return "no session (session=False)"
        return "the daemon is on another host (or sent no slab)"

    def map_hbm(self) -> Any:
        """Map the daemon's HBM slab through CUDA IPC (once per process) and
        return the mapping (``view(offset, length)`` gives device tensors).
        Raises Unavailable without an HBM tier, on another host, when the
        tier runs on the host (hbm.on_cpu) or without CUDA here."""
        if self.hbm is None:
            if not self.hbm_regions:
                raise Unavailable("the daemon has no hbm tier this client can map (none, or another host)")
            from kvstore.wire.hbm_ipc import open_region

            r = self.hbm_regions[0]
            self.hbm = open_region(r.device, r.ipc_handle, r.base_offset, r.size_bytes, r.slab_id, r.ipc)
        return self.hbm

    def hbm_view(self, offset: int, length: int) -> Any:
        """Device tensor view of an HBM slot (after map_hbm)."""
        return self.map_hbm().view(offset, length)

    def _view(self, offset: int, length: int) -> np.ndarray:
        assert self.slab is not None
        if not self.slab.covers(offset, length):
            # the daemon grew its slab: map again
            path, sid = self.slab.path, self.slab.slab_id
            self.slab.close()
            self.slab = SlabMapping(path, 0, sid)
            if self.prefault:
                self.slab.prefault_in_background()
        return self.slab.view(offset, length)

    # Request building and response handling shared by Client and AsyncClient:
    # the two differ only in how they call.
    def _put_requests(self, ns: Namespace, keys: list[bytes], payloads: Sequence[Buffer],
                      parent: bytes | None) -> Iterator[pb.PutRequest]:
        """Inline puts, split into messages under the size limit."""
        limit = max(1, self.max_message_bytes - 64 * 1024)
        nsm = ns_pb(ns)
        start, size = 0, 0
        bounds = []
        for i, p in enumerate(payloads):
            n = as_u8(p).size + 64
            if i > start and size + n > limit:
                bounds.append((start, i))
                start, size = i, 0
            size += n
        if start < len(keys):
            bounds.append((start, len(keys)))
        for a, b in bounds:
            par = parent if a == 0 else keys[a - 1]
            yield pb.PutRequest(ns=nsm, keys=keys[a:b], parent=par or b"",
                                payloads=[as_u8(p).tobytes() for p in payloads[a:b]])

    def _ns_msg(self, ns: Namespace) -> pb.Namespace:
        """``ns_pb(ns)``, built once per namespace (building it costs more
        than the rest of a small request)."""
        msg = self._ns_msgs.get(ns)
        if msg is None:
            if len(self._ns_msgs) >= 1024:
                self._ns_msgs.clear()
            msg = self._ns_msgs[ns] = ns_pb(ns)
        return msg

    def _reserve_request(self, ns: Namespace, keys: Sequence[bytes] | bytes, srcs: list[np.ndarray],
                         parent: bytes | None) -> pb.ReserveRequest:
        req = pb.ReserveRequest(ns=self._ns_msg(ns), keys_packed=pack_keys(keys, check=True), parent=parent or b"")
        sizes = {s.size for s in srcs}
        if len(sizes) == 1:
            req.block_bytes = sizes.pop()
        else:
            req.sizes.extend(s.size for s in srcs)
        return req

    def _fill_slots(self, r: pb.ReserveResponse, srcs: list[np.ndarray]) -> tuple[list[KeyStatus], list[int]]:
        """Write each reserved slot (copy fused with its checksum)."""
        sa = r.slots
        statuses = [KeyStatus(x) for x in sa.status]
        ok = [i for i, st in enumerate(sa.status) if st == 0]
        dsts = [self._view(sa.offset[i], sa.length[i]) for i in ok]
        csums = copy_many(dsts, [srcs[i] for i in ok], self.copy_threads).tolist()
        return statuses, csums

    @staticmethod
    def _merge_commit(statuses: list[KeyStatus], c: pb.CommitResponse) -> list[KeyStatus]:
        committed = iter(KeyStatus(int(x.status)) for x in c.results)
        return [next(committed) if s is KeyStatus.OK else s for s in statuses]

    def _read_slots(self, r: pb.AcquireResponse, sink: BlockSink) -> list[KeyStatus]:
        """Copy acquired blocks out of the slab into ``sink``, verifying checksums."""
        sa = r.slots
        statuses = [KeyStatus(x) for x in sa.status]
        todo = []
        for i in range(int(r.hit_blocks)):
            if sink.size_of(i) != sa.length[i]:
                statuses[i] = KeyStatus.INVALID
            else:
                todo.append(i)
        ok = sink.write(todo, [self._view(sa.offset[i], sa.length[i]) for i in todo],
                        [sa.checksum[i] for i in todo])
        for i, good in zip(todo, ok.tolist()):
            if not good:
                statuses[i] = KeyStatus.CORRUPT
        return statuses

    @staticmethod
    def _apply_chunk(chunk: pb.GetChunk, outs: Sequence[Buffer], statuses: list[KeyStatus],
                     sums: dict[int, int] | None = None) -> None:
        i = chunk.index
        statuses[i] = KeyStatus(int(chunk.status))
        if chunk.status != pb.STATUS_OK:
            return
        dst = as_u8_writable(outs[i])
        if dst.size != chunk.total:
            statuses[i] = KeyStatus.INVALID
            return
        dst[chunk.offset : chunk.offset + len(chunk.data)] = np.frombuffer(chunk.data, np.uint8)
        if sums is not None:
            sums[i] = int(chunk.checksum)

    @staticmethod
    def _inline_checked(outs: Sequence[Buffer], sums: dict[int, int], statuses: list[KeyStatus],
                        threads: int) -> list[int]:
        """Check the blocks an inline get wrote into ``outs`` against the
        checksums the daemon sent: one that fails (or came without one) is
        ``CORRUPT`` in ``statuses``, never handed over as good. Returns those
        indices (to report)."""
        todo = [i for i, s in enumerate(statuses) if s is KeyStatus.OK]
        if not todo:
            return []
        want = np.array([sums.get(i, -1) & 0xFFFFFFFFFFFFFFFF for i in todo], np.uint64)
        ok = (checksum_many([as_u8(outs[i]) for i in todo], threads) == want) & np.array([i in sums for i in todo])
        bad = [i for i, good in zip(todo, ok.tolist()) if not good]
        for i in bad:
            statuses[i] = KeyStatus.CORRUPT
        return bad

    @classmethod
    def _inline_take(cls, chunk: pb.GetChunk, bufs: dict[int, np.ndarray], statuses: list[KeyStatus],
                     sums: dict[int, int]) -> None:
        """One chunk of an inline get's answer into ``bufs`` (a block's buffer made at its first chunk)."""
        if chunk.status == pb.STATUS_OK and chunk.index not in bufs:
            bufs[chunk.index] = np.empty(chunk.total, np.uint8)
        cls._apply_chunk(chunk, bufs, statuses, sums)  # type: ignore[arg-type]

    @classmethod
    def _inline_result(cls, bufs: dict[int, np.ndarray], sums: dict[int, int], statuses: list[KeyStatus],
                       threads: int) -> tuple[list[np.ndarray | None], list[int]]:
        """The blocks ``_inline_take`` assembled (None where missing or failing
        their checksum: a miss, never the bytes), and the failed indices."""
        bad = cls._inline_checked(bufs, sums, statuses, threads)  # type: ignore[arg-type]
        return [bufs[i] if s is KeyStatus.OK else None for i, s in enumerate(statuses)], bad

    @classmethod
    def _inline_blocks(cls, chunks: Iterable[pb.GetChunk], n: int,
                       threads: int) -> tuple[list[np.ndarray | None], list[int]]:
        """An inline get's answer (``chunks``) as ``_inline_result``."""
        bufs: dict[int, np.ndarray] = {}
        sums: dict[int, int] = {}
        statuses = [KeyStatus.MISS] * n
        for chunk in chunks:
            cls._inline_take(chunk, bufs, statuses, sums)
        return cls._inline_result(bufs, sums, statuses, threads)

    @staticmethod
    def _inline_parts(sink: BlockSink) -> tuple[list[np.ndarray], dict[int, int]]:
        """Buffers an inline get into a sink assembles the blocks in (their
        checksums go in the dict), before ``_inline_done`` hands them over."""
        return [np.empty(sink.size_of(i), np.uint8) for i in range(len(sink))], {}

    @staticmethod
    def _inline_done(sink: BlockSink, parts: list[np.ndarray], sums: dict[int, int],
                     statuses: list[KeyStatus]) -> list[KeyStatus]:
        """Hand the assembled blocks to the sink, checked against the checksums the daemon sent."""
        todo = [i for i, s in enumerate(statuses) if s is KeyStatus.OK and i in sums]
        ok = sink.write(todo, [parts[i] for i in todo], [sums[i] for i in todo])
        for i, good in zip(todo, ok.tolist()):
            if not good:
                statuses[i] = KeyStatus.CORRUPT
        return statuses

    @staticmethod
    def _statuses(results: Any) -> list[KeyStatus]:
        return [KeyStatus(int(r.status)) for r in results]
