"""A daemon whose start fails (a port taken, a TLS file missing) leaves
nothing behind: its slab and owner file in /dev/shm were made before the
failure and used to stay until another daemon's start swept them."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any, Iterator

import pytest

from kvstore.config import ConfigError, load_config
from kvstore.daemon import server


def _shm_files() -> set[str]:
    uid = os.getuid()
    return {n for n in os.listdir("/dev/shm")
            if n.startswith((f"kvstore-{uid}-{os.getpid()}-", f"kvstore.owner-{uid}-"))}


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _fails_to_start(overrides: dict[str, Any]) -> None:
    config = load_config(None, {}, {"metrics.port": 0, "dram.capacity": "16MiB", **overrides})
    before = _shm_files()
    with pytest.raises((OSError, RuntimeError, ConfigError)):
        asyncio.run(server.start(config))
    assert _shm_files() - before == set()


def test_port_taken_leaves_no_slab(taken_port: int) -> None:
    _fails_to_start({"server.port": taken_port})  # a fixed address: an owner file too


def test_missing_tls_key_leaves_no_slab(tmp_path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not used: the key is read first\n")
    _fails_to_start({"server.port": 0, "server.tls_cert_file": str(cert),
                     "server.tls_key_file": str(tmp_path / "missing.key")})


def test_dram_capacity_beyond_dev_shm_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    """The slab is a sparse file in /dev/shm: a dram.capacity larger than
    /dev/shm can back was accepted (a resize to it is refused), and the put
    that found tmpfs full would have killed the daemon with SIGBUS."""
    from kvstore.tools.cli import main

    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    before = _shm_files()
    config = load_config(None, {}, {"server.port": 0, "metrics.port": 0, "dram.capacity": too_big})
    with pytest.raises(ConfigError, match="dram.capacity") as exc:
        asyncio.run(server.start(config))
    assert exc.value.key == "dram.capacity"
    assert main(["serve", "--port", "0", "--metrics-port", "0", "--dram", str(too_big)]) == 2
    err = capsys.readouterr().err
    assert "dram.capacity" in err and "/dev/shm" in err and "Traceback" not in err
    assert _shm_files() - before == set()


def test_unusable_tls_files_are_a_config_error_naming_the_key(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """A TLS file that is not PEM (or a key that is not the certificate's)
    made grpc fail to listen with "Failed to bind to address 127.0.0.1:P"
    (exit 1), which points at the port; a missing one gave a bare errno."""
    from kvstore.tools.cli import main
    from tests.support.tls import make_ca

    ca = make_ca(tmp_path / "ca")
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM\n")
    cases = [
        ({"server.tls_cert_file": str(junk), "server.tls_key_file": str(junk)}, "server.tls_cert_file"),
        ({"server.tls_cert_file": ca.cert, "server.tls_key_file": str(tmp_path / "nope.key")},
         "server.tls_key_file"),
        ({"server.tls_cert_file": ca.cert, "server.tls_key_file": ca.key, "server.tls_client_ca_file": str(junk)},
         "server.tls_client_ca_file"),
    ]
    before = _shm_files()
    for overrides, key in cases:
        config = load_config(None, {}, {"server.port": 0, "metrics.port": 0, "dram.capacity": "16MiB", **overrides})
        with pytest.raises(ConfigError, match=key) as exc:
            asyncio.run(server.start(config))
        assert exc.value.key == key
    argv = ["serve", "--port", "0", "--metrics-port", "0", "--dram", "16MiB"]
    env = {"KVSTORE_SERVER_TLS_CERT_FILE": str(junk), "KVSTORE_SERVER_TLS_KEY_FILE": str(junk)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "server.tls_cert_file" in err and "bind" not in err
    assert _shm_files() - before == set()


def test_admin_config_shows_the_running_capacity_and_policy(make_daemon) -> None:
    """`kvstore admin config` "prints the whole running tree": after a resize
    and a policy switch it still printed the capacity and policy of start."""
    import tomllib

    from kvstore.client import Client

    d = make_daemon(dram__capacity="8MiB", dram__page_size="1MiB")
    with Client(d.target, use_shm=False) as c:
        c.admin_resize("dram", 4 << 20)
        c.admin_set_policy("lfu")
        running = tomllib.loads(c.admin_get_config())
    assert running["dram"]["capacity"] == "4MiB"
    assert running["eviction"]["policy"] == "lfu"
    assert d.config.dram.capacity == 8 << 20  # the config read at start is unchanged
