"""Reliability figures: runs the fault-injection suite (tests/faults) and
reports what it measured (docs/reliability.md).

The suite's tests assert the required behaviour; this script runs them at a
chosen scale, collects the figures they record (``KVSTORE_FAULT_JSON``),
prints a table and writes ``{"figures": {...}, "targets": [...]}`` with a
target per required behaviour, each computed from the figures of this run.
Every target is written whatever happened: one whose test failed, errored,
was skipped or did not run (``-k``) has ``value: null``, ``met: false`` and
the reason. The tests record what they measured before they assert, so the
figures of a failed test still appear among the figures.

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

# (figure, goal, lower is better, the tests that measure it): the required
# behaviour of each fault. A target is computed only when every one of its
# tests passed in this run; otherwise (failed, errored, skipped, deselected
# or never collected) it is written with value null and met false.
CRASH, RES, FLIP, DEATH = ("test_fault_crash", "test_fault_resources", "test_fault_bitflip",
                           "test_fault_client_death")
FUZZ_TESTS = tuple(f"test_fault_fuzz::{t}" for t in (
    "test_fuzz_well_typed_messages", "test_fuzz_mutated_and_wrongly_typed_bytes",
    "test_oversized_messages_and_huge_batches", "test_daemon_survived_with_bounded_memory"))
SLOW_DISK = (f"{RES}::test_slow_disk_deadlines_and_abandoned_calls",)
TARGETS: list[tuple[str, float, bool, tuple[str, ...]]] = [
    ("crash_sigkill.corrupt_returns", 0, True, (f"{CRASH}::test_sigkill_during_puts_and_demotion",)),
    ("torn_files.corrupt_returns", 0, True, (f"{CRASH}::test_torn_and_garbled_ssd_files",)),
    ("torn_files.start_ratio", 1, False, (f"{CRASH}::test_torn_and_garbled_ssd_files",)),
    ("bitflip_dram.detection_rate", 1, False, (f"{FLIP}::test_dram_bit_flips_are_always_detected",)),
    ("bitflip_dram.false_hits", 0, True, (f"{FLIP}::test_dram_bit_flips_are_always_detected",)),
    ("bitflip_ssd.detection_rate", 1, False, (f"{FLIP}::test_ssd_bit_flips_are_always_detected",)),
    ("bitflip_ssd.false_hits", 0, True, (f"{FLIP}::test_ssd_bit_flips_are_always_detected",)),
    ("disk_full.corrupt_returns", 0, True, (f"{RES}::test_disk_full_then_space_returns",)),
    ("disk_full.put_ok_ratio", 1, False, (f"{RES}::test_disk_full_then_space_returns",)),
    ("slow_disk.abandoned_left_behind", 0, True, SLOW_DISK),
    # issue 19: Lookup p99 with a 30 ms disk / Lookup p99 with a normal disk (same run, same load)
    ("slow_disk.lookup_p99_ratio", 2, True, SLOW_DISK),
    ("cpu_starvation.leases_falsely_expired", 0, True, (f"{RES}::test_cpu_starvation_expires_nothing_live",)),
    ("cpu_starvation.reservations_falsely_expired", 0, True, (f"{RES}::test_cpu_starvation_expires_nothing_live",)),
    ("client_death.leaked_slots", 0, True, (f"{DEATH}::test_a_thousand_client_deaths_leak_nothing",)),
    ("client_death.leaked_leases", 0, True, (f"{DEATH}::test_a_thousand_client_deaths_leak_nothing",)),
    ("client_death.leaked_reservations", 0, True, (f"{DEATH}::test_a_thousand_client_deaths_leak_nothing",)),
    ("eviction_race.wrong_bytes", 0, True, ("test_fault_race::test_eviction_racing_lookup_acquire",)),
    ("fuzz.crashes", 0, True, FUZZ_TESTS),
    ("fuzz.internal_errors", 0, True, FUZZ_TESTS),
    ("soak.rss_growth_after_warmup_pct", 5, True, ("test_fault_soak::test_soak_many_async_clients",)),
    ("soak.wrong_bytes", 0, True, ("test_fault_soak::test_soak_many_async_clients",)),
    ("soak.shm_segments_left", 0, True, ("test_fault_soak::test_soak_many_async_clients",)),
    ("security.static_scan_findings", 0, True, ("test_fault_security::test_product_code_never_unpickles_or_evals",)),
    ("security.cross_tenant_leaks", 0, True, ("test_fault_security::test_a_tenant_never_sees_another_tenants_blocks",)),
    ("security.weak_hash_collision_leaks", 0, True,
     ("test_fault_security::test_weakened_16_bit_hash_collisions_are_misses",)),
    ("security.foreign_reports_matched", 0, True,
     ("test_fault_report_binding::test_only_the_receiving_tenant_and_session_may_report",)),
    ("security.undecodable_wrong_code", 0, True, ("test_fault_decode::test_undecodable_requests_get_invalid_argument",)),
    ("security.undecodable_tracebacks", 0, True, ("test_fault_decode::test_undecodable_requests_get_invalid_argument",)),
    ("security.undecodable_log_lines", 1, True, ("test_fault_decode::test_undecodable_requests_get_invalid_argument",)),
    # issue 19: no single call takes the daemon or the cache down
    ("resize_limits.refused", 2, False,
     ("test_fault_limits::test_resize_beyond_the_host_is_refused_and_a_failed_resize_changes_nothing",)),
    ("resize_limits.failed_remap_left_tier_unchanged", 1, False,
     ("test_fault_limits::test_resize_beyond_the_host_is_refused_and_a_failed_resize_changes_nothing",)),
    ("oversized_reserve.evicted", 0, True, ("test_fault_limits::test_an_oversized_reserve_leaves_another_tenants_hits_intact",)),
    ("oversized_reserve.other_tenant_hits_kept_ratio", 1, False,
     ("test_fault_limits::test_an_oversized_reserve_leaves_another_tenants_hits_intact",)),
    ("sigterm_write_back.survived_ratio", 1, False, ("test_fault_shutdown::test_sigterm_in_write_back_mode_keeps_every_block",)),
    ("sigterm_write_back.wrong_bytes", 0, True, ("test_fault_shutdown::test_sigterm_in_write_back_mode_keeps_every_block",)),
    ("slab_after_sigkill.slabs_left", 0, True, ("test_fault_shutdown::test_a_restart_removes_the_slab_of_a_killed_predecessor",)),
    ("suite.failed_tests", 0, True, ()),
]


def outcomes(xml_path: str) -> dict[str, str] | None:
    """``module::test`` -> passed / failed / error / skipped, from pytest's
    JUnit XML (None when there is no readable report)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    out: dict[str, str] = {}
    for case in root.iter("testcase"):
        mod = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "").split("[", 1)[0]
        kinds = {child.tag for child in case}
        state = ("error" if "error" in kinds else "failed" if "failure" in kinds
                 else "skipped" if "skipped" in kinds else "passed")
        key = f"{mod}::{name}"
        if out.get(key, "passed") == "passed":  # a parametrized test: the worst of its cases
            out[key] = state
    return out


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
    tests = outcomes(raw + ".xml")
    for p in (raw, raw + ".xml"):
        try:
            os.unlink(p)
        except OSError:
            pass
    rep = Report(f"faults ({scale})")
    flat = flatten(figs)
    if tests is not None:
        states = list(tests.values())
        flat["suite.tests_passed"] = float(states.count("passed"))
        flat["suite.tests_skipped"] = float(states.count("skipped"))
        flat["suite.failed_tests"] = float(states.count("failed") + states.count("error"))
    flat["suite.pytest_exit_code"] = float(rc)
    flat["suite.wall_s"] = round(wall, 1)
    for k, v in flat.items():
        rep.figure(k, v)
    for name, goal, lower, needs in TARGETS:
        if tests is None:
            rep.unmeasured(name, goal, lower, "the suite wrote no report")
            continue
        not_passed = [f"{t} {tests.get(t, 'not run')}" for t in needs if tests.get(t) != "passed"]
        if not_passed:
            rep.unmeasured(name, goal, lower, "; ".join(not_passed))
        elif name not in flat:
            rep.unmeasured(name, goal, lower, "its test passed but recorded no such figure")
        else:
            rep.target(name, flat[name], goal, lower_is_better=lower)
    rep.emit(a.json)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
