"""Servers that start children of their own (a vLLM API server starts its
engine core and workers): each runs in its own process group, and stopping
or killing it signals the whole group, so no engine is left behind, orphaned
and spinning, when the server is killed (SIGKILL of the server alone leaves
its engine core running).

A SIGKILLed vLLM leaves its message queue's shared memory behind
(``/dev/shm/psm_*``, ``/dev/shm/sem.mp-*``: Python's ``multiprocessing``
unlinks them only on a clean exit). Killing or stopping a group removes the
ones its processes had mapped, and no other file."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

__all__ = ["group_alive", "group_shm", "kill_group", "start_group", "stop_group"]

SHM_DIR = "/dev/shm"
LEFT_BY_KILL = ("psm_", "sem.mp-")
"""Names of the shared-memory files a killed ``multiprocessing`` user leaves."""


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


def group_pids(pgid: int) -> list[int]:
    """The processes of group ``pgid`` (from ``/proc``)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after the command name, which may hold spaces
        if len(fields) > 2 and int(fields[2]) == pgid:
            out.append(int(name))
    return out


def group_shm(pgid: int) -> set[str]:
    """The ``LEFT_BY_KILL`` files of ``SHM_DIR`` that processes of group
    ``pgid`` have mapped. Matched by inode: a named semaphore is mapped under
    the temporary name glibc gave it before linking it to its own (the
    mapping's path says "(deleted)")."""
    inodes = set()
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
                inodes.add(int(parts[4]))
    found = set()
    with os.scandir(SHM_DIR) as it:
        for e in it:
            if e.name.startswith(LEFT_BY_KILL) and e.inode() in inodes:
                found.add(e.path)
    return found


def unlink_all(paths: set[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def kill_group(p: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Signal every process of ``p``'s group (the group outlives its leader);
    with SIGKILL, reap ``p`` and remove the shared memory the group had
    mapped (``group_shm``)."""
    left = group_shm(p.pid) if sig == signal.SIGKILL else set()
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        p.wait(30)
        unlink_all(left)


def stop_group(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """SIGTERM each group and wait up to ``timeout`` per server; then SIGKILL
    every group, whether or not its leader exited (children may remain), and
    remove the shared memory the groups had mapped before the SIGTERM."""
    left = set().union(*(group_shm(p.pid) for p in procs))
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
    unlink_all(left)
