"""The wire format of ``transport/ucx.py``'s block fetch: message layouts,
tags, status codes, what a provider answers and what a fetch returns.
Nothing here touches UCX; ``transport.ucx`` sends and receives these.

Wire protocol (all tag messages on the one endpoint a client opens to a
server's listener; ucxx hashes our tags with the endpoint's own tags, so two
connections never match each other's messages)::

    client -> server  REQUEST   TAG_REQ            preamble + header + trailer
    server -> client  TABLE     tag_tab(seq)       head + lengths[count] + checksums[count]
                                                   (the head alone when the status is not OK)
    client -> server  GO        tag_go(seq)        uint8 want[count]   (only if status OK and
                                                                        some block is present)
    server -> client  BLOCK i   tag_blk(seq, i)    the region, received into alloc()'s view

``seq`` is unique per client process, so the answers of concurrent fetches
over one endpoint never mix.  The server receives every request of an
endpoint into one buffer and ucxx does not say how many bytes a message
had: the trailer (its ``seq``, the message's length, magic ``KVBE``) ends
every request at the length its preamble claims (the magic last, so even a
one-byte cut shows), so a message shorter than its claim (whose tail would
be an earlier request's bytes) is refused, never parsed (``parse_request``);
the server clears the trailer after each request.  The GO round trip lets the receiver say which
blocks it has room for (``alloc`` may return ``None``), so nothing is sent
that nobody receives.

**Sized fetch** (``fetch(..., sizes=...)``: the caller knows each block's
length beforehand, as a daemon does for a namespace it stores): one round trip,
no GO.  ``alloc`` runs before the request; the request (magic ``KVB2``)
carries after the header the int64 length the client receives into for
each block (0: none), and the client posts those receives while the server
answers::

    client -> server  REQUEST   TAG_REQ            preamble + header + posted[count] + trailer
    server -> client  TABLE     tag_tab(seq)       as above
    server -> client  BLOCK i   tag_blk(seq, i)    for every i with posted[i] > 0: the region
                                                   if the status is OK, the block is present
                                                   and its length is posted[i]; otherwise an
                                                   empty message

So every receive the client posted is completed by the server, whatever
the answer, and nothing is sent that nobody receives.  A block whose length
differs from the posted one is not sent (``ok`` False, ``lengths`` gives
its real length).  A server of another protocol version (magics ``KVB1``/
``KVB2``: no trailer) closes the endpoint on these magics, and this server
on theirs: the fetch fails (a miss). A request's ``flags`` are 0 in this
version: a server refuses (closes the endpoint on) a request that sets one,
so a newer peer's flag is never ignored.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Final, Sequence

import numpy as np

__all__ = ["Alloc", "FetchFault", "FetchResult", "Provider", "Served", "MAX_BLOCKS", "MAX_HEADER", "MAGIC",
           "MAGIC_SIZED", "WIRE_VERSION", "PRE", "TRAILER", "INBOX", "inbox", "HEAD", "Request", "request", "parse_request",
           "ST_OK", "ST_REFUSED", "ST_INVALID", "ST_FAILED", "ST_TIMEOUT", "STATUS_WORD", "TAG_REQ", "tag_tab",
           "tag_go", "tag_blk", "table",
           "check_served", "sized_sends", "refused", "verified"]

MAX_HEADER: Final = 1 << 20
"""Largest request header in bytes (the server's receive buffer per endpoint)."""
MAX_BLOCKS: Final = 1 << 20
"""Most blocks in one fetch."""

WIRE_VERSION: Final = 3
"""The block fetch's wire version (the digit of ``MAGIC``), which a daemon
names in its cluster ``Member`` record and ``NodeInfo``: a peer that names
another is not fetched from (kvstore/daemon/peers.py)."""
MAGIC: Final = b"KVB3"
MAGIC_SIZED: Final = b"KVB4"
MAGIC_END: Final = b"KVBE"
EMPTY: Final = np.empty(0, dtype=np.uint8)
"""The message a sized fetch's receive gets for a block the server does not send."""
PRE: Final = struct.Struct("<4sIQIId")  # magic, flags, seq, count, header length, timeout (s)
TRAILER: Final = struct.Struct("<QI4s")  # seq, message length (bytes), MAGIC_END (last: a cut shows)
INBOX: Final = PRE.size + MAX_HEADER + TRAILER.size
"""The server's receive buffer per endpoint: the longest request."""


def inbox() -> np.ndarray:
    """A server connection's receive buffer (``INBOX`` bytes, allocated once
    per connection the server lets in)."""
    return np.zeros(INBOX, dtype=np.uint8)

HEAD: Final = struct.Struct("<QII240s")  # seq, status, error length, error text
ST_OK, ST_REFUSED, ST_INVALID, ST_FAILED, ST_TIMEOUT = 0, 1, 2, 3, 4
STATUS_WORD: Final = {ST_REFUSED: "refused", ST_INVALID: "invalid request", ST_FAILED: "failed",
                      ST_TIMEOUT: "timed out"}

SEQ_MASK: Final = (1 << 37) - 1

# Tags are ints below 2**61 - 1: ucxx mixes ``hash(tag)`` with the endpoint's
# own tag, and ``hash`` of such an int is the int itself in every process
# (``hash`` of str/bytes is salted per process; never use those here).
TAG_REQ: Final = 4 << 57


def tag_tab(seq: int) -> int:
    return (1 << 57) | (seq & SEQ_MASK)


def tag_go(seq: int) -> int:
    return (2 << 57) | (seq & SEQ_MASK)


def tag_blk(seq: int, i: int) -> int:
    return (3 << 57) | (i << 37) | (seq & SEQ_MASK)


# --------------------------------------------------------------- requests
def request(magic: bytes, seq: int, count: int, header: bytes, timeout: float,
            posted: np.ndarray | None = None) -> bytearray:
    """A REQUEST message: preamble, header, ``posted`` (int64 per block, a
    sized request's), trailer."""
    extra = b"" if posted is None else np.asarray(posted, dtype=np.int64).tobytes()
    body = PRE.size + len(header) + len(extra)
    out = bytearray(body + TRAILER.size)
    PRE.pack_into(out, 0, magic, 0, seq, count, len(header), timeout)
    out[PRE.size:body] = header + extra
    TRAILER.pack_into(out, body, seq, len(out), MAGIC_END)
    return out


@dataclass(slots=True, frozen=True)
class Request:
    """A request as the server parsed it: ``header`` and ``posted`` are views
    of the receive buffer, valid until its next receive (copy what outlives it)."""

    seq: int
    count: int
    header: np.ndarray
    """uint8, the provider's opaque header."""
    timeout: float
    posted: np.ndarray | None
    """A sized request's int64 length per block; None for the two-step protocol."""


def parse_request(inbox: np.ndarray) -> Request:
    """The request ``inbox`` received (the server's buffer of ``INBOX``
    bytes), checked before anything is sized by it; ValueError names what is
    wrong. Clears the trailer: an earlier request's can never end a later,
    shorter one."""
    magic, flags, seq, count, hlen, timeout = PRE.unpack_from(inbox.data, 0)
    sized = magic == MAGIC_SIZED
    if magic != MAGIC and not sized:
        raise ValueError(f"unknown request magic {bytes(magic)!r} (a peer of another wire version)")
    if flags:
        raise ValueError(f"request flags 0x{flags:x} unknown to this server (a peer of a newer wire version)")
    extra = 8 * count if sized else 0
    if hlen > MAX_HEADER or count > MAX_BLOCKS or hlen + extra > MAX_HEADER:
        raise ValueError(f"request of {count} blocks and a {hlen}-byte header is over the limits")
    body = PRE.size + hlen + extra
    end_seq, length, end_magic = TRAILER.unpack_from(inbox.data, body)
    inbox[body:body + TRAILER.size] = 0
    if end_magic != MAGIC_END or length != body + TRAILER.size or end_seq != seq:
        raise ValueError(f"request {seq} is shorter than the {body + TRAILER.size} bytes it claims")
    posted = None
    if sized:
        posted = np.frombuffer(inbox.data, np.int64, count, PRE.size + hlen)
        if (posted < 0).any():
            raise ValueError(f"request {seq} posts a negative length")
    return Request(seq, count, inbox[PRE.size:PRE.size + hlen], timeout, posted)


# ------------------------------------------------------------------ types
@dataclass(slots=True, frozen=True)
class Served:
    """What a provider hands the server for one request."""

    lengths: np.ndarray
    """int64 per requested block; 0 = absent on this peer."""
    checksums: np.ndarray
    """uint64 per block: XXH3-64 of the payload, as the sender's index has it."""
    regions: list[memoryview]
    """One per PRESENT block, in order: views over the sender's slab, no copies."""
    release: Callable[[], None]
    """Called exactly once when the send completed or failed (the provider unpins there)."""


Provider = Callable[[bytes], Awaitable[Served]]
"""Answers an opaque request header; may raise PermissionError / ValueError,
which the client sees as ``FetchResult.error`` (all ``ok`` False)."""


class FetchFault(enum.Enum):
    """Why a whole fetch failed (``FetchResult.fault``): what the caller
    decides on, never the error's wording."""

    LINK = "link"
    """The connect failed or timed out, the fetch missed its deadline or its transfer broke."""
    SLOW = "slow"
    """The peer's provider did not answer within the peer's bound (``ST_TIMEOUT``)."""
    REFUSED = "refused"
    """The peer refused the request (``ST_REFUSED``: its credential, its per-connection limit)."""
    INVALID = "invalid"
    """The peer found the request malformed (``ST_INVALID``)."""
    FAILED = "failed"
    """The peer's provider failed otherwise (``ST_FAILED``, or a status this side does not know)."""
    ALLOC = "alloc"
    """This side's ``alloc`` failed: nothing was received."""

    @property
    def link(self) -> bool:
        """Whether the link cost the caller the wait (the peer is then suspect)."""
        return self is FetchFault.LINK or self is FetchFault.SLOW


STATUS_FAULT: Final = {ST_REFUSED: FetchFault.REFUSED, ST_INVALID: FetchFault.INVALID, ST_FAILED: FetchFault.FAILED,
                       ST_TIMEOUT: FetchFault.SLOW}


@dataclass(slots=True)
class FetchResult:
    ok: np.ndarray
    """bool per requested block: arrived AND checksum verified."""
    lengths: np.ndarray
    """int64 per block as the peer reported (0 = absent)."""
    nbytes: int
    """Bytes of the blocks that arrived verified."""
    seconds: float
    error: str | None
    """Whole-call failure (peer gone, deadline, refused); then ok is all False."""
    corrupt: int = 0
    """Blocks that arrived but failed the checksum."""
    checksums: np.ndarray | None = None
    """uint64 per block as the peer reported (valid where ``ok``): what the
    receiver commits, so it need not hash the bytes again."""
    fault: FetchFault | None = None
    """Set with ``error``: its kind (``error`` is for people, ``fault`` for decisions)."""
    unconfirmed: int = 0
    """Receives not confirmed ended after a fault: late bytes may still land
    in the destinations, which must never be reused."""


Alloc = Callable[[np.ndarray], Sequence["memoryview | None"]]
"""Given per-block lengths, a destination per block (None = skip that block)."""


def check_served(s: Any, count: int) -> str:
    """What is wrong with a provider's answer to a request of ``count``
    blocks ("" when nothing is): the server answers FAILED with it."""
    if not isinstance(s, Served):
        return f"provider returned {type(s).__name__}, not Served"
    if len(s.lengths) != count or len(s.checksums) != count:
        return f"provider answered {len(s.lengths)} blocks for a request of {count}"
    present = np.asarray(s.lengths) > 0
    if int(present.sum()) != len(s.regions):
        return f"provider gave {len(s.regions)} regions for {int(present.sum())} present blocks"
    for n, r in zip(np.asarray(s.lengths)[present], s.regions):
        if r.nbytes != int(n):
            return f"provider region of {r.nbytes} bytes for a block of {int(n)}"
    return ""


def table(seq: int, status: int, msg: str, served: Served | None, count: int) -> np.ndarray:
    """The TABLE message: head (seq, status, error text cut to 240 bytes),
    then, only when ``served`` is given (an OK answer, whose ``count`` the
    provider checked), lengths and checksums. A refused or failed answer is
    the head alone: its size never follows an unchecked ``count`` from the
    wire (the receiver's buffer is larger, which UCX allows)."""
    out = np.zeros(HEAD.size + (16 * count if served is not None else 0), dtype=np.uint8)
    text = msg.encode("utf-8", "replace")[:240]
    HEAD.pack_into(out.data, 0, seq, status, len(text), text)
    if served is not None:
        body = out[HEAD.size:]
        body[: 8 * count].view(np.int64)[:] = np.asarray(served.lengths, dtype=np.int64)
        body[8 * count:].view(np.uint64)[:] = np.asarray(served.checksums, dtype=np.uint64)
    return out


def sized_sends(ep: Any, seq: int, posted: np.ndarray, served: Served | None) -> list[Awaitable[Any]]:
    """A sized request's block sends: the region where the block is present
    at the posted length, an empty message for every other posted block."""
    wanted = np.flatnonzero(posted > 0)
    if served is None:
        return [ep.send(EMPTY, tag=tag_blk(seq, int(i))) for i in wanted]
    lengths = np.asarray(served.lengths, dtype=np.int64)
    region_of = np.cumsum(lengths > 0) - 1  # block i's index in served.regions, where present
    return [ep.send(served.regions[int(region_of[i])] if lengths[i] > 0 and lengths[i] == posted[i] else EMPTY,
                    tag=tag_blk(seq, int(i))) for i in wanted]


def refused(address: str, status: int, text: bytes) -> tuple[str, FetchFault]:
    """The error and fault of a fetch the peer at ``address`` answered with ``status`` (not OK)."""
    word = STATUS_WORD.get(status, f"status {status}")
    return f"peer {address} {word}: {text.decode('utf-8', 'replace')}", STATUS_FAULT.get(status, FetchFault.FAILED)


def verified(verdicts: dict[int, bool], lengths: np.ndarray, sums: np.ndarray, seconds: float) -> FetchResult:
    """A fetch's result from its blocks' checksum verdicts (block -> good)."""
    ok = np.zeros(lengths.size, dtype=bool)
    corrupt = 0
    for j, good in verdicts.items():
        ok[j] = good
        corrupt += not good
    return FetchResult(ok, lengths, int(lengths[ok].sum()), seconds, None, corrupt, sums)
