"""The asyncio client for the kvstore daemon: ``AsyncClient``, with the data
calls of ``kvstore.client.sync.Client`` (awaitable: ``lookup``, ``put``,
``get``, ``get_into``, ``remove``, ``clear``, ``stats``; keys as a list of
16-byte keys or packed in one ``bytes`` where ``Client`` takes them so) and the
same typed answers. The zero-copy and two-phase calls (``acquire``,
``reserve``, ``commit``, ``view``) and the admin calls are ``Client``'s only."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

import grpc

import numpy as np

from kvstore.buffers import KEY_BYTES, as_u8, pack_keys, split_keys
from kvstore.client.base import ClientBase
from kvstore.client.sinks import BlockSink, as_sink, is_sink
from kvstore.errors import InvalidArgument, KeyStatus, KVStoreError
from kvstore.keys import Namespace
from kvstore.results import DaemonStats, LookupResult
from kvstore.wire.answers import lookup_from_pb, stats_from_pb
from kvstore.wire.convert import ns_pb
from kvstore.wire.shm import host_identity
from kvstore.wire.status import error_from_rpc
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tiers.base import Buffer

__all__ = ["AsyncClient"]


class AsyncClient(ClientBase):
    """asyncio client with the data calls of ``Client`` (awaitable; see the module docstring)."""

    def __init__(self, target: str | None = None, *, token: str | None = None, token_file: str | None = None,
                 tls_ca_file: str | None = None, name: str = "kvstore-aio-client", use_shm: bool = True,
                 timeout: float = 30.0) -> None:
        super().__init__(target, token, token_file, tls_ca_file, name, use_shm, timeout)
        creds = self._creds()
        self.channel = (grpc.aio.secure_channel(self.target, creds, self._options()) if creds
                        else grpc.aio.insecure_channel(self.target, self._options()))
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self._ka_task: asyncio.Task[None] | None = None

    async def connect(self, session: bool = True) -> "AsyncClient":
        if session:
            resp = await self._call(self.stub.Handshake, pb.HandshakeRequest(
                client_name=self.name, pid=os.getpid(), host_id=host_identity(), protocol_version=1))
            self._after_handshake(resp)
            call = self.stub.KeepAlive(pb.KeepAliveRequest(session_id=self.session), metadata=self._md())
            self._ka_task = asyncio.get_running_loop().create_task(self._drain(call))
        return self

    @staticmethod
    async def _drain(call: Any) -> None:
        try:
            async for _ in call:
                pass
        except (grpc.RpcError, asyncio.CancelledError):
            pass

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, metadata=self._md(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    async def close(self) -> None:
        if self._ka_task is not None:
            self._ka_task.cancel()
        if self.slab is not None:
            self.slab.close()
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def lookup(self, ns: Namespace, keys: Sequence[bytes] | bytes) -> LookupResult:
        r = await self._call(self.stub.Lookup, pb.LookupRequest(ns=ns_pb(ns), keys_packed=pack_keys(keys, check=True)))
        return lookup_from_pb(r)

    async def put(self, ns: Namespace, keys: Sequence[bytes] | bytes, payloads: Sequence[Buffer],
                  parent: bytes | None = None) -> list[KeyStatus]:
        keys = split_keys(pack_keys(keys, check=True))
        if len(keys) != len(payloads):
            raise InvalidArgument(f"{len(keys)} keys but {len(payloads)} payloads")
        if not keys:  # nothing to reserve
            return []
        if self.slab is None:
            out: list[KeyStatus] = []
            for req in self._put_requests(ns, keys, payloads, parent):
                out += self._statuses((await self._call(self.stub.Put, req)).results)
            return out
        srcs = [as_u8(p) for p in payloads]
        r = await self._call(self.stub.Reserve, self._reserve_request(ns, keys, srcs, parent))
        if not r.reservation_id:
            return [KeyStatus(x) for x in r.slots.status]
        try:
            statuses, csums = self._fill_slots(r, srcs)
        except BaseException:
            await self._call(self.stub.Abort, pb.AbortRequest(reservation_id=r.reservation_id))
            raise
        c = await self._call(self.stub.Commit, pb.CommitRequest(reservation_id=r.reservation_id, checksums=csums))
        return self._merge_commit(statuses, c)

    async def get(self, ns: Namespace, keys: Sequence[bytes] | bytes) -> list[np.ndarray | None]:
        """The present blocks' bytes (None where missing or failing their checksum)."""
        packed = pack_keys(keys, check=True)
        if self.slab is None:
            bufs: dict[int, np.ndarray] = {}
            sums: dict[int, int] = {}
            statuses = [KeyStatus.MISS] * (len(packed) // KEY_BYTES)
            try:
                async for chunk in self.stub.Get(pb.GetRequest(ns=ns_pb(ns), keys=split_keys(packed)),
                                                 metadata=self._md(), timeout=self.timeout):
                    self._inline_take(chunk, bufs, statuses, sums)
            except grpc.RpcError as e:
                raise error_from_rpc(e) from None
            return self._inline_result(bufs, sums, statuses, self.copy_threads)[0]  # failed: a miss
        r = await self._call(self.stub.Acquire, pb.AcquireRequest(ns=ns_pb(ns), keys_packed=packed, promote=True))
        outs = [np.empty(int(n), np.uint8) for n in r.slots.length]
        return [o if s is KeyStatus.OK else None
                for o, s in zip(outs, await self._read_acquired(ns, split_keys(packed), r, outs))]

    async def get_into(self, ns: Namespace, keys: Sequence[bytes] | bytes,
                       outs: Sequence[Buffer] | BlockSink) -> list[KeyStatus]:
        keys = split_keys(pack_keys(keys, check=True))
        if len(outs) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} output buffers")
        if self.slab is None:
            if is_sink(outs):
                parts, sums = self._inline_parts(outs)
                return self._inline_done(outs, parts, sums, await self._get_inline(ns, keys, parts, sums))
            sums = {}
            statuses = await self._get_inline(ns, keys, outs, sums)
            self._inline_checked(outs, sums, statuses, self.copy_threads)
            return statuses
        r = await self._call(self.stub.Acquire, pb.AcquireRequest(ns=ns_pb(ns), keys_packed=pack_keys(keys, check=True),
                                                                   promote=True))
        return await self._read_acquired(ns, keys, r, outs)

    async def _read_acquired(self, ns: Namespace, keys: list[bytes], r: pb.AcquireResponse,
                             outs: Sequence[Buffer] | BlockSink) -> list[KeyStatus]:
        """Copy an ``Acquire``'s blocks out (verified), release, report the corrupt ones."""
        try:
            statuses = self._read_slots(r, as_sink(outs, self.copy_threads))
        finally:
            if r.lease_id:
                await self._call(self.stub.Release, pb.ReleaseRequest(lease_id=r.lease_id))
        bad = [k for k, s in zip(keys, statuses) if s is KeyStatus.CORRUPT]
        if bad:  # the daemon drops them (best effort: they are misses here already)
            try:
                await self._call(self.stub.ReportCorrupt, pb.ReportCorruptRequest(ns=ns_pb(ns), keys=bad))
            except KVStoreError:
                pass
        return statuses

    async def _get_inline(self, ns: Namespace, keys: list[bytes], outs: Sequence[Buffer],
                          sums: dict[int, int] | None = None) -> list[KeyStatus]:
        statuses = [KeyStatus.MISS] * len(keys)
        try:
            async for chunk in self.stub.Get(pb.GetRequest(ns=ns_pb(ns), keys=keys), metadata=self._md(),
                                             timeout=self.timeout):
                self._apply_chunk(chunk, outs, statuses, sums)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return statuses

    async def remove(self, ns: Namespace, keys: Sequence[bytes]) -> list[KeyStatus]:
        r = await self._call(self.stub.Remove, pb.RemoveRequest(ns=ns_pb(ns), keys=list(keys)))
        return self._statuses(r.results)

    async def clear(self, ns: Namespace | None = None) -> int:
        """Remove a namespace's blocks (None: every namespace the caller may see); the count removed."""
        req = pb.ClearRequest(ns=ns_pb(ns)) if ns is not None else pb.ClearRequest(all_namespaces=True)
        return int((await self._call(self.stub.Clear, req)).removed)

    async def stats(self, include_namespaces: bool = True) -> DaemonStats:
        r = await self._call(self.stub.Stats, pb.StatsRequest(include_namespaces=include_namespaces))
        return stats_from_pb(r)
