"""vLLM OpenAI servers with the kvstore connector, as the fleet tests
(tests/integration/test_pd.py, test_route_vllm.py) and benches
(bench/pd.py, bench/route.py) start them: the tiny Llama of tests/vllm, one
API server per backend in its own process group (``procs.start_group``: its
engine core goes with it), a health wait that shows the server's log when it
exits, and the connector's JSON-lines stats records."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

import httpx

from tests.support.procs import start_group

__all__ = ["ROOT", "VLLM_PY", "kv_transfer_config", "make_tiny_model", "records", "server_up", "start_server",
           "vllm_env", "wait_servers"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PY = os.environ.get("KVSTORE_VLLM_PY") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
"""The vLLM environment's python (``make vllm-env``)."""


def vllm_env(**extra: str) -> dict[str, str]:
    """This process's environment, offline, with kvstore importable."""
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                "PYTHONPATH": ROOT, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    env.update(extra)
    return env


_BUILT: list[str] = []
"""This process's one build of the tiny Llama (a private directory nobody
edits), which every later ``make_tiny_model`` copies."""


def make_tiny_model(dest: str) -> str:
    """Write the tiny Llama (tests/vllm/tiny_model.py) to ``dest``: built once
    per process (a torch and transformers import in the vLLM environment, the
    cost of the build), then copied, so that each caller owns and may edit its
    own copy (the same bytes: the weights come from a fixed seed)."""
    if not _BUILT:
        cache = tempfile.mkdtemp(prefix="kvstore-tiny-llama-")
        atexit.register(shutil.rmtree, cache, True)
        built = os.path.join(cache, "tiny")
        subprocess.run([VLLM_PY, os.path.join(ROOT, "tests", "vllm", "tiny_model.py"), built], check=True,
                       env=vllm_env(), capture_output=True, timeout=600)
        _BUILT.append(built)
    shutil.copytree(_BUILT[0], dest, dirs_exist_ok=True)
    return dest


def kv_transfer_config(role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for the kvstore connector (``extra``: its
    ``kv_connector_extra_config``); a block failing its checksum is recomputed."""
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "engine_adapter.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def start_server(model: str, port: int, ktc: dict[str, Any], log_path: str, env: dict[str, str] | None = None,
                 max_model_len: int = 2048) -> subprocess.Popen[bytes]:
    """``vllm.entrypoints.openai.api_server`` serving ``model`` as "tiny"
    (float32, eager) on 127.0.0.1:``port``, its output in ``log_path``."""
    log = open(log_path, "wb")
    try:
        return start_group(
            [VLLM_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "tiny",
             "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager", "--host", "127.0.0.1",
             "--port", str(port), "--kv-transfer-config", json.dumps(ktc)],
            env=env if env is not None else vllm_env(VLLM_CPU_OMP_THREADS_BIND="nobind"),
            stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()  # (the child has its own copy)


def server_up(url: str, proc: subprocess.Popen[bytes], log_path: str) -> bool:
    """Whether the HTTP server at ``url`` (vLLM, a router) answers
    ``/health`` with 200; raises, with its log's tail, when it has exited."""
    if proc.poll() is not None:
        with open(log_path, "rb") as f:
            raise RuntimeError(f"the server at {url} exited ({proc.returncode}):\n"
                               f"{f.read()[-4000:].decode(errors='replace')}")
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_servers(servers: dict[str, tuple[str, subprocess.Popen[bytes], str]], timeout: float) -> None:
    """Wait until every server ``name -> (url, process, log path)`` answers
    ``/health`` (vLLM on two shared cores takes minutes); raise when one
    exits or the time is over."""
    deadline = time.monotonic() + timeout
    for name, (url, proc, log_path) in servers.items():
        while not server_up(url, proc, log_path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start within {timeout:.0f} s (log: {log_path})")
            time.sleep(0.5)


def records(path: str) -> list[dict[str, Any]]:
    """The connector's stats lines (``stats_path``) written so far."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
