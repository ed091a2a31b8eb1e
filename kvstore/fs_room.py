"""Room left on a file system: one answer for the start checks
(kvstore/daemon/state.py), resizes (kvstore/core/resize.py) and the DRAM
slab's growth (tiers/dram.py), so each refuses a capacity the same way."""

from __future__ import annotations

import os


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still take on the file system that
    holds ``path`` (``statvfs``: ``f_bavail * f_frsize``; blocks kept for
    root do not count). ``path`` must exist (OSError otherwise)."""
    st = os.statvfs(path)
    return int(st.f_bavail) * int(st.f_frsize)
