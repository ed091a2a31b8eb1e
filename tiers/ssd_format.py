"""The SSD tier's on-disk record format and file layer (tiers/ssd.py):
record header and identity layout, checksums, the ``FileLayer`` protocol
(tests swap in a layer that fails or sleeps) and vectored I/O helpers."""

from __future__ import annotations

import ctypes
import errno
import importlib
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import xxhash

from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, Unavailable
from kvstore.reserve import libc_function
from tiers.base import BlockMeta, Buffer

log = logging.getLogger("kvstore.ssd")

SCHEMA_VERSION = 1
SCHEMA_FILE, SCHEMA_MAGIC = "SCHEMA", "kvstore-ssd-tier"
LOCK_FILE, INDEX_DIR, NAMESPACES_FILE = "LOCK", "index", "namespaces"
RECORD_MAGIC, RECORD_VERSION = b"KVB1", 1
HEADER_BYTES = 88
IDENT_BYTES = 80
SEG_RE = re.compile(r"^seg-(\d{12})\.kvs$")
IOV_MAX = 512  # buffers per pwritev/preadv call (Linux allows 1024)
MAX_FDS = 256
NS_MAGIC = b"KVNS"
FREE, ALLOC, LIVE = 0, 1, 2
CLOEXEC = os.O_CLOEXEC

IDENT = np.dtype([("magic", "S4"), ("version", "<u2"), ("plen", "<u2"), ("size", "<u8"),
                   ("seq", "<u8"), ("csum", "<u8"), ("ns", "u1", (16,)), ("key", "u1", (16,)),
                   ("parent", "u1", (16,))])
HEADER = np.dtype([("ident", IDENT), ("hcrc", "<u8")])
VALUE = np.dtype([("seg", "<u8"), ("off", "<u8"), ("ident", IDENT)])
NS, KEY, PARENT, NSKEY = slice(32, 48), slice(48, 64), slice(64, 80), slice(32, 64)  # identity bytes
assert IDENT.itemsize == IDENT_BYTES and HEADER.itemsize == HEADER_BYTES
assert IDENT.fields is not None and IDENT.fields["ns"][1] == 32 and IDENT.fields["parent"][1] == 64


def _load_xxh3() -> Callable[[Buffer], int]:
    """kvstore.checksum's native SIMD xxh3_64 when present (same values as xxhash)."""
    try:
        return cast(Callable[[Buffer], int], importlib.import_module("kvstore.checksum").checksum)
    except (ImportError, AttributeError):  # pragma: no cover - module still being written
        return cast(Callable[[Buffer], int], xxhash.xxh3_64_intdigest)


_xxh3 = _load_xxh3()


def record_checksum(buf: Buffer) -> int:
    return int(_xxh3(buf))


def io_error(exc: BaseException, what: str) -> KVStoreError:
    """ENOSPC/EDQUOT -> CapacityError; any other I/O failure -> Unavailable."""
    if (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or "no space" in str(exc).lower():
        return CapacityError(f"ssd tier: disk full while {what}")
    return Unavailable(f"ssd tier: I/O error while {what}: {exc}")


class FileLayer(Protocol):
    """The file operations the tier performs on segments and small files."""

    def open(self, path: str, flags: int, mode: int = 0o600, /) -> int: ...
    def close(self, fd: int, /) -> None: ...
    def pwritev(self, fd: int, bufs: Sequence[Any], offset: int, /) -> int: ...
    def preadv(self, fd: int, bufs: Sequence[Any], offset: int, /) -> int: ...
    def fdatasync(self, fd: int, /) -> None: ...
    def fsync(self, fd: int, /) -> None: ...
    def ftruncate(self, fd: int, length: int, /) -> None: ...
    def unlink(self, path: str, /) -> None: ...
    def rename(self, src: str, dst: str, /) -> None: ...
    def preallocate(self, fd: int, length: int, /) -> bool: ...


_fallocate = libc_function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
"""``fallocate(fd, mode, offset, len)`` (Linux), or None."""
FALLOC_FL_KEEP_SIZE = 1


def preallocate(fd: int, length: int) -> bool:
    """Reserve ``length`` bytes of disk for ``fd`` from offset 0 without
    changing its size (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``): appends
    then land in one run of blocks the file system placed at once, and
    need no block allocation when synced. A ``ftruncate`` to the file's
    size gives back what was not written. False, having done nothing,
    where the file system or the disk's free space does not allow it."""
    if _fallocate is None or length <= 0:
        return False
    if _fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, length) == 0:
        return True
    try:  # a fallocate that failed part way (ENOSPC) keeps what it allocated: give that back
        os.ftruncate(fd, os.fstat(fd).st_size)
    except OSError:
        pass
    return False


class OsFileLayer:
    """The real operating system."""

    open = staticmethod(os.open)
    close = staticmethod(os.close)
    pwritev = staticmethod(os.pwritev)
    preadv = staticmethod(os.preadv)
    fdatasync = staticmethod(os.fdatasync)
    fsync = staticmethod(os.fsync)
    ftruncate = staticmethod(os.ftruncate)
    unlink = staticmethod(os.unlink)
    rename = staticmethod(os.rename)
    preallocate = staticmethod(preallocate)


def vec_io(op: Callable[[int, Sequence[Any], int], int], fd: int, bufs: list[np.ndarray], offset: int) -> int:
    """``op`` (preadv/pwritev) over all of ``bufs`` in IOV_MAX chunks, resuming
    after short transfers; stops at end of file. Returns bytes moved."""
    total = i = 0
    while i < len(bufs):
        chunk = bufs[i:i + IOV_MAX]
        got = op(fd, chunk, offset + total)
        total += got
        if got >= sum(b.size for b in chunk):
            i += len(chunk)
            continue
        if got <= 0:
            break
        for b in chunk:  # skip what moved, keep the rest of the chunk
            if got < b.size:
                bufs[i] = b[got:]
                break
            got -= b.size
            i += 1
    return total


def write_all(fs: FileLayer, fd: int, bufs: list[np.ndarray], offset: int) -> None:
    want = sum(b.size for b in bufs)
    if vec_io(fs.pwritev, fd, bufs, offset) < want:
        raise OSError(errno.EIO, "pwritev made no progress")


def read_runs(fs: FileLayer, fd_of: Callable[[int], int], todo: list[int], segs: list[int], offs: list[int],
              szs: list[int], hbuf: np.ndarray, dsts: Sequence[np.ndarray]) -> np.ndarray:
    """Read the records ``todo`` (positions into ``segs``/``offs``/``szs``,
    in order), the header of each into its row of ``hbuf`` and its payload
    into ``dsts``: one ``preadv`` per run of records lying back to back in a
    segment (``fd_of(segment)``). Returns which were read whole; a failed
    read is logged and its records read again one by one, so one bad record
    does not take the intact ones beside it."""
    got = np.zeros(hbuf.shape[0], dtype=bool)

    def read(run: list[int]) -> None:
        first = run[0]
        try:
            nread = vec_io(fs.preadv, fd_of(segs[first]), [b for i in run for b in (hbuf[i], dsts[i][:szs[i]])],
                           offs[first])
        except OSError as exc:
            log.warning("ssd read of segment %d failed: %s", segs[first], exc)
            if len(run) > 1:
                for i in run:
                    read([i])
            return
        for i in run:
            got[i] = offs[i] + HEADER_BYTES + szs[i] - offs[first] <= nread

    g = 0
    while g < len(todo):
        first, h = todo[g], g + 1
        end = offs[first] + HEADER_BYTES + szs[first]
        while h < len(todo) and h - g < IOV_MAX // 2 and segs[todo[h]] == segs[first] and offs[todo[h]] == end:
            end += HEADER_BYTES + szs[todo[h]]
            h += 1
        read(todo[g:h])
        g = h
    return got


def ident_bytes(idn: np.ndarray) -> np.ndarray:
    """Identities as an (n, 80) uint8 array."""
    return np.ascontiguousarray(idn).view(np.uint8).reshape(-1, IDENT_BYTES)


def as_void(a: np.ndarray) -> np.ndarray:
    """Rows of a 2-D uint8 array as one opaque value each (sortable; tolist() gives bytes)."""
    a = np.ascontiguousarray(a)
    return a.view(f"V{a.shape[1]}").ravel()


def loc_keys(locs: np.ndarray) -> list[bytes]:
    raw = np.asarray(locs, dtype=">u8").tobytes()
    return [b"b" + raw[i * 8:(i + 1) * 8] for i in range(len(locs))]


def identity_arrays(owners: Sequence[BlockMeta]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ns, key, parent) as (n, 16) uint8 arrays, and parent lengths; checks lengths."""
    n = len(owners)
    if any(len(o.ns_digest) != 16 or len(o.key) != 16 or len(o.parent) not in (0, 16) for o in owners):
        raise InvalidArgument("ssd tier: namespace digest and key must be 16 bytes, parent 0 or 16")

    def join(parts: Sequence[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(n, 16)

    return (join([o.ns_digest for o in owners]), join([o.key for o in owners]),
            join([o.parent or bytes(16) for o in owners]),
            np.fromiter((len(o.parent) for o in owners), dtype=np.uint16, count=n))


def scan_segment(fs: FileLayer, path: str, sid: int, end: int, found: dict[bytes, np.ndarray]) -> None:
    """Read a segment's record headers into ``found`` ((namespace, key) ->
    VALUE; the newest record of a key wins), up to the first bad header."""
    hdr = np.empty(1, dtype=HEADER)
    hb, h = hdr.view(np.uint8), hdr[0]
    fd = fs.open(path, os.O_RDONLY | CLOEXEC)
    try:
        off = 0
        while off + HEADER_BYTES <= end and vec_io(fs.preadv, fd, [hb], off) == HEADER_BYTES:
            idn = h["ident"]
            rec_end = off + HEADER_BYTES + int(idn["size"])
            if (idn["magic"] != RECORD_MAGIC or int(idn["version"]) != RECORD_VERSION
                    or record_checksum(hb[:IDENT_BYTES]) != int(h["hcrc"]) or rec_end > end):
                break
            v = np.zeros(1, dtype=VALUE)
            v["seg"], v["off"], v["ident"] = sid, off, idn
            name = bytes(hb[NSKEY])
            if name not in found or int(found[name]["ident"]["seq"][0]) < int(idn["seq"]):
                found[name] = v
            off = rec_end
    finally:
        fs.close(fd)


@dataclass(slots=True)
class Segment:
    """One segment file: its id, its size, and the bytes of live records in it."""

    id: int
    size: int
    live: int = 0


def parse_index(ks: list[bytes], vs: list[bytes]) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    """The index's block entries as (locs, VALUE records), and the keys of
    malformed entries (left out)."""
    bad = [k for k, v in zip(ks, vs) if len(k) != 9 or k[:1] != b"b" or len(v) != VALUE.itemsize]
    if bad:
        drop = set(bad)
        pairs = [(k, v) for k, v in zip(ks, vs) if k not in drop]
        ks, vs = [k for k, _ in pairs], [v for _, v in pairs]
    locs = np.ascontiguousarray(np.frombuffer(b"".join(ks), dtype=np.uint8).reshape(-1, 9)[:, 1:])
    return locs.view(">u8").ravel().astype(np.int64), np.frombuffer(b"".join(vs), dtype=VALUE).copy(), bad
