"""Session-wide test setup: the repository root on sys.path, shared
fixtures, and the markers that sort the suite (``make test-fast`` runs
``-m "not slow"``; see tests/README.md):

- every test under ``integration/``, ``faults/`` and ``vllm/`` is ``slow``;
- unit tests that start a process are ``subprocess`` and ``slow``: those
  marked ``@pytest.mark.subprocess`` in their file, and those listed in
  ``SUBPROCESS_TESTS`` here (files other packages own);
- ``gpu`` tests skip without CUDA.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from tests.support.keys import chain, payload_for  # noqa: E402  (after the sys.path line)

__all__ = ["chain", "payload_for"]  # their home is tests.support.keys; old imports keep working

TESTS = Path(__file__).resolve().parent
SLOW_DIRS = frozenset({"integration", "faults", "vllm"})
"""Top-level test directories whose every test is slow (real daemons, processes, models)."""
SUBPROCESS_TESTS = frozenset({
    ("unit/kvstore/test_keys.py", "test_keys_identical_in_fresh_process"),
    ("unit/tiers/test_ssd.py", "test_sigkill_during_writes_leaves_whole_blocks"),
    ("unit/transport/test_ucx.py", "test_in_process_round_trip_over_real_ucxx"),
})
"""Unit tests (file under tests/, function) that start a process."""


@pytest.fixture
def ns():
    from kvstore.keys import Namespace

    return Namespace(tenant="t", model_id="m", block_size=4)


@pytest.fixture
def ns2():
    from kvstore.keys import Namespace

    return Namespace(tenant="u", model_id="m", block_size=4)


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark slow tests by directory and by process start (module docstring);
    tests marked ``gpu`` skip cleanly on a machine without CUDA."""
    for it in items:
        try:
            rel = it.path.resolve().relative_to(TESTS)
        except ValueError:
            continue
        starts_process = (rel.as_posix(), getattr(it, "originalname", it.name)) in SUBPROCESS_TESTS
        if starts_process:
            it.add_marker(pytest.mark.subprocess)
        if rel.parts[0] in SLOW_DIRS or starts_process or it.get_closest_marker("subprocess") is not None:
            it.add_marker(pytest.mark.slow)
    gpu = [it for it in items if it.get_closest_marker("gpu") is not None]
    if gpu and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for it in gpu:
            it.add_marker(skip)


def _kvstore_slabs() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"kvstore-{os.getuid()}-")}
    except FileNotFoundError:
        return set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(scope="session", autouse=True)
def _remove_slabs_of_killed_daemons():
    """Daemons the tests SIGKILL leave their slab in /dev/shm (by design:
    docs/security.md, "Restarts"). At the end of the session, remove the
    slabs created during it whose daemon (the pid in the name
    ``kvstore-<uid>-<pid>-<rand>``) is gone, so test runs do not fill
    /dev/shm. Slabs of live processes and older ones are left alone."""
    before = _kvstore_slabs()
    yield
    for name in sorted(_kvstore_slabs() - before):
        try:
            pid = int(name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
