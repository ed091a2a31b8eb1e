"""Type stub for the optional C extension kvstore.core.ckeytable (ckeytable.c)."""

from __future__ import annotations

import numpy as np

def find(table: np.ndarray, k0: np.ndarray, k1: np.ndarray, nscol: np.ndarray, state: np.ndarray,
         keys: np.ndarray, ns: int, want_state: int, stop: bool, out: np.ndarray, /) -> int: ...
def place(table: np.ndarray, k0: np.ndarray, nscol: np.ndarray, rows: np.ndarray, /) -> int: ...
def remove(table: np.ndarray, k0: np.ndarray, nscol: np.ndarray, rows: np.ndarray, /) -> None: ...
