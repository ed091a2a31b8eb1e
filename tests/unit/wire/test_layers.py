"""Imports point one way (DESIGN.md section 2): the daemon uses wire, never
the client; the client uses wire, never the daemon; wire uses neither; and
the router inside an engine reaches the daemon only through the client
(no protobuf)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("package,forbidden", [
    ("kvstore/wire", ("kvstore.daemon", "kvstore.client")),
    ("kvstore/client", ("kvstore.daemon",)),
    ("kvstore/daemon", ("kvstore.client",)),
])
def test_package_does_not_import(package: str, forbidden: tuple[str, ...]) -> None:
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in sorted((ROOT / package).glob("*.py"))
           for m in sorted(_imports(p)) if m.startswith(forbidden)]
    assert not bad, bad


def test_router_uses_the_client_not_proto() -> None:
    mods = _imports(ROOT / "engine_adapter" / "router.py")
    assert not [m for m in mods if m.startswith("proto")], mods
