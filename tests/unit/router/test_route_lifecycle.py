"""The router's edges: a salted request in cluster mode, clients that leave
during a P/D prefill or before a stream's relay, a daemon that restarted
under a cache view, and the background tasks after shutdown."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from kvstore.keys import Namespace
from router.cache_view import CacheView
from router.prompts import Endpoint, request_tokens
from tests.unit.router.test_route_unit import BS, Rig, model_dir, prompt  # noqa: F401  (fixture)
from tiers.base import TierKind


@pytest.fixture
def rig(model_dir: str) -> Iterator[Rig]:  # noqa: F811
    r = Rig(model_dir)
    yield r
    r.close()


class PeerView(CacheView):
    """A cache view whose cluster lookup answers as a daemon's directory
    does: a peer holds blocks per (namespace digest, key); it credits the
    leading run of ``keys`` held under ``ns``."""

    def __init__(self, name: str) -> None:
        super().__init__(name, "127.0.0.1:1")
        self.peer: set[tuple[bytes, bytes]] = set()
        self.asked: list[Namespace] = []

    def cluster_tiers(self, ns: Namespace, keys: Sequence[bytes], local: np.ndarray) -> np.ndarray:
        self.asked.append(ns)
        run = len(local)
        while run < len(keys) and (ns.digest, keys[run]) in self.peer:
            run += 1
        return np.concatenate([local, np.full(run - len(local), int(TierKind.REMOTE), dtype=np.int64)])


# ---------------------------------------------------------------- 1. cache_salt in cluster mode
def test_a_salted_request_is_scored_against_its_own_namespace_on_peers(rig: Rig) -> None:
    a = rig.backend("a")
    a.spec = dataclasses.replace(a.spec, cluster=True)
    view = PeerView("a")
    a.cache = view
    m = rig.svc.models["tiny"]
    text = prompt(41)
    plain = request_tokens(m, Endpoint.COMPLETIONS, {"prompt": text})
    salted = request_tokens(m, Endpoint.COMPLETIONS, {"prompt": text, "cache_salt": "u1"})
    salted_ns = Namespace(**{**m.namespace.to_dict(), "salt": "u1"})  # type: ignore[arg-type]
    # a peer holds the unsalted blocks only: a salted request is not credited with them
    view.peer = {(m.namespace.digest, k) for k in plain.keys}
    r = rig.post({"model": "tiny", "prompt": text, "cache_salt": "u1", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvstore-hit-tokens"] == "0"
    assert view.asked[-1].salt == "u1"
    # a peer holds the salted blocks: the salted request is credited with them on a
    view.peer = {(salted_ns.digest, k) for k in salted.keys}
    r = rig.post({"model": "tiny", "prompt": text, "cache_salt": "u1", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvstore-backend"] == "a"
    assert r.headers["x-kvstore-hit-tokens"] == str(len(salted.keys) * BS)
    # and an unsalted request is not credited with the salted blocks
    r = rig.post({"model": "tiny", "prompt": text, "max_tokens": 2})
    assert r.headers["x-kvstore-hit-tokens"] == "0" and view.asked[-1].salt == ""
