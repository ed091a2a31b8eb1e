"""The ``[cluster]`` section of the daemon's config (kept apart from
``kvstore/config.py`` to keep that module small; ``kvstore.config``
re-exports both names)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, ClassVar

from kvstore.config_fields import Duration, Port, Section, bounds

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ClusterMode(StrEnum):
    """Membership sources ``cluster.mode`` may name."""

    OFF = "off"
    STATIC = "static"
    ETCD = "etcd"


@dataclass(slots=True, frozen=True)
class ClusterConfig(Section):
    """Other daemons: membership, block directory, peer fetch and its cost
    model (docs/cluster.md)."""

    SECTION: ClassVar[str] = "cluster"

    mode: ClusterMode = ClusterMode.OFF
    """off (one daemon alone), static (cluster.peers) or etcd (cluster.etcd_endpoint)."""
    node_id: str = ""
    """This daemon's name in the cluster; empty: its gRPC address."""
    peers: str = ""
    """static mode: gRPC addresses of the other daemons, comma-separated."""
    etcd_endpoint: str = "127.0.0.1:2379"
    """etcd mode: host:port of an etcd v3 endpoint."""
    etcd_prefix: str = "/kvstore"
    """etcd mode: key prefix of this cluster's member records."""
    lease_ttl: Duration = 5.0
    """etcd mode: a member whose lease is not renewed for this long is gone."""
    block_host: str = "127.0.0.1"
    """Address the block transport (UCX) listens on."""
    block_port: Port = 0
    """Port of the block transport; 0 picks a free one."""
    fetch_timeout: Duration = 2.0
    """Deadline of one block fetch from a peer; past it the blocks are misses."""
    rpc_timeout: Duration = 0.5
    """Deadline of a directory call (Locate, Publish) or a probe."""
    probe_interval: Duration = 1.0
    """static mode: how often peers are probed for liveness."""
    publish_interval: Duration = 0.05
    """Stored/removed events are batched this long before they go to the owners."""
    peer_latency: Duration = 50e-6
    """Seed of a peer link's latency in the cost model (a probe replaces it)."""
    peer_bandwidth_gbps: Annotated[float, bounds(1e-6, None)] = 100.0
    """Seed of a peer link's bandwidth, Gb/s (measured transfers update it)."""
    peer_max_requests: Annotated[int, bounds(1, 1 << 20)] = 64
    """Block requests one peer connection may have served here at once; more are refused
    (the fetcher sees a miss) until one ends."""
    peer_max_connections: Annotated[int, bounds(1, 1 << 16)] = 256
    """Block transport connections open here at once, from all peers together (each holds a 1 MiB
    receive buffer; a fetcher keeps one per peer); one more is closed at once (its fetch is a miss)."""
    probe_links: bool = True
    """Measure each new peer's round trip with an empty fetch."""
    peer_backoff: Duration = 5.0
    """A peer whose block transport timed out or failed is a miss (recompute) at once for this long,
    then probed again with an empty fetch; fetches resume once a probe answers. 0: no back-off."""
    h2d_bandwidth_gbytes: Annotated[float, bounds(1e-6, None)] = 25.0
    """Host-to-device copy bandwidth, GB/s (targets in HBM)."""
    prefill_tokens_per_s: Annotated[float, bounds(0, None)] = 0.0
    """Recompute speed for models without shape or table; 0: the daemon's TTFT predictor (seeded from
    admission.prefill_tokens_per_s, learned from reported TTFTs)."""
    prefill_tflops: Annotated[float, bounds(0, None)] = 0.0
    """Useful TFLOP/s of one rank's prefill for models with a shape in models_file; 0: use tokens/s."""
    fetch_margin: Annotated[float, bounds(0, None)] = 0.1
    """Fetch only when transfer * (1 + margin) <= recompute."""
    models_file: str = ""
    """TOML with [model."<model_id>"] shapes and/or prefill tables (docs/cluster.md)."""
    peer_token_env: str = ""
    """Environment variable holding the bearer token this daemon sends to peers
    (cluster RPCs need an admin token when peers have auth on)."""
    tls_ca_file: str = ""
    """PEM CA bundle that peers' server certificates are checked against when
    server TLS is on; empty: server.tls_client_ca_file, else the system roots.
    Peer calls present this daemon's own certificate (mutual TLS)."""
    allow_insecure_unauthenticated: bool = False
    """Allow cluster mode with auth off (no server.tenants_file, auth_token_file
    or auth_token_env). INSECURE: then anyone who reaches this node's gRPC or
    UCX block port can read every tenant's blocks. Only for a closed network
    or a test."""

    def _validate(self) -> None:
        if self.mode is ClusterMode.STATIC and not self.peers.strip():
            self._fail("peers", "is empty: static mode needs the other daemons' gRPC addresses")
        if self.peer_token_env and not _ENV_NAME_RE.match(self.peer_token_env):
            self._fail("peer_token_env", f"invalid value {self.peer_token_env!r}: expected an "
                       "environment variable name")
        if self.fetch_timeout <= 0 or self.rpc_timeout <= 0:
            self._fail("fetch_timeout", "fetch_timeout and rpc_timeout must be > 0")
        if self.peer_backoff < 0:
            self._fail("peer_backoff", f"must be >= 0s, got {self.peer_backoff:g}s")
        if self.lease_ttl < 1:
            self._fail("lease_ttl", "must be >= 1s (etcd leases have whole seconds)")

    @property
    def peer_list(self) -> list[str]:
        return [p.strip() for p in self.peers.split(",") if p.strip()]


__all__ = ["ClusterConfig", "ClusterMode"]
