"""The fault suite's clean-up of SIGKILLed daemons' slabs removes only
theirs. A dead daemon's pid is free for the next process (pid_max 32768
wraps within minutes on a busy CI host): a later process with that pid
(another test run's pytest hosting an in-process daemon) has a live slab
with the same ``kvstore-<uid>-<pid>-`` prefix, and unlinking it makes every
client that attaches afterwards fail to map it (ENOENT: "no shared-memory
slab")."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

from tests.faults.faultlib import KilledSlabs


def _slab(pid: int) -> str:
    name = f"kvstore-{os.getuid()}-{pid}-{secrets.token_hex(4)}"
    with open(os.path.join("/dev/shm", name), "wb") as f:
        f.write(bytes(64))
    return name


def test_a_slab_made_later_under_a_reused_pid_is_kept() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    killed = KilledSlabs()
    own = _slab(p.pid)  # the daemon's slab (its default name)
    later = ""
    try:
        killed.note(p.pid)
        p.kill()
        p.wait(30)
        later = _slab(p.pid)  # the next process given this pid made its own
        removed = killed.remove()
        assert own in removed and not os.path.exists(os.path.join("/dev/shm", own))
        assert later not in removed and os.path.exists(os.path.join("/dev/shm", later))
    finally:
        p.kill()
        for n in (own, later):
            if n and os.path.exists(os.path.join("/dev/shm", n)):
                os.unlink(os.path.join("/dev/shm", n))
