"""``slab_owner.sweep_dead``: what dead daemons of this user left in
``/dev/shm`` (slabs, owner files) goes when any daemon starts; nothing of a
live process, of another user, or a configured slab name is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvstore.daemon.slab_owner import sweep_dead

UID = os.getuid()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: no such process now
    return p.pid


def owner(d, digest: str, pid: int, slab: str) -> str:
    name = f"kvstore.owner-{UID}-{digest}"
    (d / name).write_text(json.dumps({"pid": pid, "slab": slab, "identity": "tcp:127.0.0.1:1"}))
    return name


def test_sweep_removes_what_dead_daemons_left_and_keeps_the_rest(tmp_path):
    dead, live = dead_pid(), os.getppid()
    gone = [f"kvstore-{UID}-{dead}-0a1b2c3d",  # a port-0 daemon's slab: no owner file names it
            f"kvstore-{UID}-{dead}-00ff00ff"]  # named by an owner file too
    kept = [f"kvstore-{UID}-{live}-0a1b2c3d",  # a live daemon's slab
            f"kvstore-{UID}-{os.getpid()}-0a1b2c3d",  # this process's own
            f"kvstore-{UID + 1}-{dead}-0a1b2c3d",  # another uid in the name
            f"kvstore-stage-{UID}-{dead}-0a1b2c3d",  # not a slab name (the socket server sweeps these)
            "my-configured-slab", f"kvstore-{UID}-{dead}"]
    for n in gone + kept:
        (tmp_path / n).write_bytes(b"\0" * 64)
    gone.append(owner(tmp_path, "0000000000000001", dead, gone[1]))
    gone.append(owner(tmp_path, "0000000000000002", dead, f"kvstore-{UID}-{dead}-deadbeef"))  # slab gone already
    kept.append(owner(tmp_path, "0000000000000003", live, kept[0]))  # alive
    kept.append(owner(tmp_path, "0000000000000004", dead, "my-configured-slab"))  # left to its successor
    kept.append(f"kvstore.owner-{UID}-0000000000000005.{dead}.tmp")  # a state file being written
    (tmp_path / kept[-1]).write_text("{")
    kept.append(f"kvstore.owner-{UID}-0000000000000006")
    (tmp_path / kept[-1]).write_text("not json")  # unreadable: left alone
    removed = sweep_dead(str(tmp_path))
    assert sorted(removed) == sorted(gone)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert sweep_dead(str(tmp_path)) == []  # nothing more on a second pass


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a file of another user")
def test_sweep_leaves_another_users_files(tmp_path):
    dead = dead_pid()
    name = f"kvstore-{UID}-{dead}-0a1b2c3d"
    (tmp_path / name).write_bytes(b"x")
    os.chown(tmp_path / name, 12345, 12345)
    assert sweep_dead(str(tmp_path)) == []
    assert os.listdir(tmp_path) == [name]


def test_sweep_of_a_missing_directory_is_a_no_op(tmp_path):
    assert sweep_dead(str(tmp_path / "none")) == []
