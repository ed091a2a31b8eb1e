"""The router against fake vLLM servers (tiny FastAPI apps): decisions, 429,
retries, mid-stream failures, disconnects, bad input, quotas, metrics."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace, block_keys
from kvstore.results import Event, EventKind
from tiers.base import TierKind
from router.cache_view import CacheView
from router.config import (
    ApiKey,
    BackendSpec,
    ModelSpec,
    PredictorSpec,
    RouterConfig,
    ServiceClass,
    TenantQuota,
)
from router.prompts import Endpoint, load_model, request_tokens
from router.server import build_app
from tests.unit.router.fakes import FakeVLLM, ServerThread, make_model_dir

BS = 4


def ns_fn(spec: ModelSpec) -> Namespace:
    return Namespace(tenant=spec.namespace_tenant, model_id="tiny-test", kv_dtype=spec.kv_dtype,
                     block_size=spec.block_size)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model_dir(str(tmp_path_factory.mktemp("tok")))


class Rig:
    def __init__(self, model_dir: str, namespace_fn: Any = ns_fn, **cfg_changes: Any) -> None:
        self.fakes = {n: FakeVLLM(n) for n in ("a", "b")}
        self.servers = {n: ServerThread(f.app()).start() for n, f in self.fakes.items()}
        base = dict(
            listen="127.0.0.1:0",
            backends=tuple(BackendSpec(n, s.url) for n, s in self.servers.items()),
            models=(ModelSpec("tiny", model_dir, block_size=BS, kv_dtype="float32", max_model_len=600),),
            api_keys=(ApiKey("ka", "ta", "gold"), ApiKey("kt", "tt", "tight"), ApiKey("kq", "tq", "gold")),
            classes=(ServiceClass("gold", ttft_slo=30.0), ServiceClass("tight", ttft_slo=1e-4)),
            tenants=(TenantQuota("tq", requests_per_s=0.001, request_burst=1),),
            predictor=PredictorSpec(prefill_tokens_per_s=1e4, prefill_overhead_s=0.001, decode_penalty_s=0.05),
            health_interval=0.05, health_failures=3)  # (one slow check on a loaded machine is no outage)
        base.update(cfg_changes)
        self.cfg = RouterConfig(**base)
        self.app = build_app(self.cfg, namespace_fn=namespace_fn, follow_events=False)
        self.svc = self.app.state.router
        self.router = ServerThread(self.app).start()
        self.http = httpx.Client(base_url=self.router.url, timeout=30)

    def backend(self, name: str) -> Any:
        return self.svc.pool.by_name(name)

    def post(self, body: dict[str, Any], key: str = "ka", path: str = "/v1/completions") -> httpx.Response:
        return self.http.post(path, json=body, headers={"authorization": f"Bearer {key}"})

    def state(self) -> dict[str, Any]:
        r = self.http.get("/router/backends", headers={"authorization": "Bearer ka"})
        return {b["name"]: b for b in r.json()["backends"]}

    def wait(self, cond: Any, what: str, tries: int = 3000) -> None:
        """Poll the router until ``cond()`` (each poll is an HTTP round trip; bounded, no sleeps)."""
        for _ in range(tries):
            if cond():
                return
            self.state()
        raise AssertionError(f"timed out waiting for {what}")

    def close(self) -> None:
        self.http.close()
        self.router.stop()
        for s in self.servers.values():
            s.stop()


@pytest.fixture
def rig(model_dir: str) -> Iterator[Rig]:
    r = Rig(model_dir)
    yield r
    r.close()


def prompt(n_tokens: int, start: int = 3) -> str:
    return " ".join(f"w{start + i % 900}" for i in range(n_tokens))


def hold(rig: Rig, name: str, text: str, n_blocks: int) -> None:
    """Make backend ``name``'s cache view hold the first blocks of ``text``."""
    b = rig.backend(name)
    if b.cache is None:
        b.cache = CacheView(name, "127.0.0.1:1")
    m = rig.svc.models["tiny"]
    keys = request_tokens(m, Endpoint.COMPLETIONS, {"prompt": text}).keys[:n_blocks]
    b.cache.apply(Event(EventKind.STORED, b"", keys, TierKind.DRAM, seq=1))


# ---------------------------------------------------------------- keys
def test_the_routers_namespace_follows_the_backends_identity_flags(tmp_path: Any) -> None:
    # a backend run with --quantization (its config without a quantization config) or
    # --disable-sliding-window has another namespace; the router computes it when told
    from kvstore.identity import engine_namespace, vllm_layout_tag
    from router.prompts import shared_namespace

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "sliding_window": 64}))
    common = {"block_size": BS, "kv_dtype": "bfloat16", "weights_digest": "w"}
    tag = vllm_layout_tag("cuda")
    plain = shared_namespace(ModelSpec("m", str(d), **common))
    assert plain == engine_namespace(str(d), layout_tag=tag, **common)
    quant = shared_namespace(ModelSpec("m", str(d), quantization="fp8", **common))
    assert quant == engine_namespace(str(d), layout_tag=tag, quantization="fp8", **common) != plain
    off = shared_namespace(ModelSpec("m", str(d), disable_sliding_window=True, **common))
    assert off == engine_namespace(str(d), layout_tag=tag, disable_sliding_window=True, **common) != plain
    # --config-format mistral: vLLM reads params.json over config.json (another class, other values)
    (d / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "norm_eps": 1e-5}))
    mistral = shared_namespace(ModelSpec("m", str(d), config_format="mistral", **common))
    assert mistral == engine_namespace(str(d), layout_tag=tag, config_format="mistral", **common) != plain
    assert shared_namespace(ModelSpec("m", str(d), config_format="hf", **common)) == plain
    with pytest.raises(InvalidArgument, match="config_format"):
        ModelSpec("m", str(d), config_format="gguf", **common)


def test_prompt_tokens_and_keys(model_dir: str) -> None:
    spec = ModelSpec("tiny", model_dir, block_size=BS, kv_dtype="float32")
    m = load_model(spec, ns_fn)
    p = request_tokens(m, Endpoint.COMPLETIONS, {"prompt": "w3 w4 w5 w6 w7 w8 w9 w10 w11"})
    assert p.tokens.tolist() == list(range(3, 12))
    assert p.keys == block_keys(m.namespace, np.arange(3, 11))  # (9 - 1) // 4 = 2 loadable blocks
    assert request_tokens(m, Endpoint.COMPLETIONS, {"prompt": list(range(3, 12))}).keys == p.keys
    salted = request_tokens(m, Endpoint.COMPLETIONS, {"prompt": list(range(3, 12)), "cache_salt": "u1"})
    assert salted.keys != p.keys
    chat = request_tokens(m, Endpoint.CHAT, {"messages": [{"role": "user", "content": "w5 w6"}]})
    want = m.tokenizer.apply_chat_template([{"role": "user", "content": "w5 w6"}], tokenize=True,
                                           add_generation_prompt=True, return_dict=False)
    assert chat.tokens.tolist() == list(want)
    assert chat.tokens.tolist()[:3] == [1, m.tokenizer.convert_tokens_to_ids("user"), 5]
    parts = request_tokens(m, Endpoint.CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "w5"}, {"type": "text", "text": "w6"}]}]})
    assert parts.tokens.tolist() == chat.tokens.tolist()  # text parts joined by newlines, as vLLM does


# ---------------------------------------------------------------- decisions
def test_cold_request_goes_somewhere_and_says_where(rig: Rig) -> None:
    r = rig.post({"model": "tiny", "prompt": prompt(40), "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == f"{r.headers['x-kvstore-backend']}-answer"
    assert float(r.headers["x-kvstore-predicted-ttft-ms"]) > 0
    assert r.headers["x-kvstore-runner-up"].split("=")[0] in {"a", "b"}


def test_repeated_prefix_goes_to_the_holder(rig: Rig) -> None:
    text = prompt(400)
    hold(rig, "b", text, 90)
    for _ in range(3):
        r = rig.post({"model": "tiny", "prompt": text, "max_tokens": 4})
        assert r.status_code == 200
        assert r.headers["x-kvstore-backend"] == "b"
        assert int(r.headers["x-kvstore-hit-tokens"]) == 90 * BS
        assert r.headers["x-kvstore-runner-up"].startswith("a=")
    assert not rig.fakes["a"].requests and len(rig.fakes["b"].requests) == 3


def test_loaded_holder_loses_to_recompute_elsewhere(rig: Rig) -> None:
    text = prompt(400)
    hold(rig, "b", text, 90)
    rig.fakes["b"].running = 40.0  # vLLM's /metrics: 40 requests decoding on b
    rig.wait(lambda: rig.backend("b").engine.running == 40.0, "b's metrics poll")
    r = rig.post({"model": "tiny", "prompt": text, "max_tokens": 4})
    assert r.headers["x-kvstore-backend"] == "a"
    assert r.headers["x-kvstore-runner-up"].startswith("b=")
    # and back to the holder once its load is gone
    rig.fakes["b"].running = 0.0
    rig.wait(lambda: rig.backend("b").engine.running == 0.0, "b's metrics poll")
    assert rig.post({"model": "tiny", "prompt": text, "max_tokens": 4}).headers["x-kvstore-backend"] == "b"


def test_predicted_slo_miss_is_429_before_any_backend(rig: Rig) -> None:
    r = rig.post({"model": "tiny", "prompt": prompt(300), "max_tokens": 4}, key="kt")
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "slo" and "target" in err["message"]
    assert not rig.fakes["a"].requests and not rig.fakes["b"].requests
    assert 'kvstore_route_rejections_total{klass="tight",reason="slo",tenant="tt"} 1.0' in rig.http.get(
        "/metrics").text


def test_tenant_rate_limit(rig: Rig) -> None:
    assert rig.post({"model": "tiny", "prompt": prompt(10)}, key="kq").status_code == 200
    r = rig.post({"model": "tiny", "prompt": prompt(10)}, key="kq")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    assert rig.post({"model": "tiny", "prompt": prompt(10)}, key="ka").status_code == 200  # other tenants unaffected


# ---------------------------------------------------------------- resilience
def test_failure_before_first_byte_is_retried_on_the_next_backend(rig: Rig) -> None:
    rig.fakes["a"].fail_status = 500
    r = rig.post({"model": "tiny", "prompt": prompt(40)})
    assert r.status_code == 200
    assert r.headers["x-kvstore-backend"] == "b" and r.headers["x-kvstore-retried"] == "1"
    assert len(rig.fakes["a"].requests) == 1
    assert not rig.backend("a").healthy or rig.backend("a").failures >= 0
    assert "kvstore_route_retries_total" in rig.http.get("/metrics").text


def test_dead_backend_leaves_the_pool_and_comes_back(rig: Rig) -> None:
    rig.fakes["a"].healthy = False
    rig.wait(lambda: not rig.backend("a").healthy, "a to leave the pool")
    for _ in range(3):
        assert rig.post({"model": "tiny", "prompt": prompt(40)}).headers["x-kvstore-backend"] == "b"
    rig.fakes["a"].healthy = True
    rig.wait(lambda: rig.backend("a").healthy, "a to come back")


def test_backend_dying_mid_stream_ends_the_stream_with_an_error(rig: Rig) -> None:
    rig.fakes["a"].die_mid_stream = True
    with rig.http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": prompt(40), "stream": True},
                         headers={"authorization": "Bearer ka"}) as r:
        assert r.headers["x-kvstore-backend"] == "a"
        rig.fakes["a"].healthy = False  # a dead process fails its health checks too
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert not rig.backend("a").healthy
    assert json.loads(events[0][6:])["choices"][0]["text"] == "a-answer"
    assert "error" in json.loads(events[-1][6:])
    # new requests go elsewhere
    assert rig.post({"model": "tiny", "prompt": prompt(40)}).headers["x-kvstore-backend"] == "b"


def test_client_disconnect_cancels_upstream(rig: Rig) -> None:
    import asyncio

    fa = rig.fakes["a"]
    fa.gate = asyncio.Event()
    rig.fakes["b"].healthy = False
    rig.wait(lambda: not rig.backend("b").healthy, "b to leave the pool")
    body = json.dumps({"model": "tiny", "prompt": prompt(40), "stream": True}).encode()
    raw = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer ka\r\n"
           f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", rig.router.port)) as s:
        s.sendall(raw)
        rig.wait(lambda: len(fa.requests) == 1, "the request to reach a")
    # the client went away before its first byte
    rig.wait(lambda: fa.cancelled == 1 and not rig.backend("a").inflight, "a's request to be cancelled")


def test_streaming_relays_every_event_and_learns_ttft(rig: Rig) -> None:
    before = rig.backend("a").predictor.calibrations + rig.backend("b").predictor.calibrations
    with rig.http.stream("POST", "/v1/chat/completions", headers={"authorization": "Bearer ka"},
                         json={"model": "tiny", "stream": True,
                               "messages": [{"role": "user", "content": prompt(100)}]}) as r:
        assert r.status_code == 200
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 3
    after = rig.backend("a").predictor.calibrations + rig.backend("b").predictor.calibrations
    assert after == before + 1  # the measured TTFT went back to the chosen backend's predictor
    text = rig.http.get("/metrics").text
    assert "kvstore_route_ttft_seconds_count" in text and "kvstore_route_ttft_error_seconds_bucket" in text


@pytest.mark.parametrize("limit,learns", [({}, False), ({"max_tokens": 200}, False),
                                          ({"max_completion_tokens": 1}, True), ({"max_tokens": 1}, True)])
def test_a_non_streamed_answer_calibrates_only_when_it_is_one_token(rig: Rig, limit: dict[str, int],
                                                                     learns: bool) -> None:
    """A non-streamed answer's time is its TTFT only for a one-token answer. A
    chat without max_tokens generates up to the context (vLLM's default), so
    its whole generation time must not be taught to the predictor as a TTFT."""
    def reports() -> int:
        return sum(rig.backend(n).predictor.error_stats().reports for n in ("a", "b"))

    before = reports()
    r = rig.post({"model": "tiny", "messages": [{"role": "user", "content": prompt(100)}], **limit},
                 path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    assert reports() == before + int(learns)


# ---------------------------------------------------------------- bad input
def test_bad_input_gets_clear_4xx_and_the_router_keeps_serving(rig: Rig) -> None:
    h = {"authorization": "Bearer ka", "content-type": "application/json"}
    r = rig.http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers=h)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = rig.post({"model": "nope", "prompt": "w3"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = rig.post({"model": "tiny", "prompt": prompt(700)})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = rig.post({"model": "tiny", "prompt": 12})
    assert r.status_code == 400
    r = rig.post({"model": "tiny", "messages": "hi"}, path="/v1/chat/completions")
    assert r.status_code == 400
    r = rig.http.post("/v1/completions", json={"model": "tiny", "prompt": "w3"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    r = rig.post({"model": "tiny", "prompt": "w3"}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert not rig.fakes["a"].requests and not rig.fakes["b"].requests
    assert rig.post({"model": "tiny", "prompt": prompt(10)}).status_code == 200
    models = rig.http.get("/v1/models", headers={"authorization": "Bearer ka"}).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert rig.http.get("/health").status_code == 200


# ---------------------------------------------------------------- policies and config
def test_baseline_policies(model_dir: str) -> None:
    rr = Rig(model_dir, policy="round_robin")
    try:
        got = [rr.post({"model": "tiny", "prompt": prompt(20)}).headers["x-kvstore-backend"] for _ in range(4)]
        assert sorted(got) == ["a", "a", "b", "b"] and got[0] != got[1]
    finally:
        rr.close()
    pf = Rig(model_dir, policy="prefix")
    try:
        text = prompt(400)
        hold(pf, "b", text, 90)
        pf.fakes["b"].running = 40.0  # loaded: cost would leave it, the prefix policy does not
        pf.wait(lambda: pf.backend("b").engine.running == 40.0, "b's metrics poll")
        assert pf.post({"model": "tiny", "prompt": text}).headers["x-kvstore-backend"] == "b"
    finally:
        pf.close()


def test_config_from_toml_and_flags(tmp_path: Any, model_dir: str) -> None:
    from kvstore.errors import InvalidArgument
    from router.config import RoutingPolicy, load_router_config

    path = tmp_path / "router.toml"
    path.write_text(f'''
listen = "127.0.0.1:8123"
policy = "prefix"
[[backend]]
name = "a"
url = "http://127.0.0.1:9001"
daemon = "127.0.0.1:50051"
[[model]]
name = "tiny"
path = "{model_dir}"
block_size = 16
kv_dtype = "float32"
device = "cpu"
[[class]]
name = "gold"
ttft_slo = 0.5
[[api_key]]
key = "k1"
tenant = "t1"
class = "gold"
[predictor]
prefill_tokens_per_s = 1234.0
''')
    cfg = load_router_config(str(path), backends=["b=http://127.0.0.1:9002=127.0.0.1:50052"],
                             api_keys=["k2=t2:silver"])
    assert cfg.listen_addr == ("127.0.0.1", 8123) and cfg.policy is RoutingPolicy.PREFIX
    assert [b.name for b in cfg.backends] == ["a", "b"] and cfg.backends[1].daemon == "127.0.0.1:50052"
    assert cfg.models[0].block_size == 16 and cfg.predictor.prefill_tokens_per_s == 1234.0
    assert {k.key: (k.tenant, k.klass) for k in cfg.api_keys} == {"k1": ("t1", "gold"), "k2": ("t2", "silver")}
    assert cfg.klass("silver").ttft_slo > 0  # a class named by a flag only exists with the default target
    assert RouterConfig().listen_addr[0] == "127.0.0.1"  # loopback unless configured
    for bad in ('listen = "nowhere"', 'policy = "random"', 'bogus = 1', '[[backend]]\nname = "x"\nurl = "ftp://x"'):
        path.write_text(bad + "\n")
        with pytest.raises(InvalidArgument):
            load_router_config(str(path))
    path.write_bytes(b"\xff\xfe\n")  # not UTF-8: was a UnicodeDecodeError traceback out of `kvstore route`
    with pytest.raises(InvalidArgument, match="router.toml"):
        load_router_config(str(path))


def test_vllm_metrics_count_only_foreign_load_and_the_penalty_learns() -> None:
    from router.backends import EngineMetrics, Pool

    cfg = RouterConfig(backends=(BackendSpec("a", "http://127.0.0.1:9"),),
                       predictor=PredictorSpec(decode_penalty_s=0.01))
    b = Pool(cfg, None, follow_events=False).backends[0]  # type: ignore[arg-type]
    b.begin(1, 100, 0.0, 0.0)
    b.inflight[1].first_byte = 1.0  # one of the router's requests, decoding
    b.engine = EngineMetrics(waiting=0.0, running=3.0, own_pending=0, own_total=1)  # vLLM counted it too
    assert b.running_now() == 3.0  # 1 own + 2 others, not 4
    b.end(1)
    assert b.running_now() == 2.0  # the poll's count of it is stale: still only the 2 others
    assert b.queue_wait_s(5.0) == pytest.approx(0.02)
    for _ in range(50):  # measured TTFTs 0.1 s above the prediction with 2 decodes running
        b.learn_penalty(2.0, 0.1)
    assert 0.05 < b.decode_penalty_s <= 1.0
    b.learn_penalty(0.0, 5.0)  # nothing running: nothing to learn here
    before = b.decode_penalty_s
    b.learn_penalty(2.0, -10.0)
    assert before / 2 <= b.decode_penalty_s < before  # bounded step down
