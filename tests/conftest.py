from __future__ import annotations

import hashlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def chain(seed: bytes, n: int, parent: bytes = b"") -> list[bytes]:
    """n chained 16-byte test keys (not the product hash: tests of the store
    only need distinct, chain-shaped keys)."""
    out = []
    prev = parent or hashlib.blake2b(seed, digest_size=16).digest()
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        out.append(prev)
    return out


def payload_for(ns_tag: bytes, key: bytes, size: int) -> bytes:
    """Deterministic, distinct bytes for (namespace, key)."""
    block = hashlib.blake2b(ns_tag + key, digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly on a machine without CUDA."""
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
