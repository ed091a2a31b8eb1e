"""Block-key hashing and payload-checksum benchmark. Not a test: it reports numbers.

Figures, all measured in one run on this machine:

- chain hashing of one prompt (``block_keys_array`` on int64 token ids, the
  whole public call: validation, conversion and the key chain) in tokens/s
  at several block sizes, beside raw ``xxhash.xxh3_128_digest`` over the
  same token bytes (``tokens.astype('<u4').tobytes()``, prepared outside the
  timing) measured right next to it; also the list form (``block_keys``) and
  uint32 input;
- fused copy + XXH3-64 (``kvstore.checksum.copy_checksum``) over a large
  array in 1 MiB and 4 MiB blocks, beside ``np.copyto`` of the whole array,
  ``np.copyto`` in the same blocks, copy-then-hash, and python-xxhash's
  ``xxh3_64_intdigest`` alone.

``measure()`` is imported by bench/core.py (bench/ on sys.path); run this
file directly for the table and JSON.

Usage: python bench/hashing.py [--quick] [--json PATH] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np
import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from benchlib import Report, median_time  # noqa: E402

from kvstore import checksum as cks  # noqa: E402
from kvstore import keys as K  # noqa: E402
from kvstore.keys import Namespace, block_keys, block_keys_array  # noqa: E402

MIB = 1 << 20
VOCAB = 128256  # Llama-3 vocabulary size: realistic id range


def measure(n_tokens: int = 131072, block_sizes: tuple[int, ...] = (16, 64, 256),
            repeats: int = 7) -> dict[int, dict[str, Any]]:
    """Chain-hashing throughput per block size.

    Returns ``{block_size: {...}}`` with ``median_s`` / ``tokens_per_s``
    (``block_keys_array`` on an int64 prompt), ``raw_median_s`` /
    ``raw_tokens_per_s`` (``xxh3_128_digest`` of the same ids as uint32
    bytes, timed beside it), ``ratio`` (chain / raw throughput),
    ``list_tokens_per_s`` (``block_keys``, one bytes object per key),
    ``uint32_tokens_per_s`` / ``uint32_ratio`` (uint32 input) and ``native``
    (whether the C extension ran the chain).
    """
    rng = np.random.default_rng(12345)
    tokens = rng.integers(0, VOCAB, size=n_tokens, dtype=np.int64)
    tokens_u32 = tokens.astype("<u4")
    raw = tokens_u32.tobytes()
    inner_raw = max(1, 2_000_000 // max(1, n_tokens))
    out: dict[int, dict[str, Any]] = {}
    for bs in block_sizes:
        ns = Namespace("bench", "bench-model", block_size=bs)
        inner = max(1, 500_000 // max(1, n_tokens))
        raw_s = median_time(lambda: xxhash.xxh3_128_digest(raw), repeats=repeats, inner=inner_raw)
        chain_s = median_time(lambda: block_keys_array(ns, tokens), repeats=repeats, inner=inner)
        u32_s = median_time(lambda: block_keys_array(ns, tokens_u32), repeats=repeats, inner=inner)
        list_s = median_time(lambda: block_keys(ns, tokens), repeats=repeats, inner=inner)
        raw_s2 = median_time(lambda: xxhash.xxh3_128_digest(raw), repeats=repeats, inner=inner_raw)
        raw_s = min(raw_s, raw_s2)  # the faster of the two baselines: the stricter ratio
        out[bs] = {
            "median_s": chain_s,
            "tokens_per_s": n_tokens / chain_s,
            "raw_median_s": raw_s,
            "raw_tokens_per_s": n_tokens / raw_s,
            "ratio": raw_s / chain_s,
            "list_median_s": list_s,
            "list_tokens_per_s": n_tokens / list_s,
            "uint32_median_s": u32_s,
            "uint32_tokens_per_s": n_tokens / u32_s,
            "uint32_ratio": raw_s / u32_s,
            "native": K.HAVE_NATIVE,
        }
    return out


def measure_copy(total_bytes: int = 256 * MIB, block_bytes: tuple[int, ...] = (MIB, 4 * MIB),
                 repeats: int = 5) -> dict[str, float]:
    """Copy and checksum throughput (GB/s of payload) over ``total_bytes``.

    Keys: ``copyto_whole_gbs`` (one ``np.copyto``), ``xxh3_64_gbs``
    (python-xxhash over the array), ``checksum_gbs`` (kvstore.checksum), and
    per block size B (in MiB): ``copyto_{B}mib_gbs`` (``np.copyto`` per
    block), ``copy_then_hash_{B}mib_gbs`` (``np.copyto`` + ``xxh3_64`` per
    block) and ``copy_checksum_{B}mib_gbs`` (fused, per block).
    """
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, size=total_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst.fill(1)  # fault the pages in before timing
    gb = total_bytes / 1e9
    res: dict[str, float] = {}
    res["copyto_whole_gbs"] = gb / median_time(lambda: np.copyto(dst, src), repeats=repeats)
    res["xxh3_64_gbs"] = gb / median_time(lambda: xxhash.xxh3_64_intdigest(src.data), repeats=repeats)
    res["checksum_gbs"] = gb / median_time(lambda: cks.checksum(src), repeats=repeats)
    for bb in block_bytes:
        n = total_bytes // bb
        srcs = [src[i * bb:(i + 1) * bb] for i in range(n)]
        dsts = [dst[i * bb:(i + 1) * bb] for i in range(n)]
        tag = f"{bb // MIB}mib" if bb >= MIB else f"{bb // 1024}kib"
        part = n * bb / 1e9

        def copy_blocks() -> None:
            for d, s in zip(dsts, srcs):
                np.copyto(d, s)

        def copy_then_hash() -> None:
            for d, s in zip(dsts, srcs):
                np.copyto(d, s)
                xxhash.xxh3_64_intdigest(d.data)

        def fused() -> None:
            for d, s in zip(dsts, srcs):
                cks.copy_checksum(d, s)

        res[f"copyto_{tag}_gbs"] = part / median_time(copy_blocks, repeats=repeats)
        res[f"copy_then_hash_{tag}_gbs"] = part / median_time(copy_then_hash, repeats=repeats)
        res[f"copy_checksum_{tag}_gbs"] = part / median_time(fused, repeats=repeats)
    assert cks.copy_checksum(dst, src) == xxhash.xxh3_64_intdigest(src.data)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller run (well under a minute)")
    ap.add_argument("--json", metavar="PATH", help="write figures and targets as JSON")
    ap.add_argument("--repeats", type=int, default=None, help="timing samples per figure")
    args = ap.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 9)

    rep = Report("hashing")
    rep.figure("native_extension", float(K.HAVE_NATIVE and cks.HAVE_NATIVE), "bool")
    hashing = measure(n_tokens=131072, block_sizes=(16, 64, 256), repeats=repeats)
    for bs, r in hashing.items():
        rep.figure(f"hash_bs{bs}_tokens_per_s", r["tokens_per_s"], "tokens/s")
        rep.figure(f"hash_bs{bs}_raw_xxh3_tokens_per_s", r["raw_tokens_per_s"], "tokens/s")
        rep.figure(f"hash_bs{bs}_ratio_to_raw", r["ratio"], "x")
        rep.figure(f"hash_bs{bs}_uint32_ratio_to_raw", r["uint32_ratio"], "x")
        rep.figure(f"hash_bs{bs}_list_tokens_per_s", r["list_tokens_per_s"], "tokens/s")
    default_bs = Namespace("t", "m").block_size
    if default_bs in hashing:
        rep.target(f"chain hashing / raw xxh3 (block_size {default_bs})", hashing[default_bs]["ratio"], 0.3)

    copy = measure_copy(total_bytes=(64 if args.quick else 256) * MIB, repeats=repeats)
    for name, value in copy.items():
        rep.figure(name, value, "GB/s")
    for tag in ("1mib", "4mib"):
        rep.figure(f"copy_checksum_{tag}_vs_copyto_whole", copy[f"copy_checksum_{tag}_gbs"] / copy["copyto_whole_gbs"], "x")
        rep.figure(f"copy_checksum_{tag}_vs_copyto_blocks", copy[f"copy_checksum_{tag}_gbs"] / copy[f"copyto_{tag}_gbs"], "x")
    rep.emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
