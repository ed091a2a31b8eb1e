"""kvstore.daemon.metrics against a real small TieredStore, and the deploy files
(alert rules, Grafana dashboard) against the metrics it actually exports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from kvstore.keys import Namespace
from kvstore.daemon.metrics import MAX_TENANT_LABELS, OP_BUCKETS, OTHER_TENANT, Metrics, loop_stats_fn
from kvstore.core.store import StoreConfig, TieredStore

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[3]
ALERTS = ROOT / "deploy" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
BLOCK = 4096


@pytest.fixture
def store() -> Iterator[TieredStore]:
    st = TieredStore(StoreConfig(dram_bytes=1 << 20, dram_page_bytes=1 << 20))
    try:
        yield st
    finally:
        st.close()


def _keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in exposition text (labels must match exactly)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = ",".join(sorted(p for p in re.findall(r'\w+="[^"]*"', m.group(2) or "")))
        if got == want:
            return float(m.group(3))
    raise AssertionError(f"no sample {name}{{{want}}} in:\n{text}")


# ---------------------------------------------------------------- collector


def test_collector_values_from_real_store(store: TieredStore) -> None:
    ns = Namespace(tenant="acme", model_id="llama")
    ns_b = Namespace(tenant="beta", model_id="qwen")
    keys = _keys(1, 4)
    payloads = [np.full(BLOCK, i, dtype=np.uint8) for i in range(4)]
    assert store.put(ns, keys, payloads).ok
    assert store.lookup(ns, keys + _keys(9, 2)).hit_blocks == 4   # 4 of 6 hit
    assert store.lookup(ns_b, _keys(2, 3)).hit_blocks == 0        # 0 of 3 hit
    got = store.get(ns, keys[:2])
    assert got.ok
    store.pin(ns, keys[:1])
    store.remove(ns, keys[3:])

    m = Metrics(store.stats)
    text = m.render().decode()

    assert sample(text, "kvstore_tier_blocks", tier="dram") == 3
    assert sample(text, "kvstore_tier_used_bytes", tier="dram") == 3 * BLOCK
    assert sample(text, "kvstore_tier_capacity_bytes", tier="dram") == 1 << 20
    assert sample(text, "kvstore_tier_pinned_bytes", tier="dram") == BLOCK
    assert sample(text, "kvstore_evictions_total", tier="dram", reason="removed") == 1
    assert sample(text, "kvstore_lookups_total") == 2
    assert sample(text, "kvstore_lookup_blocks_total") == 9
    assert sample(text, "kvstore_lookup_hit_blocks_total") == 4
    assert sample(text, "kvstore_namespace_lookup_blocks_total", namespace="acme/llama/bfloat16/bs16") == 6
    assert sample(text, "kvstore_namespace_lookup_hit_blocks_total", namespace="acme/llama/bfloat16/bs16") == 4
    assert sample(text, "kvstore_namespace_lookup_blocks_total", namespace="beta/qwen/bfloat16/bs16") == 3
    assert sample(text, "kvstore_namespace_lookup_hit_blocks_total", namespace="beta/qwen/bfloat16/bs16") == 0
    assert sample(text, "kvstore_puts_total") == 1
    assert sample(text, "kvstore_put_blocks_total") == 4
    assert sample(text, "kvstore_put_bytes_total") == 4 * BLOCK
    assert sample(text, "kvstore_gets_total") == 1
    assert sample(text, "kvstore_get_blocks_total") == 2
    assert sample(text, "kvstore_get_hit_blocks_total") == 2
    assert sample(text, "kvstore_get_bytes_total") == 2 * BLOCK
    assert sample(text, "kvstore_checksum_failures_total") == 0
    assert sample(text, "kvstore_capacity_rejects_total") == 0
    assert sample(text, "kvstore_open_reservations") == 0
    assert sample(text, "kvstore_open_leases") == 0
    assert sample(text, "kvstore_eviction_policy_info", policy="lru") == 1
    assert sample(text, "kvstore_stats_errors_total") == 0
    assert "# HELP kvstore_tier_used_bytes " in text

    # values are read at scrape time: a later change shows in the next scrape
    store.lookup(ns, keys[:2])
    text = m.render().decode()
    assert sample(text, "kvstore_lookups_total") == 3
    assert sample(text, "kvstore_lookup_hit_blocks_total") == 6


def test_namespaces_sharing_a_label_are_one_summed_series(store: TieredStore) -> None:
    """The label leaves out the salt (and weights digest, layout...): two
    namespaces that differ only there once gave two samples with the same
    label set, which Prometheus refuses as duplicates (and the per-namespace
    hit ratio read one of them)."""
    a = Namespace(tenant="acme", model_id="llama", salt="user-1")
    b = Namespace(tenant="acme", model_id="llama", salt="user-2")
    keys = _keys(3, 2)
    for ns in (a, b):
        assert store.put(ns, keys, [np.zeros(BLOCK, np.uint8)] * 2).ok
    assert store.lookup(a, keys).hit_blocks == 2
    assert store.lookup(b, keys[:1] + _keys(4, 1)).hit_blocks == 1

    text = Metrics(store.stats).render().decode()
    label = 'namespace="acme/llama/bfloat16/bs16"'
    for name, want in (("kvstore_namespace_lookup_blocks_total", 4),
                       ("kvstore_namespace_lookup_hit_blocks_total", 3)):
        lines = [line for line in text.splitlines() if line.startswith(f"{name}{{{label}}}")]
        assert len(lines) == 1, lines
        assert sample(text, name, namespace="acme/llama/bfloat16/bs16") == want



def test_reservations_leases_and_capacity_rejects(store: TieredStore) -> None:
    ns = Namespace(tenant="t", model_id="m")
    slots = (1 << 20) // BLOCK
    keys = [bytes([3, i]) + bytes(14) for i in range(slots - 1)]  # one chain, all but one slot
    assert store.put(ns, keys, [np.zeros(BLOCK, np.uint8)] * len(keys)).ok
    lease = store.acquire(ns, keys, owner="client-1")               # pins every block
    res = store.reserve(ns, _keys(4, 1), BLOCK, owner="client-1")  # takes the last slot
    assert res.handle and lease.handle
    full = store.put(ns, _keys(5, 1), [np.zeros(BLOCK, np.uint8)])  # nothing evictable
    assert not full.ok
    text = Metrics(store.stats).render().decode()
    assert sample(text, "kvstore_open_leases") == 1
    assert sample(text, "kvstore_open_reservations") == 1
    assert sample(text, "kvstore_tier_pinned_bytes", tier="dram") == len(keys) * BLOCK
    assert sample(text, "kvstore_capacity_rejects_total") == 1
    store.release(lease.handle, "client-1")
    assert sample(Metrics(store.stats).render().decode(), "kvstore_tier_pinned_bytes",
                  tier="dram") == 0


def test_eviction_counted_by_reason(store: TieredStore) -> None:
    ns = Namespace(tenant="t", model_id="m")
    n = (1 << 20) // BLOCK
    for i in range(n + 8):  # more 4 KiB roots than the 1 MiB slab holds
        store.put(ns, [bytes([7, i % 256, i // 256]) + bytes(13)], [np.zeros(BLOCK, np.uint8)])
    store.set_policy("lfu")
    text = Metrics(store.stats).render().decode()
    assert sample(text, "kvstore_evictions_total", tier="dram", reason="evicted") >= 8
    assert sample(text, "kvstore_eviction_policy_info", policy="lfu") == 1


def test_failing_snapshot_does_not_fail_the_scrape() -> None:
    def broken() -> Any:
        raise RuntimeError("store is gone")

    m = Metrics(broken)
    m.observe("Lookup", 0.001)
    text = m.render().decode()
    assert sample(text, "kvstore_stats_errors_total") == 1
    assert "kvstore_tier_used_bytes{" not in text
    assert sample(text, "kvstore_op_seconds_count", op="Lookup") == 1


def test_direct_metrics(store: TieredStore) -> None:
    m = Metrics(store.stats)
    m.observe("Lookup", 0.0003)
    m.observe("Lookup", 7.0)
    with m.timed("Commit"):
        pass
    with pytest.raises(ValueError):
        with m.timed("Put"):
            raise ValueError("boom")
    m.rejected("Commit", "NOT_FOUND")
    m.rejected("Commit", "NOT_FOUND")

    class Code:  # a grpc.StatusCode-like enum member
        name = "PERMISSION_DENIED"

    m.rejected("Release", Code())
    m.inline_bytes("in", 1000)
    m.inline_bytes("out", 24)
    m.inline_bytes("out", 0)
    from tiers.base import TierKind
    m.lookup_hits([TierKind.DRAM, TierKind.DRAM, TierKind.SSD])
    text = m.render().decode()
    assert sample(text, "kvstore_op_seconds_count", op="Lookup") == 2
    assert sample(text, "kvstore_op_seconds_bucket", op="Lookup", le="0.0005") == 1
    assert sample(text, "kvstore_op_seconds_bucket", op="Lookup", le="5.0") == 1
    assert sample(text, "kvstore_op_seconds_bucket", op="Lookup", le="+Inf") == 2
    assert sample(text, "kvstore_op_seconds_bucket", op="Lookup", le="5e-05") == 0
    assert sample(text, "kvstore_op_seconds_count", op="Commit") == 1
    assert sample(text, "kvstore_op_seconds_count", op="Put") == 1
    assert sample(text, "kvstore_rpc_rejected_total", method="Commit", code="NOT_FOUND") == 2
    assert sample(text, "kvstore_rpc_rejected_total", method="Release",
                  code="PERMISSION_DENIED") == 1
    assert sample(text, "kvstore_inline_bytes_total", direction="in") == 1000
    assert sample(text, "kvstore_inline_bytes_total", direction="out") == 24
    assert sample(text, "kvstore_tier_lookup_hit_blocks_total", tier="dram") == 2
    assert sample(text, "kvstore_tier_lookup_hit_blocks_total", tier="ssd") == 1
    assert OP_BUCKETS[0] == 50e-6 and OP_BUCKETS[-1] == 5.0


def test_registries_are_independent(store: TieredStore) -> None:
    a, b = Metrics(store.stats), Metrics(store.stats)
    a.rejected("Get", "NOT_FOUND")
    assert "kvstore_rpc_rejected_total{" in a.render().decode()
    assert "kvstore_rpc_rejected_total{" not in b.render().decode()


def test_http_endpoint_port_zero(store: TieredStore) -> None:
    m = Metrics(store.stats)
    server, port = m.start_http("127.0.0.1", 0)
    try:
        assert port > 0 and m.http_port == port and m.http_thread is not None
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b"kvstore_tier_capacity_bytes{tier=\"dram\"} 1.048576e+06" in body
    finally:
        m.stop_http()
    assert m.http_port is None


def test_http_endpoint_port_taken(store: TieredStore) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"metrics endpoint 127.0.0.1:{port}: "):
            Metrics(store.stats).start_http("127.0.0.1", port)


async def test_loop_stats_fn_snapshots_on_the_loop(store: TieredStore) -> None:
    import asyncio
    import threading

    seen: list[int] = []

    def stats() -> Any:
        seen.append(threading.get_ident())
        return store.stats()

    loop = asyncio.get_running_loop()
    m = Metrics(loop_stats_fn(loop, stats))
    text = (await asyncio.to_thread(m.render)).decode()  # scrape from another thread
    assert sample(text, "kvstore_tier_capacity_bytes", tier="dram") == 1 << 20
    m.render()  # and from the loop's own thread: no deadlock
    assert seen == [threading.get_ident()] * 2


# ------------------------------------------------------- deploy files vs. metrics

_PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                 "group_right", "bool", "offset", "inf", "nan", "le", "atan2"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not
    functions, keywords, labels (inside {} or by(...)), ranges or strings."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    s = re.sub(r"\{[^}]*\}", "", s)                                      # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)                                     # ranges
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def test_promql_name_extraction() -> None:
    expr = ('histogram_quantile(0.99, sum by (op, le) (rate(kvstore_op_seconds_bucket'
            '{instance=~"$instance"}[$__rate_interval]))) / on(instance) group_left '
            'up{job="kvstore"} > 0 and increase(foo_total[5m]) offset 1h')
    assert promql_metric_names(expr) == {"kvstore_op_seconds_bucket", "up", "foo_total"}


def _alert_exprs() -> dict[str, str]:
    doc = yaml.safe_load(ALERTS.read_text())
    out = {}
    for group in doc["groups"]:
        for rule in group["rules"]:
            out[rule.get("alert") or rule["record"]] = rule["expr"]
    return out


def _dashboard_exprs() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(doc["panels"])
    for var in doc["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if var["type"] == "query" and isinstance(q, str):
            m = re.match(r"label_values\((\w+)\s*,", q)
            out.append((f"variable {var['name']}", m.group(1) if m else q))
    return out


def test_alert_rules_use_exported_metrics(store: TieredStore) -> None:
    exported = Metrics(store.stats).names()
    exprs = _alert_exprs()
    assert {"KVStorePrefixHitRatioLow", "KVStoreChecksumFailures", "KVStoreDown"} <= set(exprs)
    for name, expr in exprs.items():
        used = promql_metric_names(expr) - {"up"}  # `up` comes from Prometheus itself
        assert used or name == "KVStoreDown", name
        assert used <= exported, f"{name} uses unknown metrics {used - exported}"
    doc = yaml.safe_load(ALERTS.read_text())
    rules = {r["alert"]: r for g in doc["groups"] for r in g["rules"]}
    hit = rules["KVStorePrefixHitRatioLow"]
    assert hit["for"] == "10m" and "< 0.5" in hit["expr"] and "[5m]" in hit["expr"]
    assert "kvstore_lookup_hit_blocks_total" in hit["expr"]
    assert "> 0" in hit["expr"]  # instances without lookups are ignored
    assert "namespace" in rules["KVStoreNamespacePrefixHitRatioLow"]["expr"]
    assert "up{" in rules["KVStoreDown"]["expr"] and "== 0" in rules["KVStoreDown"]["expr"]


def _router_metric_names() -> set[str]:
    """The router's metrics (its panels share the dashboard)."""
    from router.backends import Pool
    from router.config import RouterConfig
    from router.metrics import RouterMetrics

    return RouterMetrics(Pool(RouterConfig(), None, follow_events=False)).names()  # type: ignore[arg-type]


def test_dashboard_uses_only_exported_metrics(store: TieredStore) -> None:
    exported = Metrics(store.stats).names() | _router_metric_names()
    doc = json.loads(DASHBOARD.read_text())
    assert doc["schemaVersion"] >= 36
    ds = [v for v in doc["templating"]["list"] if v["name"] == "datasource"]
    assert ds and ds[0]["type"] == "datasource" and ds[0]["query"] == "prometheus"
    exprs = _dashboard_exprs()
    assert len(exprs) >= 10
    used_all: set[str] = set()
    for title, expr in exprs:
        used = promql_metric_names(expr)
        assert used, f"panel {title!r} queries no metric: {expr}"
        assert used <= exported, f"panel {title!r} uses unknown metrics {used - exported}"
        used_all |= used
    for panel in doc["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    # the panels the operator page promises
    for needed in ("kvstore_namespace_lookup_hit_blocks_total", "kvstore_tier_used_bytes",
                   "kvstore_evictions_total", "kvstore_op_seconds_bucket",
                   "kvstore_put_bytes_total", "kvstore_checksum_failures_total",
                   "kvstore_rpc_rejected_total"):
        assert needed in used_all, needed
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))


def test_admission_tenant_label_is_bounded(store: TieredStore) -> None:
    """Without auth the tenant of an Admit is whatever the request names:
    each new name was a new series for the daemon's life (a client looping
    over tenant names grew /metrics and the daemon without bound)."""
    m = Metrics(store.stats)
    for i in range(MAX_TENANT_LABELS + 50):
        m.admission_decision(f"t{i}", "admit", "ok", 0.01)
    m.admission_decision("t0", "admit", "ok", 0.01)  # a tenant that has its label keeps it
    text = m.render().decode()
    tenants = set(re.findall(r'^kvstore_admission_decisions_total\{[^}]*tenant="([^"]*)"', text, re.M))
    assert len(tenants) == MAX_TENANT_LABELS + 1 and OTHER_TENANT in tenants
    assert sample(text, "kvstore_admission_decisions_total", kind="admit", reason="ok", tenant=OTHER_TENANT) == 50
    assert sample(text, "kvstore_admission_decisions_total", kind="admit", reason="ok", tenant="t0") == 2


def test_namespace_series_are_bounded_and_the_rest_fold_into_other(store: TieredStore) -> None:
    """Each namespace label was a series of its own for the daemon's life: a
    client naming model ids at will grew /metrics (and Prometheus) without
    bound. Now the busiest ``namespace_series`` labels keep theirs, the rest
    are summed into ``_other``, and the totals stay right over scrapes."""
    m = Metrics(store.stats, namespace_series=3)
    for i in range(10):  # model m{i}: 10 + i blocks queried, i hit
        ns = Namespace(tenant="acme", model_id=f"m{i}")
        keys = _keys(i, 10 + i)
        assert store.put(ns, keys[:i], [np.zeros(BLOCK, np.uint8)] * i).ok if i else True
        store.lookup(ns, keys)

    def series(text: str, name: str) -> dict[str, float]:
        return {k: float(v) for k, v in re.findall(rf'^{name}\{{namespace="([^"]*)"\}} (\S+)$', text, re.M)}

    for extra in (0, 5):
        if extra:  # more traffic on a folded namespace: it stays folded (a counter never moves series)
            store.lookup(Namespace(tenant="acme", model_id="m0"), _keys(0, extra))
        text = m.render().decode()
        queried = series(text, "kvstore_namespace_lookup_blocks_total")
        hit = series(text, "kvstore_namespace_lookup_hit_blocks_total")
        busiest = {f"acme/m{i}/bfloat16/bs16" for i in (7, 8, 9)}
        assert set(queried) == set(hit) == busiest | {OTHER_TENANT}
        assert sum(queried.values()) == sample(text, "kvstore_lookup_blocks_total") == sum(range(10, 20)) + extra
        assert sum(hit.values()) == sample(text, "kvstore_lookup_hit_blocks_total") == sum(range(10))
        assert queried[OTHER_TENANT] == sum(range(10, 17)) + extra and hit[OTHER_TENANT] == sum(range(7))


def test_expired_reservations_and_leases_are_counted(store: TieredStore) -> None:
    """A reservation never committed and a lease taken with a ttl (no
    session) both expire in ``reap``: /metrics counts each kind."""
    ns = Namespace(tenant="t", model_id="m")
    keys = _keys(6, 2)
    assert store.put(ns, keys, [np.zeros(BLOCK, np.uint8)] * 2).ok
    assert store.acquire(ns, keys, owner="client-1", ttl=1.0).handle
    assert store.reserve(ns, _keys(7, 1), BLOCK, owner="client-1").handle
    assert store.reap(now=store.clock() + 3600) == 2  # past every deadline
    text = Metrics(store.stats).render().decode()
    assert sample(text, "kvstore_reservations_expired_total") == 1
    assert sample(text, "kvstore_leases_expired_total") == 1
