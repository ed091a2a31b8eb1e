"""A real etcd (Debian's ``etcd-server``) on 127.0.0.1 with random ports and
a temporary data dir, for the cluster tests; killed after."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Etcd:
    def __init__(self) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            pytest.skip("etcd is not installed (make test installs Debian's etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="kvstore-etcd-")
        self.client_port, self.peer_port = _port(), _port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.exe = exe
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [self.exe, "--name", "t", "--data-dir", os.path.join(self.dir, "data"),
             "--listen-client-urls", c, "--advertise-client-urls", c,
             "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
             "--initial-cluster", f"t={p}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{c}/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("etcd did not become healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def etcd():
    e = Etcd()
    yield e
    e.close()
