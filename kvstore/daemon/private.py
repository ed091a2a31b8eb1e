"""Files and sockets private to the daemon's user.

A Unix socket takes its mode from the process's umask when it is bound; a
``chmod`` after that leaves a window in which, with a umask of ``002`` or
``000``, the group or everyone could connect, and keep the connection (a
gRPC channel lives on) after the ``chmod``. ``private_umask`` closes it:
a socket or file created inside is ``0600`` from the start. The umask is
the process's, so a file another thread creates meanwhile is made
stricter, never looser; the daemon binds its sockets at start, before its
background threads run, and creates no directory inside.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.errors import Unavailable

__all__ = ["PRIVATE_UMASK", "private_dir", "private_umask"]

PRIVATE_UMASK = 0o177
"""Group and others get nothing; the owner no execute bit (sockets and files)."""


@contextmanager
def private_umask() -> Iterator[None]:
    """Inside, files and sockets are created private to this user."""
    old = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(old)


def private_dir() -> str:
    """A directory only the daemon's user may enter (mode 0700, owned by it):
    ``$XDG_RUNTIME_DIR/kvstore`` when that variable names such a directory,
    else ``<tmp>/kvstore-<uid>``. Created when missing; a directory of
    another owner or open to others is refused (Unavailable), never used."""
    uid = os.getuid()
    run = os.environ.get("XDG_RUNTIME_DIR", "")
    base = os.path.join(run, "kvstore") if run and os.path.isdir(run) else \
        os.path.join(tempfile.gettempdir(), f"kvstore-{uid}")
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) & 0o077:
        raise Unavailable(f"{base} is not a private directory of uid {uid} (mode 0700): "
                          "no same-host socket; set server.lookup_socket")
    return base
