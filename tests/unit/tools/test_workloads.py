"""Trace generators (bench/workloads.py): seeded, deterministic, and with the
documented shapes."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.tools import workloads as W

KINDS = list(W.WORKLOADS)


def _small(kind: str, seed: int = 0) -> list[W.Request]:
    return W.make_trace(kind, seed, quick=True)


def _same(a: list[W.Request], b: list[W.Request]) -> bool:
    return len(a) == len(b) and all(
        x.tenant == y.tenant and x.arrival == y.arrival and x.output_tokens == y.output_tokens
        and np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_generators_are_deterministic(kind: str) -> None:
    a, b = _small(kind, 3), _small(kind, 3)
    assert _same(a, b)
    assert not _same(a, _small(kind, 4))


@pytest.mark.parametrize("kind", KINDS)
def test_requests_are_sorted_and_well_formed(kind: str) -> None:
    trace = _small(kind)
    assert len(trace) > 10
    times = np.array([r.arrival for r in trace])
    assert np.all(np.diff(times) >= 0) and times[0] >= 0
    for r in trace:
        assert r.tokens.dtype == np.uint32 and r.tokens.size > 0
        assert int(r.tokens.max()) < 32000
        assert r.tenant and r.output_tokens >= 1
    assert {r.kind for r in trace} == ({"chat", "shared_prompt", "agent", "docqa"} if kind == "mix" else {kind})


def _prefix_of_earlier(trace: list[W.Request]) -> float:
    """Share of requests that extend an earlier request of the same tenant."""
    seen: dict[str, list[np.ndarray]] = {}
    n = 0
    for r in trace:
        if any(p.size < r.tokens.size and np.array_equal(r.tokens[: p.size], p) for p in seen.get(r.tenant, [])):
            n += 1
        seen.setdefault(r.tenant, []).append(r.tokens)
    return n / len(trace)


def test_chat_turns_extend_the_history() -> None:
    p = W.ChatParams(conversations=40, turns_mean=5)
    trace = list(W.chat(1, p))
    # a conversation of k turns has k - 1 turns that extend an earlier prompt
    assert _prefix_of_earlier(trace) > 0.6
    # every conversation of a tenant starts with that tenant's system prompt
    firsts: dict[str, np.ndarray] = {}
    for r in trace:
        head = r.tokens[:100]
        firsts.setdefault(r.tenant, head)
        assert np.array_equal(firsts[r.tenant], head)


def test_shared_prompt_templates_have_zipf_popularity() -> None:
    p = W.SharedPromptParams(requests=800, templates=6, tenants=6, repeat=0.0)
    trace = list(W.shared_prompt(2, p))
    # one tenant per template here, so the tenant names the template
    counts = sorted((sum(r.tenant == t for r in trace) for t in {r.tenant for r in trace}), reverse=True)
    assert len(counts) == 6 and counts[0] > 2 * counts[-1]
    # every request = its template + a question of ~question_tokens
    by_tenant: dict[str, list[np.ndarray]] = {}
    for r in trace:
        by_tenant.setdefault(r.tenant, []).append(r.tokens)
    for prompts in by_tenant.values():
        lcp = min(_common_prefix(prompts[0], b) for b in prompts[1:])
        assert lcp > 1000  # system prompt + few-shot examples are shared
        assert all(x.size - lcp < 10 * p.question_tokens for x in prompts)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    eq = a[:n] == b[:n]
    return n if eq.all() else int(np.argmin(eq))


def test_agent_steps_are_short_and_share_the_tool_description() -> None:
    trace = list(W.agent(0, W.AgentParams(tasks=20, steps_mean=8)))
    assert _prefix_of_earlier(trace) > 0.5
    d = W.describe(trace)
    assert d["prompt_to_output"] > 30  # prompts much longer than outputs
    assert d["prompt_tokens_p50"] > 2000


def test_docqa_prompts_are_long_and_popular_documents_repeat() -> None:
    trace = list(W.docqa(0, W.DocQAParams(requests=300, documents=8)))
    d = W.describe(trace)
    assert d["prompt_tokens_mean"] > 2000 and d["prompt_to_output"] > 20
    assert d["reuse_per_shared_block"] > 8


@pytest.mark.parametrize("kind", ["shared_prompt", "agent", "docqa"])
def test_most_prompt_tokens_are_shared(kind: str) -> None:
    # published observation: 85-97% of prompt tokens shared with another request
    d = W.describe(_small(kind))
    assert d["shared_token_share"] >= 0.85


def test_mix_prefixes_tenants_and_aligns_spans() -> None:
    trace = _small("mix")
    assert all(r.tenant.split("/")[0] in ("chat", "shared_prompt", "agent", "docqa") for r in trace)
    spans = {k: max(r.arrival for r in trace if r.kind == k) for k in ("chat", "shared_prompt", "agent", "docqa")}
    assert max(spans.values()) == pytest.approx(min(spans.values()), rel=1e-6)


def test_bursty_arrivals_mean_rate_and_burstiness() -> None:
    rng = np.random.default_rng(5)
    t = W.bursty_arrivals(rng, 20000, rate=10.0, burst=6.0, burst_share=0.2, period_s=5.0)
    assert np.all(np.diff(t) >= 0)
    assert 20000 / t[-1] == pytest.approx(10.0, rel=0.2)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() > 1.2  # burstier than Poisson (CV 1)
    p = np.diff(W.bursty_arrivals(np.random.default_rng(5), 20000, rate=10.0, burst=1.0))
    assert p.std() / p.mean() == pytest.approx(1.0, abs=0.1)


def test_parse_params_converts_and_rejects() -> None:
    p = W.parse_params("chat", ["conversations=7", "think_s=1.5"])
    assert p.conversations == 7 and p.think_s == 1.5
    with pytest.raises(ValueError, match="no parameter"):
        W.parse_params("chat", ["nope=1"])
    with pytest.raises(ValueError, match="must be int"):
        W.parse_params("chat", ["conversations=x"])
    with pytest.raises(ValueError, match="name=value"):
        W.parse_params("chat", ["conversations"])
    with pytest.raises(ValueError, match="allowed"):
        W.parse_params("nope")
    assert W.params_for("agent", quick=True).scale == W.QUICK_SCALE


@pytest.mark.timeout(30)  # before the fix these looped forever: the clock never advanced
@pytest.mark.parametrize("param", ["burst_period_s=0", "burst_period_s=-1", "burst_period_s=nan", "rate=nan",
                                   "rate=inf", "think_s=inf"])
def test_non_positive_period_and_non_finite_params_are_refused(param: str) -> None:
    with pytest.raises(ValueError, match="must be"):
        W.make_trace("chat", 0, W.parse_params("chat", [param]), quick=True)


def test_cli_replay_with_a_zero_burst_period_exits_2(capsys) -> None:
    from kvstore.tools.cli import main

    assert main(["replay", "--workload", "chat", "--quick", "-p", "burst_period_s=0"]) == 2
    assert "burst_period_s must be > 0" in capsys.readouterr().err


def test_scale_multiplies_counts() -> None:
    small = list(W.shared_prompt(0, W.SharedPromptParams(requests=400, scale=0.5)))
    assert len(small) == 200


def test_trace_file_round_trip(tmp_path) -> None:
    trace = _small("chat")[:20]
    path = str(tmp_path / "t.jsonl")
    assert W.save_trace(path, trace) == 20
    back = W.load_trace(path)
    assert [r.tenant for r in back] == [r.tenant for r in trace]
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(back, trace))
    assert [r.arrival for r in back] == pytest.approx([r.arrival for r in trace])
