"""The kvstore daemon: a thin grpc.aio layer over one ``TieredStore``.

``Daemon`` composes the three servicers (``KVStoreService``,
``AdminService``, ``ClusterService``, each in its own module) over one
shared ``DaemonState``; this module starts and stops it (``start``,
``Running``, ``serve``). Errors from the exception tree become status codes
through ``kvstore.wire.status`` (the one place they are mapped), in one RPC
wrapper (``kvstore.daemon.rpc``) shared with the same-host socket.

Security defaults: listens on 127.0.0.1 (or a Unix socket, mode 0600); with a
token configured every call needs ``authorization: Bearer <token>`` and the
caller's tenant comes from its token, never from the namespace it sends;
optional TLS.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.config import Config
from kvstore.core.store import TieredStore
from kvstore.daemon import peers, slab_owner, tls
from kvstore.daemon.admin_service import AdminService
from kvstore.daemon.cluster_service import ClusterService
from kvstore.daemon.decode import DecodeGuard, add_guarded
from kvstore.daemon.kv_service import KVStoreService
from kvstore.daemon.private import private_umask
from kvstore.errors import KVStoreError
from kvstore.daemon.state import PROTOCOL_VERSION, SESSION_MD, store_config
from kvstore.wire.convert import ns_from_pb
from kvstore.wire.status import STATUS_TABLE, status_for
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger("kvstore.daemon.server")


class Daemon(KVStoreService, AdminService, ClusterService):
    """The servicer of KVStore, Admin and Cluster, owning the store and
    sessions (their shared state is ``DaemonState``)."""


# ------------------------------------------------------------- running
@dataclass
class Running:
    server: grpc.aio.Server
    daemon: Daemon
    port: int
    health: health.HealthServicer
    address: str
    fast: Any = None  # the fast Lookup socket (kvstore.daemon.socket_server), if any

    async def stop(self, grace: float | None = None) -> None:
        self.health.enter_graceful_shutdown()
        if self.fast is not None:
            await self.fast.stop()
        if self.daemon.cluster is not None:
            cluster, self.daemon.cluster = self.daemon.cluster, None
            try:
                await cluster.stop()
            except Exception:
                log.exception("stopping the cluster node failed")
        await self.server.stop(grace)
        await self.daemon.stop_background()
        # /metrics goes once the drained calls have counted (their last scrape sees them) and before
        # serve's final SSD flush blocks this loop (a scrape then timed out as a stats error) and
        # the store closes; off the loop, so a scrape in progress still gets its snapshot
        await asyncio.to_thread(self.daemon.metrics.stop_http)
        slab_owner.forget(self.daemon.identity, self.daemon.store.dram.name)  # a clean stop leaves no slab


async def start(config: Config, store: TieredStore | None = None) -> Running:
    """Build and start the daemon's gRPC server on the running loop. When
    start fails (a port taken, a TLS file missing, the cluster unreachable),
    what it built goes again: the store it made (and so its slab in
    /dev/shm) is closed; a ``store`` passed in is left to its caller."""
    s = config.server
    opts = [("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=opts)
    daemon = Daemon(config, store)
    try:
        return await _start(config, server, daemon)
    except BaseException:
        await server.stop(0)
        await daemon.stop_background()
        if store is None:
            slab_owner.forget(daemon.identity, daemon.store.dram.name)
            daemon.store.close()
        raise


async def _start(config: Config, server: grpc.aio.Server, daemon: Daemon) -> Running:
    s = config.server
    # undecodable request bytes: INVALID_ARGUMENT and one rate-limited log line per peer (decode.py);
    # counted and timed once per call, like the calls that decode (kvstore/daemon/rpc.py)
    guard = daemon.decode_guard = DecodeGuard(
        daemon.metrics.refused,
        authenticate=lambda context: daemon.auth.principal(context.invocation_metadata()))
    add_guarded(server, pb_grpc.add_KVStoreServicer_to_server, daemon, guard)
    add_guarded(server, pb_grpc.add_AdminServicer_to_server, daemon, guard)
    add_guarded(server, pb_grpc.add_ClusterServicer_to_server, daemon, guard)
    hs = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = (pb.DESCRIPTOR.services_by_name["KVStore"].full_name,
             pb.DESCRIPTOR.services_by_name["Admin"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    creds = tls.server_credentials(s)  # None with TLS off; mutual TLS with server.tls_client_ca_file
    port = 0
    address = ""
    if s.host:
        address = f"{s.host}:{s.port}" if ":" not in s.host else f"[{s.host}]:{s.port}"
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        address = f"{s.host}:{port}"
    if s.unix_socket:
        uaddr = f"unix:{s.unix_socket}"
        with private_umask():  # bound here: 0600 from the start, whatever the operator's umask
            server.add_secure_port(uaddr, creds) if creds else server.add_insecure_port(uaddr)
        address = address or uaddr
    await server.start()
    fast = None
    if s.unix_socket:
        os.chmod(s.unix_socket, 0o600)
    if s.lookup_socket != "off":
        fast = await start_socket(daemon, s.lookup_socket, s.unix_socket)
    for n in names[:2]:
        hs.set(n, health_pb2.HealthCheckResponse.SERVING)
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    daemon.start_background()
    running = Running(server, daemon, port, hs, address, fast)
    if config.cluster.mode.value != "off":
        await start_cluster(running, config)
    return running


async def start_socket(daemon: Daemon, path: str, unix_socket: str) -> Any:
    """The same-host socket (kvstore.daemon.socket_server), on by default: at
    ``path``, else beside ``unix_socket``, else in a private directory of the
    daemon's user. None (logged) when it cannot be opened: the daemon still
    serves gRPC."""
    from kvstore.daemon.socket_server import LookupSocketServer, default_path

    try:
        fast = LookupSocketServer(daemon, path or default_path(unix_socket))
        await fast.start()
    except (OSError, KVStoreError) as e:
        if path:
            raise
        log.warning("no same-host socket (%s): same-host clients use gRPC for every call", e)
        return None
    daemon.lookup_socket = fast.path
    return fast


async def start_cluster(running: Any, config: Config) -> None:
    """Join the cluster once the daemon's gRPC server runs (its address is
    the default node id); the health service's ``kvstore.v1.Cluster`` entry
    follows the membership source."""
    from grpc_health.v1 import health_pb2

    svc = pb.DESCRIPTOR.services_by_name["Cluster"].full_name
    hs = running.health
    addr = running.address if not running.address.startswith("unix:") else f"127.0.0.1:{running.port}"
    node = peers.ClusterNode(running.daemon, config, addr)

    def health(ok: bool) -> None:
        hs.set(svc, health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING)

    node.health_fn = health
    if not running.daemon.auth.enabled:  # only with cluster.allow_insecure_unauthenticated (config.py)
        peers.log.warning("INSECURE: cluster mode %s with auth off (cluster.allow_insecure_unauthenticated): any "
                          "host that reaches this node's gRPC port or UCX block port (ucxx listens on every "
                          "interface) can read every tenant's blocks (docs/security.md)", config.cluster.mode.value)
    try:
        await node.start()
    except BaseException:
        await running.stop(0)
        raise
    running.daemon.cluster = node


def shutdown_transport() -> None:
    """At process exit: stop the UCX notifier thread (it would keep the
    process alive) once every daemon of the process has stopped."""
    import sys

    ucx = sys.modules.get("transport.ucx")
    if ucx is not None and hasattr(ucx, "shutdown"):
        try:
            ucx.shutdown()
        except Exception:
            peers.log.exception("shutting UCX down failed")


def serve(config: Config) -> int:
    """Run the daemon until SIGTERM/SIGINT; drain in-flight calls; return 0."""
    return asyncio.run(_serve(config))


async def _serve(config: Config) -> int:
    t0 = time.perf_counter()
    running = await start(config)
    d = running.daemon
    mport = None
    if config.metrics.port:
        try:
            _, mport = d.metrics.start_http(config.metrics.host, config.metrics.port)
        except Exception:
            await running.stop(0)
            d.store.close()
            raise
    rec = d.store.recovery
    if rec is not None:
        log.info("ssd tier at %s: recovered %d blocks (%d bytes) in %.3fs; dropped %d unusable records",
                 d.store.ssd.tier.path if d.store.ssd else "?", rec.blocks, rec.bytes, rec.seconds, rec.dropped)
    log.info("kvstore serving on %s (dram %d bytes in %s, policy %s, auth %s, metrics %s) in %.2fs",
             running.address, d.store.dram.capacity_bytes, d.store.dram.path, d.store.policy.name.value,
             "on" if d.auth.enabled else "off", f"{config.metrics.host}:{mport}" if mport else "off",
             time.perf_counter() - t0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining (up to %.1fs)", config.server.drain_seconds)
    await running.stop(config.server.drain_seconds)
    if d.store.ssd is not None:
        t1 = time.perf_counter()
        written, left = d.store.flush()
        log.info("flushed %d dram-only blocks to ssd in %.2fs (%d left dram-only)", written,
                 time.perf_counter() - t1, left)
    d.store.close()
    if config.cluster.mode.value != "off":
        shutdown_transport()
    log.info("stopped")
    return 0


__all__ = ["Daemon", "PROTOCOL_VERSION", "Running", "SESSION_MD", "STATUS_TABLE", "ns_from_pb", "serve", "start",
           "start_cluster", "start_socket", "shutdown_transport", "status_for", "store_config"]
