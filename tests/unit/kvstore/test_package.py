"""``kvstore/__init__``: the public API loads lazily (a leaf import pulls no
grpc), every public name resolves, and the typed stub names the same things."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore

ROOT = Path(__file__).resolve().parents[3]


def test_every_public_name_resolves() -> None:
    for name in kvstore.__all__:
        assert getattr(kvstore, name) is not None, name
    assert kvstore.Namespace is kvstore.keys.Namespace
    assert kvstore.InvalidArgument is kvstore.errors.InvalidArgument
    assert set(kvstore.__all__) <= set(dir(kvstore))


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvstore.nope  # noqa: B018
    from kvstore import _native  # a submodule still imports (when built) through the normal machinery  # noqa: F401


def test_stub_names_what_the_package_exports() -> None:
    tree = ast.parse((ROOT / "kvstore" / "__init__.pyi").read_text())
    names = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
    names |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert names == set(kvstore.__all__) | {"__all__"}


@pytest.mark.subprocess
def test_leaf_imports_pull_no_grpc() -> None:
    code = ("import sys, kvstore, kvstore.errors, kvstore.keys; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'torch') "
            "or m.startswith(('kvstore.client', 'kvstore.daemon', 'kvstore.core'))); "
            "print(' '.join(bad)); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
