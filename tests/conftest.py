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
