"""The connector's ``kv_connector_extra_config``: a key it does not read is
refused when vLLM builds the connector, naming it. A misspelt ``tenant``
(``tennant``) used to share the engine's blocks under the default tenant,
and a misspelt ``target`` used the default daemon, without a word. Every key
it reads is named in ``KVStoreConnector``'s docstring and in docs/vllm.md.
Runs in the vLLM environment's python, without an engine."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.support.vllm_servers import VLLM_PY, vllm_env
from tests.vllm.conftest import require_vllm

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
from types import SimpleNamespace as NS
from engine_adapter.vllm_common import EXTRA_KEYS, extra_config
from engine_adapter.vllm import KVStoreConnector

def outcome(extra):
    try:
        return {"ok": True, "extra": extra_config(NS(kv_transfer_config=NS(kv_connector_extra_config=extra)))}
    except ValueError as e:
        return {"ok": False, "error": str(e)}

print(json.dumps({"keys": sorted(EXTRA_KEYS), "doc": KVStoreConnector.__doc__,
                  "good": outcome({"target": "127.0.0.1:1", "tenant": "acme", "timeout": 2.0}),
                  "none": outcome(None), "typo": outcome({"target": "127.0.0.1:1", "tennant": "acme"})}))
"""


def test_an_unknown_extra_config_key_is_refused_naming_it() -> None:
    require_vllm()
    p = subprocess.run([VLLM_PY, "-c", PROBE], env=vllm_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["good"] == {"ok": True, "extra": {"target": "127.0.0.1:1", "tenant": "acme", "timeout": 2.0}}
    assert got["none"] == {"ok": True, "extra": {}}
    assert got["typo"]["ok"] is False
    assert "tennant" in got["typo"]["error"] and "tenant" in got["typo"]["error"]
    doc = " ".join(got["doc"].split())
    guide = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8")
    assert [k for k in got["keys"] if f"``{k}``" not in doc] == []
    assert [k for k in got["keys"] if f"`{k}`" not in guide] == []
