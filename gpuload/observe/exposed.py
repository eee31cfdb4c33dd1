"""Exposed wait: what the loader was doing while the training thread waited, as pure functions.

The training thread's waits inside ``next()`` are the time prefetching did not hide. Each
stage span that overlaps a wait was work the step was waiting behind (or work that ran
beside it on another thread); :func:`exposed` sums, per stage, the time its spans overlap
the waits (over every thread that ran it, so two threads decoding during one wait count
twice), and the waiting during which no stage ran at all (``idle``: nothing was in flight,
so more prefetch or threads would have started work earlier). Vectorised: the waits become a
cumulative function ``W(t)`` (time waited before ``t``), and a span's overlap is
``W(t1) - W(t0)``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["exposed", "merge"]


def merge(t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals ``[t0, t1)`` as sorted disjoint intervals."""
    if not len(t0):
        return t0, t1
    order = np.argsort(t0, kind="stable")
    a, b = t0[order], t1[order]
    reach = np.maximum.accumulate(b)
    new = np.ones(len(a), bool)
    new[1:] = a[1:] > reach[:-1]
    starts = a[new]
    groups = np.cumsum(new) - 1
    ends = np.zeros(len(starts))
    np.maximum.at(ends, groups, b)
    return starts, ends


def _waited_before(a: np.ndarray, b: np.ndarray):
    """``W(t)``: time inside the disjoint sorted intervals ``[a, b)`` before ``t`` (vectorised)."""
    cum = np.concatenate([[0.0], np.cumsum(b - a)])

    def w(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(a, t, side="right") - 1
        inside = np.clip(t - a[np.maximum(k, 0)], 0.0, (b - a)[np.maximum(k, 0)])
        return np.where(k >= 0, cum[np.maximum(k, 0)] + inside, 0.0)

    return w


def exposed(wait_t0, wait_t1, stage, span_t0, span_t1, n_stages: int) -> tuple[np.ndarray, float]:
    """(seconds each of ``n_stages`` stages' spans overlapped the waits, seconds of waiting with no
    span running). Waits and spans are given as arrays of start and end times (any order)."""
    a, b = merge(np.asarray(wait_t0, float), np.asarray(wait_t1, float))
    per = np.zeros(n_stages)
    if not len(a):
        return per, 0.0
    w = _waited_before(a, b)
    s0, s1 = np.asarray(span_t0, float), np.asarray(span_t1, float)
    if len(s0):
        per = np.bincount(np.asarray(stage, int), weights=w(s1) - w(s0), minlength=n_stages)[:n_stages]
        u0, u1 = merge(s0, s1)
        covered = float((w(u1) - w(u0)).sum())
    else:
        covered = 0.0
    return per, max(0.0, float((b - a).sum()) - covered)
