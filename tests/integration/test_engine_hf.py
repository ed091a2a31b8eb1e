"""A real Hugging Face transformer end to end (CPU, float32, seeded random
weights, nothing downloaded): greedy generation after a prefix loaded from
the store is token-for-token identical to a full recompute and the
first-token logits agree to 1e-5; for TP=1 and TP=2 (two processes, gloo,
heads split), with blocks from DRAM and from SSD (after a daemon restart)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from engine_adapter.hf import (HFPrefixCache, build_model, check_tp, llama_config, model_namespace,  # noqa: E402
                               weights_digest)
from engine_adapter.tp import LocalGroup  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.errors import InvalidArgument, KeyStatus  # noqa: E402
from tests.integration.conftest import wait_until  # noqa: E402
from tiers.base import TierKind  # noqa: E402

BS = 16
PREFIX, SUFFIX, NEW = 96, 20, 32
ATOL = 1e-5
SSD = dict(ssd__capacity="256MiB", ssd__write_mode="through", ssd__admit_min_hits=0, ssd__sync=False)


@pytest.fixture(scope="module")
def model():
    return build_model(llama_config(), seed=0)


def prompts(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (PREFIX,), generator=g)
    return (torch.cat([shared, torch.randint(0, vocab, (SUFFIX,), generator=g)]),
            torch.cat([shared, torch.randint(0, vocab, (SUFFIX,), generator=g)]))


def stop_now(d) -> None:
    """Stop a fixture daemon mid-test (the fixture's teardown then skips it)."""
    d.stop()
    d.stop = lambda: None


def ssd_daemon(make_daemon, path: str):
    d = make_daemon(ssd__path=path, **SSD)
    if TierKind.SSD not in d.store.tiers:
        pytest.skip("this daemon has no SSD tier")
    return d


def wait_on_ssd(d, n: int) -> None:
    """Until ``n`` blocks have their write-through SSD copy."""
    wait_until(lambda: d.call(lambda: int((d.store.index.ssd_loc[d.store.index.used_rows()] >= 0).sum())) >= n,
               what="write-through copies on SSD")


def assert_same(cached, full) -> None:
    assert cached.tokens == full.tokens
    diff = float((cached.first_logits - full.first_logits).abs().max())
    assert diff <= ATOL, diff


def test_tp1_prefix_from_dram_matches_full_recompute(daemon, model):
    ns = model_namespace(model, tenant="t", block_size=BS)
    p1, p2 = prompts(model.config.vocab_size)
    with HFPrefixCache(model, ns, target=daemon.target, max_tokens=256) as hc:
        warm = hc.generate(p1, 2, use_store=True, save=True)
        assert warm.cached_tokens == 0 and warm.save.stored_blocks == (PREFIX + SUFFIX) // BS
        full = hc.generate(p2, NEW, use_store=False, save=False)
        look = hc.connector.lookup(p2)
        assert look.hit_blocks == PREFIX // BS and set(look.tiers) == {"dram"}
        cached = hc.generate(p2, NEW)
        assert cached.cached_tokens == PREFIX and cached.load.statuses[:PREFIX // BS] == (KeyStatus.OK,) * 6
        assert_same(cached, full)
        # the second request's own blocks were saved; the shared ones were not rewritten
        assert cached.save.existing_blocks == PREFIX // BS and cached.save.stored_blocks == 1
        # the whole prompt cached: still one token is computed, and the result is the same
        again = hc.generate(p2, NEW, save=False)
        assert again.cached_tokens == ((PREFIX + SUFFIX - 1) // BS) * BS
        assert_same(again, full)
        assert hc.connector.stats.faults == 0


def test_tp1_prefix_from_ssd_after_restart_matches_full_recompute(make_daemon, model, tmp_path):
    ns = model_namespace(model, tenant="t", block_size=BS)
    p1, p2 = prompts(model.config.vocab_size, seed=2)
    d = ssd_daemon(make_daemon, str(tmp_path / "ssd"))
    with HFPrefixCache(model, ns, target=d.target, max_tokens=256) as hc:
        hc.generate(p1, 2)
        full = hc.generate(p2, NEW, use_store=False, save=False)
    wait_on_ssd(d, (PREFIX + SUFFIX) // BS)
    stop_now(d)
    d2 = ssd_daemon(make_daemon, str(tmp_path / "ssd"))
    with HFPrefixCache(model, ns, target=d2.target, max_tokens=256) as hc:
        look = hc.connector.lookup(p2)
        assert look.hit_blocks == PREFIX // BS and set(look.tiers) == {"ssd"}
        cached = hc.generate(p2, NEW, save=False)
        assert cached.cached_tokens == PREFIX
        assert_same(cached, full)
        assert set(hc.connector.lookup(p2).tiers) == {"dram"}  # Acquire promoted them


def test_sliding_window_cache_saves_no_kv_of_other_positions(daemon):
    """A sliding-window layer keeps only the last ``window - 1`` positions:
    after generation its tensor no longer starts at position 0, so blocks
    it no longer holds must not be saved (before: positions 4..35 were
    stored under the keys of tokens 0..31, and a later load used them)."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=40, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mistral = MistralForCausalLM(cfg).eval()
    ns = model_namespace(mistral, tenant="sw", block_size=BS)
    g = torch.Generator().manual_seed(3)
    p1 = torch.randint(0, 512, (32,), generator=g)
    p2 = torch.cat([p1, torch.randint(0, 512, (4,), generator=g)])
    with HFPrefixCache(mistral, ns, target=daemon.target, max_tokens=256) as hc:
        # 32 prompt + 11 generated positions: the window holds positions 4..42 only
        hc.generate(p1, 12)
        full = hc.generate(p2, 4, use_store=False, save=False)
        cached = hc.generate(p2, 4, save=False)
        assert_same(cached, full)
        # while the window still holds every prompt position, blocks are saved
        p3 = torch.randint(0, 512, (33,), generator=g)
        assert hc.generate(p3, 2).save.stored_blocks == 2
        p4 = torch.cat([p3[:32], torch.randint(0, 512, (4,), generator=g)])
        cached = hc.generate(p4, 4, save=False)
        assert cached.cached_tokens == 32
        assert_same(cached, hc.generate(p4, 4, use_store=False, save=False))


def test_daemon_down_means_a_normal_full_prefill(model):
    ns = model_namespace(model, tenant="t", block_size=BS)
    _, p2 = prompts(model.config.vocab_size)
    with HFPrefixCache(model, ns, target="127.0.0.1:1", max_tokens=256, timeout=1.0) as hc:
        full = hc.generate(p2, NEW, use_store=False, save=False)
        got = hc.generate(p2, NEW)
        assert got.cached_tokens == 0 and got.load.fault and got.save.fault
        assert got.tokens == full.tokens and torch.equal(got.first_logits, full.first_logits)
        assert hc.connector.stats.faults >= 1


def test_bad_input_is_refused_before_anything_runs(model):
    ns = model_namespace(model, tenant="t", block_size=BS)
    with pytest.raises(InvalidArgument, match="KV heads: 2 heads cannot be split evenly over 4"):
        check_tp(model, 4)

    class Four(LocalGroup):
        size = 4

    with pytest.raises(InvalidArgument, match="cannot be split evenly"):
        HFPrefixCache(model, ns, target="127.0.0.1:1", group=Four())

    class Two(LocalGroup):
        size = 2

    with pytest.raises(InvalidArgument, match="shard the model"):  # TP group but an unsplit model
        HFPrefixCache(model, model_namespace(model, tenant="t", block_size=BS, tp_size=2),
                      target="127.0.0.1:1", group=Two())
    with HFPrefixCache(model, ns, target="127.0.0.1:1", max_tokens=64) as hc:
        with pytest.raises(InvalidArgument, match="longer than max_tokens"):
            hc.generate(torch.arange(100), 2)
        with pytest.raises(InvalidArgument, match="batch 2"):
            hc.generate(torch.zeros(2, 5, dtype=torch.long), 2)


def test_weights_digest_names_the_weights(model):
    assert weights_digest(model) == weights_digest(build_model(llama_config(), seed=0))
    assert weights_digest(model) != weights_digest(build_model(llama_config(), seed=1))


# ------------------------------------------------------------------ TP=2
TP = 2


def run_ranks(target: str, out: str, mode: str, repo_root: str) -> None:
    """One process per rank (gloo over loopback); results as JSON + .npy."""
    init = os.path.join(out, f"init-{mode}")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "engine_adapter.tp_check", "--rank", str(r), "--world",
                               str(TP), "--init-file", init, "--target", target, "--mode", mode, "--out", out,
                               "--prefix", str(PREFIX), "--suffix", str(SUFFIX), "--new-tokens", str(NEW)],
                              cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(TP)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"


def results(out: str, rank: int, phase: str) -> tuple[dict, np.ndarray]:
    with open(os.path.join(out, f"rank{rank}-{phase}.json")) as f:
        rec = json.load(f)
    return rec, np.load(os.path.join(out, f"rank{rank}-{phase}-logits.npy"), allow_pickle=False)


def check_tp_results(out: str) -> list[dict]:
    saves = []
    for r in range(TP):
        ref, ref_logits = results(out, r, "save")
        got, got_logits = results(out, r, "load")
        assert ref["save_statuses"] == ["OK"] * ((PREFIX + SUFFIX) // BS), r
        assert got["cached_tokens"] == PREFIX and got["loaded_blocks"] == PREFIX // BS, r
        assert got["tokens"] == ref["tokens"], r
        diff = float(np.abs(got_logits - ref_logits).max())
        assert diff <= ATOL, (r, diff)
        saves.append(ref)
    # every rank computed the same thing (the logits are all-reduced)
    assert results(out, 0, "load")[0]["tokens"] == results(out, 1, "load")[0]["tokens"]
    return saves


def check_one_slot_per_block(target: str, shard_bytes: int, keys: list[bytes], model) -> None:
    ns = model_namespace(model, tenant="tp-check", block_size=BS, tp_size=TP)
    with Client(target) as c:
        assert c.lookup(ns, keys).hit_blocks == PREFIX // BS
        block = c.get(ns, keys[:1])[0]
        assert block.size == TP * shard_bytes  # both shards in one entry


def test_tp2_prefix_from_dram_matches_full_recompute(daemon, tmp_path, repo_root, model):
    out = str(tmp_path)
    run_ranks(daemon.target, out, "both", repo_root)
    saves = check_tp_results(out)
    check_one_slot_per_block(daemon.target, saves[0]["shard_bytes"], [bytes.fromhex(k) for k in saves[0]["keys"]],
                             model)


def test_tp2_prefix_from_ssd_after_restart_matches_full_recompute(make_daemon, tmp_path, repo_root):
    out = str(tmp_path)
    d = ssd_daemon(make_daemon, str(tmp_path / "ssd"))
    run_ranks(d.target, out, "save", repo_root)
    wait_on_ssd(d, (PREFIX + SUFFIX) // BS)
    stop_now(d)
    d2 = ssd_daemon(make_daemon, str(tmp_path / "ssd"))
    assert d2.call(lambda: int((d2.store.index.tier[d2.store.index.used_rows()] == TierKind.SSD).sum())) \
        == (PREFIX + SUFFIX) // BS
    run_ranks(d2.target, out, "load", repo_root)
    check_tp_results(out)
