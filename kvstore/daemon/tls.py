"""TLS for the daemon's gRPC: the server's credentials (mutual TLS when
``server.tls_client_ca_file`` is set) and the credentials its peer channels
use (docs/security.md, "Between daemons").

A peer channel follows the server's configuration: with TLS on it is a TLS
channel that checks the peer's certificate against ``cluster.tls_ca_file``
(else ``server.tls_client_ca_file``, else the system roots) and presents this
daemon's own certificate (so peers that require client certificates accept
it); with TLS off it is a plain channel, and a peer token sent over it to a
host that is not this one crosses the network in clear (warned at start).
"""

from __future__ import annotations

import ipaddress
import logging

import grpc

from kvstore.config import Config, ServerConfig

log = logging.getLogger("kvstore.daemon.tls")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(s: ServerConfig) -> grpc.ServerCredentials | None:
    """The gRPC server's credentials; None with TLS off."""
    if not s.tls_cert_file:
        return None
    ca = _read(s.tls_client_ca_file) if s.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(_read(s.tls_key_file), _read(s.tls_cert_file))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def peer_credentials(config: Config) -> grpc.ChannelCredentials | None:
    """Credentials of the channels to peers; None with TLS off."""
    s, c = config.server, config.cluster
    if not s.tls_cert_file:
        return None
    ca_file = c.tls_ca_file or s.tls_client_ca_file
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file) if ca_file else None,
                                        private_key=_read(s.tls_key_file), certificate_chain=_read(s.tls_cert_file))


def peer_channel(address: str, creds: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    """An asyncio channel to a peer's gRPC address."""
    if creds is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, creds)


def is_local(address: str) -> bool:
    """Whether a ``host:port`` address is this host (loopback or a Unix socket)."""
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]") or address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_clear_token(config: Config, token: str, peers: list[str]) -> None:
    """Warn when a peer token would cross the network without TLS."""
    if token and not config.server.tls_cert_file:
        remote = [p for p in peers if not is_local(p)]
        if remote or config.cluster.mode.value == "etcd":
            log.warning("cluster: TLS is off, so the peer token goes to %s in clear; configure "
                        "server.tls_cert_file/tls_key_file on every node (docs/security.md)",
                        ", ".join(remote) or "the etcd members")
