"""Two vLLM OpenAI servers ("a", "b") with the kvstore connector, each with its
own ``kvstore serve`` daemon, for the fleet benches (bench/pd.py,
bench/route.py). Every server runs in its own process group and is stopped
as a group (``tests.support.procs``); the servers themselves start as the
fleet tests start theirs (``tests.support.vllm_servers``)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx
from benchlib import free_port, wait_serving

from tests.support.procs import start_group, stop_group
from tests.support.vllm_servers import (
    ROOT,
    kv_transfer_config,
    make_tiny_model,
    records,
    start_server,
    vllm_env,
    wait_servers,
)

NAMES = ("a", "b")


@dataclass
class BenchFleet:
    work: str
    model: str = ""
    daemons: dict[str, str] = field(default_factory=dict)
    """Backend name -> its daemon's gRPC target."""
    urls: dict[str, str] = field(default_factory=dict)
    """Backend name -> its vLLM server's base URL."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        """For every process of the fleet (``/reset_prefix_cache`` needs vLLM's dev mode)."""
        return vllm_env(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", UCX_WARN_UNUSED_ENV_VARS="n")

    def stats_path(self, n: str) -> str:
        return os.path.join(self.work, f"{n}.jsonl")

    def records(self, n: str) -> list[dict[str, Any]]:
        """Backend ``n``'s connector stats lines."""
        return records(self.stats_path(n))

    def start_daemon(self, n: str, argv: list[str], env: dict[str, str]) -> None:
        """``kvstore serve`` (``argv``: its options) for backend ``n``, on a free port."""
        port = free_port()
        self.daemons[n] = f"127.0.0.1:{port}"
        with open(os.path.join(self.work, f"daemon-{n}.log"), "wb") as log:
            self.procs.append(start_group([sys.executable, "-m", "kvstore", "serve", "--port", str(port),
                                           "--metrics-port", "0", *argv],
                                          env=env, stdout=subprocess.DEVNULL, stderr=log))

    def launch(self, daemon_argv: list[str], connector: dict[str, Any], env: dict[str, str] | None = None,
              stats: bool = True) -> None:
        """The tiny model, a daemon and a vLLM server per backend; returns
        when all serve. ``connector``: more extra config for each connector
        (its ``target`` is set here, and with ``stats`` its ``stats_path``)."""
        env = env if env is not None else self.env()
        self.model = make_tiny_model(os.path.join(self.work, "tiny"))
        for n in NAMES:
            self.start_daemon(n, daemon_argv, env)
        for t in self.daemons.values():
            wait_serving(t, 120, self.procs)
        ncpu = os.cpu_count() or 1
        servers = {}
        for core, n in enumerate(NAMES):
            port = free_port()
            self.urls[n] = f"http://127.0.0.1:{port}"
            # one core each (as two machines would be), when there are two
            benv = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(core % ncpu) if ncpu >= 2 else "nobind"}
            extra = {**connector, "target": self.daemons[n]}
            if stats:
                extra["stats_path"] = self.stats_path(n)
            ktc = kv_transfer_config(**extra)
            log_path = os.path.join(self.work, f"vllm-{n}.log")
            proc = start_server(self.model, port, ktc, log_path, benv, max_model_len=4096)
            self.procs.append(proc)
            servers[f"vLLM {n}"] = (self.urls[n], proc, log_path)
        wait_servers(servers, 1200)

    def start_router(self, name: str, settings: list[str], tables: list[str], block_size: int
                     ) -> tuple[subprocess.Popen[bytes], str]:
        """``kvstore route`` in front of the fleet (both backends, the tiny
        model): ``settings`` are top-level TOML lines, ``tables`` more
        sections; returns once it answers ``/health``."""
        port = free_port()
        lines = [f'listen = "127.0.0.1:{port}"', *settings]
        for n in NAMES:
            lines += ["[[backend]]", f'name = "{n}"', f'url = "{self.urls[n]}"', f'daemon = "{self.daemons[n]}"']
        lines += ["[[model]]", 'name = "tiny"', f'path = "{self.model}"', f"block_size = {block_size}",
                  'kv_dtype = "float32"', 'dtype = "float32"', 'device = "cpu"', 'kv_cache_layout = "LBHNC"', *tables]
        path = os.path.join(self.work, f"router-{name}.toml")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        log_path = os.path.join(self.work, f"router-{name}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "router", "--config", path, "--log-level", "warning"],
                                    env={**os.environ, "PYTHONPATH": ROOT}, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_servers({f"router {name}": (url, proc, log_path)}, 120)
        return proc, url

    def reset(self) -> None:
        """Start cold: daemons cleared, vLLM prefix caches reset."""
        from kvstore.client import Client

        for t in self.daemons.values():
            with Client(t, use_shm=False, session=False) as c:
                c.clear()
        for url in self.urls.values():
            httpx.post(f"{url}/reset_prefix_cache", timeout=30)

    def stop(self) -> None:
        """SIGTERM every process group (a vLLM server's engine core is in its
        server's), then SIGKILL what is left."""
        stop_group(list(reversed(self.procs)))
