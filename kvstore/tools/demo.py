"""``kvstore demo``: the prefix-cache experiment a user runs first.

A small Llama-style model (seeded random weights, nothing downloaded; text
is tokenized one UTF-8 byte per token, so "one character" is one token)
answers requests made of a long system prompt plus a question, through
:class:`engine_adapter.hf.HFPrefixCache` and a kvstore daemon:

1. **same prompt**: the system prompt with ``--requests`` different
   questions. The first request is cold and stores the prompt's blocks; the
   others load the shared prefix and compute only their question.
2. **one char changed**: the same requests with the first character of the
   system prompt changed, against the cache run 1 left (read-only: nothing
   is stored), so the hit ratio is zero: a chained key depends on every
   token before it. The first divergent block is printed as ``kvstore diff``
   prints it.
3. **second daemon**: the same prompt through another, separate daemon: no
   cross-daemon hit (its first request is cold) unless daemons are clustered.

Per run it prints the blocks the daemon holds for the namespace, the prefix
hit ratio (hit blocks / full prompt blocks, over all requests) and the time
to first token with the cache and without it (a full prefill of the same
prompt, measured beside it).

The daemon is started in-process (``--target`` uses a running one for runs
1-2; run 3 always starts its own). Module API: ``add_arguments(parser)``,
``run(args)``, ``run_demo(...)``, :class:`InProcessDaemon` (also used by
``bench/engine.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from kvstore.config import load_config
from kvstore.errors import InvalidArgument
from kvstore.keys import as_token_array
from kvstore.tools.format import format_diff
from kvstore.tools.inputs import check_output, write_json

__all__ = ["InProcessDaemon", "RunReport", "add_arguments", "run", "run_demo", "system_prompt", "QUESTIONS"]

SYSTEM_PROMPT = (
    "You are the support assistant of Northwind Rail, a regional railway. Answer in two sentences at most, "
    "politely and precisely, using only the facts below. If a question is not covered, say so and point to "
    "the help desk. Facts: trains run from 05:10 to 00:40 every day; the night service on Fridays and "
    "Saturdays runs hourly until 03:40. A single fare costs 3.20 in zone A, 4.60 across zones A and B, and "
    "6.10 across all three zones; children under six travel free, and a day pass costs three single fares. "
    "Bicycles are allowed outside the rush hours (07:00-09:00 and 16:30-18:30) in the marked carriages. "
    "Dogs travel free on a leash; other pets must be carried in a closed basket. Lost property is kept for "
    "thirty days at the central station, counter 4, open 08:00-19:00 on weekdays. Refunds for delays over "
    "thirty minutes are paid on request within fourteen days, online or at any ticket office. Season "
    "tickets are personal and must carry a photo; monthly tickets start on any day. Quiet carriages are the "
    "first and last of each train: no calls, no music. Station lifts are checked every morning; outages are "
    "posted in the app. Wheelchair users can book assistance up to two hours ahead by phone or in the app. "
    "The timetable changes twice a year, in June and in December; the app always shows the current one."
)

QUESTIONS = (
    "When is the last train on a Tuesday?", "How much is a ticket across all zones?",
    "Can I bring my bike at 8 am?", "Do children pay?", "Where do I find a lost umbrella?",
    "How do I get a refund for a late train?", "Can my cat come along?", "Is there a night train on Friday?",
    "Where can I make a phone call on the train?", "How do I book help with a wheelchair?",
    "What does a day pass cost in zone A?", "When does the timetable change?",
    "Can someone else use my season ticket?", "Are the lifts working today?",
    "Can I start a monthly ticket on the 17th?", "Is my dog allowed?",
    "How long is lost property kept?", "What are the rush hours?",
    "How much is a ticket for zones A and B?", "Can I get a refund after three weeks?",
)


def system_prompt(changed: bool = False) -> str:
    """The demo's system prompt; ``changed`` swaps its first character."""
    return ("Y" if not changed else "y") + SYSTEM_PROMPT[1:]


def encode(text: str) -> list[int]:
    """One token per UTF-8 byte (vocabulary 256)."""
    return list(text.encode("utf-8"))


# --------------------------------------------------------------------------
# A daemon in this process
# --------------------------------------------------------------------------


class InProcessDaemon:
    """The real daemon on its own event loop in a thread, on a free port.

    ``overrides`` are dotted config keys (``{"dram.capacity": "1GiB"}``)."""

    def __init__(self, overrides: Mapping[str, Any] | None = None) -> None:
        from kvstore.daemon import server  # deferred: the daemon's stack loads only when one starts

        base: dict[str, Any] = {"server.port": 0, "metrics.port": 0, "dram.capacity": "512MiB"}
        base.update(overrides or {})
        self.config = load_config(None, {}, base)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="kvstore-daemon")
        self.thread.start()
        try:
            self.running = asyncio.run_coroutine_threadsafe(server.start(self.config), self.loop).result(60)
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        self.target = f"127.0.0.1:{self.running.port}" if self.running.port else self.running.address
        self.store = self.running.daemon.store

    def call(self, fn: Any, *a: Any) -> Any:
        """Run ``fn(*a)`` on the daemon's loop (the store is single-threaded)."""
        async def go() -> Any:
            return fn(*a)

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(60)

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.running.stop(1.0), self.loop).result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.store.close()

    def __enter__(self) -> "InProcessDaemon":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------
# The experiment
# --------------------------------------------------------------------------


@dataclass(slots=True)
class RunReport:
    """One run of the experiment."""

    name: str
    daemon: str
    requests: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    first_request_hit_blocks: int = 0
    cached_blocks: int = 0
    """Blocks the daemon holds for the namespace after the run."""
    ttft_cached_ms: list[float] = field(default_factory=list)
    ttft_full_ms: list[float] = field(default_factory=list)
    same_tokens: bool = True
    """Every request generated the same tokens with and without the cache."""
    note: str = ""

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def medians(self) -> tuple[float, float]:
        """Median TTFT (ms) without and with the cache, over requests 2..N
        (request 1 is the cold one)."""
        full = self.ttft_full_ms[1:] or self.ttft_full_ms
        cached = self.ttft_cached_ms[1:] or self.ttft_cached_ms
        return statistics.median(full), statistics.median(cached)


def _namespace_blocks(target: str, ns: Any) -> int:
    from kvstore.client import Client  # deferred: grpc loads only when a daemon is reached

    with Client(target, timeout=10.0) as c:
        st = c.stats(include_namespaces=True)
    for n in st.namespaces:
        if n.digest == ns.digest:
            return n.blocks
    return 0


def _one_run(hc: Any, name: str, label: str, prompt: str, questions: Sequence[str], save: bool,
             new_tokens: int, note: str = "") -> RunReport:
    import torch

    rep = RunReport(name, label, note=note)
    bs = hc.block_size
    for i, q in enumerate(questions):
        ids = torch.tensor(encode(prompt + "\n\nQuestion: " + q + "\nAnswer:"))
        full = hc.generate(ids, new_tokens, use_store=False, save=False)
        got = hc.generate(ids, new_tokens, use_store=True, save=save)
        assert got.load is not None
        rep.requests += 1
        rep.prompt_blocks += len(ids) // bs
        rep.hit_blocks += got.load.hit_blocks
        if i == 0:
            rep.first_request_hit_blocks = got.load.hit_blocks
        rep.ttft_full_ms.append(full.ttft_s * 1e3)
        rep.ttft_cached_ms.append(got.ttft_s * 1e3)
        rep.same_tokens &= got.tokens == full.tokens
    rep.cached_blocks = _namespace_blocks(hc.connector.target, hc.ns)
    return rep


def format_runs(runs: Sequence[RunReport]) -> str:
    """The per-run table."""
    header = ["RUN", "DAEMON", "REQUESTS", "CACHED BLOCKS", "HIT RATIO", "1ST REQ HIT", "TTFT NO CACHE",
              "TTFT CACHED", "SPEEDUP", "SAME TOKENS"]
    rows = []
    for r in runs:
        full, cached = r.medians()
        rows.append([r.name, r.daemon, str(r.requests), f"{r.cached_blocks:,}", f"{100 * r.hit_ratio:.1f}%",
                     f"{r.first_request_hit_blocks} blocks", f"{full:.1f} ms", f"{cached:.1f} ms",
                     f"{full / cached:.2f}x" if cached else "-", "yes" if r.same_tokens else "NO"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(row)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)


def run_demo(target: str | None = None, requests: int = 20, new_tokens: int = 1, seed: int = 0,
             layers: int = 4, hidden: int = 256, out: Any = print) -> tuple[list[RunReport], str]:
    """Run the three experiments; returns the run reports and the divergence
    text. ``out`` receives progress lines."""
    import torch  # deferred with engine_adapter.hf: torch and transformers load only when the demo runs

    from engine_adapter.hf import HFPrefixCache, build_model, llama_config, model_namespace
    from kvstore.client import Client

    torch.manual_seed(seed)
    cfg = llama_config(vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8,
                       num_hidden_layers=layers, num_attention_heads=max(1, hidden // 32),
                       num_key_value_heads=max(1, hidden // 64), max_position_embeddings=4096)
    model = build_model(cfg, seed=seed)
    ns = model_namespace(model, tenant="demo", model_id="kvstore-demo-llama", block_size=16)
    questions = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i})") for i in range(requests)]
    started: list[InProcessDaemon] = []
    try:
        if target is None:
            started.append(InProcessDaemon())
            target = started[0].target
            name_a = "A (in-process)"
        else:
            name_a = f"A ({target})"
        with Client(target, timeout=10.0) as c:
            c.clear(ns)  # the demo's own namespace only: start cold
        runs = []
        with HFPrefixCache(model, ns, target=target, max_tokens=4096) as hc:
            out(f"model: Llama, {layers} layers, hidden {hidden}, {cfg.num_attention_heads} heads "
                f"({cfg.num_key_value_heads} KV), random weights; block size {ns.block_size} tokens; "
                f"system prompt {len(encode(SYSTEM_PROMPT))} tokens")
            out("run 1/3: same system prompt, different questions ...")
            runs.append(_one_run(hc, "same prompt", name_a, system_prompt(), questions, True, new_tokens))
            out("run 2/3: first character of the system prompt changed ...")
            runs.append(_one_run(hc, "one char changed", name_a, system_prompt(True), questions, False, new_tokens,
                                 note="read-only against run 1's cache"))
        q0 = "\n\nQuestion: " + questions[0] + "\nAnswer:"
        diff = format_diff(ns, as_token_array(encode(system_prompt() + q0)),
                           as_token_array(encode(system_prompt(True) + q0)), "original", "changed", context=8)
        out("run 3/3: same prompt through a second, separate daemon ...")
        b = InProcessDaemon()
        started.append(b)
        with HFPrefixCache(model, ns, target=b.target, max_tokens=4096) as hc:
            runs.append(_one_run(hc, "second daemon", "B (in-process)", system_prompt(), questions, True,
                                 new_tokens, note="not clustered with A"))
        return runs, diff
    finally:
        for d in started:
            d.stop()


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvstore demo`` flags."""
    p.add_argument("--target", help="use this running daemon for runs 1-2 (default: start one in-process)")
    p.add_argument("--requests", type=int, default=20, help="requests per run (20)")
    p.add_argument("--new-tokens", type=int, default=1, help="tokens generated per request (1)")
    p.add_argument("--layers", type=int, default=4, help="model layers (4)")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: leaves a core to the daemon; see bench/engine.py)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def run(args: argparse.Namespace) -> int:
    """``kvstore demo``: exit 0 when the three runs behave as expected
    (warm hits, zero hits for the changed prompt, a cold second daemon,
    identical tokens), 1 otherwise."""
    if args.requests < 2:
        raise InvalidArgument("--requests must be at least 2 (the first request is the cold one)")
    if args.json:
        check_output(args.json)
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise InvalidArgument("kvstore demo needs the 'transformers' package (pip install transformers)") from None
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    t0 = time.perf_counter()
    try:
        runs, diff = run_demo(args.target, args.requests, args.new_tokens, args.seed, args.layers, args.hidden)
    finally:
        torch.set_num_threads(threads)
    print()
    print(format_runs(runs))
    print("\nHIT RATIO: hit blocks / full prompt blocks over all requests; TTFT: median of requests 2..N;")
    print("run 2 is read-only against run 1's cache; run 3's daemon is not clustered with A.")
    print("\nfirst divergent block of the changed prompt (as `kvstore diff` prints it):")
    print(diff.rstrip())
    same, changed, second = runs
    ok = (same.hit_ratio > 0 and changed.hit_blocks == 0 and second.first_request_hit_blocks == 0
          and all(r.same_tokens for r in runs))
    print(f"\n{'as expected' if ok else 'UNEXPECTED'}: run 1 hit ratio {100 * same.hit_ratio:.1f}%, "
          f"run 2 {100 * changed.hit_ratio:.1f}%, run 3 first request {second.first_request_hit_blocks} blocks "
          f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        write_json(args.json, {"runs": [dict(asdict(r), hit_ratio=r.hit_ratio) for r in runs], "diff": diff, "ok": ok})
    return 0 if ok else 1
