"""Seeded workload traces for ``kvstore replay`` and ``bench/sweep.py``.

Each generator yields :class:`Request` objects ``(tenant, tokens, arrival)``
sorted by arrival time. Token ids are random draws from a ``vocab``-sized
alphabet: only *which tokens repeat where* matters to a prefix cache, so the
traces model sharing structure, lengths and timing, not language.

The shapes follow the published observations quoted in the project's notes
(seeds/002: Preble's study of five prompt-heavy workloads):

- prompts are far longer than outputs (37x to 2,494x in Preble's workloads);
- most prompt tokens (85-97%) are shared with at least one other request;
- one shared sequence is reused by about 8.6 to 126 requests;
- arrivals are bursty: a two-state (calm / burst) modulated Poisson process,
  ``burst`` times the calm rate during bursts, bursts covering ``burst_share``
  of the time, and the long-run mean rate equal to ``rate``.

Workloads (``WORKLOADS``; every parameter has a default and can be set on the
command line as ``-p name=value``; ``scale`` multiplies the request/session
counts, ``--quick`` runs use ``scale=0.25``):

``chat``
    Multi-turn chat. ``conversations`` sessions start at bursty arrival times,
    each with ``turns_mean`` turns on average (geometric). Every conversation
    of a tenant starts with that tenant's system prompt (``system_tokens``).
    Turn k's prompt is turn k-1's prompt + its answer (``answer_tokens``,
    lognormal) + a new question (``question_tokens``, lognormal); turns are
    ``think_s`` apart on average (exponential). A turn reuses the whole
    previous turn, so it is the case LRU was made for.
``shared_prompt``
    A shared system prompt with few-shot examples plus a distinct question.
    ``templates`` templates (system prompt of ``system_tokens`` + ``shots``
    examples of ``shot_tokens`` each, lognormal lengths), chosen with Zipf
    popularity (exponent ``zipf``), one tenant per template modulo
    ``tenants``; the question (``question_tokens``) is new except that with
    probability ``repeat`` a recent question of the same template is asked
    again (a retry or a popular query).
``agent``
    Agent loops: ``agent_types`` tool descriptions (``tool_tokens``,
    lognormal) shared by all tasks of a type (Zipf popularity); each of
    ``tasks`` tasks adds a task statement (``task_tokens``) and then runs
    ``steps_mean`` steps on average (geometric); each step's prompt is the
    previous one + the model's short action (``action_tokens``) + the tool's
    observation (``observation_tokens``); steps are ``step_s`` apart on
    average. Long shared prefix, many short steps.
``docqa``
    Document QA: ``documents`` long documents (``doc_tokens``, lognormal),
    Zipf popularity (``zipf``); each of ``requests`` requests is a tenant's
    instruction (``instruction_tokens``) + one document + a short question
    (``question_tokens``).
``mix``
    All four at once: each sub-trace generated with its defaults times
    ``scale`` x its weight (``chat``, ``shared_prompt``, ``agent``, ``docqa``
    weights; 0 leaves it out), tenants prefixed by the workload name, arrival
    times of each sub-trace stretched to the same span (``span_s``), merged by
    arrival.

Usage (prints a summary of the trace's shape; ``--out`` writes it as JSON
lines that ``kvstore replay --trace`` reads)::

    python bench/workloads.py chat [-p conversations=500] [--seed 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from kvstore.keys import Namespace, block_keys_array

__all__ = ["Request", "WORKLOADS", "ChatParams", "SharedPromptParams", "AgentParams", "DocQAParams",
           "MixParams", "chat", "shared_prompt", "agent", "docqa", "mix", "make_trace", "parse_params",
           "params_for", "describe", "save_trace", "load_trace", "QUICK_SCALE"]

QUICK_SCALE = 0.25
"""``scale`` the benchmarks use with ``--quick``."""


@dataclass(slots=True, frozen=True)
class Request:
    """One inference request of a trace."""

    tenant: str
    """Who sent it: requests share cached blocks only within a tenant."""
    tokens: np.ndarray
    """The prompt's token ids (uint32)."""
    arrival: float
    """Seconds since the start of the trace."""
    output_tokens: int = 0
    """Tokens the model generates for it (its answer)."""
    kind: str = ""
    """The workload that produced it (kept through ``mix``)."""


# ----------------------------------------------------------------- params
@dataclass(slots=True, frozen=True)
class _Common:
    scale: float = 1.0
    """Multiplies the request/session counts (``--quick``: 0.25)."""
    vocab: int = 32000
    """Token ids are drawn from 0..vocab-1."""
    rate: float = 2.0
    """Mean arrivals (requests or sessions) per second."""
    burst: float = 4.0
    """Arrival rate multiplier during bursts (1: plain Poisson)."""
    burst_share: float = 0.2
    """Share of the time spent in bursts."""
    burst_period_s: float = 20.0
    """Mean length of a burst plus the calm that follows it."""


@dataclass(slots=True, frozen=True)
class ChatParams(_Common):
    conversations: int = 300
    tenants: int = 4
    system_tokens: int = 600
    turns_mean: float = 5.0
    question_tokens: int = 60
    answer_tokens: int = 250
    think_s: float = 30.0
    rate: float = 1.0


@dataclass(slots=True, frozen=True)
class SharedPromptParams(_Common):
    requests: int = 2000
    templates: int = 12
    tenants: int = 4
    system_tokens: int = 600
    shots: int = 5
    shot_tokens: int = 250
    question_tokens: int = 80
    answer_tokens: int = 40
    zipf: float = 1.0
    repeat: float = 0.05
    rate: float = 20.0


@dataclass(slots=True, frozen=True)
class AgentParams(_Common):
    tasks: int = 80
    agent_types: int = 6
    tool_tokens: int = 4000
    task_tokens: int = 150
    steps_mean: float = 10.0
    action_tokens: int = 40
    observation_tokens: int = 200
    step_s: float = 3.0
    zipf: float = 1.0
    rate: float = 0.5


@dataclass(slots=True, frozen=True)
class DocQAParams(_Common):
    requests: int = 1500
    documents: int = 24
    tenants: int = 2
    doc_tokens: int = 5000
    instruction_tokens: int = 150
    question_tokens: int = 40
    answer_tokens: int = 60
    zipf: float = 1.0
    rate: float = 10.0


@dataclass(slots=True, frozen=True)
class MixParams:
    scale: float = 1.0
    """Multiplies every sub-trace's counts (on top of its weight)."""
    chat: float = 0.25
    shared_prompt: float = 0.25
    agent: float = 0.25
    docqa: float = 0.25
    """Weights: each sub-trace runs at scale x weight (0 leaves it out)."""
    span_s: float = 0.0
    """Stretch every sub-trace's arrivals to this span (0: their mean span)."""


# ---------------------------------------------------------------- helpers
def _count(n: int, scale: float) -> int:
    return max(1, int(round(n * scale)))


def _lognormal(rng: np.random.Generator, median: int, sigma: float = 0.5, size: int | None = None) -> Any:
    """Positive integer lengths with the given median (at least 1)."""
    v = np.maximum(1, np.round(median * rng.lognormal(0.0, sigma, size)).astype(np.int64))
    return v if size is not None else int(v)


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, int(n), dtype=np.uint32)


def _zipf_choice(rng: np.random.Generator, n: int, alpha: float, size: int) -> np.ndarray:
    """Indices 0..n-1 with P(i) proportional to 1/(i+1)^alpha (0 most popular)."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    return rng.choice(n, size=size, p=w / w.sum())


def bursty_arrivals(rng: np.random.Generator, n: int, rate: float, burst: float = 4.0,
                    burst_share: float = 0.2, period_s: float = 20.0) -> np.ndarray:
    """``n`` arrival times of a two-state modulated Poisson process.

    Calm periods and bursts alternate with exponential lengths (means
    ``period_s * (1 - burst_share)`` and ``period_s * burst_share``); the
    burst rate is ``burst`` times the calm rate, and the mean rate is
    ``rate``. ``burst == 1`` is a plain Poisson process.
    """
    if n <= 0:
        return np.zeros(0)
    if not 0 < rate < math.inf:
        raise ValueError(f"rate must be > 0 and finite, got {rate}")
    if not 0 < period_s < math.inf:  # 0, < 0 or nan never advanced the clock: an endless loop
        raise ValueError(f"burst_period_s must be > 0 and finite, got {period_s}")
    burst = max(1.0, burst)
    share = min(max(burst_share, 0.0), 1.0) if burst > 1 else 0.0
    calm = rate / ((1 - share) + share * burst)
    out = np.empty(n)
    t, i, in_burst = 0.0, 0, False
    while i < n:
        mean_len = period_s * (share if in_burst else 1 - share)
        end = t + (rng.exponential(mean_len) if mean_len > 0 else 0.0)
        lam = calm * (burst if in_burst else 1.0)
        if mean_len > 0 and lam > 0:
            # arrivals of a Poisson process on [t, end): count, then sorted uniforms
            k = min(n - i, int(rng.poisson(lam * (end - t))))
            out[i : i + k] = np.sort(rng.uniform(t, end, k))
            i += k
        t = end
        in_burst = not in_burst if share > 0 else False
    return out


def _arrivals(rng: np.random.Generator, n: int, p: _Common) -> np.ndarray:
    return bursty_arrivals(rng, n, p.rate, p.burst, p.burst_share, p.burst_period_s)


def _sorted(reqs: list[Request]) -> Iterator[Request]:
    reqs.sort(key=lambda r: r.arrival)
    yield from reqs


# ------------------------------------------------------------- generators
def chat(seed: int = 0, params: ChatParams | None = None) -> Iterator[Request]:
    """Multi-turn chat (see the module docstring)."""
    p = params or ChatParams()
    rng = np.random.default_rng([seed, 1])
    systems = [_tokens(rng, _lognormal(rng, p.system_tokens, 0.3), p.vocab) for _ in range(p.tenants)]
    n = _count(p.conversations, p.scale)
    starts = _arrivals(rng, n, p)
    reqs: list[Request] = []
    for c in range(n):
        tenant = int(rng.integers(p.tenants))
        history = systems[tenant]
        t = float(starts[c])
        for _ in range(int(rng.geometric(1.0 / max(p.turns_mean, 1.0)))):
            prompt = np.concatenate([history, _tokens(rng, _lognormal(rng, p.question_tokens), p.vocab)])
            out = _lognormal(rng, p.answer_tokens, 0.6)
            reqs.append(Request(f"tenant{tenant}", prompt, t, out, "chat"))
            history = np.concatenate([prompt, _tokens(rng, out, p.vocab)])
            t += float(rng.exponential(p.think_s))
    return _sorted(reqs)


def shared_prompt(seed: int = 0, params: SharedPromptParams | None = None) -> Iterator[Request]:
    """Shared system prompt + few-shot examples + a distinct question."""
    p = params or SharedPromptParams()
    rng = np.random.default_rng([seed, 2])
    templates = []
    for _ in range(p.templates):
        parts = [_tokens(rng, _lognormal(rng, p.system_tokens, 0.3), p.vocab)]
        parts += [_tokens(rng, _lognormal(rng, p.shot_tokens, 0.3), p.vocab) for _ in range(p.shots)]
        templates.append(np.concatenate(parts))
    n = _count(p.requests, p.scale)
    times = _arrivals(rng, n, p)
    which = _zipf_choice(rng, p.templates, p.zipf, n)
    recent: dict[int, list[np.ndarray]] = {}
    reqs: list[Request] = []
    for i in range(n):
        k = int(which[i])
        asked = recent.setdefault(k, [])
        if asked and rng.random() < p.repeat:
            q = asked[int(rng.integers(len(asked)))]
        else:
            q = _tokens(rng, _lognormal(rng, p.question_tokens), p.vocab)
            asked.append(q)
            del asked[:-32]  # "recent": the last 32 questions of the template
        reqs.append(Request(f"tenant{k % p.tenants}", np.concatenate([templates[k], q]), float(times[i]),
                            _lognormal(rng, p.answer_tokens), "shared_prompt"))
    return _sorted(reqs)


def agent(seed: int = 0, params: AgentParams | None = None) -> Iterator[Request]:
    """Agent loops: a long tool description, many short steps."""
    p = params or AgentParams()
    rng = np.random.default_rng([seed, 3])
    tools = [_tokens(rng, _lognormal(rng, p.tool_tokens, 0.3), p.vocab) for _ in range(p.agent_types)]
    n = _count(p.tasks, p.scale)
    starts = _arrivals(rng, n, p)
    kinds = _zipf_choice(rng, p.agent_types, p.zipf, n)
    reqs: list[Request] = []
    for j in range(n):
        k = int(kinds[j])
        prompt = np.concatenate([tools[k], _tokens(rng, _lognormal(rng, p.task_tokens), p.vocab)])
        t = float(starts[j])
        for _ in range(int(rng.geometric(1.0 / max(p.steps_mean, 1.0)))):
            act = _lognormal(rng, p.action_tokens)
            reqs.append(Request(f"agent{k}", prompt, t, act, "agent"))
            obs = _lognormal(rng, p.observation_tokens, 0.7)
            prompt = np.concatenate([prompt, _tokens(rng, act + obs, p.vocab)])
            t += float(rng.exponential(p.step_s))
    return _sorted(reqs)


def docqa(seed: int = 0, params: DocQAParams | None = None) -> Iterator[Request]:
    """A few long documents, many questions each, Zipf popularity."""
    p = params or DocQAParams()
    rng = np.random.default_rng([seed, 4])
    instr = [_tokens(rng, _lognormal(rng, p.instruction_tokens, 0.2), p.vocab) for _ in range(p.tenants)]
    docs = [_tokens(rng, _lognormal(rng, p.doc_tokens, 0.4), p.vocab) for _ in range(p.documents)]
    owner = rng.integers(p.tenants, size=p.documents)
    n = _count(p.requests, p.scale)
    times = _arrivals(rng, n, p)
    which = _zipf_choice(rng, p.documents, p.zipf, n)
    reqs = []
    for i in range(n):
        d = int(which[i])
        tenant = int(owner[d])
        q = _tokens(rng, _lognormal(rng, p.question_tokens), p.vocab)
        reqs.append(Request(f"tenant{tenant}", np.concatenate([instr[tenant], docs[d], q]), float(times[i]),
                            _lognormal(rng, p.answer_tokens), "docqa"))
    return _sorted(reqs)


def mix(seed: int = 0, params: MixParams | None = None) -> Iterator[Request]:
    """The four workloads at once, merged by arrival time."""
    p = params or MixParams()
    parts: list[list[Request]] = []
    for name in ("chat", "shared_prompt", "agent", "docqa"):
        w = float(getattr(p, name))
        if w <= 0:
            continue
        spec, gen = WORKLOADS[name]
        sub = list(gen(seed, spec(scale=p.scale * w)))  # type: ignore[call-arg]
        parts.append([dataclasses.replace(r, tenant=f"{name}/{r.tenant}") for r in sub])
    spans = [max(r.arrival for r in part) for part in parts if part]
    span = p.span_s if p.span_s > 0 else (float(np.mean(spans)) if spans else 0.0)
    reqs: list[Request] = []
    for part in parts:
        top = max(r.arrival for r in part) if part else 0.0
        k = span / top if top > 0 else 1.0
        reqs += [dataclasses.replace(r, arrival=r.arrival * k) for r in part]
    return _sorted(reqs)


WORKLOADS: dict[str, tuple[type, Callable[..., Iterator[Request]]]] = {
    "chat": (ChatParams, chat),
    "shared_prompt": (SharedPromptParams, shared_prompt),
    "agent": (AgentParams, agent),
    "docqa": (DocQAParams, docqa),
    "mix": (MixParams, mix),
}


# -------------------------------------------------------------- front door
def parse_params(kind: str, items: Iterable[str] | Mapping[str, Any] = ()) -> Any:
    """The params dataclass of ``kind`` with ``items`` (``"name=value"``
    strings or a mapping) applied; values are converted to each field's type.
    Raises ValueError naming the allowed workloads or fields."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; allowed: {', '.join(WORKLOADS)}")
    spec = WORKLOADS[kind][0]
    types = {f.name: f.type for f in dataclasses.fields(spec)}
    pairs = items.items() if isinstance(items, Mapping) else (_split(s) for s in items)
    kw: dict[str, Any] = {}
    for name, value in pairs:
        if name not in types:
            raise ValueError(f"workload {kind} has no parameter {name!r}; allowed: {', '.join(types)}")
        conv = int if types[name] in (int, "int") else float
        try:
            kw[name] = conv(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"parameter {name} of {kind} must be {conv.__name__}, got {value!r}") from None
        if not math.isfinite(kw[name]):
            raise ValueError(f"parameter {name} of {kind} must be finite, got {value!r}")
    return spec(**kw)


def _split(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"workload parameter {item!r} must look like name=value")
    return name.strip(), value.strip()


def params_for(kind: str, params: Any = None, quick: bool = False) -> Any:
    """Params of ``kind`` (default ones if None), scaled by QUICK_SCALE if ``quick``."""
    p = params if params is not None else WORKLOADS[kind][0]()
    return dataclasses.replace(p, scale=p.scale * QUICK_SCALE) if quick else p


def make_trace(kind: str, seed: int = 0, params: Any = None, quick: bool = False) -> list[Request]:
    """The whole trace of workload ``kind`` as a list (sorted by arrival)."""
    p = params_for(kind, params if params is not None else parse_params(kind), quick)
    return list(WORKLOADS[kind][1](seed, p))


def describe(trace: Sequence[Request], block_size: int = 16) -> dict[str, float]:
    """Shape figures: requests, tenants, prompt and output lengths, the share
    of prompt tokens (in full blocks) that some *other* request also has at
    the same position of the same prefix, and the span of arrivals."""
    if not trace:
        return {"requests": 0}
    lens = np.array([r.tokens.size for r in trace])
    outs = np.array([r.output_tokens for r in trace])
    # identify a block by its chained key (kvstore.keys): two requests share
    # a block exactly when a prefix cache would share it
    tenants = sorted({r.tenant for r in trace})
    ns = {t: Namespace(tenant=t, model_id="trace", block_size=block_size) for t in tenants}
    ids = [block_keys_array(ns[r.tenant], r.tokens).view("<u8").reshape(-1, 2)[:, 0] for r in trace]
    flat = np.concatenate(ids) if ids else np.zeros(0, np.uint64)
    uniq, counts = np.unique(flat, return_counts=True)
    shared = int(counts[counts > 1].sum())
    times = np.array([r.arrival for r in trace])
    gaps = np.diff(times) if len(times) > 1 else np.zeros(1)
    return {
        "requests": float(len(trace)),
        "tenants": float(len(tenants)),
        "prompt_tokens_mean": float(lens.mean()),
        "prompt_tokens_p50": float(np.median(lens)),
        "prompt_tokens_max": float(lens.max()),
        "output_tokens_mean": float(outs.mean()),
        "prompt_to_output": float(lens.sum() / max(outs.sum(), 1)),
        "blocks": float(flat.size),
        "distinct_blocks": float(uniq.size),
        "shared_token_share": float(shared / max(flat.size, 1)),
        "reuse_per_shared_block": float(counts[counts > 1].mean()) if np.any(counts > 1) else 0.0,
        "span_s": float(times.max() - times.min()),
        "interarrival_cv": float(gaps.std() / gaps.mean()) if gaps.mean() > 0 else 0.0,
    }


# ------------------------------------------------------------------ files
def save_trace(path: str, trace: Iterable[Request]) -> int:
    """Write ``trace`` as JSON lines ``{"tenant", "arrival", "output_tokens",
    "kind", "tokens": [...]}``; returns the number of requests."""
    n = 0
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps({"tenant": r.tenant, "arrival": round(r.arrival, 6),
                                "output_tokens": int(r.output_tokens), "kind": r.kind,
                                "tokens": r.tokens.tolist()}, separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


def load_trace(path: str) -> list[Request]:
    """Read a JSON-lines trace (see :func:`save_trace`; only ``tokens`` is
    required), sorted by arrival."""
    out: list[Request] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            d = json.loads(line)
            out.append(Request(str(d.get("tenant", "default")), np.asarray(d["tokens"], dtype=np.uint32),
                               float(d.get("arrival", i)), int(d.get("output_tokens", 0)), str(d.get("kind", ""))))
    out.sort(key=lambda r: r.arrival)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=list(WORKLOADS))
    ap.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"scale the counts by {QUICK_SCALE}")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", help="write the trace as JSON lines")
    a = ap.parse_args(argv)
    try:
        trace = make_trace(a.kind, a.seed, parse_params(a.kind, a.param), a.quick)
    except ValueError as e:
        print(f"workloads: {e}", file=sys.stderr)
        return 2
    for k, v in describe(trace, a.block_size).items():
        print(f"{k:>24}: {v:.4g}")
    if a.out:
        print(f"wrote {save_trace(a.out, trace)} requests to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
