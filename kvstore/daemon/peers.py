"""The daemon's side of the cluster: membership, the directory share this
daemon owns, publishing its stored/removed blocks to their owners, Lookup's
cluster mode and the fetch behind Acquire; its blocks are served to peers
over the block transport by ``block_provider.BlockProvider``.

The transport (``transport.ucx`` by default) moves memory regions and knows
nothing about the index; this module encodes the request header
(``BlockFetchHeader``: namespace, the caller's credential, keys), authorizes
it on the serving side, pins what is served (a lease released when the send
ends), and on the fetching side reserves DRAM slots, fetches into them,
commits the blocks that arrived intact and aborts the rest: a failed or
corrupt block is a clean miss, never wrong data. A fetch whose link timed
out or failed (the transport's ``FetchFault``: ``link``; never its error's
wording) makes the peer suspect: its blocks are recomputed at once for
``cluster.peer_backoff``, then its link is probed again (``_reprobe``).

Everything runs on the daemon's event loop (each store call under the store
lock), except a served fetch's read of blocks on SSD, which runs on the
daemon's disk worker; ``Served.release`` may be called from a transport
thread and hops back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import grpc
import numpy as np

from kvstore.buffers import pack_keys, split_keys
from kvstore.config import ClusterMode, Config
from kvstore.daemon import tls
from kvstore.daemon.block_provider import BlockProvider
from kvstore.daemon.fetch_plan import RunFetch
from kvstore.daemon.fetch_slots import FETCH_OWNER
from kvstore.keys import Namespace
from kvstore.results import Event, EventKind, LookupResult, DropReason
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from transport.cluster import DirectoryTable, EtcdMembership, Member, Membership, StaticMembership, owners
from transport.ucx_wire import WIRE_VERSION
from transport.cost import GBIT, ChainDecision, CostConfig, CostModel, Estimate, shapes_from_toml

log = logging.getLogger("kvstore.cluster")


def default_transport() -> tuple[Any, Any]:
    """(BlockServer class, BlockClient class) of the UCX transport."""
    from transport import ucx

    return ucx.BlockServer, ucx.BlockClient


transport_factory: Callable[[], tuple[Any, Any]] = default_transport
"""Where the daemon gets its block transport (tests swap in a fake)."""



@dataclass(slots=True)
class ClusterView:
    """Lookup's cluster answer for one chain."""

    local: LookupResult
    remote_blocks: int = 0
    peer: str | None = None
    block_bytes: int = 0
    estimate: Estimate = field(default_factory=lambda: Estimate(ChainDecision.LOCAL, 0.0, 0.0, 0, 0))
    block_load_s: float = 0.0


class ClusterNode:
    """One daemon's membership in the cluster (see the module docstring)."""

    def __init__(self, daemon: Any, config: Config, grpc_address: str) -> None:
        self.daemon = daemon
        self.store = daemon.store
        self.metrics = daemon.metrics
        self.cfg = config.cluster
        c = self.cfg
        self.node_id = c.node_id or grpc_address
        self.grpc_address = grpc_address
        shapes: dict[str, Any] = {}
        tables: dict[str, Any] = {}
        if c.models_file:
            with open(c.models_file, "rb") as f:
                shapes, tables = shapes_from_toml(tomllib.load(f))
        self.cost = CostModel(CostConfig(
            latency_s=c.peer_latency, bandwidth_Bps=c.peer_bandwidth_gbps * GBIT,
            h2d_bandwidth_Bps=c.h2d_bandwidth_gbytes * 1e9,
            prefill_tokens_per_s=c.prefill_tokens_per_s or config.admission.prefill_tokens_per_s,
            prefill_flops_per_s=c.prefill_tflops * 1e12, margin=c.fetch_margin, backoff_s=c.peer_backoff),
            shapes, tables)
        predictor = getattr(getattr(daemon, "admission", None), "predictor", None)
        if predictor is not None:  # one model: Admit's remote terms and the fetch decision's recompute side
            predictor.attach_cost(self.cost, share_prefill=not c.prefill_tokens_per_s)
        self.table = DirectoryTable()
        self.locates = 0
        """Locate rounds made for views (each asks the keys' owners once)."""
        self.located_bb: dict[bytes, int] = {}
        """Block bytes per namespace digest as Locates answered (an Acquire's hint needs them; at most 4,096)."""
        self.token = os.environ.get(c.peer_token_env, "").strip() if c.peer_token_env else ""
        self.creds = tls.peer_credentials(config)  # peer channels follow the server's TLS (mutual TLS)
        tls.warn_clear_token(config, self.token, c.peer_list)
        server_cls, client_cls = transport_factory()
        # served for at most serve_s (+ < 1 s slack) whatever a peer asks; pinned longer (lease_s)
        self.serve_s = 2 * c.fetch_timeout
        self.lease_s = 2 * self.serve_s + 1.0
        self.provider = BlockProvider(daemon, self.lease_s,
                                      lambda node: hasattr(self, "membership") and node in self.membership.members)
        self.provide = self.provider.provide
        """Serves a peer's fetch (``kvstore.daemon.block_provider``)."""
        self.block_server = server_cls(self.provide, host=c.block_host, port=c.block_port, max_wait_s=self.serve_s,
                                       max_requests=c.peer_max_requests, max_connections=c.peer_max_connections)
        self.block_client = client_cls(connect_timeout_s=min(2.0, c.fetch_timeout))
        self.fetcher = RunFetch(self.node_id, self.store, self.metrics, c, self.block_client, self.cost)
        self.block_address = ""
        self.membership: Membership
        self._channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.ClusterStub]] = {}
        self._pending: list[tuple[str, bytes, list[bytes]]] = []
        self._resync = True
        self._owed: set[str] = set()
        """Owners that resynced (their view changed, or they restarted: they may have dropped what this
        node published to them): the next flush sends each its share of the inventory again."""
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._digest_ns: dict[bytes, Namespace] = {}
        self._probing: set[str] = set()
        """Suspect peers whose link is being probed again."""
        self._foreign: dict[str, int] = {}
        """Peers logged as speaking another block wire version, and that version."""
        self._block_addresses: dict[str, str] = {}
        """Each member's block address as membership last said (a change: its link is forgotten)."""
        self._loop = asyncio.get_running_loop()
        self.health_fn: Callable[[bool], None] | None = None
        self._last_health: bool | None = None

    # ------------------------------------------------------------ lifecycle
    def _me(self) -> Member:
        caps = tuple(sorted((t.label, int(tier.capacity_bytes)) for t, tier in self.store.tiers.items()))
        return Member(self.node_id, self.grpc_address, self.block_address, caps, WIRE_VERSION)

    async def start(self) -> None:
        self.block_address = await self.block_server.start()
        me = self._me()
        c = self.cfg
        if c.mode is ClusterMode.ETCD:
            self.membership = EtcdMembership(me, c.etcd_endpoint, c.etcd_prefix, int(round(c.lease_ttl)))
        else:
            self.membership = StaticMembership(me, c.peer_list, self._probe, c.probe_interval)
        self.membership.subscribe(self._on_members)
        self.store.subscribe(self._on_event)
        await self.membership.start()
        self._tasks.append(self._loop.create_task(self._publisher()))
        self._tasks.append(self._loop.create_task(self._health_watch()))
        self._sync_health()
        log.info("cluster: node %s (mode %s), block transport on %s", self.node_id, c.mode.value,
                 self.block_address)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:  # ended here, not by whatever the steps below happen to await (bounded: never hang)
            await asyncio.wait(self._tasks, timeout=5.0)
        await self.membership.stop()
        for ch, _ in self._channels.values():
            await ch.close()
        self._channels.clear()
        for what, step in (("block client", self.block_client.close), ("block server", self.block_server.stop)):
            try:
                await asyncio.wait_for(step(), 5.0)
            except Exception as e:  # shutting down: never hang on the transport
                log.warning("cluster: closing the %s failed: %s", what, e or type(e).__name__)

    @property
    def status(self) -> str:
        return self.membership.status if hasattr(self, "membership") else "starting"

    def live_ids(self) -> list[str]:
        return sorted(self.membership.members)

    # ------------------------------------------------------------- peers
    def _stub(self, address: str) -> pb_grpc.ClusterStub:
        got = self._channels.get(address)
        if got is None:
            if address not in self.cfg.peer_list and \
                    address not in {m.grpc_address for m in self.membership.members.values()}:
                raise KeyError(address)  # a peer that left (a call begun before): no channel is opened again
            ch = tls.peer_channel(address, self.creds)
            got = self._channels[address] = (ch, pb_grpc.ClusterStub(ch))
        return got[1]

    def _md(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    async def _probe(self, address: str) -> Member | None:
        r = await self._stub(address).NodeInfo(pb.NodeInfoRequest(), timeout=self.cfg.rpc_timeout,
                                                metadata=self._md())
        return Member(r.node_id, r.grpc_address or address, r.block_address,
                      tuple(sorted(r.capacity_bytes.items())), r.block_wire)

    def _on_members(self, members: dict[str, Member]) -> None:
        for node in self.table.nodes() - set(members):
            n = self.table.drop_node(node)
            log.info("cluster: %s left; dropped its %d directory entries", node, n)
        for peer in set(self.cost.links) - set(members):
            self.cost.forget(peer)
        for node, m in members.items():  # back with a new block address (restarted): the old link's figures
            if self._block_addresses.get(node, m.block_address) != m.block_address:  # and suspicion are not its
                log.info("cluster: %s moved its block transport to %s; probing its link again", node,
                         m.block_address or "-")
                self.cost.forget(node)
        self._block_addresses = {node: m.block_address for node, m in members.items()}
        for node, m in members.items():
            if not foreign_wire(m) or self._foreign.get(node) == m.wire:
                continue
            self._foreign[node] = m.wire
            log.warning("cluster: %s speaks block wire version %d, this daemon %d: its blocks are misses here "
                        "(kvstore_peer_fetch_failures_total{reason=\"wire_version\"}) until both run one version",
                        node, m.wire, WIRE_VERSION)
        self._tasks = [t for t in self._tasks if not t.done()]
        # channels and pooled endpoints to peers that left (a static peer's address is probed still);
        # a call in flight on a channel closed under it would raise CancelledError: let it end first
        keep = {m.grpc_address for m in members.values()} | set(self.cfg.peer_list)
        for address in set(self._channels) - keep:
            ch = self._channels.pop(address)[0]
            self._tasks.append(self._loop.create_task(ch.close(grace=self.cfg.rpc_timeout + 1.0)))
        self.block_client.retain({m.block_address for m in members.values() if m.block_address})
        if self.cfg.probe_links:
            for node, m in members.items():
                if node != self.node_id and node not in self.cost.links and m.block_address and not foreign_wire(m):
                    self.cost.link(node)  # seeded from config until the probe answers
                    self._tasks.append(self._loop.create_task(self._probe_link(m)))
        self.metrics.cluster_members(len(members), self.membership.healthy)
        self._sync_health()
        self._resync = True  # ownership moved: every owner gets a full inventory
        self._wake.set()

    async def _probe_link(self, m: Member) -> bool:
        """Seed the link's latency with an empty fetch's round trip (the peer
        token: a cluster call); whether it answered."""
        try:
            hdr = pb.BlockFetchHeader(node_id=self.node_id, credential=self.token).SerializeToString()
            best = None
            for _ in range(3):  # the first one pays for the connection: keep the fastest round trip
                t0 = time.perf_counter()
                res = await self.block_client.fetch(m.block_address, hdr, 0, lambda _l: [],
                                                    max(self.cfg.rpc_timeout, 2.0))
                if res.error is not None:  # (refused: this daemon's peer token is not the peer's admin token)
                    log.info("link probe of %s: %s", m.node_id, res.error)
                    return False
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            if best is not None and self.membership.members.get(m.node_id) == m:  # (not a peer since gone or moved)
                self.cost.set_link(m.node_id, latency_s=best, seed=True)  # real fetches refit it
            return True
        except Exception as e:
            log.debug("link probe of %s failed: %s", m.node_id, e)
            return False

    def _reprobe(self, peer: str) -> None:
        """Probe a suspect peer's link again (once at a time): cleared when it answers, else suspect anew."""
        m = self.membership.members.get(peer)
        if peer in self._probing or m is None or not m.block_address:
            return
        self._probing.add(peer)

        async def probe() -> None:
            try:
                ok = await self._probe_link(m)
            finally:
                self._probing.discard(peer)
            if self.membership.members.get(peer) == m:  # (a peer that left or changed has its link forgotten)
                if ok:
                    log.info("cluster: the link to %s answers again", peer)
                    self.cost.clear_suspect(peer)
                else:
                    self.cost.mark_suspect(peer)

        self._tasks.append(self._loop.create_task(probe()))

    async def _health_watch(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            self._sync_health()
            self.metrics.cluster_members(len(self.membership.members), self.membership.healthy)

    def _sync_health(self) -> None:
        ok = self.membership.healthy
        if ok != self._last_health:
            self._last_health = ok
            if self.health_fn is not None:
                self.health_fn(ok)

    # ----------------------------------------------------------- publish
    def _on_event(self, ev: Event) -> None:
        if ev.kind is EventKind.STORED:
            self._pending.append(("add", ev.ns_digest, ev.keys))
        elif ev.kind is EventKind.REMOVED:
            if ev.reason is not DropReason.MOVED:
                self._pending.append(("remove", ev.ns_digest, ev.keys))
        else:
            self._pending.append(("clear", ev.ns_digest, []))
        self._wake.set()

    def _block_bytes_of(self, digest: bytes) -> int:
        st = self.store
        ns = self._digest_ns.get(digest)
        if ns is None:
            for n in st.namespaces():
                self._digest_ns.setdefault(n.digest, n)
            ns = self._digest_ns.get(digest)
        return int(st.block_bytes(ns) or 0) if ns is not None else 0

    def _inventory(self) -> list[tuple[str, bytes, list[bytes]]]:
        """Every committed block of this node, per namespace, as add ops."""
        return [("add", digest, keys) for digest, keys in self.store.committed_blocks()]

    async def _publisher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.cfg.publish_interval if not self._resync else max(0.1, self.cfg.publish_interval))
            try:
                await self.flush()
            except Exception:
                log.exception("cluster: publishing to the directory failed")

    async def flush(self) -> None:
        """Send pending stored/removed events (or, after a membership change,
        the whole inventory) to the owners of their keys."""
        resync, owed = self._resync, self._owed - {self.node_id}
        self._owed = set()
        if resync:  # (a full resync covers what is owed)
            self._resync, owed = False, set()
            ops = self._inventory()
            self._pending.clear()
        else:
            ops, self._pending = self._pending, []
        if not ops and not resync and not owed:
            return
        ids = self.live_ids()
        per: dict[str, list[pb.DirectoryUpdate]] = {n: [] for n in ids} if resync else {}
        if owed:  # as plain adds (an owner answers only a resync), before the pending events
            self._route(per, ids, self._inventory(), owed)
        self._route(per, ids, ops)
        members = self.membership.members
        calls = []
        for node, ups in per.items():
            req = pb.PublishRequest(node_id=self.node_id, updates=ups, resync=resync)
            if node == self.node_id:
                self.apply(req)
            elif node in members:
                calls.append(self._publish_to(members[node], req))
        await asyncio.gather(*calls)

    def _route(self, per: dict[str, list[pb.DirectoryUpdate]], ids: list[str],
               ops: list[tuple[str, bytes, list[bytes]]], only: set[str] | None = None) -> None:
        """Append ``ops`` to ``per``, each key's update for its owner (among ``only``)."""
        for kind, digest, keys in ops:
            if kind == "clear":
                for n in ids:
                    per.setdefault(n, []).append(pb.DirectoryUpdate(ns_digest=digest, cleared=True))
                continue
            packed = pack_keys(keys)
            own = owners(packed, ids)
            arr = np.frombuffer(packed, np.uint8).reshape(-1, 16)
            bb = self._block_bytes_of(digest) if kind == "add" else 0
            for i in np.unique(own).tolist():
                if only is None or ids[i] in only:
                    per.setdefault(ids[i], []).append(pb.DirectoryUpdate(
                        ns_digest=digest, keys_packed=arr[own == i].tobytes(), removed=kind == "remove",
                        block_bytes=bb))

    async def _publish_to(self, m: Member, req: pb.PublishRequest) -> None:
        try:
            await self._stub(m.grpc_address).Publish(req, timeout=self.cfg.rpc_timeout, metadata=self._md())
        except KeyError:  # it left meanwhile: nothing to send it
            pass
        except grpc.RpcError as e:
            log.debug("publish to %s failed: %s", m.node_id, e)
            self._resync = True  # it missed updates: send it everything once it answers again
            self._wake.set()

    # ------------------------------------------------- directory (owner side)
    def apply(self, req: pb.PublishRequest) -> int:
        node = req.node_id
        if node != self.node_id and node not in self.membership.members:
            # not (yet, or no longer) a member here: its entries would never be
            # dropped. The publisher retries with a resync once views agree.
            from kvstore.errors import Unavailable

            raise Unavailable(f"{node!r} is not a live member in this daemon's view")
        if req.resync:
            self.table.drop_node(node)
            if node != self.node_id:  # its view changed or it restarted: it may have lost what it had from here
                self._owed.add(node)
                self._wake.set()
        n = 0
        for u in req.updates:
            if u.cleared:
                n += self.table.clear(node, u.ns_digest or None)
            elif u.removed:
                n += self.table.remove(node, u.ns_digest, split_keys(u.keys_packed))
            else:
                n += self.table.add(node, u.ns_digest, split_keys(u.keys_packed), u.block_bytes)
        return n

    def locate_local(self, digest: bytes, keys: Sequence[bytes]) -> pb.LocateResponse:
        holders = self.table.locate(keys)
        nodes = sorted(set().union(*holders)) if holders else []
        pos = {n: i for i, n in enumerate(nodes)}
        masks = [sum(1 << pos[n] for n in h if pos[n] < 64) for h in holders]
        return pb.LocateResponse(nodes=nodes, holders=masks, block_bytes=self.table.block_bytes.get(digest, 0))

    # ------------------------------------------------------------ lookup
    async def _locate(self, digest: bytes, keys: list[bytes]) -> tuple[list[set[str]], int]:
        """Holders of each key, asking each owner once."""
        self.locates += 1
        ids = self.live_ids()
        members = self.membership.members
        own = owners(pack_keys(keys), ids)
        holders: list[set[str]] = [set() for _ in keys]
        bb = 0

        async def ask(i: int) -> tuple[np.ndarray, pb.LocateResponse | None]:
            sel = np.nonzero(own == i)[0]
            sub = [keys[j] for j in sel.tolist()]
            node = ids[i]
            if node == self.node_id:
                return sel, self.locate_local(digest, sub)
            try:
                return sel, await self._stub(members[node].grpc_address).Locate(
                    pb.LocateRequest(ns_digest=digest, keys_packed=pack_keys(sub)),
                    timeout=self.cfg.rpc_timeout, metadata=self._md())
            except (grpc.RpcError, KeyError) as e:
                log.debug("locate at %s failed: %s", node, e)
                return sel, None

        for sel, resp in await asyncio.gather(*(ask(i) for i in np.unique(own).tolist())):
            if resp is None:
                continue
            bb = bb or int(resp.block_bytes)
            for j, mask in zip(sel.tolist(), resp.holders):
                holders[j] = {n for b, n in enumerate(resp.nodes) if mask >> b & 1}
        if bb:  # kept newest last: past 4,096 namespaces the one answered longest ago goes
            self.located_bb.pop(digest, None)
            self.located_bb[digest] = bb
            if len(self.located_bb) > 4096:
                self.located_bb.pop(next(iter(self.located_bb)))
        return holders, bb

    async def view(self, ns: Namespace, keys: Sequence[bytes], local: LookupResult, *,
                   to_hbm: bool = False, block_bytes: int = 0) -> ClusterView:
        """Where the rest of the chain after the local prefix is, and whether
        to fetch it: the longest run one live peer holds right after it."""
        out = ClusterView(local)
        n, hit = len(keys), local.hit_blocks
        if hit >= n or len(self.membership.members) < 2:
            self.metrics.cluster_decision("local")
            return out
        rest = list(keys[hit:])
        holders, bb = await self._locate(ns.digest, rest)
        members = self.membership.members
        live = set(members) - {self.node_id}
        best, run = None, 0
        holding = holders[0] & live
        for peer in [p for p in holding if foreign_wire(members[p])]:  # another block wire: a miss here
            self.metrics.peer_fetch_failed(peer, "wire_version")
            holding.discard(peer)
        for peer in {p for p in holding if not self.cost.suspect(p)} or holding:  # a suspect link last
            k = 0
            while k < len(rest) and peer in holders[k]:
                k += 1
            bb_peer = (bb or block_bytes) * k
            if k > run or (k == run and best is not None
                           and self.cost.transfer_s(peer, bb_peer) < self.cost.transfer_s(best, bb_peer)):
                best, run = peer, k
        if best is None:
            self.metrics.cluster_decision("local")
            return out
        return self._decide(out, ns, best, run, bb or self.store.block_bytes(ns) or block_bytes, to_hbm)

    def _decide(self, out: ClusterView, ns: Namespace, peer: str, run: int, bb: int, to_hbm: bool) -> ClusterView:
        """``out`` with the run of ``run`` blocks at ``peer`` after its local prefix, and the cost model's call."""
        hit = out.local.hit_blocks
        if self.cost.probe_due(peer):  # a suspect link's back-off has passed: still a miss until a probe answers
            self._reprobe(peer)
        out.remote_blocks, out.peer, out.block_bytes = run, peer, bb
        out.estimate = self.cost.decide(peer, run * bb, ns.model_id, run * ns.block_size, hit * ns.block_size,
                                        to_hbm)
        out.block_load_s = self.cost.transfer_s(peer, bb, to_hbm)
        self.metrics.cluster_decision(out.estimate.decision.label)
        return out

    def hinted(self, ns: Namespace, keys: Sequence[bytes], local: LookupResult, request: Any) -> ClusterView | None:
        """The view an earlier cluster Lookup's hint gives (``AcquireRequest.peer``: its peer and run),
        without locating the keys again; None when the hint no longer fits (the local prefix moved, the
        peer left). A stale peer costs what a stale directory entry does: the blocks come back absent."""
        peer, first, run = request.peer, int(request.peer_from), int(request.peer_blocks)
        bb = self.store.block_bytes(ns) or self.table.block_bytes.get(ns.digest, 0) or self.located_bb.get(ns.digest, 0)
        if not peer or not run or not bb or local.hit_blocks != first or first + run > len(keys) \
                or peer == self.node_id or peer not in self.membership.members:
            return None
        return self._decide(ClusterView(local), ns, peer, run, bb, request.to_hbm)

    async def fetch_for(self, request: Any, metadata: Any, ns: Namespace, keys: bytes | list[bytes]) -> tuple[int, int]:
        """Acquire's cluster step: fetch the remote run when that is cheaper.
        Returns (blocks fetched, wire ChainDecision)."""
        klist = keys if isinstance(keys, list) else split_keys(keys)
        local = self.store.peek(ns, klist)
        v = self.hinted(ns, klist, local, request) or await self.view(ns, klist, local, to_hbm=request.to_hbm)
        decision = int(v.estimate.decision) + 1
        if v.estimate.decision is not ChainDecision.FETCH:
            return 0, decision
        cred = ""
        for k, val in metadata or ():
            if k == "authorization" and val.startswith("Bearer "):
                cred = val[7:].strip()
        return await self.fetch(ns, klist, v, cred), decision

    # ------------------------------------------------------------- fetch
    async def fetch(self, ns: Namespace, keys: Sequence[bytes], view: ClusterView, credential: str) -> int:
        """Fetch the view's remote run into DRAM (``fetch_plan.RunFetch``: in
        pieces that each fit one request); returns blocks committed."""
        if view.peer is None or not view.remote_blocks:
            return 0
        m = self.membership.members.get(view.peer)
        if m is None or not m.block_address:
            self.metrics.peer_fetch_failed(view.peer, "gone")
            return 0
        if foreign_wire(m):
            self.metrics.peer_fetch_failed(view.peer, "wire_version")
            return 0
        hit = view.local.hit_blocks
        return await self.fetcher.fetch(ns, keys[hit:hit + view.remote_blocks], keys[hit - 1] if hit else None,
                                        view.peer, m.block_address, credential)


def foreign_wire(m: Member) -> bool:
    """Whether ``m`` names a block wire version other than this daemon's (0: it names none)."""
    return m.wire not in (0, WIRE_VERSION)


__all__ = ["ClusterNode", "ClusterView", "FETCH_OWNER", "transport_factory"]
