"""A server killed with its process group (tests/support/procs.py) leaves no
shared memory behind: a SIGKILLed ``multiprocessing`` user (vLLM's message
queue) cannot unlink its ``/dev/shm/psm_*`` and ``sem.mp-*`` files, so ``kill_group`` removes
the ones the group had mapped, and no other."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing.shared_memory import SharedMemory

from tests.support.procs import SHM_DIR, group_alive, group_shm, kill_group, start_group

CHILD = ("import multiprocessing as mp, multiprocessing.shared_memory as s, time\n"
         "m = s.SharedMemory(create=True, size=1 << 16)\n"
         "lock = mp.get_context('spawn').Lock()  # a named semaphore, kept while the process lives\n"
         "print(m.name, lock._semlock.name, flush=True)\n"
         "time.sleep(600)\n")


def test_killed_group_leaves_no_shared_memory_and_keeps_others() -> None:
    p = start_group([sys.executable, "-c", CHILD], stdout=subprocess.PIPE)
    mine = SharedMemory(create=True, size=4096)  # this process's, not the group's: it stays
    try:
        assert p.stdout is not None
        shm, sem = p.stdout.readline().decode().split()
        path, sem_path = os.path.join(SHM_DIR, shm), os.path.join(SHM_DIR, "sem." + sem.lstrip("/"))
        assert os.path.exists(path) and os.path.exists(sem_path)
        found = group_shm(p.pid)
        assert found >= {path, sem_path}
        assert os.path.join(SHM_DIR, mine.name.lstrip("/")) not in found
        kill_group(p)
        assert not os.path.exists(path) and not os.path.exists(sem_path)
        assert os.path.exists(os.path.join(SHM_DIR, mine.name.lstrip("/")))
    finally:
        if group_alive(p):
            kill_group(p)
        if p.stdout is not None:
            p.stdout.close()
        mine.close()
        mine.unlink()
