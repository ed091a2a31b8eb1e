"""``SlabMapping.prefault`` maps the pages a slab file holds, and never
fills in the pages it does not (a sparse slab stays sparse)."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from kvstore.checksum import HAVE_NATIVE
from kvstore.wire.shm import SlabMapping

PAGE = os.sysconf("SC_PAGESIZE")


@pytest.fixture
def sparse_slab():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if base is None:
        pytest.skip("no /dev/shm")
    path = os.path.join(base, f"kvstore-test-prefault-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 256 * PAGE)
        for p in (3, 4, 5, 100, 255):  # five pages written; the rest are holes
            os.pwrite(fd, bytes([p]) * PAGE, p * PAGE)
        yield path
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.skipif(not HAVE_NATIVE, reason="kvstore._native is not built")
def test_prefault_maps_resident_pages_only(sparse_slab):
    before = os.stat(sparse_slab).st_blocks
    m = SlabMapping(sparse_slab, 0)
    try:
        assert m.prefault() == 5
        assert os.stat(sparse_slab).st_blocks == before  # no hole filled in
        assert m.buf[100 * PAGE] == 100 and m.buf[255 * PAGE + PAGE - 1] == 255
        m.prefault_in_background().join(10)
        assert os.stat(sparse_slab).st_blocks == before
    finally:
        m.close()


def test_prefault_of_a_closed_mapping_does_nothing(sparse_slab):
    m = SlabMapping(sparse_slab, 0)
    m.close()
    assert m.prefault() == 0
    assert isinstance(m.buf, np.ndarray)
