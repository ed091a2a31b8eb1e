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
import ssl

import grpc

from kvstore.config import Config, ConfigError, ServerConfig

log = logging.getLogger("kvstore.daemon.tls")


def _read(path: str, key: str = "") -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        if not key:
            raise
        raise ConfigError(f"{key}: {path} cannot be read: {e.strerror or e}", key=key) from None


def check_server_files(s: ServerConfig) -> None:
    """ConfigError naming the key when the TLS files cannot serve: grpc takes
    any bytes and then fails to listen with "Failed to bind to address",
    which points at the port instead."""
    for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        if getattr(s, key):
            _read(getattr(s, key), f"server.{key}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(s.tls_cert_file, s.tls_key_file, password=lambda: b"")
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"server.tls_cert_file / server.tls_key_file ({s.tls_cert_file}, {s.tls_key_file}): "
                          f"not a PEM certificate chain and its unencrypted private key: {e}",
                          key="server.tls_cert_file") from None
    if s.tls_client_ca_file:
        try:
            ctx.load_verify_locations(cafile=s.tls_client_ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"server.tls_client_ca_file ({s.tls_client_ca_file}): not a PEM CA bundle: {e}",
                              key="server.tls_client_ca_file") from None


def server_credentials(s: ServerConfig) -> grpc.ServerCredentials | None:
    """The gRPC server's credentials; None with TLS off. ConfigError naming
    the key when a file cannot be read or used."""
    if not s.tls_cert_file:
        return None
    check_server_files(s)
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
