"""``kvstore route``: flags and the uvicorn run (registered by ``kvstore/tools/route_cli.py``)."""

from __future__ import annotations

import argparse
import logging

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (docs/router.md)")
    p.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:8000)")
    p.add_argument("--backend", action="append", default=[], metavar="[NAME=]URL[=DAEMON]",
                   help="a vLLM server and its kvstore daemon, e.g. http://127.0.0.1:8101=127.0.0.1:50051 "
                        "(repeatable; adds to the config file's)")
    p.add_argument("--model", action="append", default=[], metavar="NAME=PATH[,block_size=N][,kv_dtype=D]",
                   help="a served model and its directory (tokenizer, chat template, config)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY=TENANT[:CLASS]",
                   help="a bearer key, its tenant and service class (none: no authentication)")
    p.add_argument("--policy", choices=["cost", "prefix", "round_robin"],
                   help="how backends are ranked (default: cost, the smallest predicted TTFT)")
    p.add_argument("--no-admission", action="store_true", help="never refuse on a predicted SLO miss")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from router.config import load_router_config
    from router.server import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides: dict[str, object] = {"admission": False} if args.no_admission else {}
    if args.policy:
        overrides["policy"] = args.policy
    cfg = load_router_config(args.config, listen=args.listen, backends=args.backend, models=args.model,
                             api_keys=args.api_key, overrides=overrides)
    app = build_app(cfg)
    host, port = cfg.listen_addr
    uvicorn.run(app, host=host, port=port, log_level=args.log_level, access_log=args.log_level == "debug")
    return 0
