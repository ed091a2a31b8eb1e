"""Shared plumbing for bench/*.py: timing, the table, the JSON file.

Every benchmark writes ``{"figures": {...}, "targets": [{"name", "value",
"target", "met"}]}`` (DESIGN.md section 5); ``met`` is computed from figures
measured in the same run. A target that could not be measured in this run
(its measurement failed, was skipped or did not run) is still written, with
``value: null`` and ``met: false`` (``Report.unmeasured``), never left out.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
from typing import Any, Callable, Sequence


def median_time(fn: Callable[[], object], repeats: int = 5, inner: int = 1) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` samples of
    ``inner`` back-to-back calls each (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


class Report:
    def __init__(self, name: str) -> None:
        self.name = name
        self.figures: dict[str, float] = {}
        self.units: dict[str, str] = {}
        self.targets: list[dict[str, object]] = []

    def figure(self, name: str, value: float, unit: str = "") -> None:
        self.figures[name] = float(value)
        self.units[name] = unit

    def target(self, name: str, value: float | None, target: float, lower_is_better: bool = False,
               why: str = "") -> None:
        """A target computed from a figure of this run; ``value=None`` (or
        NaN) means it was not measured: written with ``met: false``."""
        if value is None or math.isnan(value):
            self.unmeasured(name, target, lower_is_better, why or "not measured")
            return
        met = value <= target if lower_is_better else value >= target
        self.targets.append({"name": name, "value": float(value), "target": float(target),
                             "met": bool(met), "direction": "<=" if lower_is_better else ">="})

    def unmeasured(self, name: str, target: float, lower_is_better: bool = False, why: str = "not measured") -> None:
        """A target this run could not measure: ``value: null``, ``met: false``
        and the reason (``why``)."""
        self.targets.append({"name": name, "value": None, "target": float(target), "met": False,
                             "direction": "<=" if lower_is_better else ">=", "why": why})

    def table(self) -> str:
        w = max([len(k) for k in self.figures] + [10])
        lines = [f"# {self.name} ({platform.machine()}, python {platform.python_version()})",
                 f"| {'figure'.ljust(w)} | {'value':>14} | unit |", f"|{'-' * (w + 2)}|{'-' * 16}|------|"]
        for k, v in self.figures.items():
            lines.append(f"| {k.ljust(w)} | {v:>14.4g} | {self.units.get(k, '')} |")
        if self.targets:
            tw = max(len(str(t["name"])) for t in self.targets)
            lines += ["", f"| {'target'.ljust(tw)} | {'value':>10} | {'goal':>10} | met |",
                      f"|{'-' * (tw + 2)}|{'-' * 12}|{'-' * 12}|-----|"]
            for t in self.targets:
                goal = f"{t['direction']} {t['target']:g}"
                value = "null" if t["value"] is None else f"{t['value']:.4g}"
                why = f" ({t['why']})" if t.get("why") else ""
                lines.append(f"| {str(t['name']).ljust(tw)} | {value:>10} | {goal:>10} | "
                             f"{'yes' if t['met'] else 'NO'} |{why}")
        return "\n".join(lines)

    def emit(self, json_path: str | None) -> None:
        print(self.table())
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"benchmark": self.name, "figures": self.figures, "targets": self.targets}, f, indent=2)
            print(f"wrote {json_path}", file=sys.stderr)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(target: str, timeout: float = 60.0, procs: Sequence[Any] = ()) -> None:
    """Wait until the daemon at ``target`` answers its gRPC health check with
    SERVING; fail early if one of ``procs`` (Popen objects) has exited."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout
    while True:
        try:
            with grpc.insecure_channel(target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            pass
        if time.monotonic() > end or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"daemon {target} did not become healthy")
        time.sleep(0.1)
