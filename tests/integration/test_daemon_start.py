"""A daemon whose start fails (a port taken, a TLS file missing) leaves
nothing behind: its slab and owner file in /dev/shm were made before the
failure and used to stay until another daemon's start swept them."""

from __future__ import annotations

import asyncio
import logging
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


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """``cmd_serve`` points the root logger at ``sys.stderr``, which in these
    tests is pytest's capture: left there, later tests' log lines (the
    router's health checks) hit the closed capture ("Logging error ... I/O
    operation on closed file" in CI's output). Put the root logger back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            root.removeHandler(h)
    root.handlers[:] = handlers
    root.setLevel(level)


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


def _start_expecting_refusal(config: Any, key: str) -> None:
    async def go() -> None:
        running = await server.start(config)  # (on the current code: started, and stopped again)
        await running.stop(0)

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as exc:
        asyncio.run(go())
    assert exc.value.key == key


def test_ssd_capacity_beyond_its_disk_is_refused_at_start(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """An ssd.capacity larger than the directory's file system can hold was
    accepted, and writes failed later with ENOSPC (CapacityError) once the
    disk filled; start now refuses it, naming ssd.capacity and the figures,
    as it refuses a dram.capacity /dev/shm cannot back."""
    from kvstore.tools.cli import main

    path = tmp_path / "ssd"
    st = os.statvfs(tmp_path)
    too_big = st.f_bavail * st.f_frsize + (1 << 40)
    before = _shm_files()
    config = load_config(None, {}, {"server.port": 0, "metrics.port": 0, "dram.capacity": "16MiB",
                                    "ssd.capacity": too_big, "ssd.path": str(path), "ssd.sync": False})
    _start_expecting_refusal(config, "ssd.capacity")
    assert main(["serve", "--port", "0", "--metrics-port", "0", "--dram", "16MiB", "--ssd", str(too_big),
                 "--ssd-path", str(path)]) == 2
    err = capsys.readouterr().err
    assert "ssd.capacity" in err and str(path) in err and "Traceback" not in err
    assert _shm_files() - before == set()


def test_ssd_capacity_counts_the_tiers_own_files_as_room(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the tier's directory already holds (blocks of an earlier run)
    is room for the capacity too, not only the file system's free space:
    here 1 MiB free and 4 MiB of segments allow 4 MiB and refuse 6 MiB."""
    from kvstore.daemon import state
    from kvstore.tools.cli import main

    path = tmp_path / "ssd"
    path.mkdir()
    with open(path / "seg-000000000001.kvs", "wb") as f:  # an earlier run's blocks: 4 MiB on disk
        f.write(b"\1" * (4 << 20))
        f.flush()
        os.fsync(f.fileno())
    real = os.statvfs

    class Full:
        f_bavail, f_frsize = 256, 4096  # 1 MiB free

    monkeypatch.setattr(state.os, "statvfs", lambda p: Full() if str(p).startswith(str(tmp_path)) else real(p))
    fits = load_config(None, {}, {"server.port": 0, "metrics.port": 0, "dram.capacity": "16MiB",
                                  "ssd.capacity": "4MiB", "ssd.path": str(path), "ssd.sync": False})
    state.check_ssd_room(fits)
    refused = load_config(None, {}, {"server.port": 0, "metrics.port": 0, "dram.capacity": "16MiB",
                                     "ssd.capacity": "6MiB", "ssd.path": str(path), "ssd.sync": False})
    with pytest.raises(ConfigError, match=r"ssd\.capacity") as exc:
        state.check_ssd_room(refused)
    assert exc.value.key == "ssd.capacity"
    assert main(["serve", "--port", "0", "--metrics-port", "0", "--dram", "16MiB", "--ssd", "6MiB",
                 "--ssd-path", str(path)]) == 2



def test_stop_leaves_no_task_of_the_daemon_pending(tmp_path) -> None:
    """A daemon's stop ends its own tasks (the reaper, the tier worker): it
    used to cancel them without waiting, so a loop closed right after (an
    in-process daemon's) destroyed them pending ("Task was destroyed but it
    is pending! ... DaemonState._tier_worker()")."""
    config = load_config(None, {}, {"server.port": 0, "metrics.port": 0, "dram.capacity": "16MiB",
                                    "ssd.capacity": "8MiB", "ssd.path": str(tmp_path / "ssd")})

    async def run() -> list[str]:
        before = asyncio.all_tasks()
        running = await server.start(config)
        try:
            assert {t for t in asyncio.all_tasks() - before if not t.done()} - {asyncio.current_task()}
        finally:
            await running.stop(0)
            running.daemon.store.close()
        return [repr(t) for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]

    assert asyncio.run(run()) == []


def test_stop_stops_the_metrics_endpoint() -> None:
    """The daemon's ``/metrics`` HTTP endpoint was never stopped: it lived
    until the process exited (a scrape during the final SSD flush counted a
    stats error; an in-process daemon leaked its listening port and thread).
    The daemon's stop closes it: the port refuses connections and its
    serving thread has ended."""
    import threading
    import urllib.request

    config = load_config(None, {}, {"server.port": 0, "metrics.port": 0, "dram.capacity": "16MiB"})

    async def main() -> tuple[int, threading.Thread | None]:
        running = await server.start(config)
        try:
            _, port = running.daemon.metrics.start_http("127.0.0.1", 0)
            thread = running.daemon.metrics.http_thread
            url = f"http://127.0.0.1:{port}/metrics"
            # the scrape snapshots the store on this loop: fetch it from another thread
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
            assert b"kvstore_tier_capacity_bytes" in body
        finally:
            await running.stop(0)
            running.daemon.store.close()
        assert running.daemon.metrics.http_port is None
        return port, thread

    port, thread = asyncio.run(main())
    assert thread is not None and not thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
