"""kvstore: a tiered KV-cache store for LLM inference.

The public API, re-exported here **lazily**: ``from kvstore import Client``
imports ``kvstore.client`` (and grpc) on first use, while ``import
kvstore.errors`` or ``from kvstore.keys import Namespace`` loads nothing
but the leaf modules they name. Nothing is imported at package import time,
so no package below can close an import circle through this one.

::

    from kvstore import Client, Namespace, block_keys, errors
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_MODULES: dict[str, str] = {
    "checksum": "kvstore.checksum",
    "config": "kvstore.config",
    "errors": "kvstore.errors",
    "keys": "kvstore.keys",
    "results": "kvstore.results",
}
"""Leaf modules reachable as attributes: ``kvstore.errors``."""

_NAMES: dict[str, str] = {
    # keys: namespaces and block keys
    "Namespace": "kvstore.keys",
    "KVDtype": "kvstore.keys",
    "KVLayout": "kvstore.keys",
    "HashAlgo": "kvstore.keys",
    "block_keys": "kvstore.keys",
    "block_keys_array": "kvstore.keys",
    "first_divergence": "kvstore.keys",
    # errors: the one exception tree and the per-key status
    "KeyStatus": "kvstore.errors",
    "KVStoreError": "kvstore.errors",
    "InvalidArgument": "kvstore.errors",
    "NotFound": "kvstore.errors",
    "CapacityError": "kvstore.errors",
    "Unavailable": "kvstore.errors",
    "DeadlineExceeded": "kvstore.errors",
    "DataLoss": "kvstore.errors",
    "PermissionDenied": "kvstore.errors",
    "Unauthenticated": "kvstore.errors",
    # config
    "Config": "kvstore.config",
    "load_config": "kvstore.config",
    "parse_size": "kvstore.config",
    # clients (grpc)
    "Client": "kvstore.client",
    "AsyncClient": "kvstore.client",
    "Lease": "kvstore.client",
    "Reservation": "kvstore.client",
    # the in-process store
    "StoreConfig": "kvstore.core.store",
    "TieredStore": "kvstore.core.store",
}
"""Public name -> the module that defines it."""

__all__ = sorted([*_MODULES, *_NAMES, "__version__"])
# Type checkers read __init__.pyi (the same names, typed); it imports nothing at run time,
# and import-linter, which reads only .py files, sees no edge from this package to any other.


def __getattr__(name: str) -> Any:
    """Import the module behind a public name on first use, then cache it."""
    if name in _MODULES:
        value: Any = importlib.import_module(_MODULES[name])
    elif name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    else:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
