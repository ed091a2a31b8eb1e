"""Median of several runs of one benchmark, target by target.

Issue 18 states its targets as "met in the median of 3 runs": run a bench
several times with ``--json``, then::

    python bench/median.py bench/out/core-1.json bench/out/core-2.json bench/out/core-3.json

Each target's value is the median of the runs that measured it, and it is
met if that median meets the goal. A target that some run did not measure
(``value: null``) is reported with how many runs measured it; a target with
no measured run at all shows ``met: false``, never vanishes. Figures are
medians too. ``--json PATH`` writes the result in the benches' own format
(plus ``runs`` per target).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({r.get("benchmark", "?") for r in runs})
    figures: dict[str, list[float]] = {}
    for r in runs:
        for k, v in r.get("figures", {}).items():
            figures.setdefault(k, []).append(float(v))
    order: list[str] = []
    targets: dict[str, dict[str, Any]] = {}
    for r in runs:
        for t in r.get("targets", []):
            name = str(t["name"])
            if name not in targets:
                order.append(name)
                targets[name] = {"name": name, "target": float(t["target"]), "direction": t["direction"],
                                 "values": [], "why": []}
            if t.get("value") is None:
                targets[name]["why"].append(str(t.get("why", "not measured")))
            else:
                targets[name]["values"].append(float(t["value"]))
    out_targets = []
    for name in order:
        t = targets[name]
        values = t.pop("values")
        why = t.pop("why")
        t["runs"] = f"{len(values)}/{len(runs)}"
        if values:
            med = statistics.median(values)
            t["value"] = med
            t["met"] = med <= t["target"] if t["direction"] == "<=" else med >= t["target"]
            if why:
                t["why"] = f"not measured in {len(why)} run(s): {why[0]}"
        else:
            t["value"] = None
            t["met"] = False
            t["why"] = why[0] if why else "not measured"
        out_targets.append(t)
    return {"benchmark": " + ".join(names), "runs": len(runs),
            "figures": {k: statistics.median(v) for k, v in figures.items()}, "targets": out_targets}


def table(result: dict[str, Any]) -> str:
    lines = [f"# {result['benchmark']}: median of {result['runs']} run(s)"]
    ts = result["targets"]
    if ts:
        w = max(len(t["name"]) for t in ts)
        lines += [f"| {'target'.ljust(w)} | {'median':>10} | {'goal':>10} | runs | met |",
                  f"|{'-' * (w + 2)}|{'-' * 12}|{'-' * 12}|------|-----|"]
        for t in ts:
            value = "null" if t["value"] is None else f"{t['value']:.4g}"
            why = f" ({t['why']})" if t.get("why") else ""
            lines.append(f"| {t['name'].ljust(w)} | {value:>10} | {t['direction']} {t['target']:<7g} | "
                         f"{t['runs']:>4} | {'yes' if t['met'] else 'NO'} |{why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="JSON files written by one bench's --json")
    ap.add_argument("--json", metavar="PATH", help="write the medians as JSON")
    a = ap.parse_args(argv)
    runs = []
    for path in a.runs:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
    result = combine(runs)
    print(table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
