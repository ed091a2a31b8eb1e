"""End-to-end check of the mirrored-shard protocol: one process per TP rank.

Run one copy per rank (the tests do, with ``subprocess``)::

    python -m engine_adapter.tp_check --rank R --world W --init-file F \\
        --target 127.0.0.1:PORT --mode both --out DIR

Each rank builds the same seeded random Llama model (no download), splits
it over a gloo group (:func:`engine_adapter.hf.shard_model`), and runs:

- ``save``: request 1 (shared prefix + question 1) with a full prefill, then
  its blocks are saved (every rank writes its shard into one slot per
  block); and request 2 (shared prefix + question 2) with a full recompute,
  no store: the reference.
- ``load``: request 2 again with the prefix loaded from the store and only
  the rest computed.
- ``both``: ``save`` then ``load`` in one go.

Results go to ``DIR/rank{R}-{phase}.json`` (tokens, load/save statuses) and
``DIR/rank{R}-{phase}-logits.npy`` (first-token logits, float32): plain
JSON and ``.npy`` files, never pickles.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engine_adapter.hf import HFPrefixCache, build_model, llama_config, model_namespace, shard_model
from engine_adapter.tp import TorchDistGroup


def _prompts(seed: int, vocab: int, prefix: int, suffix: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (prefix,), generator=g)
    q1 = torch.randint(0, vocab, (suffix,), generator=g)
    q2 = torch.randint(0, vocab, (suffix,), generator=g)
    return torch.cat([shared, q1]), torch.cat([shared, q2])


def _write(out: str, name: str, record: dict[str, Any], logits: torch.Tensor) -> None:
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(record, f)
    np.save(os.path.join(out, f"{name}-logits.npy"), logits.numpy().astype(np.float32), allow_pickle=False)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.init_file}", rank=args.rank,
                            world_size=args.world)
    try:
        group = TorchDistGroup()
        cfg = llama_config(num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, hidden_size=args.hidden,
                           intermediate_size=2 * args.hidden)
        model = build_model(cfg, seed=args.seed)
        ns = model_namespace(model, tenant="tp-check", block_size=args.block_size, tp_size=args.world)
        shard_model(model, group)
        p1, p2 = _prompts(args.seed + 1, cfg.vocab_size, args.prefix, args.suffix)
        with HFPrefixCache(model, ns, target=args.target, group=group, max_tokens=len(p1) + 64,
                           retry_interval=0.0) as hc:
            if args.mode in ("save", "both"):
                warm = hc.generate(p1, 2, use_store=False, save=True)
                ref = hc.generate(p2, args.new_tokens, use_store=False, save=False)
                assert warm.save is not None
                _write(args.out, f"rank{args.rank}-save", {
                    "tokens": ref.tokens, "save_statuses": [s.name for s in warm.save.statuses],
                    "save_fault": warm.save.fault, "shard_bytes": hc.layout.shard_bytes,
                    "keys": [k.hex() for k in hc.connector.keys(p2)]}, ref.first_logits)
            if args.mode in ("load", "both"):
                got = hc.generate(p2, args.new_tokens, use_store=True, save=False)
                assert got.load is not None
                _write(args.out, f"rank{args.rank}-load", {
                    "tokens": got.tokens, "cached_tokens": got.cached_tokens,
                    "load_statuses": [s.name for s in got.load.statuses], "load_fault": got.load.fault,
                    "loaded_blocks": got.load.loaded_blocks, "faults": hc.connector.stats.faults},
                    got.first_logits)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_adapter.tp_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init-file", required=True, help="file for torch.distributed's file:// rendezvous")
    ap.add_argument("--target", required=True, help="daemon address")
    ap.add_argument("--mode", choices=["save", "load", "both"], default="both")
    ap.add_argument("--out", required=True, help="directory for the result files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix", type=int, default=96, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=20, help="question tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: gloo's worker threads can still hold work
    # objects whose release during finalization aborts the process
    # ("terminate called without an active exception", about 1 run in 30
    # here; pytorch#179291) after every result file is written.
    os._exit(rc)
