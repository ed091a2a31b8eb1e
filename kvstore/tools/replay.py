"""Replay a request trace through the store; compare with Bélády's optimum.

Semantics, per request (docs/replay.md has the long form):

1. Key the prompt's *full* blocks (``kvstore.keys.block_keys_array`` in the
   request tenant's namespace; a trailing partial block is never cached).
2. ``lookup`` -> ``hit`` leading blocks present (and each one's tier).
3. ``acquire`` the hit prefix (a lease: pins it and counts as an access for
   the eviction policy; SSD blocks are promoted). The hit is what the lease
   delivered; ``hit * block_size`` prefill tokens are saved.
4. ``put`` the missing suffix with ``parent`` = the last hit key (prefill
   produced those blocks), then release the lease. Payloads are
   ``payload_bytes`` (4 KiB: one slot each) of zeros.
5. In process, the store's background work (SSD demotion, copies) runs to
   completion between requests (a daemon's background loop between
   arrivals; at most 1,024 steps, noted if more was pending); arrival
   times only order the requests.

Bélády (:func:`belady`): the same trace, the same capacity in blocks,
offline. A block is *used* by every request whose chain contains it; seen as
one access per block in chain order, a parent's next use always comes before
its children's, so "evict the cached block whose next use is furthest in the
future" only ever picks a leaf and chains stay contiguous. A missing block is
admitted only if its own next use is sooner than the furthest cached one
(otherwise it is bypassed, with the rest of its chain): the MIN algorithm,
optimal for equal-size blocks, hence an upper bound on every policy here
(they cannot bypass). Blocks never used again rank by depth (leaves first).
Cost: one ``argsort`` for the next-use table, then a heap with lazy
invalidation, O(log n) per block access; no loop per token.

API::

    pt = prepare(trace, block_size=16)       # hash once: keys, dense ids
    r = replay(pt, "cost", capacity_blocks=4096, ssd_blocks=0, ssd_admission=None)
    b = belady(pt, 4096)                     # same counters, policy "belady"
    r.block_hit_ratio / b.block_hit_ratio
    replay_daemon(pt, "127.0.0.1:50051")     # against a running daemon
    format_table([r, ...], {4096: b})

``trace`` is any iterable of objects with ``tenant``, ``tokens`` (and
optionally ``arrival``) attributes (``kvstore.tools.workloads.Request``), or of
``(tenant, tokens, arrival)`` tuples. ``kvstore replay`` is the CLI
(``add_arguments``/``run``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from kvstore.config import parse_size
from kvstore.core.eviction import PolicyName
from kvstore.core.ssd_mover import SsdSpec
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.tools import workloads as w
from kvstore.tools.belady import belady
from kvstore.tools.inputs import check_output, write_json
from kvstore.tools.replay_report import ReplayResult, base_result, format_table
from kvstore.tools.trace import PreparedTrace, TraceRequest, capacity_levels, prepare, read_trace
from tiers.base import TierKind

__all__ = ["PreparedTrace", "ReplayResult", "TraceRequest", "prepare", "replay", "replay_daemon", "belady",
           "format_table", "ssd_supported", "read_trace", "add_arguments", "run", "capacity_levels"]

OWNER = "replay"
_SLOT = 4096
_MAX_STEPS = 1024
"""Background steps run between two requests at most."""


# ------------------------------------------------------------ the SSD tier
def ssd_supported() -> dict[str, str] | None:
    """How this build's StoreConfig takes an SSD tier, or None if it does not:
    ``{"style": "spec", ...}`` (``StoreConfig.ssd = SsdSpec(...)``) or
    ``{"style": "flat", "capacity": field, "path": field, "admit": field}``."""
    names = {f.name for f in dataclasses.fields(StoreConfig)}
    if "ssd" in names:
        spec = {f.name for f in dataclasses.fields(SsdSpec)}
        if {"path", "capacity_bytes"} <= spec:
            return {"style": "spec", "admit": "admit_min_hits" if "admit_min_hits" in spec else ""}
        return None

    def pick(*cands: str) -> str:
        return next((c for c in cands if c in names), "")

    cap = pick("ssd_bytes", "ssd_capacity", "ssd_capacity_bytes")
    path = pick("ssd_path", "ssd_dir")
    if not cap or not path:
        return None
    return {"style": "flat", "capacity": cap, "path": path,
            "admit": pick("ssd_admit_min_hits", "admit_min_hits", "ssd_min_hits")}


_SSD_RECORD = 88  # bytes of the SSD tier's record header per block (docs/ssd.md)


def _store_config(capacity: int, policy: str, payload: int, ssd_blocks: int, admission: str,
                  ssd_path: str | None) -> tuple[Any, list[str]]:
    slot = -(-payload // _SLOT) * _SLOT
    page = slot * math.gcd(max(capacity, 1), 64)
    kw: dict[str, Any] = dict(dram_bytes=max(capacity, 1) * slot, dram_page_bytes=page, policy=policy,
                              verify_reads=False)
    notes: list[str] = []
    if ssd_blocks:
        how = ssd_supported()
        if how is None:
            notes.append("SSD tier skipped: this build's StoreConfig has no SSD fields")
        else:
            nbytes = ssd_blocks * (payload + _SSD_RECORD)
            admit = {"on": None, "off": 0}.get(admission)
            if how["style"] == "spec":
                spec_fields = {f.name for f in dataclasses.fields(SsdSpec)}
                skw: dict[str, Any] = dict(path=ssd_path, capacity_bytes=nbytes)
                for k, v in (("sync", False),):
                    if k in spec_fields:
                        skw[k] = v
                if admit is not None and how["admit"]:
                    skw[how["admit"]] = admit
                elif admit is not None:
                    notes.append("SSD admission off skipped: SsdSpec has no admit_min_hits")
                kw["ssd"] = SsdSpec(**skw)
            else:
                kw[how["capacity"]] = nbytes
                kw[how["path"]] = ssd_path
                if admit is not None and how["admit"]:
                    kw[how["admit"]] = admit
    return StoreConfig(**kw), notes


def _ssd_bytes_written(store: Any) -> int | None:
    mover = getattr(store, "ssd", None)
    if mover is None:
        return None
    total = 0
    found = False
    for name in ("bytes_demoted", "bytes_copied", "bytes_written", "write_bytes"):
        v = getattr(mover, name, None)
        if isinstance(v, int):
            total += v
            found = True
    return total if found else None


# --------------------------------------------------------------- in process
def replay(pt: PreparedTrace, policy: Any = "lru", capacity_blocks: int = 4096, *, ssd_blocks: int = 0,
           ssd_admission: str = "on", ssd_path: str | None = None, payload_bytes: int = _SLOT,
           label: str | None = None, store_cls: Any = None, dram_admission: bool = False) -> ReplayResult:
    """Run ``pt`` through an in-process ``TieredStore`` (module docstring).

    ``policy`` is a policy name, or an object with the ``kvstore.core.eviction.Policy``
    methods (a prototype ranking; ``label`` names it). ``ssd_blocks`` > 0 adds
    an SSD tier of that many blocks (in a temporary directory unless
    ``ssd_path``) when this build supports one (else a note says it was
    skipped); ``ssd_admission`` "on" keeps the admission rule's default, "off"
    admits every demoted block. ``store_cls`` replaces ``TieredStore`` (a
    subclass prototyping another eviction order). ``dram_admission`` turns on
    the store's DRAM admission filter (``StoreConfig.dram_admission``)."""
    if capacity_blocks < 1:
        raise InvalidArgument(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    if ssd_admission not in ("on", "off"):
        raise InvalidArgument(f"ssd_admission must be on or off, got {ssd_admission!r}")
    name = policy if isinstance(policy, str) else "lru"
    PolicyName.parse(name)  # before the store maps its slab: a bad name must not leak one
    tmp = None
    if ssd_blocks and ssd_path is None:
        tmp = ssd_path = tempfile.mkdtemp(prefix="kvreplay-ssd-")
        ssd_path = os.path.join(tmp, "ssd")
    cfg, notes = _store_config(capacity_blocks, name, payload_bytes, ssd_blocks, ssd_admission, ssd_path)
    if dram_admission:
        cfg = dataclasses.replace(cfg, dram_admission=True)
    res = base_result(pt, label or (name if isinstance(policy, str) else type(policy).__name__), capacity_blocks)
    res.notes = notes
    has_ssd = getattr(cfg, "ssd", None) is not None or (ssd_blocks > 0 and not notes)
    if has_ssd:
        res.ssd_blocks, res.ssd_admission = ssd_blocks, ssd_admission
    t0 = time.perf_counter()
    try:
        with (store_cls or TieredStore)(cfg) as store:
            if not isinstance(policy, str):
                store.policy = policy
            background = getattr(store, "background", None)
            nss = pt.namespaces()
            payload = np.zeros(payload_bytes, dtype=np.uint8)
            keys, offs, tof = pt.keys, pt.offsets.tolist(), pt.tenant_of.tolist()
            tier_counts = np.zeros(256, dtype=np.int64)
            per_req = np.zeros(pt.requests, dtype=np.int64)
            hits = rejected = capped = 0
            for r in range(pt.requests):
                s, e = offs[r], offs[r + 1]
                if s == e:
                    continue
                ns = nss[tof[r]]
                karr = keys[s:e]
                look = store.lookup(ns, karr)
                h = look.hit_blocks
                handle = ""
                if h:
                    lease = store.acquire(ns, karr[:h], OWNER)
                    handle = lease.handle
                    h = int(np.count_nonzero(lease.offsets >= 0))
                    tier_counts += np.bincount(look.tier_codes[:h], minlength=256)[:256]
                    hits += h
                    per_req[r] = h
                if h < e - s:
                    parent = karr[h - 1].tobytes() if h else None
                    put = store.put(ns, karr[h:], [payload] * (e - s - h), parent=parent)
                    rejected += sum(1 for st in put.statuses if st is KeyStatus.CAPACITY)
                if handle:
                    store.release(handle, OWNER)
                if background is not None:
                    steps = 0
                    while background():
                        steps += 1
                        if steps >= _MAX_STEPS:  # a step that reports work pending without doing any
                            capped += 1
                            break
            stats = store.stats()
            if capped:
                res.notes.append(f"background work still pending after {_MAX_STEPS} steps after {capped} requests")
            res.hit_blocks = hits
            res.request_hits = per_req
            res.rejected_blocks = rejected
            res.tier_hits = {TierKind(t).label: int(c) for t, c in enumerate(tier_counts.tolist()) if c}
            res.evictions = {f"{tk.label}/{reason}": int(n) for (tk, reason), n in
                             sorted(stats.counters.evictions.items(), key=lambda kv: (int(kv[0][0]), kv[0][1]))}
            res.put_blocks = int(stats.counters.put_blocks)
            if has_ssd:
                res.ssd_bytes_written = _ssd_bytes_written(store)
                res.demoted_blocks = int(getattr(getattr(store, "ssd", None), "demoted", 0) or 0)
                if res.ssd_bytes_written is None:
                    res.notes.append("SSD bytes written: this build reports no SSD write counter")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    res.seconds = time.perf_counter() - t0
    return res


# ------------------------------------------------------------ against a daemon
def replay_daemon(pt: PreparedTrace, target: str, *, policy: str | None = None, payload_bytes: int = _SLOT,
                  token: str | None = None) -> ReplayResult:
    """Run ``pt`` against the daemon at ``target`` through ``kvstore.client``
    (the shared-memory path when the daemon is local). The daemon's tiers are
    used as configured; ``policy`` switches its eviction policy first (admin).
    Counters are differences of ``Stats`` before and after. The trace's
    namespaces are cleared first, so prepare ``pt`` with a model id of its
    own (``kvstore replay --target`` makes one up per invocation). Other
    namespaces' blocks on the daemon share the capacity."""
    from kvstore.client import Client  # deferred: grpc loads only for a replay against a daemon

    nss = pt.namespaces()
    t0 = time.perf_counter()
    with Client(target, token=token, name="kvstore-replay") as c:
        if policy:
            c.admin_set_policy(policy)
        for ns in nss:  # a fresh start: drop this trace's blocks of an earlier run
            c.clear(ns)
        before = c.stats(include_namespaces=False).to_dict()
        cap_bytes = sum(int(t.get("capacity_bytes", 0)) for t in before.get("tiers", [])
                        if str(t.get("tier", "")).lower().endswith("dram"))
        slot = -(-payload_bytes // _SLOT) * _SLOT
        res = base_result(pt, before.get("policy", policy or "daemon") or "daemon", cap_bytes // slot if cap_bytes else 0)
        payload = np.zeros(payload_bytes, dtype=np.uint8)
        hits = rejected = 0
        tiers: dict[str, int] = {}
        offs = pt.offsets.tolist()
        blob = np.ascontiguousarray(pt.keys).view("V16").reshape(-1).tolist()
        for r in range(pt.requests):
            s, e = offs[r], offs[r + 1]
            if s == e:
                continue
            ns = nss[int(pt.tenant_of[r])]
            kl = blob[s:e]
            look = c.lookup(ns, kl)
            h = int(look.hit_blocks)
            lease = None
            if h:
                lease = c.acquire(ns, kl[:h])
                h = int(lease.hit_blocks)
                for t in look.tiers[:h]:
                    tiers[t.label] = tiers.get(t.label, 0) + 1
                hits += h
            try:
                if h < e - s:
                    st = c.put(ns, kl[h:], [payload] * (e - s - h), parent=kl[h - 1] if h else None)
                    rejected += sum(1 for x in st if x is KeyStatus.CAPACITY)
            finally:
                if lease is not None:
                    lease.release()
        after = c.stats(include_namespaces=False).to_dict()
    res.hit_blocks, res.rejected_blocks, res.tier_hits = hits, rejected, tiers
    ev_b = {str(t.get("tier")): int(t.get("evictions", 0)) for t in before.get("tiers", [])}
    res.evictions = {f"{str(t.get('tier')).lower().replace('tier_', '')}/evicted":
                     int(t.get("evictions", 0)) - ev_b.get(str(t.get("tier")), 0) for t in after.get("tiers", [])}
    res.put_blocks = int(after.get("puts", 0)) - int(before.get("puts", 0))
    res.ssd_bytes_written = int(after.get("bytes_demoted", 0)) - int(before.get("bytes_demoted", 0))
    res.seconds = time.perf_counter() - t0
    return res


# --------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvstore replay``."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", help="generate a trace: chat, shared_prompt, agent, docqa or mix")
    src.add_argument("--trace", metavar="FILE", help="JSON lines: {tenant, tokens, arrival} per request")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="workload parameter (see kvstore/tools/workloads.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smaller generated trace")
    p.add_argument("--policy", default="lru,lfu,cost", help="comma-separated policies (lru,lfu,cost)")
    p.add_argument("--capacity", default="0.25",
                   help="DRAM capacity: blocks (e.g. 4096), a size (e.g. 64MiB), or a fraction of the "
                        "trace's live peak (e.g. 0.25, the default); comma-separated for several")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    p.add_argument("--payload-bytes", type=int, default=_SLOT, help="bytes per block (4096)")
    p.add_argument("--ssd", default="0", help="SSD tier: blocks, a size, or a multiple of the DRAM "
                                              "capacity like 4x (0 = none)")
    p.add_argument("--ssd-admission", choices=["on", "off", "both"], default="on")
    p.add_argument("--dram-admission", choices=["on", "off", "both"], default="off",
                   help="the store's DRAM admission filter (StoreConfig.dram_admission); rows labelled POLICY+adm")
    p.add_argument("--no-belady", action="store_true", help="skip the optimum")
    p.add_argument("--target", help="replay against the daemon at this address instead of in process")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def _capacity(text: str, pt: PreparedTrace, payload: int) -> int:
    text = text.strip()
    try:
        v = float(text)
    except ValueError:
        return max(1, parse_size(text) // (-(-payload // _SLOT) * _SLOT))
    if not v > 0 or math.isinf(v):
        raise InvalidArgument(f"capacity must be positive and finite, got {text}")
    if v < 1 or "." in text:
        return capacity_levels(pt, [v])[0]
    return int(v)


def run(args: argparse.Namespace) -> int:
    """``kvstore replay``: print the table (and write JSON); exit 0."""
    trace: Sequence[w.Request | TraceRequest]
    if args.payload_bytes < 1:
        raise InvalidArgument(f"--payload-bytes must be >= 1, got {args.payload_bytes}")
    if args.json:
        check_output(args.json)
    if args.workload:
        try:
            trace = w.make_trace(args.workload, args.seed, w.parse_params(args.workload, args.param), args.quick)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        name = args.workload
    else:
        trace, name = read_trace(args.trace), os.path.basename(args.trace)
    model = f"replay-{os.getpid()}-{time.time_ns() % 10**9}" if args.target else "replay"
    pt = prepare(trace, args.block_size, model_id=model, name=name)
    policies = [s.strip() for s in args.policy.split(",") if s.strip()]
    for pol in policies:
        PolicyName.parse(pol)
    print(f"trace {name}: {pt.requests} requests, {pt.tokens} prompt tokens, {pt.blocks} blocks "
          f"({pt.distinct_blocks} distinct), live peak {pt.live_peak()} blocks", file=sys.stderr)
    results: list[ReplayResult] = []
    optimum: dict[int, ReplayResult] = {}
    if args.target:
        for pol in policies:
            results.append(replay_daemon(pt, args.target, policy=pol, payload_bytes=args.payload_bytes))
        caps = sorted({r.capacity_blocks for r in results if r.capacity_blocks})
    else:
        caps = [_capacity(c, pt, args.payload_bytes) for c in args.capacity.split(",") if c.strip()]
        adm = ["on", "off"] if args.ssd_admission == "both" else [args.ssd_admission]
        for cap in caps:
            ssd = _ssd_blocks(args.ssd, cap, args.payload_bytes)
            for pol in policies:
                for a in (adm if ssd else ["on"]):
                    for d in {"on": [True], "off": [False], "both": [False, True]}[args.dram_admission]:
                        results.append(replay(pt, pol, cap, ssd_blocks=ssd, ssd_admission=a,
                                              payload_bytes=args.payload_bytes, dram_admission=d,
                                              label=pol + "+adm" if d else None))
    bounds: list[ReplayResult] = []
    if not args.no_belady:
        for r in list(results):
            total = r.capacity_blocks + r.ssd_blocks
            if total and total not in optimum:
                optimum[total] = belady(pt, total)
                bounds.append(belady(pt, total, bypass=True))
    print(format_table(results + bounds, optimum))
    if args.json:
        write_json(args.json, {"trace": name, "requests": pt.requests, "blocks": pt.blocks,
                               "distinct_blocks": pt.distinct_blocks, "live_peak": pt.live_peak(),
                               "results": [r.to_dict() for r in results],
                               "belady": {str(k): v.to_dict() for k, v in optimum.items()},
                               "belady_min": {str(b.capacity_blocks): b.to_dict() for b in bounds}})
    return 0


def _ssd_blocks(text: str, dram_blocks: int, payload: int) -> int:
    text = text.strip().lower()
    if text.endswith("x"):
        try:
            factor = float(text[:-1])
        except ValueError:
            factor = math.nan
        if not 0 <= factor < math.inf:
            raise InvalidArgument(f"--ssd: {text!r} is not a multiple of the DRAM capacity like 4x")
        return int(round(factor * dram_blocks))
    if text.isdigit():
        return int(text)
    return parse_size(text) // (payload + _SSD_RECORD)
