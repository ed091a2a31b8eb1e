"""The ``kvstore route`` subcommand: registered here, implemented in the ``router`` package."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add ``route`` to the CLI's subparsers."""
    from router.cli import add_arguments, run

    p: argparse.ArgumentParser = sub.add_parser(
        "route", help="run the cache- and SLO-aware OpenAI front door for vLLM servers (docs/router.md)",
        description="An OpenAI-compatible router: each request goes to the backend with the smallest "
                    "predicted time to first token; requests that would miss their class's target get 429.")
    add_arguments(p)
    p.set_defaults(func=run)
