"""Reliability figures: runs the fault-injection suite (tests/faults) and
reports what it measured (docs/reliability.md).

The suite's tests assert the required behaviour; this script runs them at a
chosen scale, collects the figures they record (``KVSTORE_FAULT_JSON``),
prints a table and writes ``{"figures": {...}, "targets": [...]}`` with a
target per required behaviour, each computed from the figures of this run.

Scales: ``--quick`` (a smaller run, about 80 s on two cores: fewer
kills, flips, deaths and fuzz inputs, an 8 s soak of 100 clients), the default (the CI settings), ``--full`` (heavier:
30 kills, 200 damaged directories, 2,000 flips per tier, 5,000 client
deaths, 20,000 fuzz inputs, a 5-minute soak).

Usage: python bench/faults.py [--quick | --full] [--json PATH] [-k EXPR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import Report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCALES: dict[str, dict[str, str]] = {
    "quick": {"KILL_ROUNDS": "2", "TORN_TRIALS": "8", "FLIPS": "50", "CLIENT_DEATHS": "100",
              "FUZZ_INPUTS": "200", "FUZZ_HANDSHAKES": "200", "RACE_EXAMPLES": "3", "RACE_STEPS": "12",
              "SOAK_S": "8", "SOAK_WARMUP_S": "5", "SOAK_CLIENTS": "100", "STARVE_S": "3", "SLOW_DISK_S": "2",
              "KEY_EXAMPLES": "100"},
    "ci": {},
    "full": {"KILL_ROUNDS": "30", "TORN_TRIALS": "200", "FLIPS": "1000", "CLIENT_DEATHS": "5000",
             "FUZZ_INPUTS": "10000", "FUZZ_HANDSHAKES": "20000", "RACE_EXAMPLES": "100", "RACE_STEPS": "30",
             "SOAK_S": "300", "SOAK_WARMUP_S": "60", "STARVE_S": "30", "SLOW_DISK_S": "20"},
}

# (figure, goal, lower is better): the required behaviour of each fault
TARGETS: list[tuple[str, float, bool]] = [
    ("crash_sigkill.corrupt_returns", 0, True),
    ("torn_files.corrupt_returns", 0, True),
    ("torn_files.start_ratio", 1, False),
    ("bitflip_dram.detection_rate", 1, False),
    ("bitflip_dram.false_hits", 0, True),
    ("bitflip_ssd.detection_rate", 1, False),
    ("bitflip_ssd.false_hits", 0, True),
    ("disk_full.corrupt_returns", 0, True),
    ("disk_full.put_ok_ratio", 1, False),
    ("slow_disk.abandoned_left_behind", 0, True),
    ("cpu_starvation.leases_falsely_expired", 0, True),
    ("cpu_starvation.reservations_falsely_expired", 0, True),
    ("client_death.leaked_slots", 0, True),
    ("client_death.leaked_leases", 0, True),
    ("client_death.leaked_reservations", 0, True),
    ("eviction_race.wrong_bytes", 0, True),
    ("fuzz.crashes", 0, True),
    ("fuzz.internal_errors", 0, True),
    ("soak.rss_growth_after_warmup_pct", 5, True),
    ("soak.wrong_bytes", 0, True),
    ("soak.shm_segments_left", 0, True),
    ("security.static_scan_findings", 0, True),
    ("security.cross_tenant_leaks", 0, True),
    ("security.weak_hash_collision_leaks", 0, True),
    ("security.foreign_reports_matched", 0, True),
    ("security.undecodable_wrong_code", 0, True),
    ("security.undecodable_tracebacks", 0, True),
    ("security.undecodable_log_lines", 1, True),
    # issue 19: no single call takes the daemon or the cache down
    ("resize_limits.refused", 2, False),
    ("resize_limits.failed_remap_left_tier_unchanged", 1, False),
    ("oversized_reserve.evicted", 0, True),
    ("oversized_reserve.other_tenant_hits_kept_ratio", 1, False),
    ("sigterm_write_back.survived_ratio", 1, False),
    ("sigterm_write_back.wrong_bytes", 0, True),
    ("slab_after_sigkill.slabs_left", 0, True),
    ("suite.failed_tests", 0, True),
]


def flatten(figs: dict[str, dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for area, values in figs.items():
        for k, v in values.items():
            if isinstance(v, bool):
                out[f"{area}.{k}"] = float(v)
            elif isinstance(v, (int, float)):
                out[f"{area}.{k}"] = float(v)
            elif isinstance(v, dict):
                for k2, v2 in v.items():
                    if isinstance(v2, (int, float)):
                        out[f"{area}.{k}.{k2}"] = float(v2)
    # ratios the targets need
    if "torn_files.trials" in out:
        out["torn_files.start_ratio"] = out["torn_files.daemon_starts"] / max(1.0, out["torn_files.trials"])
    if "disk_full.puts" in out:
        out["disk_full.put_ok_ratio"] = out["disk_full.puts_ok"] / max(1.0, out["disk_full.puts"])
    if "oversized_reserve.other_tenant_hits_before" in out:
        out["oversized_reserve.other_tenant_hits_kept_ratio"] = (
            out["oversized_reserve.other_tenant_hits_after"] / max(1.0, out["oversized_reserve.other_tenant_hits_before"]))
    if "sigterm_write_back.blocks" in out:
        out["sigterm_write_back.survived_ratio"] = (out["sigterm_write_back.survived"]
                                                    / max(1.0, out["sigterm_write_back.blocks"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="smaller run")
    g.add_argument("--full", action="store_true", help="heavier run (tens of minutes)")
    ap.add_argument("--json", metavar="PATH", help="write figures and targets as JSON")
    ap.add_argument("-k", metavar="EXPR", help="only the tests pytest -k selects")
    a = ap.parse_args(argv)
    scale = "quick" if a.quick else "full" if a.full else "ci"
    fd, raw = tempfile.mkstemp(prefix="kvstore-faults-", suffix=".json")
    os.close(fd)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_FAULT_")}
    env.update({f"KVSTORE_FAULT_{k}": v for k, v in SCALES[scale].items()})
    env["KVSTORE_FAULT_JSON"] = raw
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/faults",
           "--junit-xml", raw + ".xml"] + (["-k", a.k] if a.k else [])
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    try:
        with open(raw) as f:
            figs = json.load(f)
    except (OSError, ValueError):
        figs = {}
    failed = 0
    try:
        import xml.etree.ElementTree as ET

        suite = ET.parse(raw + ".xml").getroot()
        node = suite if suite.tag == "testsuite" else suite[0]
        failed = int(node.get("failures", 0)) + int(node.get("errors", 0))
    except (OSError, ET.ParseError, IndexError):
        failed = 0 if rc == 0 else 1
    for p in (raw, raw + ".xml"):
        try:
            os.unlink(p)
        except OSError:
            pass
    rep = Report(f"faults ({scale})")
    flat = flatten(figs)
    flat["suite.failed_tests"] = float(failed)
    flat["suite.wall_s"] = round(wall, 1)
    for k, v in flat.items():
        rep.figure(k, v)
    for name, goal, lower in TARGETS:
        if name in flat:
            rep.target(name, flat[name], goal, lower_is_better=lower)
    rep.emit(a.json)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
