"""``kvstore route``: a cache- and SLO-aware OpenAI-compatible front door for a
fleet of vLLM servers, each with its kvstore daemon (``docs/router.md``).

- :mod:`router.config`: the typed TOML tree and flags;
- :mod:`router.prompts`: request -> tokens -> block keys (the connector's namespace);
- :mod:`router.cache_view`: what each daemon holds, by tier, from ``WatchEvents``;
- :mod:`router.backends`: health, load (in flight + vLLM ``/metrics``), a predictor per backend;
- :mod:`router.decision`: predicted TTFT per backend, early rejection, quotas, fairness;
- :mod:`router.server`: the FastAPI app, upstream forwarding, retries, streaming.
"""

from __future__ import annotations

from router.config import (
    ApiKey,
    BackendSpec,
    ModelSpec,
    PredictorSpec,
    RouterConfig,
    ServiceClass,
    TenantQuota,
    load_router_config,
)

__all__ = ["ApiKey", "BackendSpec", "ModelSpec", "PredictorSpec", "RouterConfig", "ServiceClass", "TenantQuota",
           "build_app", "load_router_config"]


def build_app(*args, **kwargs):  # type: ignore[no-untyped-def]
    """:func:`router.server.build_app` (imported on use: FastAPI is heavy)."""
    from router.server import build_app as _build

    return _build(*args, **kwargs)
