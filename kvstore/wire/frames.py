"""The same-host socket's frames (issue 9): what the daemon's
``kvstore.daemon.socket_server`` and the client's ``kvstore.client.socket``
both agree on. Pure packing, no I/O.

Frames (u32 = little-endian uint32; ``len`` counts the bytes after it)::

    hello     u32 len | ["kvs/" version " "] session id (ASCII) [| "\\n" | bearer token]
                                          (no prefix: version 1; SOCKET_VERSION)
    hello ok  u32 len | u8 0 [| shared-index header path (UTF-8)]
                                          (else an error frame, then close)
    lookup    u32 len | u16 ns_len | Namespace message (protobuf) | keys (n x 16 bytes)
    answer    u32 len | u8 0 | u32 hit_blocks | hit_blocks x u8 Tier value
    call      u32 len | u16 0xFFFF | u8 method (1-based in CALLS) | request message (protobuf)
    reply     u32 len | u8 0 | response message (protobuf)
    nsid      u32 len | u16 0xFFFE | Namespace message (protobuf)
    nsid ok   u32 len | u8 0 | u32 namespace id (0xFFFFFFFF: none yet)
    tally     u32 len | u16 0xFFFD | n x (u32 nid, u32 lookups, u64 blocks, u64 hits,
                                          u64 hbm hits, u64 dram hits, u64 ssd hits)
    tally ok  u32 len | u8 0
    reads     u32 len | u16 0xFFFC | u32 nid | u32 keys asked | keys read (n x 16 bytes)
    reads ok  u32 len | u8 0
    stage     u32 len | u16 0xFFFB
    stage ok  u32 len | u8 0 | u64 staging bytes | staging file path (UTF-8)
    put       u32 len | u16 0xFFFA | u16 ns_len | u8 has_parent | u8 flags | u32 n | u32 block bytes
                      | u64 staging offset | Namespace message (protobuf) | parent key (16 bytes, if any)
                      | keys (n x 16 bytes) | checksums (n x u64; none with flags PUT_UNHASHED)
    put ok    u32 len | u8 0 | n x u8 KeyStatus
    grant     u32 len | u16 0xFFF9 | u16 ns_len | u32 count | u32 block bytes | u32 r
                      | Namespace message (protobuf) | r x u64 slab offset given back
    grant ok  u32 len | u8 0 | u32 lifetime (ms) | u64 the session's limit (bytes) | n x u64 slab offset
    gput      u32 len | u16 0xFFF8 | (a put frame's fields, staging offset 0) | slab offsets (n x u64)
    gput ok   (as put ok)
    error     u32 len | u8 status | UTF-8 message   (status: the gRPC status code)

Versions: a client names the socket version it speaks in its hello (none
named: 1); a daemon that does not speak it answers FAILED_PRECONDITION and
closes, and the client goes over gRPC (an older daemon, which knows no
prefix, answers NOT_FOUND for the session: the same fallback). Frames of a
version never change meaning: a new frame gets a new mark (an older daemon
answers INVALID_ARGUMENT "unknown frame type"), a new call a new id
(``UNKNOWN_METHOD``), and a put frame's unused flag bits must be 0 (an
older daemon refuses a flag it does not know rather than ignore it).

``stage`` and ``put`` are the write-behind put (issue 18): the daemon gives
the connection a private staging file, the client copies a small batch
into it and sends a ``put`` frame without waiting; the daemon reserves,
copies the blocks from staging into their slots and commits, as one call.

``grant`` and ``gput`` are the granted put (issue 18,
kvstore/core/grants.py): the daemon grants the connection DRAM slots ahead
of its puts; the client copies a batch straight into granted slots and
names them in a ``gput`` frame sent without waiting; the daemon inserts
the rows. The bytes are copied once and no round trip is on the put's path.

``nsid``, ``tally`` and ``reads`` serve clients that answer lookups, and
read DRAM blocks, from the daemon's shared index
(kvstore/wire/shared_index.py): the id of a namespace the session may look
up, then the lookups it answered and the blocks it read itself, to be
counted (and, for reads, to count as accesses for eviction).

No pickle, no Python objects on the wire; frames over ``MAX_FRAME`` are
refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

MAX_FRAME = 16 + 65536 + 16 * 65536
"""Largest request frame: a namespace and 65,536 keys."""
FRAME_OVERHEAD = 256
"""Bytes a request frame adds around its message (length, method, session)."""


def fits_frame(message_bytes: int) -> bool:
    """Whether a message of this size can go over the same-host socket (a
    larger one, e.g. a 200,000-key Reserve, goes over gRPC instead)."""
    return message_bytes + FRAME_OVERHEAD <= MAX_FRAME


MAX_ANSWER = 1 << 31
"""Largest answer frame a client accepts: a status byte and a message no
larger than the daemon may send over gRPC (``server.max_message_bytes`` is
at most 2^31 - 1). Not ``MAX_FRAME``: an answer may be larger than its
request (an Acquire of 60,000 keys, a 960 KB request, answers 1.25 MB; a
Commit of a whole reservation answers for every key). The client reads an
answer as its bytes arrive, never allocating the length it was told."""
SOCKET_VERSION = 1
"""The frame protocol this side speaks (a hello of another is refused)."""
HELLO_PREFIX = b"kvs/"
"""A hello that names its version starts with this, the version and a space."""
MAX_HELLO = 8192
"""Largest hello frame."""
MAX_ERROR_TEXT = 4096
"""Bytes of an error message that go on the wire."""
HEADER = struct.Struct("<I")
"""The u32 length in front of every frame."""
HIT = struct.Struct("<BI")
"""Status byte and hit count at the front of a lookup answer."""
CALL_MARK = b"\xff\xff"
"""A call frame's first two bytes (a lookup's ns_len is below ``MAX_NS_WIRE``)."""
NSID_MARK = b"\xff\xfe"
"""An nsid frame's first two bytes."""
TALLY_MARK = b"\xff\xfd"
"""A tally frame's first two bytes."""
READS_MARK = b"\xff\xfc"
"""A reads frame's first two bytes."""
STAGE_MARK = b"\xff\xfb"
"""A stage frame's first two bytes."""
PUT_MARK = b"\xff\xfa"
"""A put frame's first two bytes."""
PUT = struct.Struct("<HBBIIQ")
"""A put frame's fixed fields after the mark: ns_len, has_parent, flags (``PUT_UNHASHED`` or 0), n, block
bytes, staging offset."""
PUT_UNHASHED = 1
"""A put frame's flag: no checksums follow the keys; the daemon hashes the blocks as it lands them (a staged
put only: a granted put's blocks are never copied by the daemon, so it must carry them)."""
GRANT_MARK = b"\xff\xf9"
"""A grant frame's first two bytes."""
GPUT_MARK = b"\xff\xf8"
"""A granted put frame's first two bytes."""
GRANT = struct.Struct("<HIII")
"""A grant frame's fixed fields after the mark: ns_len, count, block bytes, slots given back."""
GRANT_OK = struct.Struct("<BIQ")
"""Status byte, lifetime (ms) and the session's limit (bytes) of a grant answer (the offsets follow)."""
STAGE_OK = struct.Struct("<BQ")
"""Status byte and staging size of a stage answer (the path follows)."""
READS = struct.Struct("<II")
"""Namespace id and keys asked, at the front of a reads frame (after the mark)."""
MAX_NS_WIRE = 0xF000
"""A lookup's namespace message is shorter: its little-endian ns_len then
never starts like another frame's mark (``b"\\xff"`` and a byte from 0xF0
up), and two-byte values from here up are frame types, not lookups."""
NO_NSID = 0xFFFFFFFF
"""An nsid answer for a namespace the daemon has no id for yet."""
NSID = struct.Struct("<BI")
"""Status byte and namespace id of an nsid answer."""
CALLS = ("Reserve", "Commit", "Abort", "Acquire", "Release", "Lookup")
"""The unary calls the socket carries as protobuf messages (method id =
index + 1; new ones are appended, so an id keeps its meaning). ``Lookup``
here is the whole gRPC Lookup (a cluster lookup, issue r18); the plain
lookup has its own compact frame above."""
UNKNOWN_METHOD = "unknown method id"
"""The start of the error a daemon answers for a method id it does not
know (a client newer than its daemon falls back to gRPC on it)."""
OK = 0
"""Status byte of a good answer."""


def frame(body: bytes) -> bytes:
    """``body`` with its length in front."""
    return HEADER.pack(len(body)) + body


def error_frame(code: int, message: str) -> bytes:
    """An error answer: the gRPC status value and the (truncated) message."""
    return frame(bytes([code]) + message.encode()[:MAX_ERROR_TEXT])


def hello_frame(session: str, token: str | None = None, version: int = SOCKET_VERSION) -> bytes:
    prefix = b"" if version == 1 else HELLO_PREFIX + b"%d " % version  # (1: what every daemon reads)
    return frame(prefix + (session + ("\n" + token if token else "")).encode("ascii"))


def hello_version(body: bytes) -> int:
    """The socket version a hello names (1 when it names none; -1 when the prefix is malformed)."""
    if not body.startswith(HELLO_PREFIX):
        return 1
    word = body[len(HELLO_PREFIX) : body.find(b" ")] if b" " in body else b""
    return int(word) if word.isdigit() and len(word) <= 9 else -1


def hello_refusal(body: bytes) -> str:
    """Why a daemon of ``SOCKET_VERSION`` refuses this hello ("" when it does not)."""
    version = hello_version(body)
    if version == SOCKET_VERSION:
        return ""
    return f"socket protocol version {version} is not spoken here (this daemon speaks {SOCKET_VERSION}): use gRPC"


def parse_hello(body: bytes) -> tuple[str, str]:
    """(session id, bearer token or ""), after any version prefix."""
    if body.startswith(HELLO_PREFIX):
        body = body.partition(b" ")[2]
    sid, _, token = body.decode("ascii", "replace").partition("\n")
    return sid, token


def lookup_frame(ns_wire: bytes, packed_keys: bytes) -> bytes:
    if len(ns_wire) >= MAX_NS_WIRE:
        raise InvalidArgument("namespace message too long")
    body_len = 2 + len(ns_wire) + len(packed_keys)
    return HEADER.pack(body_len) + len(ns_wire).to_bytes(2, "little") + ns_wire + packed_keys


@dataclass(slots=True, frozen=True)
class LookupFrame:
    """A parsed lookup request."""

    ns_wire: bytes
    keys: bytes


def parse_lookup(body: bytes) -> LookupFrame:
    """A lookup frame's fields; InvalidArgument for a mark of a frame type
    this side does not know (two bytes from ``MAX_NS_WIRE`` up) or a
    namespace longer than the frame."""
    nslen = int.from_bytes(body[:2], "little")
    if nslen >= MAX_NS_WIRE:
        raise InvalidArgument(f"unknown frame type 0x{nslen:04X}")
    if 2 + nslen > len(body):
        raise InvalidArgument(f"lookup frame's {nslen}-byte namespace overruns its {len(body)} bytes")
    return LookupFrame(body[2 : 2 + nslen], body[2 + nslen :])


def answer_frame(hit_blocks: int, tier_values: bytes) -> bytes:
    """A lookup answer: ``tier_values`` is one wire Tier value per hit block."""
    return frame(HIT.pack(OK, hit_blocks) + tier_values)


def nsid_frame(ns_wire: bytes) -> bytes:
    return HEADER.pack(2 + len(ns_wire)) + NSID_MARK + ns_wire


def reads_frame(nid: int, asked: int, packed_keys: bytes) -> bytes:
    """The blocks a client read from the slab itself (``packed_keys``, the
    hit prefix of ``asked`` keys)."""
    return HEADER.pack(2 + READS.size + len(packed_keys)) + READS_MARK + READS.pack(nid, asked) + packed_keys


def stage_frame() -> bytes:
    return HEADER.pack(2) + STAGE_MARK


def put_frame(ns_wire: bytes, parent: bytes | None, packed_keys: bytes, block_bytes: int, offset: int,
              checksums: bytes | None) -> bytes:
    """A write-behind put of ``len(packed_keys) // 16`` blocks of
    ``block_bytes``, back to back in the staging file from ``offset``;
    ``checksums``: their xxh3_64 values as little-endian u64, which the
    daemon checks as it lands the blocks, or None (``PUT_UNHASHED``: it
    hashes them as it lands them)."""
    if len(ns_wire) >= MAX_NS_WIRE:
        raise InvalidArgument("namespace message too long")
    head = PUT.pack(len(ns_wire), 1 if parent else 0, 0 if checksums is not None else PUT_UNHASHED,
                    len(packed_keys) // 16, block_bytes, offset)
    sums = checksums if checksums is not None else b""
    body_len = 2 + PUT.size + len(ns_wire) + (16 if parent else 0) + len(packed_keys) + len(sums)
    return b"".join((HEADER.pack(body_len), PUT_MARK, head, ns_wire, parent or b"", packed_keys, sums))


def granted_put_frame(ns_wire: bytes, parent: bytes | None, packed_keys: bytes, block_bytes: int,
                      checksums: bytes, offsets: bytes) -> bytes:
    """A granted put: the blocks are in the slab slots ``offsets`` (n
    little-endian u64, granted to this connection)."""
    put = put_frame(ns_wire, parent, packed_keys, block_bytes, 0, checksums)  # (checksums: always, see PUT_UNHASHED)
    return b"".join((HEADER.pack(len(put) - 4 + len(offsets)), GPUT_MARK, put[6:], offsets))


def grant_frame(ns_wire: bytes, count: int, block_bytes: int, returned: bytes = b"") -> bytes:
    """Ask for ``count`` slots for blocks of ``block_bytes`` in a namespace,
    giving back the granted slots ``returned`` (little-endian u64 offsets)."""
    if len(ns_wire) >= MAX_NS_WIRE:
        raise InvalidArgument("namespace message too long")
    head = GRANT.pack(len(ns_wire), count, block_bytes, len(returned) // 8)
    return HEADER.pack(2 + GRANT.size + len(ns_wire) + len(returned)) + GRANT_MARK + head + ns_wire + returned


def parse_grant(body: bytes) -> tuple[bytes, int, int, list[int]]:
    """A grant frame's (namespace message, count, block bytes, slots given back)."""
    if len(body) < 2 + GRANT.size:
        raise InvalidArgument("short grant frame")
    nslen, count, size, nret = GRANT.unpack_from(body, 2)
    at = 2 + GRANT.size + nslen
    if len(body) != at + 8 * nret:
        raise InvalidArgument(f"grant frame of {len(body)} bytes does not hold a {nslen}-byte namespace "
                              f"and {nret} offsets")
    return body[2 + GRANT.size : at], count, size, list(struct.unpack_from(f"<{nret}Q", body, at))


def parse_granted_put(body: bytes) -> tuple[PutFrame, list[int]]:
    """A granted put frame's fields and slab offsets."""
    if len(body) < 2 + PUT.size:
        raise InvalidArgument("short granted put frame")
    n = PUT.unpack_from(body, 2)[3]
    if len(body) < 8 * n:
        raise InvalidArgument(f"granted put frame of {len(body)} bytes does not hold {n} offsets")
    cut = len(body) - 8 * n
    put = parse_put(body[:cut])
    if put.checksums is None:
        raise InvalidArgument("a granted put frame must carry its blocks' checksums")
    return put, list(struct.unpack_from(f"<{n}Q", body, cut))


@dataclass(slots=True, frozen=True)
class PutFrame:
    """A parsed put frame."""

    ns_wire: bytes
    parent: bytes
    keys: bytes
    block_bytes: int
    offset: int
    checksums: list[int] | None
    """None: ``PUT_UNHASHED``."""


def parse_put(body: bytes) -> PutFrame:
    """A put frame's fields; InvalidArgument when its lengths do not add up."""
    if len(body) < 2 + PUT.size:
        raise InvalidArgument("short put frame")
    nslen, has_parent, flags, n, size, offset = PUT.unpack_from(body, 2)
    if has_parent > 1 or flags & ~PUT_UNHASHED:
        raise InvalidArgument(f"put frame with flags 0x{has_parent:02x} 0x{flags:02x} this daemon does not know")
    at = 2 + PUT.size
    plen = 16 if has_parent else 0
    hashed = not flags & PUT_UNHASHED
    if len(body) != at + nslen + plen + (24 if hashed else 16) * n:
        raise InvalidArgument(f"put frame of {len(body)} bytes does not hold {n} keys"
                              + (" and checksums" if hashed else ""))
    ns_wire = body[at : at + nslen]
    at += nslen
    parent = body[at : at + plen]
    at += plen
    keys = body[at : at + 16 * n]
    sums = list(struct.unpack_from(f"<{n}Q", body, at + 16 * n)) if hashed else None
    return PutFrame(ns_wire, parent, keys, size, offset, sums)


def tally_frame(records: bytes) -> bytes:
    """``records``: ``shared_index.TALLY`` records back to back."""
    return HEADER.pack(2 + len(records)) + TALLY_MARK + records


def call_frame(name: str, request: bytes) -> bytes:
    op = CALLS.index(name) + 1
    return HEADER.pack(3 + len(request)) + CALL_MARK + bytes([op]) + request


def is_call(body: bytes) -> bool:
    return body[:2] == CALL_MARK


def call_method(body: bytes) -> str | None:
    """The method a call frame names (None when the id is unknown)."""
    op = body[2] - 1 if len(body) > 2 else -1
    return CALLS[op] if 0 <= op < len(CALLS) else None


def call_method_id(body: bytes) -> int:
    """The raw 1-based method id of a call frame (0 when missing)."""
    return body[2] if len(body) > 2 else 0


def reply_frame(response: bytes) -> bytes:
    return frame(bytes([OK]) + response)
