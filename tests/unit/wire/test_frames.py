"""The same-host socket's frames (kvstore.wire.frames): what the daemon's
socket server and the client's socket agree on, byte for byte."""

from __future__ import annotations

import struct

import grpc
import pytest

from kvstore.errors import InvalidArgument
from kvstore.wire import frames


def _body(frame: bytes) -> bytes:
    (n,) = struct.unpack_from("<I", frame)
    assert len(frame) == 4 + n
    return frame[4:]


def test_frame_prefixes_the_length() -> None:
    assert frames.frame(b"abc") == b"\x03\x00\x00\x00abc"
    assert frames.frame(b"") == b"\x00\x00\x00\x00"


def test_hello_round_trip() -> None:
    assert frames.parse_hello(_body(frames.hello_frame("s-1"))) == ("s-1", "")
    assert frames.parse_hello(_body(frames.hello_frame("s-1", "tok"))) == ("s-1", "tok")
    assert _body(frames.hello_frame("s-1", "tok")) == b"s-1\ntok"


def test_lookup_round_trip() -> None:
    keys = bytes(range(32))
    body = _body(frames.lookup_frame(b"NS", keys))
    assert body[:2] == b"\x02\x00" and not frames.is_call(body)
    req = frames.parse_lookup(body)
    assert req.ns_wire == b"NS" and req.keys == keys
    with pytest.raises(InvalidArgument):
        frames.lookup_frame(b"x" * 0xFFFF, b"")


def test_answer_layout() -> None:
    body = _body(frames.answer_frame(3, b"\x02\x02\x03"))
    status, hit = frames.HIT.unpack_from(body)
    assert (status, hit) == (frames.OK, 3) and body[frames.HIT.size:] == b"\x02\x02\x03"


@pytest.mark.parametrize("name", frames.CALLS)
def test_call_round_trip(name: str) -> None:
    body = _body(frames.call_frame(name, b"REQ"))
    assert frames.is_call(body)
    assert frames.call_method(body) == name
    assert frames.call_method_id(body) == frames.CALLS.index(name) + 1
    assert body[3:] == b"REQ"


def test_unknown_call_ids() -> None:
    assert frames.call_method(frames.CALL_MARK + b"\x00") is None
    assert frames.call_method(frames.CALL_MARK + bytes([len(frames.CALLS) + 1])) is None
    assert frames.call_method(frames.CALL_MARK) is None and frames.call_method_id(frames.CALL_MARK) == 0
    with pytest.raises(ValueError):
        frames.call_frame("Put", b"")  # only the shared-memory control calls go over the socket


def test_reply_and_error_frames() -> None:
    assert _body(frames.reply_frame(b"RESP")) == b"\x00RESP"
    body = _body(frames.error_frame(grpc.StatusCode.NOT_FOUND.value[0], "gone"))
    assert body[0] == grpc.StatusCode.NOT_FOUND.value[0] and body[1:] == b"gone"
    long = _body(frames.error_frame(13, "x" * 10_000))
    assert len(long) == 1 + frames.MAX_ERROR_TEXT


def test_limits() -> None:
    assert frames.MAX_FRAME >= 2 + 0xFFFF + 16 * 65536
    assert frames.MAX_HELLO == 8192


def test_put_frame_round_trips_and_refuses_lengths_that_do_not_add_up():
    keys = bytes(range(32))
    msg = frames.put_frame(b"ns", b"p" * 16, keys, 4096, 8192, struct.pack("<2Q", 7, 2**64 - 1))
    body = msg[4:]
    assert struct.unpack("<I", msg[:4])[0] == len(body) and body[:2] == frames.PUT_MARK
    put = frames.parse_put(body)
    assert (put.ns_wire, put.parent, put.keys, put.block_bytes, put.offset, put.checksums) == \
        (b"ns", b"p" * 16, keys, 4096, 8192, [7, 2**64 - 1])
    assert frames.parse_put(frames.put_frame(b"ns", None, keys, 1, 0, b"\0" * 16)[4:]).parent == b""
    for bad in (body[:-1], body + b"x", body[:5]):
        with pytest.raises(InvalidArgument):
            frames.parse_put(bad)
    # unhashed (PUT_UNHASHED): the keys end the frame, and the daemon takes the landing copy's hashes
    bare = frames.put_frame(b"ns", b"p" * 16, keys, 4096, 8192, None)[4:]
    assert bare[5] == frames.PUT_UNHASHED and len(bare) == len(body) - 16
    put = frames.parse_put(bare)
    assert (put.parent, put.keys, put.block_bytes, put.offset, put.checksums) == (b"p" * 16, keys, 4096, 8192, None)
    for bad in (bare[:-1], bare + b"\0" * 16, bytes(bare[:5]) + b"\0" + bare[6:]):
        with pytest.raises(InvalidArgument, match="does not hold"):
            frames.parse_put(bad)


def test_grant_and_granted_put_frames_round_trip_and_refuse_lengths_that_do_not_add_up():
    back = struct.pack("<2Q", 4096, 2**63)
    msg = frames.grant_frame(b"ns", 5, 65536, back)
    assert frames.HEADER.unpack_from(msg)[0] == len(msg) - 4 and msg[4:6] == frames.GRANT_MARK
    assert frames.parse_grant(msg[4:]) == (b"ns", 5, 65536, [4096, 2**63])
    assert frames.parse_grant(frames.grant_frame(b"ns", 1, 4096)[4:]) == (b"ns", 1, 4096, [])
    for bad in (msg[4:-1], msg[4:] + b"\0", msg[4:10]):
        with pytest.raises(InvalidArgument):
            frames.parse_grant(bad)
    keys = bytes(range(32))
    sums, offs = struct.pack("<2Q", 7, 2**64 - 1), struct.pack("<2Q", 0, 1 << 40)
    msg = frames.granted_put_frame(b"ns", b"p" * 16, keys, 4096, sums, offs)
    assert frames.HEADER.unpack_from(msg)[0] == len(msg) - 4 and msg[4:6] == frames.GPUT_MARK
    put, got = frames.parse_granted_put(msg[4:])
    assert (put.ns_wire, put.parent, put.keys, put.block_bytes, put.checksums) == \
        (b"ns", b"p" * 16, keys, 4096, [7, 2**64 - 1])
    assert got == [0, 1 << 40]
    for bad in (msg[4:-8], msg[4:-1], msg[4:] + b"\0" * 8, msg[4:8]):
        with pytest.raises(InvalidArgument):
            frames.parse_granted_put(bad)
    bare = frames.put_frame(b"ns", None, keys, 4096, 0, None)  # a granted put must carry its checksums
    with pytest.raises(InvalidArgument, match="must carry"):
        frames.parse_granted_put(frames.GPUT_MARK + bare[6:] + offs)


def test_a_lookup_frame_refuses_an_unknown_mark_and_a_namespace_past_its_end() -> None:
    ns = b"\x0a\x01m"
    with pytest.raises(InvalidArgument, match="unknown frame type"):
        frames.parse_lookup(b"\xff\xf0" + ns)  # (a frame type this daemon does not know)
    with pytest.raises(InvalidArgument, match="overruns"):
        frames.parse_lookup(len(ns + b"k" * 16).to_bytes(2, "little") + ns)
    assert frames.parse_lookup(len(ns).to_bytes(2, "little") + ns + b"k" * 16).keys == b"k" * 16


@pytest.mark.parametrize("mark", [frames.PUT_MARK, frames.NSID_MARK, frames.STAGE_MARK, frames.GRANT_MARK])
def test_a_lookup_frame_never_starts_like_another_frames_mark(mark: bytes) -> None:
    """A namespace message whose length's little-endian bytes equal a mark
    would make the daemon read the lookup as that frame: refused here."""
    nslen = int.from_bytes(mark, "little")
    with pytest.raises(InvalidArgument, match="too long"):
        frames.lookup_frame(b"x" * nslen, b"k" * 16)


def test_a_put_frame_with_flags_this_side_does_not_know_is_refused() -> None:
    """A newer client's flag (in has_parent's high bits or the flags byte) is
    refused, never ignored: ignoring it could store its blocks under another meaning."""
    keys = b"k" * 32
    good = bytearray(frames.put_frame(b"ns", None, keys, 4096, 0, b"\0" * 16)[4:])
    assert frames.parse_put(bytes(good)).parent == b""
    for at, value in ((4, 2), (5, 2), (5, 3)):  # has_parent = 2; a flag besides PUT_UNHASHED
        bad = bytearray(good)
        bad[at] = value
        with pytest.raises(InvalidArgument, match="flag"):
            frames.parse_put(bytes(bad))
        with pytest.raises(InvalidArgument, match="flag"):
            frames.parse_granted_put(frames.GPUT_MARK + bytes(bad[2:]) + b"\0" * 16)


def test_hello_carries_the_socket_version() -> None:
    assert frames.hello_version(_body(frames.hello_frame("s-1", "tok"))) == frames.SOCKET_VERSION == 1
    newer = b"kvs/2 s-1\ntok"  # what a client of the next socket version sends
    assert frames.hello_version(newer) == 2
    assert frames.parse_hello(newer) == ("s-1", "tok")
    assert frames.hello_version(b"kvs/x s-1") == -1  # malformed: refused as another version
