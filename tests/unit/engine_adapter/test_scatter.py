"""The connector's scatter of loaded blocks into vLLM's KV tensors (issue 18
goal 4): one copy per run of consecutive blocks, the same result as
``index_copy_``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_adapter.layout import block_runs, scatter_blocks, scatter_layout


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


# ---------------------------------------------- loads straight into the layers
def _stored_blocks(n: int, block_bytes: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, size=(n, block_bytes), dtype=np.uint8)


@pytest.mark.parametrize("kv_first", [False, True])
@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_scatter_sink_places_what_staging_and_scatter_place(kv_first, tp, rank):
    """Blocks read through ``scatter_layout``'s sink land in the layers
    exactly as staged whole blocks copied in with ``scatter_blocks`` do:
    layouts [blocks, 2, ...] and [2, blocks, ...] (vLLM's K/V-first CPU
    layout, registered as its block-major transpose), any rank's shard."""
    from kvstore.checksum import checksum

    nb, shape = 10, (2, 4, 2, 8)  # K/V, tokens, heads, head size (bfloat16)
    origs = [torch.zeros(2, nb, *shape[1:], dtype=torch.bfloat16) if kv_first else
             torch.zeros(nb, *shape, dtype=torch.bfloat16) for _ in range(3)]
    layers = [o.transpose(0, 1) if kv_first else o for o in origs]
    layer_bytes = int(np.prod(shape)) * 2
    shard = 3 * layer_bytes
    blocks = _stored_blocks(4, tp * shard)
    ids = [7, 2, 3, 9]
    place = scatter_layout(origs, layers, rank * shard, layer_bytes, tp * shard)
    assert place is not None
    sink = place.sink(ids)
    assert len(sink) == 4 and sink.size_of(0) == tp * shard
    ok = sink.write(range(4), list(blocks), [checksum(b) for b in blocks])
    assert ok.all()
    # the staged path: this rank's shard of each block, typed per layer, copied in
    want = [torch.zeros_like(t) for t in layers]
    rows = torch.from_numpy(blocks.copy())[:, rank * shard:(rank + 1) * shard].contiguous().view(4, 3, layer_bytes)
    typed = [rows[:, i].contiguous().view(torch.bfloat16).view(4, *shape) for i in range(3)]
    scatter_blocks(want, typed, np.asarray(ids, dtype=np.int64), np.arange(4, dtype=np.int64))
    for got, exp in zip(layers, want):  # (as bits: random bytes make NaNs)
        assert torch.equal(got.contiguous().view(torch.int16), exp.contiguous().view(torch.int16))
        assert got[ids].view(torch.int16).any()


@pytest.mark.parametrize("staged", [True, False])
def test_scatter_sink_reports_a_failed_block(staged):
    """A block failing its checksum is False (the connector then reports it
    to vLLM, which recomputes it); only a staged layout also keeps its
    places untouched."""
    from kvstore.checksum import checksum

    origs = [torch.zeros(6, 2, 4, 8, dtype=torch.float16) for _ in range(2)]
    lb = 2 * 4 * 8 * 2
    place = scatter_layout(origs, origs, 0, lb, 2 * lb)
    assert place is not None and not place.staged  # vLLM's layouts load straight into the KV tensors
    place.staged = staged
    blocks = _stored_blocks(2, 2 * lb)
    sums = [checksum(b) for b in blocks]
    sums[1] ^= 1
    assert place.sink([1, 4]).write([0, 1], list(blocks), sums).tolist() == [True, False]
    assert all(o[1].any() for o in origs)
    if staged:
        assert not any(o[4].any() for o in origs)


def test_scatter_layout_declines_what_it_cannot_place():
    t = torch.zeros(4, 3, 8, dtype=torch.float32)
    assert scatter_layout([t[:, :, ::2]], [t[:, :, ::2]], 0, 48, 48) is None  # not contiguous
    o = torch.zeros(2, 3, 4, dtype=torch.float32)  # a block's elements strided apart: no rule covers it
    assert scatter_layout([o], [o.permute(2, 1, 0)], 0, 24, 24) is None
