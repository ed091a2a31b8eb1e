"""``Report`` trusts only the caller that received the decision (issue 19,
item 6): a decision id is random (not the next integer), and a report on it
from another tenant, another session, or no session is ignored like an
unknown id -- it neither moves the shared TTFT predictor nor uses up the
decision, whose owner can still report on it."""

from __future__ import annotations

import math
from pathlib import Path

from kvstore.client import Client, ns_pb
from kvstore.keys import Namespace, block_keys
from proto import kvstore_pb2 as pb
from tests.faults.faultlib import record

TENANTS = ('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n\n'
           '[[tenant]]\nname = "beta"\ntoken = "tok-beta"\n')
NS = Namespace(tenant="acme", model_id="llama", block_size=16)


def _admit(c: Client, ns: Namespace) -> int:
    keys = block_keys(ns, list(range(4 * 16)))
    r = c.stub.Admit(pb.AdmitRequest(ns=ns_pb(ns), keys_packed=b"".join(keys), n_tokens=64, ttft_target_s=10.0,
                                     queue_wait_s=0.001), metadata=c._md(), timeout=10)
    assert r.kind == pb.ADMIT_KIND_ADMIT and r.decision_id
    return int(r.decision_id)


def _report(c: Client, decision_id: int, actual_s: float = 1e6) -> bool:
    return bool(c.stub.Report(pb.ReportRequest(decision_id=decision_id, actual_ttft_s=actual_s),
                              metadata=c._md(), timeout=10).matched)


def _rate(c: Client) -> float:
    return float(c.stub.Stats(pb.StatsRequest(), metadata=c._md(), timeout=10).prefill_tokens_per_s)


def test_only_the_receiving_tenant_and_session_may_report(make_daemon, tmp_path: Path) -> None:
    tf = tmp_path / "tenants.toml"
    tf.write_text(TENANTS)
    d = make_daemon(server__tenants_file=str(tf))
    with Client(d.target, token="tok-acme") as acme, Client(d.target, token="tok-acme") as acme2, \
            Client(d.target, token="tok-beta") as beta, Client(d.target, token="tok-acme", session=False) as bare:
        assert acme.session and acme2.session and not bare.session
        ids = [_admit(acme, NS) for _ in range(32)]
        # unguessable: not a sequence, spread over the 63-bit range
        assert len(set(ids)) == 32 and all(0 < i < 2**63 for i in ids)
        assert sorted(ids) != list(range(min(ids), min(ids) + 32))
        assert max(ids) - min(ids) > 2**40
        before = _rate(acme)
        target = ids[-1]
        # another tenant, another session of the same tenant, no session: ignored;
        # neighbours of a known id are not decisions of anyone's
        foreign = [_report(beta, target), _report(acme2, target), _report(bare, target),
                   _report(beta, target + 1), _report(beta, target - 1)]
        record("security", foreign_reports_matched=sum(foreign), foreign_reports_tried=len(foreign))
        assert not any(foreign)
        assert _rate(acme) == before, "a foreign report moved the shared predictor"
        # the decision is still there for its owner
        assert _report(acme, target, actual_s=0.05)
        assert not _report(acme, target)  # consumed once
    ast = d.daemon.admission.stats()
    assert ast.foreign_reports == 3
    record("security", foreign_reports_ignored=ast.foreign_reports, decision_ids_sampled=len(ids),
           decision_id_spread_log2=round(math.log2(max(ids) - min(ids)), 1))


def test_without_auth_the_session_binds_the_decision(make_daemon) -> None:
    d = make_daemon()
    with Client(d.target) as a, Client(d.target) as b, Client(d.target, session=False) as bare:
        did = _admit(a, NS)
        assert not _report(b, did)
        assert not _report(bare, did)
        assert _report(a, did, actual_s=0.05)
        # a decision made without a session is reported without one
        did = _admit(bare, NS)
        assert not _report(a, did)
        assert _report(bare, did, actual_s=0.05)
