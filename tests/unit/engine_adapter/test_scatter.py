"""The connector's scatter of loaded blocks into vLLM's KV tensors (issue 18
goal 4): one copy per run of consecutive blocks, the same result as
``index_copy_``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_adapter.layout import block_runs, scatter_blocks


def test_runs_break_where_ids_or_rows_jump():
    ids = np.array([4, 5, 6, 9, 10, 2], dtype=np.int64)
    rows = np.array([0, 1, 2, 3, 5, 6], dtype=np.int64)
    assert block_runs(ids, rows).tolist() == [0, 3, 4, 5, 6]
    assert block_runs(np.array([7]), np.array([0])).tolist() == [0, 1]


@pytest.mark.parametrize("ids,rows", [
    ([3, 4, 5, 6], [0, 1, 2, 3]),            # one run
    ([9, 2, 3, 7], [0, 1, 2, 3]),            # three runs
    ([1, 2, 8, 9, 10], [0, 1, 3, 4, 6]),     # rows skip a failed block
])
def test_scatter_matches_index_copy(ids, rows):
    g = torch.Generator().manual_seed(1)
    layers = [torch.zeros(12, 2, 4, 3, dtype=torch.bfloat16) for _ in range(3)]
    srcs = [torch.randn(7, 2, 4, 3, generator=g).to(torch.bfloat16) for _ in range(3)]
    want = [t.clone() for t in layers]
    i, r = torch.tensor(ids), torch.tensor(rows)
    for t, s in zip(want, srcs):
        t.index_copy_(0, i, s.index_select(0, r))
    scatter_blocks(layers, srcs, np.asarray(ids, dtype=np.int64), np.asarray(rows, dtype=np.int64))
    for got, exp in zip(layers, want):
        assert torch.equal(got, exp)
