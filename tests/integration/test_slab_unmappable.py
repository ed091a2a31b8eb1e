"""A same-host client that cannot map the daemon's slab (an OSError at
attach: the file gone, a limit hit) falls back to inline bytes, and says
so: one warning per slab path and errno, with both, and ``view`` names the
reason instead of guessing "another host"."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import KeyStatus, Unavailable
from kvstore.keys import Namespace, block_keys
from tests.conftest import payload_for

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BS = 16 * 1024


def test_a_slab_that_cannot_be_mapped_is_logged_and_named_by_view(make_daemon, caplog) -> None:
    d = make_daemon()
    path = d.store.dram.path
    hidden = path + ".hidden"
    keys = block_keys(NS, np.arange(2 * 16, dtype=np.int64))
    os.rename(path, hidden)  # the daemon keeps its mapping; the path is gone (as after a wrong sweep)
    try:
        with caplog.at_level(logging.DEBUG, logger="kvstore.client"):
            with Client(d.target) as c, Client(d.target) as c2:
                assert c.slab is None and c2.slab is None
                with pytest.raises(Unavailable) as e:
                    c.view(0, 16)
                msg = str(e.value)
                assert path in msg and f"errno {errno.ENOENT}" in msg and "another host" not in msg, msg
                # the fallback still works: inline bytes, nothing lost
                assert c.put(NS, keys, [payload_for(b"u", k, BS) for k in keys]) == [KeyStatus.OK] * 2
                assert [g.tobytes() for g in c2.get(NS, keys)] == [payload_for(b"u", k, BS) for k in keys]
    finally:
        os.rename(hidden, path)
    warned = [r for r in caplog.records if r.name == "kvstore.client" and r.levelno == logging.WARNING
              and path in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]  # once, not once per client
    assert f"errno {errno.ENOENT}" in warned[0].getMessage()


def test_view_without_shm_says_use_shm_false(daemon) -> None:
    with Client(daemon.target, use_shm=False) as c:
        with pytest.raises(Unavailable, match="use_shm=False"):
            c.view(0, 16)
