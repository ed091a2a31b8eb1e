"""The core stays mypy clean (DESIGN.md section 5)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CORE = ["kvstore/errors.py", "kvstore/keys.py", "kvstore/index.py", "kvstore/eviction.py", "kvstore/store.py", "kvstore/holds.py", "kvstore/resize.py", "kvstore/config_fields.py", "kvstore/wire.py",
        "kvstore/config.py", "kvstore/server.py", "kvstore/client.py", "kvstore/shm.py", "kvstore/results.py", "kvstore/auth.py", "kvstore/events.py",
        "kvstore/checksum.py", "kvstore/metrics.py", "tiers/base.py", "tiers/dram.py", "tiers/ssd.py", "tiers/ssd_format.py",
        "tiers/ssd_admit.py", "kvstore/tiering.py", "admission",
        "tiers/slots.py", "tiers/hbm.py", "kvstore/hbm_path.py", "kvstore/hbm_ipc.py"]


def test_core_is_mypy_clean():
    pytest.importorskip("mypy")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "mypy", *CORE], cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
