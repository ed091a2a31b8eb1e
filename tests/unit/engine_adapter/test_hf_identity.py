"""The Hugging Face adapter's namespace names the library versions that
compute its KV (transformers and torch): an upgrade of either is a new
namespace, unless the operator names one ``engine_version`` for both."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("transformers")

from engine_adapter.hf import build_model, llama_config, model_namespace  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return build_model(llama_config(num_hidden_layers=1), seed=0)


def transformers():
    """The transformers module as imported now (it replaces its own ``sys.modules`` entry as it loads)."""
    return sys.modules["transformers"]


def test_a_transformers_upgrade_is_a_new_namespace(model, monkeypatch: pytest.MonkeyPatch) -> None:
    before = model_namespace(model, tenant="t", digest="w")
    monkeypatch.setattr(transformers(), "__version__", "0.0.1-other")
    after = model_namespace(model, tenant="t", digest="w")
    assert after != before
    assert after.model_id == before.model_id and after.weights_digest == before.weights_digest


def test_a_torch_upgrade_is_a_new_namespace(model, monkeypatch: pytest.MonkeyPatch) -> None:
    before = model_namespace(model, tenant="t", digest="w")
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    assert model_namespace(model, tenant="t", digest="w") != before


def test_the_operator_names_one_engine_version_for_both(model, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = model_namespace(model, tenant="t", digest="w", engine_version="hf-stack-1")
    assert pinned != model_namespace(model, tenant="t", digest="w")
    monkeypatch.setattr(transformers(), "__version__", "0.0.1-other")
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    assert model_namespace(model, tenant="t", digest="w", engine_version="hf-stack-1") == pinned
    assert model_namespace(model, tenant="t", digest="w", engine_version="hf-stack-2") != pinned
    for bad in ("", "  ", "x" * 201):
        with pytest.raises(InvalidArgument, match="engine_version"):
            model_namespace(model, tenant="t", digest="w", engine_version=bad)
