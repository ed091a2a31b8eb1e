"""bench/median.py: the median of several runs decides a target, and a target
no run measured shows met: false instead of vanishing."""

from __future__ import annotations

import json
from pathlib import Path

from bench.median import combine, main


def run(values: dict[str, float | None], fig: float) -> dict[str, object]:
    targets = []
    for name, v in values.items():
        t: dict[str, object] = {"name": name, "value": v, "target": 1.0, "direction": ">=",
                                "met": v is not None and v >= 1.0}
        if v is None:
            t["why"] = "mooncake missing"
        targets.append(t)
    return {"benchmark": "peer_mooncake", "figures": {"x": fig}, "targets": targets}


def test_median_decides_and_unmeasured_stays() -> None:
    runs = [run({"a": 0.9, "b": 1.5, "c": None}, 1.0),
            run({"a": 1.2, "b": 0.5, "c": None}, 3.0),
            run({"a": 1.1, "b": 0.7, "c": None}, 2.0)]
    got = {t["name"]: t for t in combine(runs)["targets"]}
    assert got["a"]["value"] == 1.1 and got["a"]["met"] is True   # one run below, the median above
    assert got["b"]["value"] == 0.7 and got["b"]["met"] is False  # one run above, the median below
    assert got["c"]["value"] is None and got["c"]["met"] is False and got["c"]["runs"] == "0/3"
    assert "mooncake missing" in got["c"]["why"]
    assert combine(runs)["figures"]["x"] == 2.0


def test_partly_measured_and_lower_is_better(tmp_path: Path) -> None:
    r1 = {"benchmark": "core", "figures": {}, "targets": [
        {"name": "bytes", "value": 60.0, "target": 64.0, "direction": "<=", "met": True}]}
    r2 = {"benchmark": "core", "figures": {}, "targets": [
        {"name": "bytes", "value": None, "target": 64.0, "direction": "<=", "met": False, "why": "oom"}]}
    paths = []
    for i, r in enumerate((r1, r2)):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    out = tmp_path / "m.json"
    assert main([*paths, "--json", str(out)]) == 0
    t = json.loads(out.read_text())["targets"][0]
    assert t["met"] is True and t["runs"] == "1/2" and "oom" in t["why"]
    assert main([str(tmp_path / "missing.json")]) == 2
