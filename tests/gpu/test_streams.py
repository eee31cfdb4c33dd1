"""The loader's two streams: which work runs where, the events between them, the memory guards.

On any machine, with stand-ins that record calls (torch's stream and event calls, CuPy's
device and stream objects): the logic of :mod:`gpuload.gpu.streams` and of the pipeline's
:class:`~gpuload.pipeline.Stages` hooks. On a GPU (``gpu`` marker), the point itself: the
loader never waits for the training step's kernels.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import types

import numpy as np
import pytest
import torch

from gpuload.batch import Ragged
from gpuload.gpu import streams
from gpuload.handoff import DlpackHandoff
from gpuload.pipeline import Stages, epoch_batches
from gpuload.plan import Segment

from conftest import write_parquet


class FakeStream:
    """A torch stream stand-in: records the calls made on it into a shared log."""

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.cuda_stream = id(self)

    def wait_event(self, event):
        self.log.append((self.name, "wait_event", event.name))

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))

    def synchronize(self):
        self.log.append((self.name, "synchronize"))

    def __repr__(self):
        return self.name


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda.Stream / Event / current_stream as recorders, and a CuPy whose streams note the
    device current when they were made. Returns (log, cupy devices entered)."""
    log: list = []
    made = iter(["read", "batch", "extra"])
    devices: list = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda index: FakeStream(next(made), log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: FakeStream("consumer", log))
    count = iter(range(1000))

    class Event:
        def __init__(self):
            self.name = f"e{next(count)}"

        def record(self, stream):
            log.append((stream.name, "record", self.name))

        def synchronize(self):
            log.append(("host", "event.synchronize", self.name))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    cp = types.ModuleType("cupy")

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            devices.append(self.index)

        def __exit__(self, *exc):
            devices.append(None)

    class Stream:
        @staticmethod
        def from_external(s):
            return ("cupy", s.name, devices[-1] if devices else None)  # the device current at its creation

    cp.cuda = types.SimpleNamespace(Device=Device, Stream=Stream)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(streams, "torch_uses_rmm", lambda: False)
    FakeStream.__cuda_stream__ = lambda self: (0, self.cuda_stream)
    return log, devices


def test_cupy_streams_are_made_inside_the_device(fake_cuda):
    log, devices = fake_cuda
    ctx = streams.DeviceContext(torch.device("cuda", 1))
    assert ctx.read_stream.name == "read" and ctx.batch_stream.name == "batch"
    assert ctx._cp[ctx.read_stream] == ("cupy", "read", 1) and ctx._cp[ctx.batch_stream] == ("cupy", "batch", 1)
    assert devices == [1, None]  # entered for the CuPy streams, and left


def test_a_chunk_crosses_with_its_event(fake_cuda):
    log, _ = fake_cuda
    ctx = streams.DeviceContext(torch.device("cuda", 0))
    item = ctx.handover({"x": "cols"})
    assert log == [("read", "record", "e0")]  # recorded on the read stream, after the chunk's work
    assert ctx.receive(item) == {"x": "cols"}
    assert log[-1] == ("batch", "wait_event", "e0")  # the batch stream waits, the host does not


def test_host_waits_wait_for_an_event_not_the_stream(fake_cuda):
    log, _ = fake_cuda
    ctx = streams.DeviceContext(torch.device("cuda", 0))
    ctx.read_done()
    assert log == [("read", "record", "e0"), ("host", "event.synchronize", "e0")]
    assert not [c for c in log if c[1] == "synchronize"]


def test_readers_of_each_stream(fake_cuda):
    ctx = streams.DeviceContext(torch.device("cuda", 0))
    assert [s.name for s in ctx.readers(ctx.read_stream)] == ["batch", "consumer"]
    assert [s.name for s in ctx.readers(ctx.batch_stream)] == ["consumer"]


def test_batches_are_ready_after_the_batch_stream(fake_cuda, monkeypatch):
    log, _ = fake_cuda
    ctx = streams.DeviceContext(torch.device("cuda", 0))
    out, event = DlpackHandoff(ctx)({"x": np.arange(4)})
    assert torch.equal(out["x"], torch.arange(4)) and log[-1] == ("batch", "record", event.name)


class _Tensor:
    def __init__(self):
        self.recorded = []

    def record_stream(self, s):
        self.recorded.append(s.name)


def test_guard_with_torch_allocator_records_every_reader():
    log: list = []
    t = _Tensor()
    owner = streams.guard(t, FakeStream("read", log), [FakeStream("batch", log), FakeStream("consumer", log)], False)
    assert owner is t and t.recorded == ["batch", "consumer"] and log == []


def test_guard_with_rmm_waits_for_every_reader_before_the_free():
    log: list = []
    t = _Tensor()
    owner = streams.guard(t, FakeStream("read", log), [FakeStream("batch", log), FakeStream("consumer", log)], True)
    assert t.recorded == [] and log == []
    del owner  # the last view of the block went: the allocating stream waits, then RMM frees in its order
    assert log == [("read", "wait_stream", "batch"), ("read", "wait_stream", "consumer")]


# -- the pipeline's hooks: loads on loader threads, chunks received before their first use --------
class RecordingStages(Stages):
    """Stages that note, per thread, where it is and what it did."""

    def __init__(self):
        self.log: list = []
        self.where = threading.local()
        self.lock = threading.Lock()

    def _note(self, *what):
        with self.lock:
            self.log.append((threading.current_thread().name, getattr(self.where, "side", None)) + what)

    @contextlib.contextmanager
    def _side(self, side):
        outer = getattr(self.where, "side", None)
        self.where.side = side
        try:
            yield
        finally:
            self.where.side = outer

    def reading(self):
        return self._side("reading")

    def batching(self):
        return self._side("batching")

    def handover(self, cols):
        self._note("handover", int(np.asarray(cols["x"])[0]))
        return ("sealed", cols)

    def receive(self, item):
        tag, cols = item
        assert tag == "sealed"  # nothing used a chunk before receiving it
        self._note("receive", int(np.asarray(cols["x"])[0]))
        return cols


@pytest.mark.parametrize("shuffle", [False, True])
def test_chunks_cross_from_the_loader_threads_to_the_batching_threads(shuffle):
    sizes = [3] * 20
    chunks = [{"x": np.arange(i * 10, i * 10 + 10), "r": Ragged(np.arange(20), np.arange(0, 21, 2))}
              for i in range(6)]
    windows = [[Segment(0, 0, 10), Segment(1, 0, 10)], [Segment(2, 0, 10), Segment(3, 0, 10)],
               [Segment(4, 0, 10), Segment(5, 0, 10)]]
    perm = (lambda w, n: np.random.default_rng(w).permutation(n)) if shuffle else None
    stages = RecordingStages()

    def load(i):
        stages._note("load", i * 10)
        return chunks[i]

    def handoff(cols):
        stages._note("handoff")
        return cols

    got = list(epoch_batches(windows, sizes, load, perm, handoff, threads=2, prefetch=1,
                             stop=threading.Event(), stages=stages))
    assert np.array_equal(np.sort(np.concatenate([b["x"] for b in got])), np.arange(60))
    for name, side, what, *_ in stages.log:
        if what in ("load", "handover"):
            assert name.startswith("gpuload-load") and side == "reading", (name, side, what)
        else:  # receive on the window thread, handoff on the producer (the test's thread here)
            assert side == "batching" and not name.startswith("gpuload-load"), (name, side, what)
    for first in range(0, 60, 10):
        steps = [(s[2]) for s in stages.log if s[2] in ("load", "handover", "receive") and s[3] == first]
        assert steps == ["load", "handover", "receive"]


@pytest.mark.gpu
def test_copies_for_the_cache_writer_are_exact_and_pinned():
    """What the cache writer gets from the device: the values, dtypes and shapes of each
    array (a strided view, no rows, a list column), in pinned memory, after the host wait."""
    import cupy

    ctx = streams.DeviceContext(torch.device("cuda", 0))
    rng = np.random.default_rng(3)
    host = {"d": rng.random((1000, 13), dtype=np.float32), "b": rng.integers(0, 2, 1000).astype(bool),
            "r": Ragged(rng.integers(0, 99, 4000), np.arange(0, 4001, 4)), "e": np.zeros((0, 3), np.int8)}
    with ctx.reading():
        dev = {k: Ragged(cupy.asarray(v.values), cupy.asarray(v.offsets)) if isinstance(v, Ragged)
               else cupy.asarray(v) for k, v in host.items()}
        dev["s"] = dev["d"][:, ::2]  # a strided view: made contiguous on the read stream first
        torch.cuda._sleep(50_000_000)  # queued before the copies: to_host must wait for it
        got = ctx.to_host(dev)
    host["s"] = host["d"][:, ::2]
    for k, v in host.items():
        g = got[k]
        for want, out in ((v.values, g.values), (v.offsets, g.offsets)) if isinstance(v, Ragged) else ((v, g),):
            assert isinstance(out, np.ndarray) and out.dtype == want.dtype and out.shape == want.shape
            assert np.array_equal(out, want), k
            if out.nbytes:
                assert torch.from_numpy(out).is_pinned(), k


def test_gpu_decoder_waits_for_its_chunk_not_the_stream(monkeypatch, tmp_path):
    """GpuDecoder times decode and conversion with events on the read stream (ctx.read_done),
    never stream.synchronize() (which would wait for other threads' later reads)."""
    from gpuload.gpu import cudf_decode
    from gpuload.gpu.decoder import GpuDecoder
    from gpuload.config import Options, Source
    from gpuload.reader import open_reader

    path = write_parquet(tmp_path / "x.parquet", {"x": np.arange(10, dtype=np.int64)})
    reader = open_reader(Source(path), Options(device="cpu", cache_dir=tmp_path / "c"))
    calls = []
    ctx = types.SimpleNamespace(decode_stream=lambda: "stream", read_done=lambda: calls.append("read_done"))
    monkeypatch.setattr(cudf_decode, "read_row_groups", lambda *a, stream: calls.append(("read", stream)) or {})
    monkeypatch.setattr(cudf_decode, "columns_to_set", lambda *a: {"x": np.arange(10)})
    out = GpuDecoder(ctx)(reader.files[0], reader.chunks[0], reader.specs)
    assert calls == [("read", "stream"), "read_done", "read_done"] and out["x"].tolist() == list(range(10))


# -- on a GPU: the loader does not wait for the training step --------------------------------------
_SLOW_STEP = textwrap.dedent("""
    import sys, time, numpy as np, torch, gpuload
    data, cache, decode, shuffle = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    kw = dict(batch_size=10_000, chunk_bytes=1 << 18, shuffle=shuffle, prefetch=1, shuffle_window=2)
    if decode == "warm":
        gpuload.build_cache(data, cache, chunk_bytes=1 << 18, device="cpu")
        decode = "cpu"
    ds = gpuload.ParquetDataset(data, device="cuda", decode=decode, cache_dir=cache, **kw)
    it = iter(ds)
    first = next(it)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(4_000_000_000)  # the training step: about 2 s of one kernel on the consumer's stream
    end.record()
    t0 = time.perf_counter()
    rest = [b["x"] for b in it]  # every later batch: loaded, cut and handed off meanwhile
    host = time.perf_counter() - t0
    finished = end.query()  # the step, when the last batch was out
    torch.cuda.synchronize()
    step = start.elapsed_time(end) / 1000
    got = torch.cat([first["x"]] + rest).cpu().numpy()
    assert np.array_equal(np.sort(got), np.arange(len(got))), "rows"
    print(f"host {host:.3f} s, step {step:.3f} s, step finished before the last batch was out: {finished}")
    assert step > 1.0 and host < step / 2 and not finished, (host, step, finished)
    print("ok")
""")


@pytest.mark.slow  # a process of its own
@pytest.mark.gpu
@pytest.mark.parametrize("decode", ["warm", "cpu", "gpu"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_loader_never_waits_for_the_training_step(tmp_path, decode, shuffle):
    """A 2 s kernel on the consumer's stream right after the first batch: the rest of the epoch
    (cache reads, uploads or cuDF decoding of about 12 chunks, windows, gathers, hand-off: 39
    batches; prefetch=1, so most of that work starts after the kernel) comes out
    while it still runs. Anything on the legacy default stream, a cudaFree, a device-wide
    synchronisation or a cuFile read without GDS would make the host wait for the kernel."""
    if decode == "gpu":
        pytest.importorskip("pylibcudf")
    n = 400_000
    path = write_parquet(tmp_path / "x.parquet", {"x": np.arange(n, dtype=np.int64)}, row_group_size=10_000)
    pythonpath = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _SLOW_STEP, str(path), str(tmp_path / "c"), decode, str(int(shuffle))],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": pythonpath})
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr[-4000:]
