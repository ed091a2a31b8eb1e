"""``python -m kvstore``: the same as the ``kvstore`` command."""

from __future__ import annotations

import sys

from kvstore.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
