"""A throw-away certificate authority for TLS tests, made with the ``openssl``
command line (no Python crypto package needed): a self-signed CA and a
certificate it signs for 127.0.0.1/localhost, usable as a server and as a
client certificate (mutual TLS)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TestCA", "make_ca"]


@dataclass(frozen=True)
class TestCA:
    ca: str
    """PEM of the CA certificate."""
    cert: str
    """PEM of a certificate for IP 127.0.0.1 and DNS localhost, signed by the CA."""
    key: str
    """Its private key (PEM)."""

    def read(self, which: str) -> bytes:
        return Path(getattr(self, which)).read_bytes()


def _run(args: list[str], cwd: Path) -> None:
    subprocess.run(args, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)


def make_ca(where: Path, name: str = "node") -> TestCA:
    """A CA and one certificate signed by it, written under ``where``.
    Skips the calling test when ``openssl`` is not installed."""
    import pytest

    exe = shutil.which("openssl")
    if exe is None:
        pytest.skip("needs the openssl command line to make a test CA")
    where.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    if not (where / "ca.pem").exists():
        _run([exe, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
              "-subj", "/CN=kvstore test CA"], where)
    _run([exe, "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}"], where)
    (where / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                       "extendedKeyUsage=serverAuth,clientAuth\n")
    _run([exe, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
          "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext"], where)
    return TestCA(str(where / "ca.pem"), str(where / f"{name}.pem"), str(where / f"{name}.key"))
