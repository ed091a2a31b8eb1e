"""The SSD tier's directory (see tiers/ssd.py): creating and checking it
(0700, the ``SCHEMA`` marker), atomic rewrites of its small files, the
RocksDB index's files (0600), and the ``namespaces`` file of namespace
descriptors (atomic rewrite, xxh3 trailer).

Directory 0700, files 0600: ``SCHEMA`` (any other schema is refused, never
reinterpreted), ``LOCK`` (flock), ``namespaces`` (atomic rewrite, xxh3
trailer), ``index/`` (RocksDB, raw mode: ``b"b"`` + loc (8 B big-endian) ->
segment, offset, identity) and ``seg-NNNNNNNNNNNN.kvs``: records of an 88-byte
header (magic, version, parent length, size, write sequence, xxh3_64,
namespace digest, key, parent key, header xxh3) + payload, so a lost index is
rebuilt from the segments.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import struct

import numpy as np
import rocksdict

from kvstore.errors import InvalidArgument
from tiers.ssd_format import (
    CLOEXEC,
    INDEX_DIR,
    LOCK_FILE,
    NAMESPACES_FILE,
    NS_MAGIC,
    SCHEMA_FILE,
    SCHEMA_MAGIC,
    SCHEMA_VERSION,
    SEG_RE,
    FileLayer,
    io_error,
    record_checksum,
    write_all,
)

log = logging.getLogger("kvstore.ssd")


def files_bytes(path: str) -> int:
    """Bytes on disk (du) of everything under an SSD tier's directory
    ``path``: segments with their preallocated room, index, small files;
    0 where it does not exist yet."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # removed since listed
                pass
    return total


class SsdDirectory:
    """Where the tier's files live, and how its small files are written."""

    def __init__(self, path: str, fs: FileLayer, sync: bool) -> None:
        self.path = path
        self.fs = fs
        self.sync = sync

    def prepare(self) -> None:
        """Create the directory (0700) with its schema marker, or check the marker."""
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        os.chmod(self.path, 0o700)
        marker = os.path.join(self.path, SCHEMA_FILE)
        try:
            with open(marker, "rb") as f:
                lines = f.read(4096).decode("utf-8", "replace").splitlines()
        except FileNotFoundError:
            stray = sorted(n for n in os.listdir(self.path) if not n.endswith(".tmp") and n != LOCK_FILE)
            if stray:
                raise InvalidArgument(f"{self.path} is not empty and has no {SCHEMA_FILE} marker: not a kvstore "
                                      f"SSD directory (found {stray[:3]}); refusing to use it") from None
            self.write_small(marker, f"{SCHEMA_MAGIC}\nschema {SCHEMA_VERSION}\n".encode())
            return
        m = re.fullmatch(r"schema (\d+)", lines[1].strip()) if len(lines) >= 2 else None
        if lines[0].strip() != SCHEMA_MAGIC or m is None:
            raise InvalidArgument(f"{marker} is not a kvstore SSD schema marker; refusing to open {self.path}")
        if int(m.group(1)) != SCHEMA_VERSION:
            raise InvalidArgument(
                f"SSD directory {self.path} has schema {m.group(1)}, this kvstore reads only schema "
                f"{SCHEMA_VERSION}; refusing to reinterpret it (use a matching kvstore or another directory)")

    def segments(self) -> dict[int, int]:
        """The segment files (id as named -> size); leftover ``.tmp`` files
        are removed (one whose unlink fails is left, logged, for a later open:
        it never costs the tier)."""
        found = {}
        for name in os.listdir(self.path):
            if m := SEG_RE.match(name):
                found[int(m.group(1))] = os.stat(os.path.join(self.path, name)).st_size
            elif name.endswith(".tmp"):
                try:
                    self.fs.unlink(os.path.join(self.path, name))
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("ssd: leftover %s could not be removed (%s); left for a later open", name, e)
        return found

    def write_small(self, path: str, data: bytes) -> None:
        """Atomically replace a small file: tmp, fdatasync, rename, fsync dir."""
        fd = self.fs.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | CLOEXEC, 0o600)
        try:
            write_all(self.fs, fd, [np.frombuffer(data, np.uint8)], 0)
            self.fs.fdatasync(fd)
        finally:
            self.fs.close(fd)
        self.fs.rename(path + ".tmp", path)
        self.sync_dir()

    def small_files_bytes(self) -> int:
        """Bytes on disk of everything but the segments: small files and the index (du)."""
        total = 0
        for sub in ("", INDEX_DIR, INDEX_DIR + ".corrupt"):
            root = os.path.join(self.path, sub)
            if os.path.isdir(root):
                for e in os.scandir(root):
                    if e.is_file(follow_symlinks=False) and not SEG_RE.match(e.name):
                        try:
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                        except FileNotFoundError:  # removed since listed (RocksDB's own threads delete files)
                            pass
        return total

    def trim_fd(self, fd: int, size: int) -> None:
        """Give back a segment's disk room past ``size`` (its preallocated,
        unwritten tail: ``ftruncate`` to the size it has). A failure only
        leaves the room allocated; it is logged."""
        try:
            self.fs.ftruncate(fd, size)
        except OSError as exc:
            log.warning("ssd segment: could not give back its preallocated room: %s", exc)

    def trim(self, path: str) -> None:
        """``trim_fd`` for a segment file not open (at open, the one a stopped run was writing)."""
        try:
            fd = self.fs.open(path, os.O_RDWR | CLOEXEC)
        except OSError as exc:
            log.warning("ssd segment %s: could not open it to give back its room: %s", path, exc)
            return
        try:
            self.trim_fd(fd, os.fstat(fd).st_size)
        finally:
            self.fs.close(fd)

    def sync_dir(self) -> None:
        if self.sync:
            fd = self.fs.open(self.path, os.O_RDONLY | CLOEXEC)
            try:
                self.fs.fsync(fd)
            finally:
                self.fs.close(fd)

    def open_db(self) -> rocksdict.Rdict:
        o = rocksdict.Options(raw_mode=True)
        o.create_if_missing(True)
        o.set_keep_log_file_num(2)
        o.set_write_buffer_size(16 << 20)
        db = rocksdict.Rdict(os.path.join(self.path, INDEX_DIR), o)
        try:
            self.private_index()
        except BaseException:  # (an open handle keeps RocksDB's lock: a rebuild could not open the index)
            self.close_db(db)
            raise
        return db

    @staticmethod
    def close_db(db: rocksdict.Rdict | None) -> None:
        """Close ``db`` (if any) on a failure path: an error closing it is not raised."""
        if db is not None:
            try:
                db.close()
            except Exception:  # noqa: BLE001 - absent or broken
                pass

    def private_index(self) -> None:
        path = os.path.join(self.path, INDEX_DIR)
        os.chmod(path, 0o700)
        for e in os.scandir(path):
            if e.is_file(follow_symlinks=False):
                try:
                    os.chmod(e.path, 0o600)
                except FileNotFoundError:  # removed since listed (RocksDB's own threads delete files)
                    pass


    def fresh_index(self, db: rocksdict.Rdict | None) -> rocksdict.Rdict:
        """Close ``db`` (if any), move the index aside to ``index.corrupt``
        and open an empty one."""
        self.close_db(db)
        old, aside = os.path.join(self.path, INDEX_DIR), os.path.join(self.path, INDEX_DIR + ".corrupt")
        shutil.rmtree(aside, ignore_errors=True)
        if os.path.exists(old):
            os.rename(old, aside)
        return self.open_db()

class NamespaceFile:
    """Namespace digest -> descriptor bytes, persisted in the ``namespaces`` file."""

    def __init__(self, directory: SsdDirectory) -> None:
        self.dir = directory
        self._ns: dict[bytes, bytes] = {}

    def put(self, digest: bytes, descriptor: bytes) -> None:
        """Persist a namespace descriptor (atomic rewrite of the namespaces file)."""
        digest, descriptor = bytes(digest), bytes(descriptor)
        if not 0 < len(digest) <= 0xFFFF:
            raise InvalidArgument(f"namespace digest must be 1..65535 bytes, got {len(digest)}")
        if self._ns.get(digest) == descriptor:
            return
        ns = {**self._ns, digest: descriptor}
        body = bytearray(NS_MAGIC + struct.pack("<II", 1, len(ns)))
        for d, desc in ns.items():
            body += struct.pack("<HI", len(d), len(desc)) + d + desc
        body += struct.pack("<Q", record_checksum(bytes(body)))
        try:
            self.dir.write_small(os.path.join(self.dir.path, NAMESPACES_FILE), bytes(body))
        except OSError as exc:
            raise io_error(exc, "writing namespace descriptors") from exc
        self._ns = ns

    def all(self) -> dict[bytes, bytes]:
        """Namespace digest -> descriptor bytes, as persisted."""
        return dict(self._ns)

    def load(self) -> None:
        try:
            with open(os.path.join(self.dir.path, NAMESPACES_FILE), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return
        if len(data) >= 8 and data[:4] == NS_MAGIC and struct.unpack_from("<I", data, 4)[0] != 1:
            raise InvalidArgument(
                f"{NAMESPACES_FILE} file in {self.dir.path} has version {struct.unpack_from('<I', data, 4)[0]}, this "
                f"kvstore reads only version 1; refusing to open it (use a matching kvstore or another directory)")
        try:
            if len(data) < 20 or data[:4] != NS_MAGIC:
                raise ValueError("bad magic")
            if struct.unpack_from("<Q", data, len(data) - 8)[0] != record_checksum(data[:-8]):
                raise ValueError("checksum mismatch")
            pos, out = 12, {}
            for _ in range(struct.unpack_from("<I", data, 8)[0]):
                dl, nl = struct.unpack_from("<HI", data, pos)
                out[data[pos + 6:pos + 6 + dl]] = data[pos + 6 + dl:pos + 6 + dl + nl]
                pos += 6 + dl + nl
            self._ns = out
        except (ValueError, struct.error) as exc:
            log.warning("ssd namespaces file unreadable (%s); namespaces start empty", exc)
