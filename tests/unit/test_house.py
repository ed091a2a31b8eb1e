"""The house rules that tools check (DESIGN.md sections 2 and 5): the
import contracts in pyproject.toml ([tool.importlinter], run by
``lint-imports``) and the ruff rule set ([tool.ruff]). Each test fails with
the tool's own report, naming the broken contract or the file and rule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's packages, not an installed copy
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.subprocess
def test_import_contracts_are_kept() -> None:
    pytest.importorskip("importlinter")
    out = _run("-c", LINT_IMPORTS, "--no-cache")
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]


@pytest.mark.subprocess
def test_ruff_is_clean() -> None:
    pytest.importorskip("ruff")
    out = _run("-m", "ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]
