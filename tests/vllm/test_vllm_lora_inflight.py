"""A request planned under a LoRA's digest must not go on storing (or
loading) KV under it once the adapter's files change in place (vLLM's
``load_inplace`` reload keeps the id, name and path): its later blocks are
computed with other weights than the namespace names.

One vLLM-environment process drives the scheduler half
(``SchedulerSide``: lookup, plan, per-step metadata, finish) with vLLM's
own ``LoRARequest`` and minimal stand-ins for vLLM's request and
scheduler output, as vLLM's scheduler calls it; and the worker half's
``load_all`` with a load the scheduler dropped.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import ADAPTER_WRITER, run_lora_probe

PROBE = r"""
import json, os, sys
from collections import defaultdict
from types import SimpleNamespace as NS
from vllm.lora.request import LoRARequest
from vllm.v1.request import RequestStatus
from engine_adapter.vllm_common import ClusterMode, KVStoreConnectorMetadata, BlockMove
from engine_adapter.vllm_scheduler import SchedulerSide
from engine_adapter.vllm_worker import WorkerSide
from kvstore.keys import KEY_LEN, Namespace

work = sys.argv[1]
""" + ADAPTER_WRITER + r"""

class Client:
    hit = 0
    def lookup(self, ns, keys):
        return NS(hit_blocks=self.hit)

client = Client()
link = NS(client=lambda: client, stats=defaultdict(int), record=lambda **kw: None, fault=lambda *a: None)
base = Namespace(tenant="t", model_id="m", weights_digest="w", block_size=4)
BS = 4

def side():
    return SchedulerSide(NS(ns=base), link, block_size=BS, do_load=True, do_save=True, emit_events=False,
                         hash_block_size=None, cluster=ClusterMode.OFF)

def request(rid, lora, n):
    return NS(request_id=rid, prompt_token_ids=list(range(n)), all_token_ids=list(range(n)), num_tokens=n,
              num_computed_tokens=0, lora_request=lora, cache_salt=None, kv_transfer_params=None,
              mm_features=None, prompt_embeds=None, status=RequestStatus.RUNNING)

def step(new=(), cached=(), scheduled=None):
    # new: (req_id, block_ids, computed); cached: (req_id, new block ids, computed)
    return NS(scheduled_new_reqs=[NS(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
              scheduled_cached_reqs=NS(req_ids=[r for r, _, _ in cached], new_block_ids=[(b,) for _, b, _ in cached],
                                       resumed_req_ids=set(), num_computed_tokens=[c for _, _, c in cached]),
              num_scheduled_tokens=scheduled or {})

def moves(ms):
    return [{"req": m.req_id, "adapter": m.adapter, "keys": len(m.keys) // KEY_LEN, "blocks": list(m.block_ids),
             "first": m.first} for m in ms]

out = {}
a = os.path.join(work, "adapter-a")
write(a, b"weights v1" * 100)
lora = LoRARequest("a", 1, a)

# 1. saves: a 12-token prompt computed in one step (3 blocks saved), then decode steps after a reload in place
s = side()
r = request("r1", lora, 12)
s.get_num_new_matched_tokens(r, 0)
s.update_state_after_alloc(r, None, 0)
m1 = s.build_connector_meta(step(new=[("r1", [10, 11, 12], 0)], scheduled={"r1": 12}))
out["digest"] = s.reqs["r1"].adapter
out["saves_before"] = moves(m1.saves)
write(a, b"weights v2" * 120)  # new weights at the same path, then load_lora_adapter(load_inplace=True)
r.all_token_ids = list(range(16)); r.num_tokens = 16
m2 = s.build_connector_meta(step(cached=[("r1", [13], 12)], scheduled={"r1": 4}))
out["saves_after"] = moves(m2.saves)
r.all_token_ids = list(range(21)); r.num_tokens = 21; r.num_computed_tokens = 20
r.status = RequestStatus.FINISHED_LENGTH_CAPPED
out["tail_held"] = s.request_finished(r, [10, 11, 12, 13, 14])[0]
out["tails"] = moves(s.tails)
out["dropped"] = link.stats["lora_changed_requests"]

# 2. loads: a request looked up and planned (the daemon holds 2 blocks), the files change before its step
write(a, b"weights v3" * 140)
lora3 = LoRARequest("a3", 3, a)
s = side()
client.hit = 2
r = request("r2", lora3, 12)
ext = s.get_num_new_matched_tokens(r, 0)[0]
s.update_state_after_alloc(r, None, ext)
out["ext"] = ext
write(a, b"weights v4" * 160)
m3 = s.build_connector_meta(step(new=[("r2", [20, 21, 22], 0)], scheduled={"r2": 12 - ext}))
out["loads_after"] = moves(m3.loads)
out["saves_after_load"] = moves(m3.saves)

# 2b. the tail of a finished request: the files change after its last step, before it finishes
client.hit = 0
s = side()
r = request("r5", LoRARequest("a5", 5, a), 8)
s.get_num_new_matched_tokens(r, 0)
s.update_state_after_alloc(r, None, 0)
out["r5_saves"] = len(s.build_connector_meta(step(new=[("r5", [50, 51], 0)], scheduled={"r5": 8})).saves)
r.all_token_ids = list(range(13)); r.num_tokens = 13; r.num_computed_tokens = 12
r.status = RequestStatus.FINISHED_STOPPED
write(a, b"weights v5" * 180)
out["r5_tail_held"] = s.request_finished(r, [50, 51, 52])[0]
out["r5_tails"] = moves(s.tails)

# 2c. another file in the directory is not a change; a weight file replaced (same size, new inode) is
b6 = os.path.join(work, "adapter-b6")
write(b6, b"weights v1" * 100)
s = side()
r = request("r6", LoRARequest("b6", 6, b6), 16)
s.get_num_new_matched_tokens(r, 0)
s.update_state_after_alloc(r, None, 0)
out["r6_saves"] = [len(s.build_connector_meta(step(new=[("r6", [60, 61, 62, 63], 0)], scheduled={"r6": 4})).saves)]
with open(os.path.join(b6, "README.md"), "w") as f:
    f.write("notes")
out["r6_saves"].append(len(s.build_connector_meta(step(cached=[("r6", [], 4)], scheduled={"r6": 4})).saves))
tmp = os.path.join(b6, ".new")
with open(tmp, "wb") as f:
    f.write(b"weights v9" * 100)
os.replace(tmp, os.path.join(b6, "adapter_model.safetensors"))
out["r6_saves"].append(len(s.build_connector_meta(step(cached=[("r6", [], 8)], scheduled={"r6": 4})).saves))

# 3. a request without LoRA in the same steps is untouched
s = side()
client.hit = 0
r = request("r3", None, 8)
s.get_num_new_matched_tokens(r, 0)
s.update_state_after_alloc(r, None, 0)
out["plain_saves"] = moves(s.build_connector_meta(step(new=[("r3", [30, 31], 0)], scheduled={"r3": 8})).saves)

# 4. the worker: a dropped load (no keys) reads nothing; its blocks are load errors (vLLM recomputes them)
w = WorkerSide.__new__(WorkerSide)
w.load_errors, w.load_failed, w.layers, w.ident = set(), set(), [object()], NS(ns=base)
w.link = NS(client=lambda: (_ for _ in ()).throw(AssertionError("no daemon call")), stats=defaultdict(int),
            stats_path=None)
try:
    w.load_all(KVStoreConnectorMetadata(loads=[BlockMove("r2", "", "", b"", [20, 21], 0)]))
    out["worker_errors"], out["worker_failed"] = sorted(w.load_errors), sorted(w.load_failed)
except Exception as e:
    out["worker_errors"] = out["worker_failed"] = repr(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_lora_probe(PROBE, str(tmp_path_factory.mktemp("vllm-lora-inflight")))


def test_blocks_computed_before_the_reload_are_saved_under_its_digest(probed: dict) -> None:
    assert probed["digest"].startswith("lora:")
    assert probed["saves_before"] == [{"req": "r1", "adapter": probed["digest"], "keys": 3, "blocks": [10, 11, 12],
                                       "first": 0}]


def test_a_planned_request_saves_nothing_once_its_adapter_changed_in_place(probed: dict) -> None:
    # block 3 is computed after the files changed: not stored under the old digest (nor any other)
    assert probed["saves_after"] == []
    assert probed["tail_held"] is False and probed["tails"] == []
    assert probed["dropped"] >= 1


def test_no_tail_is_saved_once_the_adapter_changed_before_the_request_finished(probed: dict) -> None:
    assert probed["r5_saves"] == 1  # (blocks 0-1, computed before the change, were saved)
    assert probed["r5_tail_held"] is False and probed["r5_tails"] == []


def test_only_a_change_of_the_adapters_files_stops_its_saves(probed: dict) -> None:
    # a README added beside the files: still saved; the weights replaced by rename (same size): not
    assert probed["r6_saves"] == [1, 1, 0]


def test_a_planned_load_is_dropped_once_its_adapter_changed_in_place(probed: dict) -> None:
    assert probed["ext"] == 8
    # the two planned blocks are not read under the old digest: an empty load whose blocks vLLM recomputes
    assert probed["loads_after"] == [{"req": "r2", "adapter": probed["loads_after"][0]["adapter"], "keys": 0,
                                      "blocks": [20, 21], "first": 0}]
    assert probed["saves_after_load"] == []


def test_a_request_without_lora_is_untouched(probed: dict) -> None:
    assert probed["plain_saves"] == [{"req": "r3", "adapter": "", "keys": 2, "blocks": [30, 31], "first": 0}]


def test_the_worker_reads_nothing_for_a_dropped_load(probed: dict) -> None:
    assert probed["worker_errors"] == [20, 21]
    assert probed["worker_failed"] == ["r2"]
