"""The core stays mypy clean (DESIGN.md section 5)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CORE = ["kvstore/errors.py", "kvstore/keys.py", "kvstore/core/index.py", "kvstore/core/eviction.py", "kvstore/core/store.py", "kvstore/core/holds.py", "kvstore/core/resize.py", "kvstore/config_fields.py", "kvstore/wire/convert.py",
        "kvstore/config.py", "kvstore/daemon/server.py", "kvstore/client/sync.py", "kvstore/wire/shm.py", "kvstore/results.py", "kvstore/daemon/auth.py", "kvstore/daemon/events.py",
        "kvstore/checksum.py", "kvstore/daemon/metrics.py", "tiers/base.py", "tiers/dram.py", "tiers/ssd.py", "tiers/ssd_format.py",
        "tiers/ssd_admit.py", "kvstore/core/ssd_mover.py", "admission",
        "tiers/slots.py", "tiers/hbm.py", "kvstore/core/hbm_mover.py", "kvstore/wire/hbm_ipc.py",
        "kvstore/namespace.py", "transport", "engine_adapter/connector.py", "engine_adapter/results.py",
        "engine_adapter/layout.py", "engine_adapter/tp.py", "engine_adapter/tp_check.py"]


def test_core_is_mypy_clean():
    pytest.importorskip("mypy")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-m", "mypy", *CORE], cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
