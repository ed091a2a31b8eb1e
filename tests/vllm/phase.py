"""One vLLM process (run with the vLLM environment's python) with the
kvstore connector: generates greedily for a list of prompts given as JSON
and writes what happened as JSON. Used by tests/vllm and bench/vllm.py.

    phase.py SPEC.json OUT.json

SPEC: {"model": dir, "target": "127.0.0.1:port", "stats_path": file,
       "llm_kwargs": {...} (more LLM(...) arguments: hf_overrides, served_model_name),
       "prefix_caching": bool, "max_tokens": int, "connector": bool,
       "prompts": [{"name", "tokens": [...], "load": bool, "save": bool,
                    "wait_for": file (optional: block until it exists, after
                    writing "<file>.ready"), "repeat": int,
                    "reset_prefix_cache": bool (empty vLLM's prefix cache first)}]}
OUT: {"startup_s": s, "results": [{"name", "tokens", "num_cached_tokens", "seconds"}]}
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    events: list = []
    if spec.get("kv_events"):
        kw["kv_events_config"] = _subscribe(spec["kv_events"], events)
    if spec.get("connector", True):
        extra = {"target": spec["target"], "tenant": "tests", "timeout": 5.0}
        if spec.get("stats_path"):
            extra["stats_path"] = spec["stats_path"]
        extra.update(spec.get("extra", {}))
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="engine_adapter.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], max_model_len=spec.get("max_model_len", 4096), enforce_eager=True,
              dtype=spec.get("dtype", "bfloat16"), seed=0, enable_prefix_caching=spec.get("prefix_caching", True),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096), **kw, **spec.get("llm_kwargs", {}))
    startup = time.perf_counter() - t0
    results = []
    for p in spec["prompts"]:
        if p.get("wait_for"):
            open(p["wait_for"] + ".ready", "w").close()
            deadline = time.monotonic() + 300
            while not os.path.exists(p["wait_for"]) and time.monotonic() < deadline:
                time.sleep(0.05)
        if p.get("reset_prefix_cache"):
            llm.reset_prefix_cache()  # vLLM's own cache empty again, as in a fresh process
        params = {"kv_transfer_params": {"kvstore_load": p.get("load", True), "kvstore_save": p.get("save", True)}}
        sp = SamplingParams(max_tokens=p.get("max_tokens", spec.get("max_tokens", 16)), temperature=0.0,
                            ignore_eos=True, extra_args=params)
        for _ in range(p.get("repeat", 1)):
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=p["tokens"])], sp, use_tqdm=False)[0]
            dt = time.perf_counter() - t
            results.append({"name": p["name"], "tokens": list(out.outputs[0].token_ids),
                            "num_cached_tokens": out.num_cached_tokens, "seconds": dt,
                            "finish_reason": out.outputs[0].finish_reason})
    if spec.get("kv_events"):
        time.sleep(1.0)  # the publisher thread sends asynchronously
    json.dump({"startup_s": startup, "results": results, "kv_events": events}, open(sys.argv[2], "w"))


def _subscribe(endpoint: str, sink: list) -> object:
    """Enable vLLM's KV events on a ZMQ endpoint and collect them (a
    subscriber thread, as a router following vLLM's events would)."""
    import threading

    import msgspec
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import KVEventBatch

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)

    def run() -> None:
        while True:
            _, _, payload = sub.recv_multipart()
            for ev in dec.decode(payload).events:
                sink.append({"type": type(ev).__name__, "medium": getattr(ev, "medium", None),
                             "blocks": len(getattr(ev, "block_hashes", []) or []),
                             "tokens": len(getattr(ev, "token_ids", []) or []),
                             "has_parent": getattr(ev, "parent_block_hash", None) is not None})

    threading.Thread(target=run, daemon=True).start()
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)


if __name__ == "__main__":
    main()
