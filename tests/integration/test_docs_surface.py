"""What README.md and docs/*.md show a user, run against a real daemon: the
README's Python example as written, and the Admin calls' documented errors."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import AsyncClient, Client
from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.keys import Namespace

ROOT = Path(__file__).resolve().parents[2]


def test_readme_python_example_runs(daemon) -> None:
    """The README's example block, with the names it leaves to the reader
    (``token_ids``, ``payloads``, ``use``) bound, and the daemon's address."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block is not None
    code = block.group(1).replace('"127.0.0.1:50051"', repr(daemon.target))
    seen: list[list[object]] = []
    env = {"token_ids": list(range(100)), "payloads": [np.full(4096, i, np.uint8) for i in range(6)],
           "use": seen.append}
    exec(compile(code, "README.md", "exec"), env)  # noqa: S102 - our own README
    assert env["hit"] == 0 and len(seen) == 1 and seen[0] == []  # a fresh daemon: nothing to acquire
    exec(compile(code, "README.md", "exec"), env)  # noqa: S102 - the second run hits what the first put
    assert env["hit"] == 6 and [int(v[0]) for v in seen[1]] == list(range(6))  # type: ignore[index]



@pytest.mark.parametrize("use_shm", [True, False])
def test_put_of_no_blocks_is_an_empty_answer(daemon, use_shm: bool) -> None:
    """The README's ``c.put(ns, keys[hit:], ...)`` when every block hit: an empty
    batch answers [] (it was INVALID_ARGUMENT on the shared-memory path)."""
    ns = Namespace(tenant="t", model_id="m", block_size=4)
    with Client(daemon.target, use_shm=use_shm) as c:
        assert c.put(ns, [], []) == [] and c.put(ns, b"", []) == []

    async def run() -> list[KeyStatus]:
        async with AsyncClient(daemon.target, use_shm=use_shm) as a:
            return await a.put(ns, [], [])

    assert asyncio.run(run()) == []


def test_resize_of_a_tier_that_cannot_be_resized_is_invalid_argument(daemon) -> None:
    """docs/daemon.md: ResizeTier resizes DRAM or SSD (HBM where configured); ``remote``
    is not a tier of this daemon to resize: INVALID_ARGUMENT, not NOT_FOUND."""
    with Client(daemon.target) as c:
        with pytest.raises(InvalidArgument, match="dram, ssd, hbm"):
            c.admin_resize("remote", 1 << 30)
