"""The DRAM tier (tiers/dram.py): a 0600 shared-memory slab with verified
copies in and out, zero-copy views, resize in place, and cleanup on close."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvstore.checksum import checksum
from kvstore.errors import CapacityError, InvalidArgument
from tests.conftest import payload_for
from tiers.base import TierKind
from tiers.dram import DramTier

B = 4096


def P(i: int) -> bytes:
    return payload_for(b"d", b"%d" % i, B)


@pytest.fixture
def dram():
    t = DramTier(4 * B, page_bytes=B, copy_threads=1)
    yield t
    t.close()


def test_the_slab_is_a_private_file_that_close_removes():
    t = DramTier(2 * B, page_bytes=B)
    path = t.path
    assert t.kind is TierKind.DRAM and path.startswith("/dev/shm/")
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 2 * B
    t.close()
    assert not os.path.exists(path)
    t.close()  # twice is harmless


def test_write_then_read_verifies_each_block(dram):
    locs = dram.allocate(B, 3)
    sums = dram.write(locs, [P(i) for i in range(3)])
    assert sums.tolist() == [checksum(P(i)) for i in range(3)]
    outs = [np.empty(B, np.uint8) for _ in range(3)]
    ok = dram.read_into(locs, np.full(3, B), sums, outs)
    assert ok.tolist() == [True] * 3 and [o.tobytes() for o in outs] == [P(i) for i in range(3)]
    dram.corrupt_for_test(int(locs[1]), bit=13)
    ok = dram.read_into(locs, np.full(3, B), sums, outs)
    assert ok.tolist() == [True, False, True]


def test_views_are_zero_copy(dram):
    loc = int(dram.allocate(B, 1)[0])
    v = dram.view(loc, B)
    v[:] = np.frombuffer(P(7), np.uint8)
    out = np.empty(B, np.uint8)
    assert dram.read_into(np.asarray([loc]), np.asarray([B]), np.asarray([checksum(P(7))]), [out]).all()
    assert out.tobytes() == P(7)


def test_resize_grows_in_place_and_shrinks_only_over_empty_pages(dram):
    locs = dram.allocate(B, 2)
    dram.write(locs, [P(0), P(1)])
    dram.resize(8 * B)
    assert dram.capacity_bytes == 8 * B and dram.size == 8 * B and os.stat(dram.path).st_size == 8 * B
    assert dram.view(int(locs[1]), B).tobytes() == P(1)  # data survives a grow
    more = dram.allocate(B, 6)
    assert more.size == 6 and int(more.max()) >= 4 * B
    with pytest.raises(CapacityError):
        dram.resize(2 * B)  # pages above hold blocks
    dram.free(more)
    dram.resize(2 * B)
    assert dram.capacity_bytes == 2 * B and dram.view(int(locs[0]), B).tobytes() == P(0)


def test_bad_sizes_are_refused():
    with pytest.raises(InvalidArgument):
        DramTier(0)
    t = DramTier(2 * B, page_bytes=B)
    try:
        with pytest.raises(InvalidArgument):
            t.footprint(B + 1)  # larger than a page
    finally:
        t.close()


def test_populate_backs_the_whole_slab_and_what_a_resize_adds():
    """``populate``: every byte of the slab is backed by memory when it is
    created, and the pages a resize adds before they hold anything; without
    it the file stays sparse until blocks land."""
    cap = 64 * B
    sparse = DramTier(cap, page_bytes=16 * B)
    full = DramTier(cap, page_bytes=16 * B, populate=True)
    try:
        assert os.stat(sparse.path).st_blocks * 512 < cap
        assert os.stat(full.path).st_blocks * 512 >= cap
        loc = full.allocate(B, 1)
        full.write(loc, [P(1)])
        full.resize(2 * cap)
        assert os.stat(full.path).st_blocks * 512 >= 2 * cap
        out = bytearray(B)
        assert full.read_into(loc, np.array([B]), np.array([checksum(P(1))], np.uint64), [out]).all()
        assert bytes(out) == P(1)  # backing the added pages left the stored block alone
    finally:
        sparse.close()
        full.close()


def test_populate_that_the_host_cannot_back_is_a_clear_error(monkeypatch):
    """A slab the host cannot back is refused at creation (CapacityError,
    and no file is left behind); a resize it cannot back leaves the tier as
    it was."""
    def no_room(fd, off, n):
        raise OSError(28, "No space left on device")

    t = DramTier(16 * B, page_bytes=4 * B, populate=True)
    try:
        with monkeypatch.context() as m:
            m.setattr(os, "posix_fallocate", no_room)
            mine = f"kvstore-{os.getuid()}-{os.getpid()}-"  # (other processes' slabs come and go meanwhile)
            before = set(os.listdir("/dev/shm"))
            with pytest.raises(CapacityError, match="dram.populate"):
                DramTier(16 * B, page_bytes=4 * B, populate=True)
            assert {n for n in set(os.listdir("/dev/shm")) - before if n.startswith(mine)} == set()
            with pytest.raises(CapacityError, match="cannot grow"):
                t.resize(32 * B)
        assert t.capacity_bytes == 16 * B and os.stat(t.path).st_size == 16 * B
        t.resize(32 * B)  # room again: it grows, backed
        assert os.stat(t.path).st_blocks * 512 >= 32 * B
    finally:
        t.close()


_SHRINK_UNDER_A_READER = """
import mmap, os
import numpy as np
from tiers.dram import DramTier
B = 4096
t = DramTier(4 * B, page_bytes=B, copy_threads=1)
top = t.allocate(B, 4)
t.write(top, [bytes([i + 1]) * B for i in range(4)])
fd = os.open(t.path, os.O_RDONLY)
client = np.frombuffer(mmap.mmap(fd, 4 * B, access=mmap.ACCESS_READ), np.uint8)  # a client's mapping
os.close(fd)
loc = int(top.max())
assert client[loc] != 0
t.free(top[2:])
t.resize(2 * B)
backed = t.host_room()[0]
print(int(client[loc : loc + B].max()), os.fstat(t._fd).st_size, backed <= 2 * B, flush=True)
t.resize(4 * B)  # grows back in place: the kept blocks are still there
print(t.view(int(top[0]), B).tobytes() == bytes([1]) * B, os.fstat(t._fd).st_size)
t.close()
"""


def test_a_shrink_keeps_the_file_so_a_reader_of_a_retired_page_sees_zeros_not_sigbus():
    """A same-host client reading without a lease (kvstore/client/shared.py)
    may still be copying a block out of a page a shrink retires: the file
    keeps its size (reading past its end would be a SIGBUS that kills the
    client), and the retired pages' memory goes back to the host, so the
    reader sees zeros (a checksum mismatch: a miss)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SHRINK_UNDER_A_READER], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                         timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["0", str(4 * B), "True", "True", str(4 * B)]
