"""The daemon's side of the shared index (layout and reader:
kvstore/wire/shared_index.py).

``SharedIndex.start`` moves the key table and the index columns a lookup
reads into files under ``/dev/shm`` (``BlockIndex.share``: they are grown
there from then on) and hooks the store lock (``StoreLock.on_take`` /
``on_give``): the sequence turns odd when a thread comes to hold the lock
and even when it lets go, so a reader knows when what it read may be torn.
Before the sequence turns even again, arrays that moved to new files
(growth, a rehash) are named in the header under a new generation, and the
files they left are unlinked (a reader still mapping one keeps a valid,
stale copy and sees the generation change).

Not started (clients then ask the daemon for every lookup) when the native
helper is not built, or when DRAM admission is on (its frequency sketch
counts the keys of every lookup, which clients cannot send cheaply).
Files of daemons that died without stopping are removed at start (their
names carry the pid).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
import secrets
from typing import Any

import numpy as np

from kvstore.core.ssd_io import StoreLock
from kvstore.core.store import TieredStore
from kvstore.daemon.slab_owner import pid_alive
from kvstore.wire.shared_index import (ARRAYS, FILE_NAME, HEADER_BYTES, LAYOUT, MAGIC, NAME_BYTES, NAMES_AT,
                                       SHM_DIR, load_native)

log = logging.getLogger("kvstore.daemon.shared_index")


def sweep_stale(shm_dir: str = SHM_DIR, pattern: re.Pattern[str] = FILE_NAME) -> int:
    """Remove shared-index files (or other files named by ``pattern``,
    ``kvstore-<what>-<uid>-<pid>-...``) of this user's daemons that are gone."""
    uid = str(os.getuid())
    removed = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        if not pattern.fullmatch(name):
            continue
        parts = name.split("-")
        if parts[2] != uid or pid_alive(int(parts[3])):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed += 1
        except OSError:
            pass
    return removed


_DTYPES = {name: np.dtype(dt) for name, dt in ARRAYS}


class SharedIndex:
    """Publishes a store's lookup columns; see the module docstring."""

    def __init__(self, store: TieredStore, lock: StoreLock, shm_dir: str = SHM_DIR) -> None:
        native = load_native()
        if native is None:
            raise OSError("kvstore._native is not built")
        self._begin, self._end = native.seq_begin, native.seq_end
        self.store = store
        self.lock = lock
        self.dir = shm_dir
        self.prefix = f"kvstore-idx-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(shm_dir, self.prefix + ".hdr")
        self._seq = itertools.count(1)
        self._files: dict[str, np.ndarray] = {}
        """Every array file of ours that exists, by name."""
        self._current: tuple[np.ndarray, ...] = ()
        self.failed = False
        self.closed = False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, HEADER_BYTES)
            self._map = mmap.mmap(fd, HEADER_BYTES)
        finally:
            os.close(fd)
        self.hdr = np.frombuffer(self._map, dtype="<u8")
        self.hdr[2] = MAGIC
        self.hdr[4] = LAYOUT

    # ------------------------------------------------------------- arrays
    def alloc(self, name: str, length: int, dtype: str) -> np.ndarray:
        """A new array in a file of its own (``BlockIndex.share``'s alloc);
        after ``close`` a plain numpy array (nobody reads it any more).
        OSError for a column whose dtype is not the one the readers assume
        (``ARRAYS``): the index is then not shared."""
        if self.closed:
            return np.empty(int(length), dtype=dtype)
        want = _DTYPES.get(name)
        if want is not None and np.dtype(dtype) != want:
            raise OSError(f"index column {name!r} is {np.dtype(dtype)}, the shared layout says {want}: not shared")
        fname = f"{self.prefix}.{next(self._seq)}"
        nbytes = max(1, int(length)) * np.dtype(dtype).itemsize
        fd = os.open(os.path.join(self.dir, fname), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            m = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        arr = np.frombuffer(m, dtype=dtype, count=int(length))
        self._files[fname] = arr
        return arr

    def _arrays(self) -> tuple[np.ndarray, ...]:
        idx = self.store.index
        return (idx.key_table,) + tuple(getattr(idx, col) for col, _ in ARRAYS[1:])

    # ------------------------------------------------------------ publish
    def start(self) -> None:
        """Move the arrays into shared memory, publish, hook the lock."""
        sweep_stale(self.dir)
        with self.lock:
            try:
                self.store.index.share(self.alloc)
            except OSError:
                self.close()  # (columns already moved stay valid: their files are only unlinked)
                raise
            self._begin(self.hdr)
            self._publish()
            self._end(self.hdr)
            self.lock.on_take = self._take
            self.lock.on_give = self._give

    def _take(self) -> None:
        self._begin(self.hdr)

    def _give(self) -> None:
        """The holder lets go: name moved arrays, then make the sequence even.
        Never raises (it runs in the lock's release): a failure stops the
        sharing for good (clients then ask the daemon)."""
        try:
            if not self.failed:
                cur = self._arrays()
                if len(cur) != len(self._current) or any(a is not b for a, b in zip(cur, self._current)):
                    self._publish()
        except Exception:
            log.exception("shared index: publishing failed; clients ask the daemon from now on")
            self.failed = True
            self.hdr[3] = 1
        self._end(self.hdr)

    def _publish(self) -> None:
        cur = self._arrays()
        names = []
        for arr in cur:
            name = next((n for n, a in self._files.items() if a is arr), None)
            if name is None:
                raise RuntimeError("an index array is not in shared memory")
            names.append(name)
        raw = b"".join(n.encode("ascii").ljust(NAME_BYTES, b"\0") for n in names)
        self._map[NAMES_AT : NAMES_AT + len(raw)] = raw
        self.hdr[1] = self.hdr[1] + np.uint64(1)
        self._current = cur
        keep = set(names)
        for name in [n for n in self._files if n not in keep]:
            del self._files[name]
            try:
                os.unlink(os.path.join(self.dir, name))
            except OSError:
                pass

    # -------------------------------------------------------------- close
    def close(self) -> None:
        """Readers stop (``closed``), the hooks go, every file is removed."""
        self.closed = True
        if self.lock.on_give == self._give:
            self.lock.on_take = None
            self.lock.on_give = None
        self.hdr[3] = 1
        for name in [self.prefix + ".hdr", *self._files]:
            try:
                os.unlink(os.path.join(self.dir, name))
            except OSError:
                pass
        self._files.clear()

    def stats(self) -> dict[str, Any]:
        return {"path": self.path, "generation": int(self.hdr[1]), "files": len(self._files)}
