"""A LoRA's identity follows its files, not vLLM's id for it: vLLM's
``load_inplace`` reload keeps the adapter's id, name and path while the
files (and the weights the worker computes with) change, so the connector
must not keep naming the old files' digest.

One vLLM-environment process drives the scheduler half's
``SchedulerSide.adapter_id`` with vLLM's own ``LoRARequest`` objects, as
``/v1/load_lora_adapter`` builds them (``lora_int_id`` reused on reload).
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import ADAPTER_WRITER, run_lora_probe

PROBE = r"""
import json, os, sys
from vllm.lora.request import LoRARequest
from engine_adapter.vllm_scheduler import SchedulerSide

work = sys.argv[1]
""" + ADAPTER_WRITER + r"""

sched = SchedulerSide(None, None, block_size=16, do_load=True, do_save=True, emit_events=False,
                      hash_block_size=None)
a = os.path.join(work, "adapter-a")
write(a, b"weights v1" * 100)
out = {"v1": sched.adapter_id(LoRARequest("a", 1, a))}
out["v1_again"] = sched.adapter_id(LoRARequest("a", 1, a))
write(a, b"weights v2" * 120)  # new weights at the same path, then load_lora_adapter(load_inplace=True)
out["reloaded"] = sched.adapter_id(LoRARequest("a", 1, a, load_inplace=True))
out["reloaded_again"] = sched.adapter_id(LoRARequest("a", 1, a))
b = os.path.join(work, "adapter-b")
write(b, b"weights v2" * 120)  # the new weights loaded under a new name: a new vLLM id
out["new_name"] = sched.adapter_id(LoRARequest("b", 2, b))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_lora_probe(PROBE, str(tmp_path_factory.mktemp("vllm-lora-identity")))


def test_an_unchanged_adapter_keeps_its_identity(probed: dict) -> None:
    assert probed["v1"] and probed["v1"].startswith("lora:")
    assert probed["v1_again"] == probed["v1"]


def test_a_reload_in_place_with_new_files_is_never_the_old_identity(probed: dict) -> None:
    # the files changed under the same vLLM id, name and path: which of them a request computes
    # with depends on when vLLM's worker reloads, so the adapter is no longer cached (a miss)
    assert probed["reloaded"] != probed["v1"] and probed["reloaded"] is None
    assert probed["reloaded_again"] is None


def test_the_new_files_under_a_new_name_are_cached(probed: dict) -> None:
    assert probed["new_name"] and probed["new_name"].startswith("lora:")
    assert probed["new_name"] != probed["v1"]
