"""Servers that start children of their own (a vLLM API server starts its
engine core and workers): each runs in its own process group, and stopping
or killing it signals the whole group, so no engine is left behind, orphaned
and spinning, when the server is killed (SIGKILL of the server alone leaves
its engine core running)."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

__all__ = ["group_alive", "kill_group", "start_group", "stop_group"]


def start_group(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen`` in a new session (its own process group)."""
    return subprocess.Popen(argv, start_new_session=True, **kw)


def group_alive(p: subprocess.Popen[bytes]) -> bool:
    """Whether any process of ``p``'s group still exists."""
    try:
        os.killpg(p.pid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_group(p: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Signal every process of ``p``'s group (the group outlives its leader);
    with SIGKILL, reap ``p``."""
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        p.wait(30)


def stop_group(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """SIGTERM each group and wait up to ``timeout`` per server; then SIGKILL
    every group, whether or not its leader exited (children may remain)."""
    for p in procs:
        if p.poll() is None:
            kill_group(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        kill_group(p)
