"""Read-ahead of remote chunks (gpuload/sources/readahead.py): each chunk fetched ahead once."""

from __future__ import annotations

from types import SimpleNamespace

from gpuload.sources.readahead import ReadAhead
from gpuload.sources.settings import RemoteSettings


class _Job:
    nbytes = 1000

    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


def test_a_chunk_warmed_twice_at_once_is_fetched_once_and_counted_once():
    """A reviewer's note: two warms of one chunk that both pass the check each started a fetch, the second
    replacing the first, whose bytes then held the read-ahead budget until the epoch's end."""
    ra = ReadAhead(RemoteSettings(readahead_bytes=10**6))
    jobs = []

    def start(*args, **kwargs):
        jobs.append(_Job())
        return jobs[-1]

    ra._start = start
    chunk = SimpleNamespace(file=0, rg_start=0, rg_stop=2)
    nested = []

    def cached():  # between the outer call's check and its fetch, another thread warms the same chunk
        if not nested:
            nested.append(ra.warm(None, chunk, [0], False, lambda: False))
        return False

    assert ra.warm(None, chunk, [0], False, cached) and nested == [True]
    assert len(jobs) == 2 and [j.cancelled for j in jobs] == [False, True]
    assert ra._ahead_bytes == 1000 and ra._take((0, 0, 2)) is jobs[0] and ra._ahead_bytes == 0
