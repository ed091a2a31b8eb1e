"""The connector's tail save without a vLLM engine (run with the vLLM
environment's python): vLLM's CPU platform turns async scheduling off, so
the end-to-end runs never leave a finished request with unsaved full
blocks. Here the scheduler and worker halves (real ``Request``, real
daemon at TARGET) run the hand-off vLLM would: ``request_finished`` ->
next step's plan -> ``wait_for_save`` -> ``get_finished``.

    tail_check.py TARGET OUT.json
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import Request, RequestStatus

from engine_adapter.vllm import KVStoreConnector
from kvstore.client import Client
from kvstore.keys import block_keys

BS, NB, LAYERS, KVH, HEAD = 16, 8, 2, 1, 4


def config(target: str) -> SimpleNamespace:
    mc = SimpleNamespace(model="tail-check", served_model_name="tail-check", revision=None, dtype=torch.float32,
                         get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: KVH,
                         get_head_size=lambda: HEAD)
    ktc = SimpleNamespace(kv_connector_extra_config={"target": target, "tenant": "tail", "timeout": 2.0,
                                                     "weights_digest": "tail-check-weights",
                                                     "retry_interval": 0.0},
                          kv_role="kv_both", kv_load_failure_policy="recompute")
    return SimpleNamespace(kv_transfer_config=ktc, model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto",
                           block_size=BS), parallel_config=SimpleNamespace(tensor_parallel_size=1,
                           pipeline_parallel_size=1), scheduler_config=SimpleNamespace(async_scheduling=True),
                           kv_events_config=None)


def request(rid: str, prompt: list[int], out: list[int], status: RequestStatus) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=64), None)
    r.append_output_token_ids(out)
    r.num_computed_tokens = r.num_tokens - 1  # the last sampled token has no KV
    r.status = status
    return r


def step() -> SimpleNamespace:  # a step that schedules nothing (vLLM keeps stepping for delayed frees)
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                                 num_computed_tokens=[]))


def main() -> None:
    target, out_path = sys.argv[1], sys.argv[2]
    kcc = SimpleNamespace(num_blocks=NB, kv_cache_layout=None, hash_block_size=None)
    sched = KVStoreConnector(config(target), KVConnectorRole.SCHEDULER, kcc)
    worker = KVStoreConnector(config(target), KVConnectorRole.WORKER, kcc)
    gen = torch.Generator().manual_seed(3)
    layers = {f"l{i}": torch.randn(NB, KVH, BS, 2 * HEAD, generator=gen) for i in range(LAYERS)}
    worker.register_kv_caches(layers)
    rng = np.random.default_rng(5)
    prompt, answer = rng.integers(3, 1000, 40).tolist(), rng.integers(3, 1000, 24).tolist()
    res: dict = {}
    # 40 prompt + 24 generated = 64 tokens, 63 with KV: blocks 0-2 complete
    # (block 2 = 8 prompt + 8 generated tokens), block 3 lacks its last KV
    done = request("done", prompt, answer, RequestStatus.FINISHED_LENGTH_CAPPED)
    st = sched.scheduler.state(done)
    keys = block_keys(sched.ns, np.asarray(prompt + answer, dtype=np.int64))
    with Client(target) as c:  # the prompt's blocks went in earlier steps
        c.put(sched.ns, keys[:2], [np.zeros(worker.worker.block_bytes, np.uint8)] * 2)
    st.saved = 2
    res["finished"] = list(sched.request_finished(done, [4, 5, 6, 7]))
    aborted = request("aborted", prompt, answer, RequestStatus.FINISHED_ABORTED)
    sched.scheduler.state(aborted)
    res["aborted"] = list(sched.request_finished(aborted, [0, 1, 2, 3]))
    meta = sched.build_connector_meta(step())
    res["plan"] = [(m.req_id, m.first, m.block_ids, m.final) for m in meta.saves]
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    res["sent"] = sorted(worker.get_finished({"done"})[0] or [])
    res["worker_stats"] = dict(worker.stats)
    res["sent_again"] = worker.get_finished(set())[0]
    worker.clear_connector_metadata()
    with Client(target) as c:
        res["hit_chain"] = int(c.lookup(sched.ns, keys).hit_blocks)
        res["hit_block2"] = int(c.lookup(sched.ns, [keys[2]]).hit_blocks)
        res["hit_block3"] = int(c.lookup(sched.ns, [keys[3]]).hit_blocks)
        buf = np.zeros(worker.worker.block_bytes, np.uint8)
        res["get"] = [s.name for s in c.get_into(sched.ns, [keys[2]], [buf])]
    want = torch.cat([t[6].reshape(-1).view(torch.uint8) for t in layers.values()]).numpy()
    res["bytes_equal"] = bool(np.array_equal(buf, want))
    # the daemon gone: the tail is still reported done (a miss later, never a stuck request)
    down = KVStoreConnector(config("127.0.0.1:1"), KVConnectorRole.WORKER, kcc)
    down.register_kv_caches(layers)
    late = request("late", prompt, answer, RequestStatus.FINISHED_STOPPED)
    sched.scheduler.state(late)
    res["late"] = list(sched.request_finished(late, [4, 5, 6, 7]))
    down.bind_connector_metadata(sched.build_connector_meta(step()))
    down.wait_for_save()
    res["sent_down"] = sorted(down.get_finished({"late"})[0] or [])
    res["faults_down"] = down.stats["faults"]
    res["lora"] = lora_ids(sched)
    # token ids no key can name (vLLM does not check them with skip_tokenizer_init): served as a miss
    bad = {}
    for name, tok in (("huge", 1 << 32), ("negative", -1)):
        prompt = list(range(3, 3 + 2 * BS))
        prompt[BS + 1] = tok
        r = Request(f"bad-{name}", prompt, SamplingParams(max_tokens=4), None)
        try:
            bad[name] = list(sched.get_num_new_matched_tokens(r, 0))
        except Exception as e:  # noqa: BLE001 - what the test reports
            bad[name] = repr(e)[:200]
    res["bad_ids"] = bad
    json.dump(res, open(out_path, "w"))


def lora_ids(sched: KVStoreConnector) -> dict:
    """The namespace adapter id of a LoRA request: the digest of the
    adapter's files, not its name or path."""
    import shutil
    import tempfile

    from vllm.lora.request import LoRARequest

    from kvstore import identity

    work = tempfile.mkdtemp(prefix="tail-lora-")
    a = os.path.join(work, "a")
    os.makedirs(a)
    with open(os.path.join(a, "adapter_config.json"), "w") as f:
        json.dump({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                   "base_model_name_or_path": "/models/base"}, f)
    with open(os.path.join(a, "adapter_model.safetensors"), "wb") as f:
        f.write(b"lora weights v1")
    copy = shutil.copytree(a, os.path.join(work, "copy"))
    prompt = list(range(3, 3 + 2 * BS))

    def adapter(rid: str, lora: LoRARequest) -> tuple[str, str] | None:
        r = Request(rid, prompt, SamplingParams(max_tokens=4), None, lora_request=lora)
        st = sched.scheduler.state(r)
        return None if st is None else (st.adapter, st.lora_name)

    out = {"v1": adapter("lora-1", LoRARequest("mine", 1, a)),
           "renamed_copy": adapter("lora-2", LoRARequest("other-name", 2, copy)),
           "want_v1": identity.adapter_digest(a)}
    with open(os.path.join(a, "adapter_model.safetensors"), "wb") as f:
        f.write(b"lora weights v2")
    out["v2"] = adapter("lora-3", LoRARequest("mine", 3, a))
    out["missing"] = adapter("lora-4", LoRARequest("gone", 4, os.path.join(work, "nowhere")))
    # a Hugging Face repository id (vLLM downloads it into the hub cache): named by the cached snapshot's
    # files; two repositories' adapters under one name are two namespaces; one not cached is not stored
    for repo, data in (("kvtest/sql-lora-v1", b"sql v1"), ("kvtest/sql-lora-v2", b"sql v2")):
        top = os.path.join(os.environ["HF_HUB_CACHE"], "models--" + repo.replace("/", "--"))
        snap = os.path.join(top, "snapshots", "b" * 40)
        os.makedirs(snap)
        os.makedirs(os.path.join(top, "refs"))
        with open(os.path.join(top, "refs", "main"), "w") as f:
            f.write("b" * 40)
        shutil.copy(os.path.join(copy, "adapter_config.json"), snap)
        with open(os.path.join(snap, "adapter_model.safetensors"), "wb") as f:
            f.write(data)
        out[repo] = adapter(f"lora-{repo}", LoRARequest("sql", 5 + len(out), repo))
        out[f"want {repo}"] = identity.adapter_digest(snap)
    out["not_cached"] = adapter("lora-9", LoRARequest("sql", 9, "kvtest/sql-lora-v3"))
    shutil.rmtree(work)
    return out


if __name__ == "__main__":
    main()
