"""The vLLM version is part of a backend's namespace (an upgrade may change
the KV): the router learns each backend's version from vLLM's
``GET /version`` on its health checks and hashes that backend's keys in the
namespace of that version; a model's ``engine_version`` pins it; a backend
whose version is unknown is predicted a miss, never a hit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.results import Event, EventKind
from kvstore.keys import Namespace
from router.cache_view import CacheView
from router.config import ModelSpec
from router.prompts import Endpoint, keys_at, request_tokens
from tests.unit.router.test_route_unit import BS, Rig, model_dir, prompt  # noqa: F401  (fixture)
from tiers.base import TierKind


def versioned_ns(spec: ModelSpec) -> Namespace:
    return Namespace(tenant=spec.namespace_tenant, model_id=f"tiny-test@{spec.engine_version}",
                     kv_dtype=spec.kv_dtype, block_size=spec.block_size)


@pytest.fixture
def vrig(model_dir: str) -> Iterator[Rig]:  # noqa: F811
    r = Rig(model_dir, namespace_fn=versioned_ns)
    yield r
    r.close()


def hold_at(rig: Rig, name: str, text: str, n_blocks: int, version: str) -> None:
    """Make backend ``name``'s cache view hold the first blocks of ``text`` as a vLLM of ``version`` stored them."""
    b = rig.backend(name)
    if b.cache is None:
        b.cache = CacheView(name, "127.0.0.1:1")
    m = rig.svc.models["tiny"]
    got = keys_at(m, request_tokens(m, Endpoint.COMPLETIONS, {"prompt": text}), version)
    assert got is not None
    b.cache.apply(Event(EventKind.STORED, b"", got[1][:n_blocks], TierKind.DRAM, seq=1))


def hits(rig: Rig, text: str) -> tuple[str, int]:
    r = rig.post({"model": "tiny", "prompt": text, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.headers["x-kvstore-backend"], int(r.headers["x-kvstore-hit-tokens"])


def test_the_routers_namespace_names_the_vllm_version(tmp_path: Any) -> None:
    from kvstore.identity import engine_namespace, vllm_layout_tag
    from router.prompts import shared_namespace

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    common = {"block_size": BS, "kv_dtype": "bfloat16", "weights_digest": "w"}
    a = shared_namespace(ModelSpec("m", str(d), engine_version="0.32.0", **common))
    assert a == engine_namespace(str(d), layout_tag=vllm_layout_tag("cuda", engine_version="0.32.0"), **common)
    assert shared_namespace(ModelSpec("m", str(d), engine_version="0.33.0", **common)) != a


def test_a_backend_is_keyed_in_its_own_vllm_version(vrig: Rig) -> None:
    vrig.fakes["a"].version, vrig.fakes["b"].version = "0.32.0", "0.32.0"
    vrig.wait(lambda: vrig.state()["b"]["engine_version"] == "0.32.0", "b's version")
    text = prompt(400)
    hold_at(vrig, "b", text, 90, "0.32.0")
    assert hits(vrig, text) == ("b", 90 * BS)
    # b is upgraded: the blocks its old vLLM stored are not a hit for the new one
    vrig.fakes["b"].version = "0.33.0"
    vrig.wait(lambda: vrig.state()["b"]["engine_version"] == "0.33.0", "b's new version")
    assert hits(vrig, text)[1] == 0
    hold_at(vrig, "b", text, 50, "0.33.0")
    assert hits(vrig, text) == ("b", 50 * BS)


@pytest.mark.parametrize("answer", [None, 5, "", "x" * 5000])
def test_a_backend_of_unknown_version_is_predicted_a_miss(vrig: Rig, answer: Any) -> None:
    vrig.fakes["a"].version = vrig.fakes["b"].version = answer  # no /version, or one the router cannot use
    text = prompt(400)
    hold_at(vrig, "b", text, 90, "0.32.0")
    vrig.wait(lambda: vrig.state()["b"]["engine_version"] == "", "b's version to be unknown")
    assert vrig.backend("b").healthy  # (in the pool: only its keys are unknown)
    assert hits(vrig, text)[1] == 0
    vrig.fakes["b"].version = "0.32.0"  # it answers: its blocks are hits again
    vrig.wait(lambda: vrig.state()["b"]["engine_version"] == "0.32.0", "b's version")
    assert hits(vrig, text) == ("b", 90 * BS)


def test_a_pinned_engine_version_wins_over_the_backends(model_dir: str) -> None:  # noqa: F811
    r = Rig(model_dir, namespace_fn=versioned_ns,
            models=(ModelSpec("tiny", model_dir, block_size=BS, kv_dtype="float32", max_model_len=600,
                              engine_version="pinned"),))
    try:
        r.fakes["b"].version = "0.33.0"
        r.wait(lambda: r.state()["b"]["engine_version"] == "0.33.0", "b's version")
        text = prompt(400)
        hold_at(r, "b", text, 90, "pinned")
        assert hits(r, text) == ("b", 90 * BS)
        r.fakes["b"].version = None  # even a backend that does not say
        r.wait(lambda: r.state()["b"]["engine_version"] == "", "b's version gone")
        assert hits(r, text) == ("b", 90 * BS)
    finally:
        r.close()
