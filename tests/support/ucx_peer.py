"""A ``transport.ucx_peer`` process for the UCX integration tests (a
BlockServer serving views of a deterministic slab, driven over its stdin),
and their shared helpers. Nothing here imports ucxx: the ``peer`` fixture
(tests/integration/conftest.py) skips without it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLAB = 16 << 20
KIB = 1 << 10
ENV = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", UCX_TLS="tcp,self")
os.environ.setdefault("UCX_TLS", "tcp,self")


class PeerProc:
    def __init__(self, port: int = 0, max_requests: int = 0, max_wait: float = 0.0) -> None:
        more = ["--max-requests", str(max_requests)] if max_requests else []
        more += ["--max-wait", str(max_wait)] if max_wait else []
        self.p = subprocess.Popen([sys.executable, "-m", "transport.ucx_peer", "--port", str(port),
                                   "--slab-mib", str(SLAB >> 20), *more], cwd=ROOT, env=ENV, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.p.wait(5)}")
        self.address: str = json.loads(line)["address"]
        self.port = int(self.address.rsplit(":", 1)[1])

    def cmd(self, op: str) -> dict[str, Any]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps({"op": op}) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def stats(self) -> dict[str, Any]:
        return self.cmd("stats")

    def signal(self, sig: int) -> None:
        os.kill(self.p.pid, sig)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                os.kill(self.p.pid, signal.SIGCONT)
                self.cmd("stop")
                self.p.wait(10)
            except (OSError, ValueError, subprocess.TimeoutExpired, json.JSONDecodeError):
                self.p.kill()
                self.p.wait(10)


async def poll(pred, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.02)
