"""Cluster membership and the block directory.

Membership: who is in the cluster now. Two sources behind one interface:

- ``StaticMembership``: a fixed peer list (config ``cluster.peers``); a peer
  is live while its probe answers (the daemon probes with its ``NodeInfo``
  RPC, which also tells the peer's node id and block address).
- ``EtcdMembership``: each daemon puts its ``Member`` record under
  ``<prefix>/members/<node_id>`` with a lease it keeps alive, lists the
  prefix and watches it; a daemon whose lease lapses is gone. When etcd is
  unreachable the view shrinks to this node alone (local blocks keep being
  served), ``healthy`` is False and ``status`` says why; it re-registers when
  etcd is back.

Directory: which node holds which block. Ownership of each block key is
sharded over the live members by rendezvous hashing (``owners``); each
daemon tells the owners what it stored and removed (batched), and a lookup
for a chain asks the owners of the keys it did not find locally, one batched
call per owner. ``DirectoryTable`` is one owner's share. A stale entry (a
holder that lost the block) ends as a clean miss after the failed fetch.

Nothing here imports the daemon: the RPCs are injected callables.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Sequence

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument

log = logging.getLogger("kvstore.cluster")


@dataclass(slots=True, frozen=True)
class Member:
    """One daemon as the cluster sees it."""

    node_id: str
    grpc_address: str
    block_address: str = ""
    capacities: tuple[tuple[str, int], ...] = ()
    """(tier label, bytes) pairs."""
    wire: int = 0
    """Its block transport's wire version (``transport.ucx_wire.WIRE_VERSION``);
    0: a daemon that predates the field (its requests' magic still tells)."""

    def to_json(self) -> bytes:
        d = asdict(self)
        d["capacities"] = dict(self.capacities)
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Member":
        d = json.loads(raw)  # (its errors are ValueErrors)
        if not isinstance(d, dict) or not isinstance(d.get("node_id"), str) or not d["node_id"]:
            raise InvalidArgument("member record without node_id")
        caps = d.get("capacities") or {}
        try:  # any malformed record is a ValueError: a member source skips it
            return cls(node_id=d["node_id"], grpc_address=str(d.get("grpc_address", "")),
                       block_address=str(d.get("block_address", "")),
                       capacities=tuple(sorted((str(k), int(v)) for k, v in dict(caps).items())),
                       wire=int(d.get("wire", 0)))
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidArgument(f"member record {d['node_id']!r}: bad capacities or wire: {e}") from None


# ------------------------------------------------------------ rendezvous
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorized (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


def node_seed(node_id: str) -> np.uint64:
    return np.uint64(xxhash.xxh3_64_intdigest(node_id.encode()))


def owners(keys: bytes | np.ndarray, node_ids: Sequence[str]) -> np.ndarray:
    """Index into ``node_ids`` of each key's owner (highest random weight).

    ``keys``: packed 16-byte keys, or a (n, 16) uint8 array. Keys are
    already uniform hashes; the weight is ``mix(key ^ seed(node))``. The
    answer depends only on the set of node ids, so every daemon agrees, and
    when a node leaves only its keys move."""
    arr = np.frombuffer(keys, dtype=np.uint8) if isinstance(keys, (bytes, bytearray, memoryview)) else keys
    lo = np.ascontiguousarray(arr.reshape(-1, 16)[:, :8]).view(np.uint64).reshape(-1)
    if not node_ids:
        return np.zeros(lo.shape[0], np.int64)
    seeds = np.array([node_seed(n) for n in node_ids], dtype=np.uint64)
    scores = _mix(lo[:, None] ^ seeds[None, :])
    return np.argmax(scores, axis=1).astype(np.int64)


# ------------------------------------------------------------- directory
@dataclass
class DirectoryTable:
    """One owner's share of the directory: key -> the nodes holding it.

    Loops here are per block over plain dicts (the store does the per-byte
    work); entries of a node vanish with it (``drop_node``)."""

    holders: dict[bytes, set[str]] = field(default_factory=dict)
    by_node: dict[tuple[str, bytes], set[bytes]] = field(default_factory=dict)
    block_bytes: dict[bytes, int] = field(default_factory=dict)
    """ns digest -> payload bytes of its blocks (as publishers said)."""

    def __len__(self) -> int:
        return len(self.holders)

    def add(self, node: str, ns_digest: bytes, keys: Iterable[bytes], block_bytes: int = 0) -> int:
        mine = self.by_node.setdefault((node, ns_digest), set())
        n = 0
        for k in keys:
            self.holders.setdefault(k, set()).add(node)
            mine.add(k)
            n += 1
        if block_bytes:
            self.block_bytes[ns_digest] = int(block_bytes)
        return n

    def remove(self, node: str, ns_digest: bytes, keys: Iterable[bytes]) -> int:
        mine = self.by_node.get((node, ns_digest))
        n = 0
        for k in keys:
            h = self.holders.get(k)
            if h is not None and node in h:
                h.discard(node)
                n += 1
                if not h:
                    del self.holders[k]
            if mine is not None:
                mine.discard(k)
        return n

    def clear(self, node: str, ns_digest: bytes | None = None) -> int:
        """Forget what ``node`` holds (in one namespace, or everywhere)."""
        pairs = [p for p in self.by_node if p[0] == node and (ns_digest is None or p[1] == ns_digest)]
        n = 0
        for p in pairs:
            n += self.remove(node, p[1], list(self.by_node.pop(p)))
        return n

    def drop_node(self, node: str) -> int:
        return self.clear(node, None)

    def nodes(self) -> set[str]:
        return {p[0] for p in self.by_node}

    def locate(self, keys: Sequence[bytes]) -> list[set[str]]:
        empty: set[str] = set()
        return [self.holders.get(k, empty) for k in keys]


# ------------------------------------------------------------ membership
ChangeFn = Callable[[dict[str, Member]], None]


class Membership:
    """The live members, including this node; listeners hear every change."""

    def __init__(self, me: Member) -> None:
        self.me = me
        self._members: dict[str, Member] = {me.node_id: me}
        self._listeners: list[ChangeFn] = []
        self.healthy = True
        self.status = "ok"
        self._task: asyncio.Task[None] | None = None

    @property
    def members(self) -> dict[str, Member]:
        return dict(self._members)

    def peers(self) -> dict[str, Member]:
        return {k: v for k, v in self._members.items() if k != self.me.node_id}

    def subscribe(self, fn: ChangeFn) -> None:
        self._listeners.append(fn)

    def _set(self, members: dict[str, Member]) -> None:
        members = dict(members)
        members[self.me.node_id] = self.me
        if members == self._members:
            return
        gone = set(self._members) - set(members)
        new = set(members) - set(self._members)
        self._members = members
        if gone or new:
            log.info("cluster membership: %d members (joined %s, left %s)", len(members),
                     sorted(new) or "-", sorted(gone) or "-")
        for fn in self._listeners:
            try:
                fn(self.members)
            except Exception:
                log.exception("membership listener failed")

    async def _loop(self) -> None:
        """Follow the membership source until cancelled (per source)."""

    def _follows(self) -> bool:
        """Whether there is a source to follow."""
        return True

    async def start(self) -> None:
        """Begin following the membership source."""
        if self._follows():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop following it."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:
                pass
            self._task = None


ProbeFn = Callable[[str], Awaitable[Member | None]]


class StaticMembership(Membership):
    """A fixed list of peer gRPC addresses; each is live while ``probe``
    answers (it returns the peer's ``Member``) and dead when it fails."""

    def __init__(self, me: Member, peer_addresses: Sequence[str], probe: ProbeFn,
                 interval_s: float = 1.0) -> None:
        super().__init__(me)
        self.addresses = [a for a in peer_addresses if a and a != me.grpc_address]
        self.probe = probe
        self.interval_s = interval_s
        self._known: dict[str, Member] = {}  # address -> member when live

    async def refresh(self) -> None:
        results = await asyncio.gather(*(self._probe_one(a) for a in self.addresses))
        live = {m.node_id: m for m in results if m is not None and m.node_id != self.me.node_id}
        self._set(live)

    async def _probe_one(self, address: str) -> Member | None:
        try:
            return await self.probe(address)
        except Exception as e:
            log.debug("probe of %s failed: %s", address, e)
            return None

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("static membership refresh failed")
            await asyncio.sleep(self.interval_s)

    def _follows(self) -> bool:
        return bool(self.addresses)


class EtcdMembership(Membership):
    """Members registered in etcd under a lease (client: ``aetcd``)."""

    def __init__(self, me: Member, endpoint: str, prefix: str = "/kvstore", ttl_s: int = 5,
                 retry_s: float = 1.0) -> None:
        super().__init__(me)
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"etcd endpoint {endpoint!r}: expected host:port")
        self.host, self.port = host, int(port)
        self.prefix = prefix.rstrip("/") + "/members/"
        self.ttl_s = max(1, int(ttl_s))
        self.retry_s = retry_s
        self._client: Any = None
        self._lease: Any = None

    def _key(self, node_id: str) -> bytes:
        return (self.prefix + node_id).encode()

    def _record(self, kv: Any) -> Member | None:
        """The member a record names, or None for a bad one: malformed, or
        its node id not its key's name (it would never leave: a key's delete
        removes the member of that name)."""
        try:
            m = Member.from_json(kv.value)
        except ValueError:
            m = None
        if m is None or self._key(m.node_id) != bytes(kv.key):
            log.warning("ignoring bad member record at %r", kv.key)
            return None
        return m

    async def _session(self) -> None:
        """Register, list, then follow the prefix until etcd fails."""
        import aetcd

        client = aetcd.Client(host=self.host, port=self.port, timeout=max(1.0, self.ttl_s / 2))
        self._client = client
        try:
            lease = await client.lease(self.ttl_s)
            self._lease = lease
            await client.put(self._key(self.me.node_id), self.me.to_json(), lease=lease)
            watch = await client.watch_prefix(self.prefix.encode())
            members: dict[str, Member] = {}
            for kv in await client.get_prefix(self.prefix.encode()):
                m = self._record(kv)
                if m is not None:
                    members[m.node_id] = m
            if not self.healthy:
                log.warning("etcd at %s:%d reachable again: cluster membership restored", self.host, self.port)
            self.healthy, self.status = True, "ok"
            self._set(members)

            async def keepalive() -> None:
                while True:
                    await asyncio.sleep(self.ttl_s / 3)
                    r = await asyncio.wait_for(lease.refresh(), self.ttl_s / 2)
                    if getattr(r, "TTL", 1) <= 0:
                        raise ConnectionError("lease expired")

            async def follow() -> None:
                async for ev in watch:
                    node = ev.kv.key.decode(errors="replace")[len(self.prefix):]
                    cur = self.members
                    if str(ev.kind).endswith("DELETE"):
                        if node == self.me.node_id:
                            raise ConnectionError("our member record was deleted (lease lapsed)")
                        cur.pop(node, None)
                    else:
                        m = self._record(ev.kv)
                        if m is None:
                            continue
                        cur[m.node_id] = m
                    self._set(cur)
                raise ConnectionError("etcd watch ended")

            loop = asyncio.get_running_loop()
            tasks = {loop.create_task(keepalive()), loop.create_task(follow())}
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
            finally:
                for t in tasks:
                    t.cancel()
                try:
                    await watch.cancel()
                except Exception:
                    pass
        finally:
            self._client = None
            try:
                await client.close()
            except Exception:
                pass

    async def _loop(self) -> None:
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self.healthy:
                    log.warning("etcd at %s:%d unreachable (%s): serving local blocks only until it is back",
                                self.host, self.port, e or type(e).__name__)
                self.healthy = False
                self.status = f"etcd unreachable: {type(e).__name__}: {e}"[:200]
                self._set({})
            await asyncio.sleep(self.retry_s)

    async def stop(self) -> None:
        await super().stop()
        # best effort: leave at once instead of waiting for the lease to lapse
        try:
            import aetcd

            client = aetcd.Client(host=self.host, port=self.port, timeout=1.0)
            try:
                await asyncio.wait_for(client.delete(self._key(self.me.node_id)), 1.0)
            finally:
                await client.close()
        except Exception:
            pass


__all__ = ["DirectoryTable", "EtcdMembership", "Member", "Membership", "StaticMembership", "owners"]
