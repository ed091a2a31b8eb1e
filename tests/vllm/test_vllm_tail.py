"""The tail save of a finished request (tests/vllm/tail_check.py, run with
the vLLM environment's python against a real daemon started here): the
connector's scheduler half keeps the blocks (``request_finished`` returns
True), plans the save in the next step, the worker half stores exactly the
full blocks whose every token has KV and reports the request through
``get_finished`` — also when the daemon is down."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.integration.conftest import DaemonThread, wait_healthy
from tests.vllm.conftest import HERE, VLLM_PY, require_vllm, vllm_env

pytestmark = pytest.mark.timeout(600)


def test_finished_request_tail_is_saved_before_its_blocks_are_freed(tmp_path) -> None:
    require_vllm()
    d = DaemonThread({"dram.capacity": "16MiB"})
    try:
        wait_healthy(d.target)
        out = tmp_path / "tail.json"
        p = subprocess.run([VLLM_PY, os.path.join(HERE, "tail_check.py"), d.target, str(out)],
                           env=vllm_env(HF_HUB_CACHE=str(tmp_path / "hub")),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-4000:]
        r = json.loads(out.read_text())
    finally:
        d.stop()
    assert r["finished"] == [True, None]  # blocks kept until the worker says done
    assert r["aborted"] == [False, None]  # an aborted request's KV may be incomplete: no tail
    assert r["plan"] == [["done", 2, [6], True]]  # block 2 only: block 3's last token has no KV
    assert r["sent"] == ["done"] and r["sent_again"] is None
    assert r["worker_stats"]["saved_blocks"] == 1
    assert (r["hit_chain"], r["hit_block2"], r["hit_block3"]) == (3, 1, 0)
    assert r["get"] == ["OK"] and r["bytes_equal"]  # the bytes of vLLM block 6 across both layers
    assert r["bad_ids"] == {"huge": [0, False], "negative": [0, False]}  # a miss, not a crash of vLLM
    assert r["late"] == [True, None] and r["sent_down"] == ["late"] and r["faults_down"] >= 1
    # a LoRA is named by its files: the same files under another name and
    # path share blocks, new files under the same name do not
    lora = r["lora"]
    assert lora["v1"] == [lora["want_v1"], "mine"] and lora["want_v1"].startswith("lora:")
    assert lora["renamed_copy"] == [lora["want_v1"], "other-name"]
    assert lora["v2"][0] != lora["want_v1"]
    # an adapter whose files are not on this host cannot be identified: its requests are not cached
    # (its name alone would give another adapter of that name, elsewhere, these blocks)
    assert lora["missing"] is None and lora["not_cached"] is None
    v1, v2 = lora["kvtest/sql-lora-v1"], lora["kvtest/sql-lora-v2"]
    assert v1 == [lora["want kvtest/sql-lora-v1"], "sql"] and v2 == [lora["want kvtest/sql-lora-v2"], "sql"]
    assert v1[0] != v2[0]
