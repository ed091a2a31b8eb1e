"""Admission control: TTFT prediction, early rejection, QoS and quotas (issue 7).

Pure decision code: no I/O, no gRPC, time from an injected clock. The daemon
wires it in (``docs/admission.md``):

- :mod:`admission.predictor`: :class:`TTFTPredictor` (the TTFT model, its
  calibration and error figures);
- :mod:`admission.slo`: :class:`AdmissionController` (``Admit``/``Report``
  RPCs), its :class:`Decision` and :class:`ReasonCode`;
- :mod:`admission.qos`: :class:`QosGate` around the data-path handlers;
- :mod:`admission.quota`: per-tenant capacity shares (:func:`victim_mask` for
  the store's eviction), rate limits, Preble-style class fairness.
"""

from __future__ import annotations

from admission.qos import (METHOD_CLASSES, RETRY_AFTER_MD, ClassCounters, QosClass, QosConfig, QosGate,
                           QosRejected, Rejection, Ticket, TicketState, retry_after_metadata)
from admission.quota import (ClassFairness, HitClass, RateLimit, TenantRateLimiter, TenantShares, TokenBucket,
                             hit_class, over_share_mask, victim_mask, victim_order)
from admission.predictor import (ErrorStats, PredictorConfig, TierLoad, TTFTBreakdown, TTFTPredictor,
                                 hit_counts)
from admission.slo import (AdmissionConfig, AdmissionController, AdmissionStats, Decision, DecisionKind,
                           ReasonCode)

__all__ = [
    "AdmissionConfig", "AdmissionController", "AdmissionStats", "ClassCounters", "ClassFairness", "Decision",
    "DecisionKind", "ErrorStats", "HitClass", "METHOD_CLASSES", "PredictorConfig", "QosClass", "QosConfig",
    "QosGate", "QosRejected", "RETRY_AFTER_MD", "RateLimit", "ReasonCode", "Rejection", "TTFTBreakdown",
    "TTFTPredictor", "TenantRateLimiter", "TenantShares", "Ticket", "TicketState", "TierLoad", "TokenBucket",
    "hit_class", "hit_counts", "over_share_mask", "retry_after_metadata", "victim_mask", "victim_order",
]
