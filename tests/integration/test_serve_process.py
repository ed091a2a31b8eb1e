"""`kvstore serve` as a real subprocess: health, a real call, SIGTERM drains
in-flight calls and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np

from kvstore.client import Client
from kvstore.errors import KeyStatus
from kvstore.keys import Namespace, block_keys
from tests.integration.conftest import wait_healthy

NS = Namespace(tenant="acme", model_id="llama", block_size=16)


def test_serve_sigterm_drains_in_flight_calls(tmp_path, repo_root):
    sock = str(tmp_path / "kv.sock")
    env = dict(os.environ, KVSTORE_LOG_LEVEL="info")
    p = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--host", "", "--unix-socket", sock,
                          "--metrics-port", "0", "--dram", "64MiB"],
                         cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        target = f"unix:{sock}"
        wait_healthy(target, timeout=60)
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
        keys = block_keys(NS, np.arange(48 * 16) % 997)
        payloads = [np.full(512 * 1024, i, np.uint8) for i in range(len(keys))]
        with Client(target, use_shm=False) as c:
            assert c.put(NS, keys, payloads) == [KeyStatus.OK] * len(keys)
            got: list = []
            started = threading.Event()

            def slow_get() -> None:
                for i, chunk in c._stream_get(NS, keys):
                    started.set()
                    got.append(chunk)
                    threading.Event().wait(0.01)  # a slow reader keeps the call in flight

            t = threading.Thread(target=slow_get)
            t.start()
            assert started.wait(30)
            p.send_signal(signal.SIGTERM)
            t.join(60)
            assert len(got) == len(keys) and all(g.status == 0 for g in got)
        assert p.wait(60) == 0
        err = p.stderr.read()
        assert "draining" in err and "stopped" in err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
