"""Every product package stays mypy clean (DESIGN.md section 5); the same
run as ``make typecheck``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ["kvstore", "tiers", "transport", "admission", "engine_adapter", "router"]
"""The packages ``make typecheck`` checks; one not (yet) in the tree is skipped."""


@pytest.mark.subprocess
def test_product_is_mypy_clean() -> None:
    pytest.importorskip("mypy")
    present = [p for p in PRODUCT if (ROOT / p).is_dir()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "mypy", *present], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]
