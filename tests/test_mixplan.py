"""The mix plan (gpuload.mixplan): apportioning, epoch lengths under both exhaustion rules,
and the arrangement of sources, as properties over random weights and sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gpuload
from gpuload.mixplan import apportion, labels, plan_mix, rest_labels, rest_steps

weights_st = st.lists(st.floats(0.01, 10.0), min_size=1, max_size=5)


@given(st.integers(0, 10_000), weights_st)
def test_apportion_sums_and_stays_within_one_of_the_exact_share(total, weights):
    got = apportion(total, weights)
    assert sum(got) == total and all(g >= 0 for g in got)
    s = sum(weights)
    assert all(abs(g - total * w / s) < 1 for g, w in zip(got, weights))


def test_apportion_breaks_ties_toward_the_earlier_source():
    assert apportion(1, [1, 1]) == [1, 0]
    assert apportion(5, [0.5, 0.3, 0.2]) == [3, 1, 1]  # remainders 0.5, 0.5, 0: the first of the tied
    assert apportion(10, [0.5, 0.3, 0.2]) == [5, 3, 2]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_an_epoch_is_the_longest_no_source_runs_out_or_the_shortest_every_source_is_read(data):
    k = data.draw(st.integers(1, 4))
    sizes = data.draw(st.lists(st.integers(1, 60), min_size=k, max_size=k))
    weights = data.draw(st.lists(st.floats(0.05, 5.0), min_size=k, max_size=k))
    per_step = data.draw(st.integers(1, 6))
    names = [f"s{i}" for i in range(k)]
    try:
        end = plan_mix(names, sizes, weights, mode="proportion", per_step=per_step, exhausted="end")
    except gpuload.ConfigError as e:  # too few batches for one step: said so
        assert "no step" in str(e)
        assert any(c > r for c, r in zip(apportion(per_step, weights), sizes))  # not even one step fits
    else:
        assert end.counts == tuple(apportion(end.steps * per_step, weights))
        assert all(c <= r for c, r in zip(end.counts, sizes)) and end.passes == (1,) * k
        longer = apportion((end.steps + 1) * per_step, weights)
        assert any(c > r for c, r in zip(longer, sizes))  # one more step would run a source out
    rep = plan_mix(names, sizes, weights, mode="proportion", per_step=per_step, exhausted="repeat")
    assert all(c >= r for c, r in zip(rep.counts, sizes))
    if rep.steps > 1:
        shorter = apportion((rep.steps - 1) * per_step, weights)
        assert any(c < r for c, r in zip(shorter, sizes))  # one step fewer would leave a source unread
    assert rep.passes == tuple(-(-c // r) for c, r in zip(rep.counts, sizes))


def test_composition_takes_one_batch_of_each_per_step():
    p = plan_mix(["a", "b", "c"], [7, 3, 5], None, mode="composition", per_step=1, exhausted="end")
    assert (p.steps, p.per_step, p.counts) == (3, 3, (3, 3, 3))
    p = plan_mix(["a", "b", "c"], [7, 3, 5], None, mode="composition", per_step=1, exhausted="repeat")
    assert (p.steps, p.counts, p.passes) == (7, (7, 7, 7), (1, 3, 2))
    assert labels(p, "k", 0, 0).tolist() == [0, 1, 2] * 7


def test_fixed_steps_that_would_run_a_source_out_are_refused_with_the_most_that_fit():
    with pytest.raises(gpuload.ConfigError, match=r"steps_per_epoch=9 .* at most 5 steps"):
        plan_mix(["a", "b"], [10, 10], [1, 1], mode="proportion", per_step=4, exhausted="end", steps=9)
    p = plan_mix(["a", "b"], [10, 10], [1, 1], mode="proportion", per_step=4, exhausted="repeat", steps=9)
    assert p.counts == (18, 18) and p.passes == (2, 2)


def test_a_source_with_no_batch_is_refused_by_name():
    with pytest.raises(gpuload.ConfigError, match="'tiny' gives no batch"):
        plan_mix(["big", "tiny"], [10, 0], [1, 1], mode="proportion", per_step=1, exhausted="end")


@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(0, 2**31), st.integers(0, 50))
def test_labels_hold_exactly_the_counts_and_are_a_pure_function_of_seed_and_epoch(sizes, seed, epoch):
    weights = [float(s) for s in sizes]
    p = plan_mix([str(i) for i in range(len(sizes))], sizes, weights, mode="proportion", per_step=2,
                 exhausted="repeat")
    got = labels(p, "key", seed, epoch)
    assert np.bincount(got, minlength=len(sizes)).tolist() == list(p.counts)
    assert np.array_equal(got, labels(p, "key", seed, epoch))
    rest = rest_labels(p, weights, 5, "key", seed, epoch, run=1)
    assert np.bincount(rest, minlength=len(sizes)).tolist() == apportion(5 * 2, weights)
    assert np.array_equal(rest, rest_labels(p, weights, 5, "key", seed, epoch, run=1))


def test_epochs_and_seeds_arrange_sources_differently():
    p = plan_mix(["a", "b", "c"], [50, 50, 50], [1, 1, 1], mode="proportion", per_step=3, exhausted="end")
    seen = {labels(p, "key", s, e).tobytes() for s in range(3) for e in range(3)}
    assert len(seen) == 9


def test_a_rest_ends_by_the_epochs_own_rule_with_each_sources_exact_share():
    """The rest of an epoch resumed on other ranks holds each source's share of its steps by weight (to one
    batch), as a whole epoch does: a new user's trial saw 28 and 20 batches at equal weights (the steps were
    cut from a random arrangement, wherever the first-pass sources ran out)."""
    p = plan_mix(["a", "b"], [10, 4], [1, 1], mode="proportion", per_step=1, exhausted="repeat")
    n = rest_steps(p, [1, 1], [28, 9], [True, False], "repeat")  # a in its first pass needs 28: 55 steps
    assert n == 55 and np.bincount(rest_labels(p, [1, 1], n, "k", 0, 0, 1)).tolist() == [28, 27]  # ties: the first
    assert rest_steps(p, [1, 1], [3, 5], [True, True], "repeat") == 10  # b's 5 at equal weights
    assert rest_steps(p, [1, 1], [3, 3], [False, False], "repeat") == 0  # none in its first pass
    assert rest_steps(p, [1, 1], [3, 2], [True, True], "end") == 5  # a 6th step would take b's 3rd batch
    assert rest_steps(p, [3, 1], [9, 9], [True, True], "end") == 12  # a's 9 at three quarters
    q = plan_mix(["a", "b"], [10, 4], [1, 1], mode="proportion", per_step=2, exhausted="end")
    n = rest_steps(q, [1, 1], [6, 2], [True, True], "end")
    assert n == 2 and np.bincount(rest_labels(q, [1, 1], n, "k", 0, 0, 1)).tolist() == [2, 2]
    c = plan_mix(["a", "b"], [10, 4], None, mode="composition", per_step=1, exhausted="end")
    assert rest_steps(c, None, [7, 3], [True, True], "end") == 3
    assert rest_steps(c, None, [7, 3], [True, True], "repeat") == 7