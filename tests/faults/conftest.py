"""The fault-injection suite (docs/reliability.md). Default settings keep the
whole directory to a few minutes on two cores; ``KVSTORE_FAULT_*`` variables
make it heavier (see each test's ``setting(...)`` calls). The figures the
tests measure are printed at the end of the run (and written as JSON to
``$KVSTORE_FAULT_JSON`` when set)."""

from __future__ import annotations

from typing import Any

from tests.faults.faultlib import summary_lines
from tests.integration.conftest import daemon, make_daemon, repo_root  # noqa: F401  (fixtures)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    lines = summary_lines()
    if lines:
        terminalreporter.section("kvstore fault-suite figures")
        for line in lines:
            terminalreporter.write_line(line)
