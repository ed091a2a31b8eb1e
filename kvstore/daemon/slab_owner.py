"""Which slab a daemon identity owns, so that a restart finds what a crashed
predecessor left in ``/dev/shm`` (issue 19, item 4).

A daemon's DRAM slab is a file in ``/dev/shm``; a SIGKILLed daemon cannot
unlink it, so a crash loop would fill host memory. Each daemon with a stable
identity (its SSD directory, else its Unix socket, else its fixed TCP
address; a daemon on port 0 with neither has none) records its pid and slab
name in a small state file, ``/dev/shm/kvstore.owner-<uid>-<digest of the
identity>`` (mode 0600). A daemon starting with the same identity reads it
and, when that pid is gone, removes the predecessor's slab before it makes
its own. (Adopting the slab, i.e. serving its blocks again, is not built:
the slab has no per-slot metadata to rebuild the DRAM index from;
docs/reliability.md.) Any daemon starting also removes what this user's
other dead daemons left (``sweep_dead``): the slab of a daemon with no
identity, and the slab and owner file of an identity that never starts
again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re

from kvstore.config import Config

log = logging.getLogger("kvstore.daemon.server")

SHM_DIR = "/dev/shm"
_SLAB_NAME = re.compile(r"^kvstore-[0-9]+-[0-9]+-[0-9a-f]+$")


def identity(config: Config) -> str:
    """The daemon's stable identity ("" when it has none)."""
    if config.ssd.capacity:
        return "ssd:" + os.path.realpath(str(config.ssd.resolved_path()))
    s = config.server
    if s.unix_socket:
        return "unix:" + os.path.realpath(s.unix_socket)
    if s.host and s.port:
        return f"tcp:{s.host}:{s.port}"
    return ""


def state_path(ident: str) -> str:
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return os.path.join(SHM_DIR, f"kvstore.owner-{os.getuid()}-{digest}")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (also when it belongs to another
    user) and is not a zombie (killed, not yet reaped by its parent: its
    files are as good as abandoned)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def read_owner(path: str) -> tuple[int, int, str]:
    """An owner file's (file owner's uid, daemon pid, slab name); raises
    OSError, ValueError, KeyError or TypeError when it cannot be read."""
    uid = os.stat(path).st_uid
    with open(path) as f:
        doc = json.load(f)
    return uid, int(doc["pid"]), str(doc["slab"])


def reclaim_predecessor(ident: str, configured: str = "") -> str | None:
    """Remove the slab of a dead daemon that had this identity; returns its
    name (None when there was nothing to remove). ``configured``: the
    ``dram.shm_name`` in use, also accepted as a slab name."""
    if not ident:
        return None
    path = state_path(ident)
    try:
        uid, pid, name = read_owner(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("slab owner file %s unreadable (%s); ignored", path, e)
        return None
    # only our own file, naming one of our slabs, of a process that is gone
    if uid != os.getuid() or not (_SLAB_NAME.match(name) or (configured and name == configured and "/" not in name)) or pid == os.getpid() or pid_alive(pid):
        return None
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("could not remove the slab %s of dead daemon %d: %s", name, pid, e)
        return None
    log.warning("removed the slab %s left by daemon %d (it died without closing it)", name, pid)
    return name


def sweep_dead(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove what this user's dead daemons left in ``shm_dir``, whatever
    their identity: slabs named ``kvstore-<uid>-<pid>-<hex>`` whose pid is
    gone, and owner files whose daemon is gone and whose slab was such a
    name (removed with it). A daemon with no stable identity (TCP port 0,
    no Unix socket, no SSD directory) has no successor to reclaim its slab,
    and an identity that never starts again left its owner file for good;
    any daemon of the user starting now removes both. An owner file naming
    a configured ``dram.shm_name`` is left to its identity's successor
    (``reclaim_predecessor``). Returns the names removed."""
    uid, me = os.getuid(), os.getpid()
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    owners = f"kvstore.owner-{uid}-"
    for name in names:
        if name.startswith(owners) and "." not in name[len(owners):]:  # (not a .tmp being written)
            try:
                who, pid, slab = read_owner(os.path.join(shm_dir, name))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if who != uid or pid == me or pid_alive(pid) or not _SLAB_NAME.match(slab):
                continue
            victims: tuple[str, ...] = (slab, name)
        elif _SLAB_NAME.match(name) and name.split("-")[1] == str(uid):
            pid = int(name.split("-")[2])
            if pid == me or pid_alive(pid):
                continue
            victims = (name,)
        else:
            continue
        for v in victims:
            try:
                if os.stat(os.path.join(shm_dir, v)).st_uid == uid:
                    os.unlink(os.path.join(shm_dir, v))
                    removed.append(v)
            except OSError:  # gone already (listed twice: as a slab and in its owner file), or not ours
                pass
    if removed:
        log.warning("removed %d file(s) that dead daemons left in %s: %s", len(removed), shm_dir,
                    ", ".join(sorted(removed)[:8]) + (" ..." if len(removed) > 8 else ""))
    return removed


def record(ident: str, slab: str) -> None:
    """Write this daemon's pid and slab name for its successors."""
    if not ident:
        return
    path = state_path(ident)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "slab": slab, "identity": ident}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("slab owner file %s not written: %s", path, e)


def forget(ident: str, slab: str) -> None:
    """At a clean stop: remove the state file if it still names ``slab``."""
    if not ident:
        return
    path = state_path(ident)
    try:
        with open(path) as f:
            if json.load(f).get("slab") == slab:
                os.unlink(path)
    except (OSError, ValueError, AttributeError):
        pass
