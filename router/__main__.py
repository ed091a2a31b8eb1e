"""``python -m router ...``: the same as ``kvstore route ...``."""

from __future__ import annotations

import argparse
import sys

from router.cli import add_arguments, run

if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="kvstore route")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
