"""Node-affine sharding: each chunk on one node, balanced, every row at most once (property-based)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuload
from gpuload import nodeplan, plan


@settings(max_examples=200, deadline=None)
@given(chunk_rows=st.lists(st.integers(1, 500), min_size=1, max_size=40), nodes=st.integers(1, 6),
       local=st.integers(1, 4), bs=st.integers(1, 64), drop_last=st.booleans(), seed=st.integers(0, 99),
       epoch=st.integers(0, 5))
def test_node_shares_partition_chunks_and_deliver_each_row_at_most_once(chunk_rows, nodes, local, bs, drop_last,
                                                                         seed, epoch):
    try:
        owned, per, undelivered = nodeplan.node_shares(chunk_rows, nodes, local, bs, drop_last, fingerprint=7, seed=seed)
    except gpuload.ConfigError:
        totals = [sum(chunk_rows[c] for c in o) for o in nodeplan.node_chunks(chunk_rows, nodes, fingerprint=7,
                                                                               seed=seed)]
        assert min(totals) // local < (bs if drop_last else 1)
        return
    assert sorted(int(c) for o in owned for c in o) == list(range(len(chunk_rows)))  # each chunk on one node
    totals = [sum(chunk_rows[c] for c in o) for o in owned]
    assert max(totals) - min(totals) <= max(chunk_rows)  # balanced by rows, within one chunk
    assert per >= 1 and (not drop_last or per % bs == 0)
    rows_seen = []
    for node in range(nodes):
        assert undelivered[node] == totals[node] - local * per
        assert undelivered[node] < max(chunk_rows) + local + (local * bs if drop_last else 0)
        for lr in range(local):
            segs = nodeplan.node_segments(chunk_rows, owned[node], node=node, local_rank=lr, per_rank=per,
                                          fingerprint=7, seed=seed, epoch=epoch, shuffle=True)
            assert sum(s.hi - s.lo for s in segs) == per  # every rank the same rows, so the same batches
            assert {s.chunk for s in segs} <= set(owned[node].tolist())  # only its node's chunks
            rows_seen += [(s.chunk, i) for s in segs for i in range(s.lo, s.hi)]
    assert len(rows_seen) == len(set(rows_seen)) == nodes * local * per
    sizes = plan.even_batch_sizes(per, bs)
    assert sum(sizes) == per and all(0 < b <= bs for b in sizes)


def test_node_chunks_are_fixed_across_epochs_and_change_with_seed():
    rows = [100] * 20
    a = nodeplan.node_chunks(rows, 3, fingerprint=1, seed=0)
    assert [o.tolist() for o in a] == [o.tolist() for o in nodeplan.node_chunks(rows, 3, fingerprint=1, seed=0)]
    assert [o.tolist() for o in a] != [o.tolist() for o in nodeplan.node_chunks(rows, 3, fingerprint=1, seed=1)]
    owned, per, _ = nodeplan.node_shares(rows, 3, 2, 8, False, fingerprint=1, seed=0)
    firsts = {tuple(s.chunk for s in nodeplan.node_segments(rows, owned[0], node=0, local_rank=0, per_rank=per,
                                                             fingerprint=1, seed=0, epoch=e, shuffle=True))
              for e in range(6)}
    assert len(firsts) > 1  # the node's chunk order changes with the epoch


def test_node_shares_refuse_a_rank_without_rows():
    with pytest.raises(gpuload.ConfigError, match="shard='node'.*too few"):
        nodeplan.node_shares([10, 10], 4, 1, 8, False, fingerprint=1, seed=0)
