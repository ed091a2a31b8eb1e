"""Fixtures for the vLLM tests: vLLM runs in subprocesses with the separate
environment ``.venv-vllm`` (``make vllm-env``); these tests skip, saying so,
only when that environment is absent."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from tests.support.vllm_servers import VLLM_PY, make_tiny_model, vllm_env

HERE = os.path.dirname(os.path.abspath(__file__))


ADAPTER_WRITER = r'''
def write(d, payload):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}, f)
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(payload)
'''
"""For the LoRA probes (run with the vLLM environment's python): ``write(dir,
payload)`` lays out a minimal PEFT adapter (its config and one weights file)."""


def run_lora_probe(probe: str, work: str) -> dict[str, Any]:
    """Run a LoRA probe script with the vLLM environment's python in
    ``work`` (its digest cache there too); its last stdout line, as JSON."""
    require_vllm()
    p = subprocess.run([VLLM_PY, "-c", probe, work],
                       env=vllm_env(KVSTORE_DIGEST_CACHE=os.path.join(work, "digests.json"),
                                    VLLM_LOGGING_LEVEL="ERROR"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def require_vllm() -> None:
    if not os.access(VLLM_PY, os.X_OK):
        pytest.skip(f"no vLLM environment at {VLLM_PY} (build it with `make vllm-env`)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama, built once per session with the vLLM environment's python."""
    require_vllm()
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


def run_phase(spec: dict[str, Any], workdir: str, name: str, timeout: float = 600, **env: str) -> dict[str, Any]:
    """Run one vLLM process (tests/vllm/phase.py) and return its JSON result."""
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    out_path = os.path.join(workdir, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    p = subprocess.run([VLLM_PY, os.path.join(HERE, "phase.py"), spec_path, out_path], env=vllm_env(**env),
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 or not os.path.exists(out_path):
        raise AssertionError(f"vLLM phase {name} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    with open(out_path) as f:
        return json.load(f)
