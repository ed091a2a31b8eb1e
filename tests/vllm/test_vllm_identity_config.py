"""Cache identity from vLLM's own engine config (no engine): what a vLLM
flag changes in the model config vLLM computes with must change the
connector's namespace, and what does not change the KV must not.

One vLLM-environment process builds each case's config as ``vllm serve``
does (``EngineArgs(...).create_engine_config()``) over copies of the tiny
Llama and records the namespace the connector derives
(``ConnectorIdentity``), its layout tag and vLLM's resolved config values.
Cases:

- ``--disable-sliding-window`` on a model whose config has a window: vLLM
  drops the window (full attention: other KV past it), so a new namespace;
- ``--hf-config-path`` naming a Hugging Face repository (here a local
  cache snapshot, offline) whose config differs from the model directory's:
  the namespace is that config's, not the model directory's;
- ``--quantization-config``: part of the KV schema; ``--model-class-overrides``
  (code the namespace cannot name): no namespace, nothing cached;
- ``--generation-config``, ``--max-model-len``, ``--tokenizer`` (another
  directory, same token ids) and prefix caching off change no KV: the same
  namespace;
- the vLLM version (another version may compute other KV): part of the
  namespace, unless the connector's ``engine_version`` names the version
  to hash in its place;
- the Mistral config format (``--config-format mistral``, or a directory
  with ``consolidated*.safetensors`` and ``params.json`` under ``auto``):
  vLLM reads ``params.json`` over ``config.json`` (another model class,
  other values), so the namespace is that file's;
- ``--hf-overrides`` of a dict-valued field (vLLM 0.32's way to set RoPE
  scaling): vLLM sets the field to the given dict (it merges only nested
  configs), so an override that leaves out a key of the config's dict
  (here YaRN's ``beta_fast``) runs with that key's default: a new
  namespace, although merging it into the config gives the config back;
- ``--load-format safetensors``, ``--logits-processors``, ``--tokenizer-mode``
  and ``--code-revision`` on a local directory change no KV: the same
  namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from kvstore.identity import engine_namespace, vllm_layout_tag
from kvstore.keys import Namespace
from tests.support.vllm_servers import VLLM_PY, vllm_env
from tests.vllm.conftest import require_vllm

PROBE = r"""
import json, sys
import vllm
from vllm.engine.arg_utils import EngineArgs
from engine_adapter.vllm_common import ConnectorIdentity

out = {"vllm_version": vllm.__version__}
for name, kw in json.loads(sys.argv[1]).items():
    extra = {"tenant": "tests", "digest_cache": sys.argv[2], **kw.pop("extra", {})}
    KTC = {"kv_connector": "KVStoreConnector", "kv_role": "kv_both", "kv_connector_module_path": "engine_adapter.vllm",
           "kv_connector_extra_config": extra}
    vc = EngineArgs(kv_transfer_config=KTC, dtype="float32", **kw).create_engine_config()
    try:
        ident = ConnectorIdentity(vc, None)
    except ValueError as e:
        out[name] = {"error": str(e)}
        continue
    ns = ident.ns
    mc = vc.model_config
    out[name] = {"ns": ns.to_dict() if ns else None, "layout_tag": ident.layout_tag,
                 "arch": mc.architecture, "rms_norm_eps": getattr(mc.hf_config, "rms_norm_eps", None),
                 "sliding_window": getattr(mc.hf_text_config, "sliding_window", None),
                 "rope": dict(getattr(mc.hf_config, "rope_parameters", None) or {})}
print(json.dumps(out))
"""

SNAPSHOT = "a" * 40
THETA = 500000.0
PARAMS = {"dim": 256, "n_layers": 4, "head_dim": 64, "hidden_dim": 512, "n_heads": 4, "n_kv_heads": 2,
          "norm_eps": 1e-5, "vocab_size": 1024, "rope_theta": THETA, "max_position_embeddings": 4096}
"""The tiny Llama's ``params.json`` (Mistral format): another norm epsilon and RoPE base than its
``config.json``."""
MIN_P = "vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor"
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 1024}


def _edit(d: str, **fields) -> None:
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)


@pytest.fixture(scope="module")
def probed(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_vllm()
    work = str(tmp_path_factory.mktemp("vllm-identity-config"))
    base = shutil.copytree(tiny_model, os.path.join(work, "base"))
    win = shutil.copytree(tiny_model, os.path.join(work, "win"))
    _edit(win, sliding_window=256, layer_types=["sliding_attention"] * 4)
    theta = shutil.copytree(tiny_model, os.path.join(work, "theta"))  # the same weights, the hub config
    with open(os.path.join(theta, "config.json")) as f:
        rope = json.load(f)["rope_parameters"]
    _edit(theta, rope_parameters={**rope, "rope_theta": THETA})
    repo = os.path.join(work, "hub", "models--kvtest--other-config")
    os.makedirs(os.path.join(repo, "snapshots", SNAPSHOT))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(SNAPSHOT)
    shutil.copy(os.path.join(theta, "config.json"), os.path.join(repo, "snapshots", SNAPSHOT, "config.json"))
    mistral = shutil.copytree(tiny_model, os.path.join(work, "mistral"))  # config.json and params.json
    with open(os.path.join(mistral, "params.json"), "w") as f:
        json.dump(PARAMS, f)
    mistral_auto = shutil.copytree(mistral, os.path.join(work, "mistral-auto"))  # + consolidated weights
    shutil.copy(os.path.join(mistral, "model.safetensors"), os.path.join(mistral_auto, "consolidated.safetensors"))
    yarn = shutil.copytree(tiny_model, os.path.join(work, "yarn"))
    _edit(yarn, rope_parameters={**YARN, "beta_fast": 64.0})
    tok = os.path.join(work, "tokenizer-only")
    os.makedirs(tok)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model, name), tok)
    cases = {"base": {"model": base}, "win": {"model": win},
             "win_off": {"model": win, "disable_sliding_window": True},
             "cfg_path": {"model": base, "hf_config_path": "kvtest/other-config"}, "theta": {"model": theta},
             "gen_config": {"model": base, "generation_config": "vllm"},
             "max_len": {"model": base, "max_model_len": 512},
             "tokenizer": {"model": base, "tokenizer": tok},
             "no_prefix_caching": {"model": base, "enable_prefix_caching": False},
             "quant_config": {"model": base, "quantization_config": {"ignore": ["lm_head"]}},
             "quant_config2": {"model": base, "quantization_config": {"ignore": ["model.embed_tokens"]}},
             "class_override": {"model": base, "model_class_overrides": {
                 "LlamaForCausalLM": "vllm.model_executor.models.llama:LlamaForCausalLM"}},
             "engine_a": {"model": base, "extra": {"engine_version": "0.0.1-a"}},
             "engine_b": {"model": base, "extra": {"engine_version": "0.0.1-b"}},
             "engine_a2": {"model": base, "extra": {"engine_version": "0.0.1-a"}},
             "engine_empty": {"model": base, "extra": {"engine_version": ""}},
             "mistral_hf": {"model": mistral}, "mistral_fmt": {"model": mistral, "config_format": "mistral"},
             "mistral_auto": {"model": mistral_auto},
             "mistral_auto_hf": {"model": mistral_auto, "config_format": "hf"},
             "load_format": {"model": base, "load_format": "safetensors"},
             "logits_processors": {"model": base, "logits_processors": [MIN_P]},
             "tokenizer_mode": {"model": base, "tokenizer_mode": "hf"},
             "code_revision": {"model": base, "code_revision": "other"},
             "yarn": {"model": yarn}, "yarn_partial": {"model": yarn, "hf_overrides": {"rope_parameters": YARN}}}
    digests = os.path.join(work, "digests.json")
    p = subprocess.run([VLLM_PY, "-c", PROBE, json.dumps(cases), digests],
                       env=vllm_env(HF_HUB_CACHE=os.path.join(work, "hub"), VLLM_LOGGING_LEVEL="ERROR"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["dirs"] = {"base": base, "win": win, "theta": theta, "mistral": mistral, "mistral_auto": mistral_auto, "yarn": yarn,
                   "digests": digests}
    return out


def _ns(probed: dict, name: str) -> Namespace:
    ns = probed[name]["ns"]
    assert ns is not None, name
    return Namespace.from_dict(ns)


def _router(probed: dict, model: str, **kw) -> Namespace:
    """What the router computes for a backend of these settings."""
    return engine_namespace(probed["dirs"][model], block_size=128, kv_dtype="float32", compute_dtype="float32",
                            tenant="tests", layout_tag=probed["base"]["layout_tag"],
                            digest_cache=probed["dirs"]["digests"], **kw)


def test_disable_sliding_window_is_a_new_namespace(probed: dict) -> None:
    assert probed["win"]["sliding_window"] == 256 and probed["win_off"]["sliding_window"] is None  # what vLLM runs
    win, off = _ns(probed, "win"), _ns(probed, "win_off")
    assert win.weights_digest == off.weights_digest
    assert win.model_id != off.model_id
    assert off != _ns(probed, "base")  # (the window's config otherwise differs from the base's)
    # the router, told the backends run with the window off, computes the same namespace
    assert _router(probed, "win", disable_sliding_window=True) == off
    assert _router(probed, "win") == win


def test_hf_config_path_of_a_hub_repository_is_the_config_used(probed: dict) -> None:
    assert probed["cfg_path"]["rope"]["rope_theta"] == THETA  # vLLM computes with the other config
    assert probed["base"]["rope"]["rope_theta"] != THETA
    cfg = _ns(probed, "cfg_path")
    assert cfg != _ns(probed, "base")
    assert cfg == _ns(probed, "theta")  # the same weights and config as a plain directory


def test_a_quantization_config_is_part_of_the_namespace(probed: dict) -> None:
    # --quantization-config (online quantization specs and ignore patterns; on a GPU it also
    # quantizes what a pre-quantized checkpoint left unquantized) changes what is computed:
    # the CPU backend accepts only the ignore list, which stands for any config here
    base, q1, q2 = _ns(probed, "base"), _ns(probed, "quant_config"), _ns(probed, "quant_config2")
    assert len({base.schema_version, q1.schema_version, q2.schema_version}) == 3
    assert q1.weights_digest == base.weights_digest and q1.model_id == base.model_id


def test_a_model_class_override_is_not_cached(probed: dict) -> None:
    # --model-class-overrides runs another class (code the namespace cannot name): no namespace,
    # so every request is a miss and nothing is saved
    assert probed["class_override"]["ns"] is None


@pytest.mark.parametrize("case", ["gen_config", "max_len", "tokenizer", "no_prefix_caching", "load_format",
                                  "logits_processors", "tokenizer_mode", "code_revision"])
def test_settings_that_do_not_change_the_kv_keep_the_namespace(probed: dict, case: str) -> None:
    assert _ns(probed, case) == _ns(probed, "base")
    assert _router(probed, "base") == _ns(probed, "base")


def test_the_vllm_version_is_part_of_the_namespace_unless_overridden(probed: dict) -> None:
    # an upgrade may change the KV (a fixed kernel, another RoPE or attention backend): by default
    # the namespace carries vLLM's version, so an upgraded engine starts a new (cold) namespace
    version = probed["vllm_version"]
    base, a, b = _ns(probed, "base"), _ns(probed, "engine_a"), _ns(probed, "engine_b")
    assert probed["base"]["layout_tag"].endswith(f"|vllm={version}")
    assert len({base, a, b}) == 3  # two versions, two namespaces
    assert a.schema_version != base.schema_version and a.model_id == base.model_id
    assert _ns(probed, "engine_a2") == a  # an operator's override: one namespace whatever vLLM runs
    assert "engine_version" in probed["engine_empty"]["error"]
    # the router, told the backends' version, computes the connector's namespace
    tag = vllm_layout_tag("cpu", probed["base"]["layout_tag"].split("|")[2], engine_version="0.0.1-a")
    assert engine_namespace(probed["dirs"]["base"], block_size=128, kv_dtype="float32", compute_dtype="float32",
                            tenant="tests", layout_tag=tag, digest_cache=probed["dirs"]["digests"]) == a


def test_the_mistral_config_format_is_the_config_used(probed: dict) -> None:
    # vLLM reads params.json (over config.json's fields) and runs another class with its values
    assert probed["mistral_hf"]["arch"] == "LlamaForCausalLM" and probed["mistral_hf"]["rms_norm_eps"] == 1e-6
    for case in ("mistral_fmt", "mistral_auto"):
        assert probed[case]["arch"] == "MistralForCausalLM" and probed[case]["rms_norm_eps"] == 1e-5
    hf, fmt, auto = _ns(probed, "mistral_hf"), _ns(probed, "mistral_fmt"), _ns(probed, "mistral_auto")
    assert fmt != hf and fmt.weights_digest == hf.weights_digest
    assert auto != _ns(probed, "mistral_auto_hf")
    assert probed["mistral_auto_hf"]["arch"] == "LlamaForCausalLM"
    # the router, told the backends' config format (or detecting it as vLLM does), agrees
    assert _router(probed, "mistral", config_format="mistral") == fmt
    assert _router(probed, "mistral") == hf
    assert _router(probed, "mistral_auto") == auto
    assert _router(probed, "mistral_auto", config_format="hf") == _ns(probed, "mistral_auto_hf")


def test_a_dict_override_replaces_the_field_as_vllm_does(probed: dict) -> None:
    # the override is the whole dict vLLM computes with: YaRN's beta_fast falls back to its default
    assert probed["yarn"]["rope"]["beta_fast"] == 64.0 and "beta_fast" not in probed["yarn_partial"]["rope"]
    partial = _ns(probed, "yarn_partial")
    assert partial != _ns(probed, "yarn") and partial.weights_digest == _ns(probed, "yarn").weights_digest
    assert _router(probed, "yarn", hf_overrides={"rope_parameters": YARN}) == partial
