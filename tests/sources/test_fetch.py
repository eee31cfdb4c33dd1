"""The fetcher: the bytes-in-flight bound, request order, version checks, retries and their classification."""

from __future__ import annotations

import threading
import time

import pytest

from gpuload import RemoteSettings, SourceError
from gpuload.sources.fetch import Fetcher
from gpuload.sources.retry import retry, transient


class _Store:
    """A store whose reads take ``delay`` seconds and record how many bytes are in flight."""

    def __init__(self, delay=0.01, fail=None):
        self.delay, self.fail, self.lock = delay, fail, threading.Lock()
        self.inflight = self.most = self.calls = 0

    def url(self, path):
        return f"mem://{path}"

    def read(self, path, start, end, timeout=None, stop=None):
        with self.lock:
            self.calls += 1
            self.inflight += end - start
            self.most = max(self.most, self.inflight)
            fail = self.fail(self.calls) if self.fail else None
        try:
            time.sleep(self.delay)
            if fail:
                raise fail
            return bytes(end - start)
        finally:
            with self.lock:
                self.inflight -= end - start

    def close(self):
        pass


def test_bytes_in_flight_stay_under_the_bound_with_many_requests():
    store = _Store()
    f = Fetcher(store, RemoteSettings(max_requests=16, max_inflight_bytes=4000, coalesce_bytes=0,
                                      max_range_bytes=1000))
    jobs = [f.start("k", [(i * 10_000, i * 10_000 + 3000)]) for i in range(10)]
    for j in jobs:
        parts = j.result()
        assert [len(v) for v in parts.values()] == [3000]  # split requests joined again
    assert 1000 < store.most <= 4000
    assert f.stats().requests == 30 and f.stats().bytes == 30_000
    f.close()


def test_a_request_of_an_interrupted_epoch_waiting_for_bytes_is_never_made_after_a_resume():
    """A reviewer's note: resume() makes a new stop event, and a request of the interrupted epoch still
    waiting for the byte budget then passed the check and went to the store."""
    store = _Store(delay=0)
    f = Fetcher(store, RemoteSettings(max_inflight_bytes=1000, coalesce_bytes=0, max_range_bytes=1000))
    held = f._budget.acquire(1000)  # the budget spent: the job's request waits for it
    job = f.start("old", [(0, 500)])
    time.sleep(0.2)
    f.interrupt()
    f.resume()
    f._budget.release(held)
    with pytest.raises(SourceError, match="not fetched"):
        job.result()
    assert store.calls == 0
    assert f.get("new", 0, 10) == bytes(10) and store.calls == 1  # the new epoch's requests are made
    f.close()


def test_transient_errors_are_retried_and_permanent_ones_are_not():
    store = _Store(delay=0, fail=lambda n: ConnectionResetError("reset by peer") if n < 3 else None)
    f = Fetcher(store, RemoteSettings(retries=5, backoff_s=0.001))
    assert f.get("k", 0, 10) == bytes(10) and f.stats().retried == 2
    store = _Store(delay=0, fail=lambda n: FileNotFoundError("gone"))
    f = Fetcher(store, RemoteSettings(retries=5, backoff_s=0.001))
    with pytest.raises(SourceError, match=r"mem://k \(bytes 0-9\): FileNotFoundError.*list the source anew"):
        f.get("k", 0, 10)
    assert store.calls == 1
    store = _Store(delay=0, fail=lambda n: TimeoutError("stalled"))
    f = Fetcher(store, RemoteSettings(retries=2, backoff_s=0.001))
    with pytest.raises(SourceError, match=r"bytes 5-9\): failed 3 times, last with TimeoutError"):
        f.get("k", 5, 10)
    assert f.stats().failed == 1


class _Status(Exception):
    def __init__(self, status):
        super().__init__(f"status {status}")
        self.status = status


def _wrapped(cause: BaseException, kind=OSError) -> OSError:
    try:
        raise kind("the store said no") from cause
    except OSError as e:
        return e


@pytest.mark.parametrize("err, expected", [(_Status(503), True), (_Status(429), True), (_Status(500), True),
                                           (_Status(404), False), (_Status(403), False), (_Status(507), True),
                                           (_Status(501), False), (_Status(505), False),  # said whenever asked
                                           (OSError(5, "Input/output error"), False),
                                           (OSError("SlowDown: please reduce your request rate"), True),
                                           (PermissionError("denied"), False), (ValueError("bad"), False),
                                           (OSError(16, "Please reduce your request rate."), True),  # s3fs SlowDown
                                           (_wrapped(_Status(503)), True), (_wrapped(_Status(403)), False),
                                           (type("NoCredentialsError", (Exception,), {})("none"), False),
                                           (type("EndpointConnectionError", (Exception,), {})("x"), True),
                                           # fsspec's HTTP store: FileNotFoundError(url) from whatever failed
                                           (_wrapped(ConnectionRefusedError(111, "refused"), FileNotFoundError), True),
                                           (_wrapped(type("ClientConnectorError", (OSError,), {})("x"),
                                                     FileNotFoundError), True),
                                           (_wrapped(_Status(404), FileNotFoundError), False),
                                           (FileNotFoundError("gone"), False)])
def test_transient_classification(err, expected):
    assert transient(err) is expected


def test_backoff_grows_and_is_jittered(monkeypatch):
    sleeps = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    with pytest.raises(SourceError):
        retry(lambda: (_ for _ in ()).throw(_Status(503)), "x", RemoteSettings(retries=6, backoff_s=0.1,
                                                                               max_backoff_s=1.0))
    assert len(sleeps) == 6
    caps = [min(1.0, 0.1 * 2 ** k) for k in range(6)]
    assert all(0 <= s <= c for s, c in zip(sleeps, caps)) and len(set(sleeps)) > 1
    import random

    random.seed(7)
    want = [random.random() for _ in range(3)]
    random.seed(7)
    with pytest.raises(SourceError):  # the jitter has a generator of its own: the script's sequence is its own
        retry(lambda: (_ for _ in ()).throw(_Status(503)), "x", RemoteSettings(retries=2, backoff_s=0.1))
    assert [random.random() for _ in range(3)] == want


def test_a_fetchs_version_check_runs_before_later_fetches_requests():
    """Read-ahead must not delay the chunk being decoded: requests run in the order their
    fetches started, and a fetch's version check jumps ahead of later fetches' ranges."""
    order = []

    class Recording(_Store):
        def read(self, path, start, end, timeout=None, stop=None):
            order.append(("get", path))
            return bytes(end - start)

    f = Fetcher(Recording(delay=0), RemoteSettings(max_requests=1, coalesce_bytes=0))
    gate = threading.Event()
    blocker = f.start("blocker", [(0, 1)], check=lambda: gate.wait(5) and order.append(("check", "blocker")))
    jobs = [f.start(name, [(0, 10), (100, 110)], check=lambda n=name: order.append(("check", n)))
            for name in ("a", "b", "c")]
    gate.set()
    blocker.result()
    for j in jobs:
        j.result()
    assert order == [("get", "blocker"), ("check", "blocker"), ("get", "a"), ("get", "a"), ("check", "a"),
                     ("get", "b"), ("get", "b"), ("check", "b"), ("get", "c"), ("get", "c"), ("check", "c")]
    f.close()


def test_a_fetch_a_decoder_waits_on_goes_before_the_read_ahead():
    """Chunks fetched ahead are queued first; the chunk a loader thread then decodes (its fetch not
    started ahead) must not wait behind them all (a user's trial: nothing arrived for 11 s of a
    first epoch while the read-ahead of three files went first)."""
    order = []

    class Recording(_Store):
        def read(self, path, start, end, timeout=None, stop=None):
            order.append(path)
            return bytes(end - start)

    f = Fetcher(Recording(delay=0), RemoteSettings(max_requests=1, coalesce_bytes=0))
    gate = threading.Event()
    blocker = f.start("blocker", [(0, 1)], check=lambda: gate.wait(5))
    ahead = [f.start(f"ahead-{i}", [(0, 10)]) for i in range(3)]
    now = [f.start(f"now-{i}", [(0, 10)], urgent=True) for i in range(2)]
    gate.set()
    for j in [blocker, *ahead, *now]:
        j.result()
    assert order == ["blocker", "now-0", "now-1", "ahead-0", "ahead-1", "ahead-2"]
    f.close()


def test_a_failed_version_check_fails_the_fetch_with_its_message():
    f = Fetcher(_Store(delay=0), RemoteSettings(retries=0))

    def changed():
        raise SourceError("mem://k changed after the dataset was opened")

    with pytest.raises(SourceError, match="changed after the dataset was opened"):
        f.start("k", [(0, 10)], check=changed).result()
    f.close()
