"""Shared pieces of the fault-injection suite: settings from ``KVSTORE_FAULT_*``
variables, the figures the tests measure, a real ``kvstore serve``
subprocess, and process probes (RSS, open fds, /dev/shm).

Figures: every test records what it measured with :func:`record`; the
suite's conftest prints them at the end of the run and, when
``KVSTORE_FAULT_JSON`` names a file, writes them there as JSON (what
``bench/faults.py`` reads)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil

from tests.integration.conftest import wait_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FIGURES: dict[str, dict[str, Any]] = {}
"""test area -> {figure name: value}, in the order recorded."""


def setting(name: str, default: float) -> float:
    """``KVSTORE_FAULT_<NAME>`` as a number, else ``default`` (the CI setting)."""
    raw = os.environ.get(f"KVSTORE_FAULT_{name.upper()}", "")
    return float(raw) if raw.strip() else default


def isetting(name: str, default: int) -> int:
    return int(setting(name, default))


def record(area: str, **figures: Any) -> None:
    """Record measured figures of one area (later values of a name win)."""
    FIGURES.setdefault(area, {}).update(figures)
    path = os.environ.get("KVSTORE_FAULT_JSON", "")
    if path:  # written as we go: a crash later still leaves what was measured
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(FIGURES, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, path)


def summary_lines() -> list[str]:
    out = []
    for area, figs in FIGURES.items():
        out.append(f"{area}:")
        for k, v in figs.items():
            out.append(f"    {k:<34} {v:.4g}" if isinstance(v, float) else f"    {k:<34} {v}")
    return out


# ---------------------------------------------------------------- processes
def rss_bytes(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def anon_bytes(pid: int) -> int:
    """Private (anonymous) resident bytes: RSS without the mapped slab and files."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss_bytes(pid)


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def shm_entries(prefix: str = "kvstore-") -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def slabs_of(pid: int) -> set[str]:
    """The /dev/shm slabs a daemon with this pid created (its default name):
    other processes on the machine may have theirs."""
    return shm_entries(f"kvstore-{os.getuid()}-{pid}-")


class KilledSlabs:
    """The slabs of the daemons a test SIGKILLs, removed at its end. Named
    while each daemon is alive (``note``, before the kill): once it is dead
    its pid is free, and the next process given it (pid_max 32768 wraps in
    minutes on a busy CI host; another test run's pytest hosting a daemon)
    makes its own live slab under the same ``kvstore-<uid>-<pid>-`` prefix,
    which must not be removed (its clients would then fail to map it)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def note(self, pid: int) -> None:
        """Daemon ``pid`` (alive now) will be killed: its slabs, by name."""
        self.names |= slabs_of(pid)

    def remove(self) -> set[str]:
        """Unlink what the noted daemons left; returns the names removed."""
        removed = set()
        for n in self.names:
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except FileNotFoundError:
                continue  # a successor with the same identity removed it already
            removed.add(n)
        return removed


class Serve:
    """``python -m kvstore serve`` on a Unix socket (a real process to
    SIGKILL, measure and shut down)."""

    def __init__(self, sock: str, *args: str, env: dict[str, str] | None = None,
                 stderr: Any = subprocess.DEVNULL, metrics: bool = False) -> None:
        self.sock = sock
        self.target = f"unix:{sock}"
        self.metrics_port = free_port() if metrics else 0
        # the daemon refuses unknown KVSTORE_* variables: the suite's own stay here
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_FAULT_")}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--host", "", "--unix-socket", sock,
             "--metrics-port", str(self.metrics_port), *args],
            cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_healthy(self, timeout: float = 90.0) -> "Serve":
        t_end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore serve exited with {self.proc.returncode}")
            try:
                wait_healthy(self.target, timeout=min(2.0, deadline_left(t_end)))
                return self
            except TimeoutError:
                if time.monotonic() >= t_end:
                    raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def op_seconds(self) -> dict[str, tuple[int, float]]:
        """Daemon-side service time per RPC from its /metrics: op -> (count, seconds)."""
        import re
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out: dict[str, list[float]] = {}
        for m in re.finditer(r'^kvstore_op_seconds_(count|sum)\{op="(\w+)"\} (\S+)$', text, re.M):
            out.setdefault(m.group(2), [0.0, 0.0])[0 if m.group(1) == "count" else 1] = float(m.group(3))
        return {k: (int(v[0]), v[1]) for k, v in out.items()}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Sampler:
    """Samples a process's RSS in the background (peak and last)."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        import threading

        self.pid, self.every = pid, every
        self.peak = self.last = rss_bytes(pid)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.last = rss_bytes(self.pid)
            except (psutil.Error, OSError):
                return
            self.peak = max(self.peak, self.last)

    def stop(self) -> int:
        self._stop.set()
        self._t.join(5)
        return self.peak


def mib(n: float) -> float:
    return round(n / (1 << 20), 1)


def deadline_left(t_end: float) -> float:
    return max(0.0, t_end - time.monotonic())
