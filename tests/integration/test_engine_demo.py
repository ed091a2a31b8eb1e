"""``kvstore demo`` at a tiny size: warm hits, zero hits for the prompt with
one character changed, no hit on a second daemon, same tokens throughout."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvstore.tools import cli  # noqa: E402
from kvstore.tools.demo import QUESTIONS, format_runs, run_demo, system_prompt  # noqa: E402


def test_demo_runs_behave_as_the_user_expects():
    runs, diff = run_demo(requests=3, layers=1, hidden=64, out=lambda *_: None)
    same, changed, second = runs
    assert [r.requests for r in runs] == [3, 3, 3]
    assert same.first_request_hit_blocks == 0 and same.hit_ratio > 0.5
    assert same.cached_blocks > 0
    assert changed.hit_blocks == 0 and changed.cached_blocks == same.cached_blocks  # read-only
    assert second.first_request_hit_blocks == 0 and second.hit_blocks == same.hit_blocks
    assert all(r.same_tokens for r in runs)
    assert "first divergent block: #0" in diff
    table = format_runs(runs)
    assert "one char changed" in table and "0.0%" in table


def test_demo_prompt_changes_one_character():
    a, b = system_prompt(), system_prompt(changed=True)
    assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1 and a[0] != b[0]
    assert len(QUESTIONS) == 20 and len(set(QUESTIONS)) == 20


def test_demo_command(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert cli.main(["demo", "--requests", "2", "--layers", "1", "--hidden", "64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "as expected" in text and "second daemon" in text
    data = json.loads(out.read_text())
    assert data["ok"] and len(data["runs"]) == 3
    assert cli.main(["demo", "--requests", "1"]) == 2
