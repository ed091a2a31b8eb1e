"""The vLLM connector's save protocol at TP = 2 without a vLLM engine (run
with the vLLM environment's python against a real daemon at TARGET): the
worker half of rank 0 of a 2-rank group, whose peer (rank 1) never writes
its shard. The group is a stand-in for vLLM's TP group that plays what the
peer does at the MIN all-reduce:

- ``fail``: rank 1 answers 0 (it could not write its shards);
- ``raise``: the collective fails (rank 1's process died: gloo raises);
- ``exit``: this process is killed inside the collective (rank 0 itself
  dies mid-save, after writing its shard, before any commit);
- ``agree``: the peer confirms (the slot then holds rank 0's shard and
  rank 1's untouched bytes); then rank 0 loads the blocks back into zeroed
  pages (``loaded``: its shard's bytes, which it checks against its own
  entry in the seal, whatever rank 1's shard holds);
- ``staged``: ``agree`` with the layouts ``scatter_layout`` does not know
  (device tensors): saves staged, loads staged in shard-wide rows.

    tp_check.py TARGET MODE[,MODE...] OUT.json

OUT: per mode, the keys, the namespace, what rank 0 wrote and how the save
ended (``exit`` last: the process ends there).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from engine_adapter.vllm import KVStoreConnector
from engine_adapter.vllm_common import BlockMove, KVStoreConnectorMetadata
from kvstore.keys import block_keys

BS, NB, LAYERS, KVH, HEAD, TP = 16, 8, 2, 1, 4, 2  # KVH: KV heads of one rank (2 in all)


def config(target: str) -> SimpleNamespace:
    mc = SimpleNamespace(model="tp-check", served_model_name="tp-check", revision=None, dtype=torch.float32,
                         get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: KVH,
                         get_head_size=lambda: HEAD)
    ktc = SimpleNamespace(kv_connector_extra_config={"target": target, "tenant": "tp", "timeout": 2.0,
                                                     "weights_digest": "tp-check-weights", "retry_interval": 0.0},
                          kv_role="kv_both", kv_load_failure_policy="recompute")
    return SimpleNamespace(kv_transfer_config=ktc, model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto",
                           block_size=BS), parallel_config=SimpleNamespace(tensor_parallel_size=TP,
                           pipeline_parallel_size=1), scheduler_config=SimpleNamespace(async_scheduling=False),
                           kv_events_config=None)


class PeerOfRank0:
    """Rank 0's view of a 2-rank group whose rank 1 behaves as ``mode`` says."""

    rank = 0
    size = TP

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.reduced = 0

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return t  # rank 0 is the source

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        self.reduced += 1
        if self.mode == "exit":
            os._exit(17)  # killed mid-save: its shard is written, nothing committed
        if self.mode == "raise":
            raise RuntimeError("gloo: connection closed by peer (rank 1 died)")
        if self.mode == "fail":
            t.zero_()
        return t

    def barrier(self) -> None:
        pass


def run(target: str, mode: str, res: dict, out_path: str) -> None:
    kcc = SimpleNamespace(num_blocks=NB, kv_cache_layout=None, hash_block_size=None)
    worker = KVStoreConnector(config(target), KVConnectorRole.WORKER, kcc)
    worker.worker.group = PeerOfRank0(mode)
    gen = torch.Generator().manual_seed(11)
    layers = {f"l{i}": torch.randn(NB, KVH, BS, 2 * HEAD, generator=gen) for i in range(LAYERS)}
    worker.register_kv_caches(layers)
    if mode == "staged":
        worker.worker.scatter = None
    ns = worker.ns
    prompt = np.random.default_rng(int.from_bytes(mode.encode(), "little") % 1000).integers(3, 1000, 3 * BS)
    keys = block_keys(ns, prompt)
    r: dict = {"keys": [k.hex() for k in keys], "ns": ns.to_dict(), "block_bytes": worker.worker.block_bytes,
               "shard_bytes": worker.worker.shard_bytes,
               "shard": torch.cat([t[[1, 2, 3]].reshape(3, -1).view(torch.uint8) for t in layers.values()], 1)
               .numpy().tobytes().hex()}
    res[mode] = r
    json.dump(res, open(out_path, "w"))  # (``exit`` never returns)
    worker.bind_connector_metadata(KVStoreConnectorMetadata(saves=[BlockMove("r", "", "", b"".join(keys),
                                                                             [1, 2, 3])]))
    try:
        worker.wait_for_save()
        r["raised"] = None
    except RuntimeError as e:
        r["raised"] = str(e)
    r["reduced"] = worker.worker.group.reduced
    if r["raised"] is None and mode in ("agree", "staged"):
        for t in layers.values():
            t[[1, 2, 3]] = 0
        worker.bind_connector_metadata(KVStoreConnectorMetadata(loads=[BlockMove("r2", "", "", b"".join(keys),
                                                                                 [3, 1, 2])]))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        r["load_errors"] = sorted(worker.get_block_ids_with_load_errors())
        r["loaded"] = torch.cat([t[[3, 1, 2]].reshape(3, -1).view(torch.uint8) for t in layers.values()], 1) \
            .numpy().tobytes().hex()
    r["stats"] = dict(worker.stats)
    worker.shutdown()
    json.dump(res, open(out_path, "w"))


def main() -> None:
    target, modes, out_path = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
    res: dict = {}
    for mode in modes:
        run(target, mode, res, out_path)


if __name__ == "__main__":
    main()
