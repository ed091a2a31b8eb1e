"""Test keys and payloads: chain-shaped test keys, real block keys of a
random prompt, and deterministic payload bytes."""

from __future__ import annotations

import hashlib

import numpy as np

from kvstore.keys import Namespace, block_keys

__all__ = ["ACME", "chain", "chain_keys", "payload_for"]

ACME = Namespace(tenant="acme", model_id="llama", block_size=16)
"""The namespace the daemon and fault tests key their prompts in."""


def chain(seed: bytes, n: int, parent: bytes = b"") -> list[bytes]:
    """n chained 16-byte test keys (not the product hash: tests of the store
    only need distinct, chain-shaped keys)."""
    out = []
    prev = parent or hashlib.blake2b(seed, digest_size=16).digest()
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        out.append(prev)
    return out


def chain_keys(seed: int, n: int, ns: Namespace = ACME) -> list[bytes]:
    """The real block keys (``kvstore.keys.block_keys``) of a prompt of ``n``
    full blocks of ``ns`` whose tokens are drawn from ``seed`` (ids < 50000):
    the same seed, the same keys, in every test file."""
    toks = np.random.default_rng(seed).integers(0, 50000, size=n * ns.block_size)
    return block_keys(ns, toks)


def payload_for(ns_tag: bytes, key: bytes, size: int) -> bytes:
    """Deterministic, distinct bytes for (namespace, key)."""
    block = hashlib.blake2b(ns_tag + key, digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]
