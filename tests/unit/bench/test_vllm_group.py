"""bench/vllm.py at TP > 1: each step's load is lined up across the ranks
(``group_steps``), so the target weighs every rank's bytes over the span
from the first rank's start to the last one's end."""

from __future__ import annotations

import pytest

from bench.vllm import group_steps


def step(rank: int, at: float, ms: float, blocks: int = 15, loaded: int | None = None,
         nbytes: int = 1000) -> dict[str, object]:
    return {"event": "load_step", "rank": rank, "at": at, "ms": ms, "planned_blocks": blocks,
            "loaded_blocks": blocks if loaded is None else loaded, "bytes": nbytes}


def test_each_step_spans_every_rank_from_first_start_to_last_end() -> None:
    recs = [step(0, 10.0, 0.4), step(1, 10.00005, 0.4),     # rank 1 starts 50 us later
            step(0, 20.0, 0.3), step(1, 19.9999, 0.2),      # rank 1 starts first, ends first
            {"event": "load", "rank": 0, "ms": 0.1}]
    got = group_steps(recs, 2)
    assert [g[0] for g in got] == [2000, 2000]
    assert got[0][1] == pytest.approx(0.00045) and got[1][1] == pytest.approx(0.0004)
    assert got[0][2] == pytest.approx(0.00005) and got[1][2] == pytest.approx(0.0001)  # the ranks' skew


def test_a_step_some_rank_has_no_record_for_is_left_out() -> None:
    recs = [step(0, 10.0, 0.4), step(1, 10.0, 0.4),
            step(0, 20.0, 0.4),                              # no rank 1 record near it
            step(0, 30.0, 0.4), step(1, 30.0, 0.4, blocks=14),  # another step's record
            step(0, 40.0, 0.4, loaded=0), step(1, 40.0, 0.4, loaded=0),  # nothing loaded
            step(1, 50.0, 0.4)]                              # no rank 0 record
    assert group_steps(recs, 2) == [(2000, pytest.approx(0.0004), pytest.approx(0.0))]
    assert group_steps(recs, 3) == []                        # no rank 2 at all


def test_records_without_a_start_are_not_lined_up() -> None:
    old = {k: v for k, v in step(1, 10.0, 0.4).items() if k != "at"}
    assert group_steps([step(0, 10.0, 0.4), old], 2) == []
