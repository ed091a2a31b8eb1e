"""``--code-revision``: with ``--trust-remote-code`` and a Hugging Face
repository id, vLLM runs the repository's code (here its config class,
whose defaults fill what ``config.json`` leaves out) from that revision,
not from the weights' snapshot that the weights digest covers. Another code
revision may compute other KV, so it must be another namespace; the same
code (the revision the weights come from) keeps it.

One vLLM-environment process builds vLLM's ``ModelConfig`` for a repository
id of a local Hugging Face cache (offline, as vLLM does online: ``EngineArgs``
would turn the id into the snapshot's path offline, where the code revision
plays no part) and records the connector's namespace and vLLM's resolved
config value.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from kvstore.keys import Namespace
from tests.support.vllm_servers import VLLM_PY, vllm_env
from tests.vllm.conftest import require_vllm

PROBE = r"""
import json, sys
from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
from engine_adapter.vllm_common import ConnectorIdentity

ktc = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both", kv_connector_module_path="engine_adapter.vllm",
                       kv_connector_extra_config={"tenant": "tests", "digest_cache": sys.argv[1]})
out = {}
for name, rev in (("none", None), ("other", "other"), ("same", "main")):
    mc = ModelConfig(model="kvtest/remote-code", trust_remote_code=True, code_revision=rev, dtype="float32")
    ns = ConnectorIdentity(VllmConfig(model_config=mc, kv_transfer_config=ktc), None).ns
    out[name] = {"ns": ns.to_dict() if ns else None, "rms_norm_eps": mc.hf_config.rms_norm_eps}
print(json.dumps(out))
"""

CODE = '''from transformers import LlamaConfig


class KVTestConfig(LlamaConfig):
    model_type = "kvtest"

    def __init__(self, rms_norm_eps={eps}, **kwargs):
        super().__init__(rms_norm_eps=rms_norm_eps, **kwargs)
'''
MAIN, OTHER = "c" * 40, "d" * 40


@pytest.fixture(scope="module")
def probed(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_vllm()
    work = str(tmp_path_factory.mktemp("vllm-code-revision"))
    repo = os.path.join(work, "hub", "models--kvtest--remote-code")
    os.makedirs(os.path.join(repo, "refs"))
    for ref, commit, eps in (("main", MAIN, "1e-6"), ("other", OTHER, "1e-5")):
        snap = os.path.join(repo, "snapshots", commit)
        os.makedirs(snap)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
        with open(os.path.join(snap, "configuration_kvtest.py"), "w") as f:
            f.write(CODE.replace("{eps}", eps))
    snap = os.path.join(repo, "snapshots", MAIN)  # the weights and config.json: at main only
    shutil.copy(os.path.join(tiny_model, "model.safetensors"), snap)
    with open(os.path.join(tiny_model, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("rms_norm_eps")
    cfg.update(model_type="kvtest", auto_map={"AutoConfig": "configuration_kvtest.KVTestConfig"})
    with open(os.path.join(snap, "config.json"), "w") as f:
        json.dump(cfg, f)
    p = subprocess.run([VLLM_PY, "-c", PROBE, os.path.join(work, "digests.json")],
                       env=vllm_env(HF_HUB_CACHE=os.path.join(work, "hub"), HF_MODULES_CACHE=os.path.join(work, "mods"),
                                    VLLM_LOGGING_LEVEL="ERROR"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _ns(probed: dict, name: str) -> Namespace:
    assert probed[name]["ns"] is not None, name
    return Namespace.from_dict(probed[name]["ns"])


def test_another_code_revision_is_another_namespace(probed: dict) -> None:
    assert probed["none"]["rms_norm_eps"] == 1e-6 and probed["other"]["rms_norm_eps"] == 1e-5  # what vLLM runs
    assert _ns(probed, "other") != _ns(probed, "none")


def test_the_weights_revision_as_code_revision_keeps_the_namespace(probed: dict) -> None:
    assert probed["same"]["rms_norm_eps"] == 1e-6
    assert _ns(probed, "same") == _ns(probed, "none")
