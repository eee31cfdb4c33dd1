"""transform=: features computed once per chunk when it is cached, exact against the function
applied to pyarrow's table, keyed in the cache, refused clearly where its outputs change.

batch_transform: every batch transformed on the producer thread, with a generator that a
resumed epoch gives each batch again, and the user's errors named with the batch."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import gpuload
from gpuload.transforms import batch_seed

from conftest import dataset_factory, write_parquet

N, BATCH = 1000, 128
_ds = dataset_factory(["x", "w", "l"], batch_size=BATCH, chunk_bytes=4096)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("transforms")
    write_parquet(d / "a.parquet", {"x": np.arange(N), "w": np.arange(N) / 7.0,
                                    "l": pa.array([[i] * (i % 4) for i in range(N)], pa.list_(pa.int64()))},
                  row_group_size=100)
    return d / "a.parquet"


def augment(batch, g):
    """What users do each epoch: noise, a random mask, negative samples, a list's values dropped."""
    n = len(batch["x"])
    out = dict(batch)
    out["w"] = batch["w"] + torch.randn(n, generator=g, device=batch["w"].device)
    out["mask"] = torch.rand(n, generator=g, device=batch["x"].device) < 0.15
    out["negative"] = torch.randint(0, N, (n, 4), generator=g, device=batch["x"].device)
    keep = torch.rand(len(batch["l"].values), generator=g, device=batch["x"].device) < 0.5
    out["l_kept"] = batch["l"].values[keep]
    return out


def _plain(b: dict) -> dict:
    return {k: (v.values.clone(), v.offsets.clone()) if isinstance(v, gpuload.Ragged) else v.clone()
            for k, v in b.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1])) if isinstance(a[k], tuple)
        else torch.equal(a[k], b[k]) for k in a)


def test_every_batch_is_transformed_off_the_training_thread_with_its_own_generator(data, tmp_path):
    threads, seeds = [], []

    def fn(batch, g):
        threads.append(threading.current_thread().name)
        seeds.append(g.initial_seed())
        return augment(batch, g)

    ds = _ds(data, tmp_path / "c", batch_transform=fn)
    batches = [_plain(b) for b in ds]
    assert len(batches) == len(ds) == -(-N // BATCH) == len(threads)
    assert set(threads) == {"gpuload-producer"}
    assert len(set(seeds)) == len(seeds)  # a generator of its own per batch
    assert seeds == [batch_seed(ds.reader.fingerprint, 0, 0, 0, 0, i) for i in range(len(batches))]
    got = np.sort(np.concatenate([b["x"].numpy() for b in batches]))
    assert np.array_equal(got, np.arange(N))  # every row once: the transform sees each batch once
    for b in batches:  # the transform's outputs are what the consumer gets
        assert b["mask"].dtype == torch.bool and b["negative"].shape == (len(b["x"]), 4)
        assert not torch.equal(b["w"], b["x"] / 7.0)
    ds.set_epoch(0)
    assert all(_same(a, _plain(b)) for a, b in zip(batches, ds))  # the same (seed, epoch): the same batches
    ds.set_epoch(1)
    again = [_plain(b) for b in ds]
    assert not any(torch.equal(a["negative"], b["negative"]) for a, b in zip(batches, again))
    seeds.clear()
    list(_ds(data, tmp_path / "c", batch_transform=fn, seed=1))
    assert seeds == [batch_seed(ds.reader.fingerprint, 1, 0, 0, 0, i) for i in range(len(batches))]
    assert not set(seeds) & {batch_seed(ds.reader.fingerprint, 0, 0, 0, 0, i) for i in range(len(batches))}


@pytest.mark.parametrize("shuffle", [True, False, "block"])
def test_a_resumed_epoch_transforms_every_batch_as_an_uninterrupted_one(data, tmp_path, shuffle):
    """State taken after every batch of two epochs; each resumed run gives the rest bit for bit."""
    ds = _ds(data, tmp_path / "c", batch_transform=augment, shuffle=shuffle, block_rows=16)
    run, states = [], []
    for e in (0, 1):
        ds.set_epoch(e)
        states.append(ds.state_dict())
        for b in ds:
            run.append(_plain(b))
            states.append(ds.state_dict())
    per_epoch = len(run) // 2
    for i, state in enumerate(states):
        if i == per_epoch:  # the state at epoch 0's end resumes epoch 1 from its start: states[i + 1]'s twin
            continue
        resumed = _ds(data, tmp_path / "c", batch_transform=augment, shuffle=shuffle, block_rows=16)
        resumed.load_state_dict(state)
        got = []
        for e in range(state["epoch"], 2):
            resumed.set_epoch(e)
            got.extend(_plain(b) for b in resumed)
        start = i if i < per_epoch else i - 1
        want = run[start:]
        assert len(got) == len(want), (i, len(got), len(want))
        assert all(_same(a, b) for a, b in zip(got, want)), i


def test_two_ranks_draw_different_generators(data, tmp_path):
    seeds = {}

    def fn(rank):
        def f(batch, g):
            seeds.setdefault(rank, []).append(g.initial_seed())
            return batch
        return f

    for rank in (0, 1):
        ds = _ds(data, tmp_path / "c", rank=rank, world_size=2, batch_transform=fn(rank))
        assert sum(len(b["x"]) for b in ds) > 0
    assert len(seeds[0]) == len(seeds[1]) and not set(seeds[0]) & set(seeds[1])


def test_the_users_error_reaches_the_loop_naming_the_batch(data, tmp_path):
    def fails(batch, g):
        if int(batch["x"][0]) >= 0 and fails.calls == 2:
            raise ValueError("my feature broke")
        fails.calls += 1
        return batch

    fails.calls = 0
    ds = _ds(data, tmp_path / "c", batch_transform=fails, shuffle=False)
    with pytest.raises(ValueError, match="my feature broke") as e:
        list(ds)
    assert "gpuload: raised by batch_transform on batch 2 of epoch 0 (rank 0, run 0)" in e.value.__notes__
    assert len(list(_ds(data, tmp_path / "c", shuffle=False))) == len(ds)  # nothing cached was harmed


def test_a_transform_that_returns_no_dict_and_one_that_is_no_function_are_refused(data, tmp_path):
    ds = _ds(data, tmp_path / "c", batch_transform=lambda b, g: list(b.values()))
    with pytest.raises(gpuload.ConfigError, match=r"batch_transform returned list for batch 0 of epoch 0.*dict"):
        next(iter(ds))
    with pytest.raises(gpuload.ConfigError, match="batch_transform=3 must be a function"):
        _ds(data, tmp_path / "c", batch_transform=3)
    with pytest.raises(gpuload.ConfigError, match=r"batch_transform=<function .*lambda.* taking those two"):
        _ds(data, tmp_path / "c", batch_transform=lambda b: b)  # at open, not at the first batch


def test_functions_of_any_shape_that_take_the_arguments_are_accepted(data, tmp_path):
    """Defaults, *args, a callable object, functools.partial, a builtin whose signature is unknown."""
    import functools

    class Shift:
        def __call__(self, batch, generator):
            return batch

    def inject(f):  # a decorator that adds the generator (a review: signature() followed __wrapped__)
        @functools.wraps(f)
        def wrapper(batch, generator):
            return f(batch)
        return wrapper

    @inject
    def tf(batch):
        return batch

    for fn in (lambda b, g=None, h=1: b, lambda *a: a[0], Shift(), functools.partial(lambda k, b, g: b, 1), tf):
        assert _ds(data, tmp_path / "c", batch_transform=fn).batch_transform is fn
    with pytest.raises(gpuload.ConfigError, match="one argument"):
        gpuload.Transform(lambda a, b: a, "two-args")
    assert gpuload.Transform(lambda cols, extra=None: cols, "k").key == "k"


@pytest.mark.gpu
def test_on_a_gpu_the_transform_runs_on_the_batch_stream_and_its_tensors_stay_valid(data, tmp_path):
    """New tensors made on the batch stream are guarded for the consumer's: values hold while
    the consumer's stream is busy and allocates."""
    streams = []

    def fn(batch, g):
        streams.append(torch.cuda.current_stream().cuda_stream)
        out = dict(batch)
        out["y"] = batch["x"] * 3 + 1  # a new block on the batch stream
        return out

    ds = _ds(data, tmp_path / "c", device="cuda", batch_transform=fn)
    consumer = torch.cuda.current_stream().cuda_stream
    total = 0
    for b in ds:
        torch.cuda._sleep(20_000_000)  # the step: busy when the batch's blocks could be reused
        scratch = [torch.empty(1 << 20, device="cuda") for _ in range(4)]
        assert torch.equal(b["y"], b["x"] * 3 + 1)
        total += len(b["x"])
        del scratch
    assert total == N and consumer not in streams and len(set(streams)) == 1


def test_an_elastic_resume_is_a_new_run_with_generators_of_its_own(data, tmp_path):
    """2 ranks take 2 batches each; 1 rank goes on: run 1 of the epoch, its batches counted from 0."""
    states = []
    for rank in (0, 1):
        ds = _ds(data, tmp_path / "c", rank=rank, world_size=2, batch_transform=augment)
        it = iter(ds)
        next(it), next(it)
        states.append(ds.state_dict())
        it.close()
    seeds = []

    def fn(batch, g):
        seeds.append(g.initial_seed())
        return augment(batch, g)

    one = _ds(data, tmp_path / "c", rank=0, world_size=1, batch_transform=fn)
    one.load_state_dict(states[0])
    rows = sum(len(b["x"]) for b in one)
    assert rows == N - 4 * BATCH
    assert seeds == [batch_seed(one.reader.fingerprint, 0, 0, 1, 0, i) for i in range(len(seeds))]



# -- transform=: at cache time -----------------------------------------------------------------
EDGES = torch.tensor([10.0, 50.0, 100.0])


def features(o: dict) -> dict:
    """log1p and bucketize of a float, a cross of two ints, a bfloat16 copy, the list kept, one dropped."""
    return {"x": o["x"], "logw": torch.log1p(o["w"]).to(torch.float32),
            "bucket": torch.bucketize(o["w"], EDGES.to(o["w"].device)),  # the chunk's device: CPU or CUDA
            "cross": torch.stack([o["x"], o["x"] % 7], 1), "half": o["w"].to(torch.bfloat16), "l": o["l"],
            "l_plus": gpuload.Ragged(o["l"].values + 1, o["l"].offsets)}


def _columns(ds) -> dict:
    out = {}
    for b in ds:
        for k, v in b.items():
            out.setdefault(k, []).append((v.values, v.offsets) if isinstance(v, gpuload.Ragged) else v)
    return out


def test_cached_features_equal_the_function_on_pyarrows_table(data, tmp_path):
    t = gpuload.Transform(features, key="features-v1")
    ds = _ds(data, tmp_path / "c", transform=t, shuffle=False)
    assert ds.outputs == ["x", "logw", "bucket", "cross", "half", "l", "l_plus"]
    got = _columns(ds)
    table = pq.read_table(data)
    w = torch.from_numpy(table["w"].to_numpy())
    x = torch.from_numpy(table["x"].to_numpy())
    assert torch.equal(torch.cat(got["x"]), x)
    assert torch.equal(torch.cat(got["logw"]), torch.log1p(w).to(torch.float32))
    assert torch.equal(torch.cat(got["bucket"]), torch.bucketize(w, EDGES))
    assert torch.equal(torch.cat(got["cross"]), torch.stack([x, x % 7], 1))
    half = torch.cat(got["half"])
    assert half.dtype == torch.bfloat16 and torch.equal(half, w.to(torch.bfloat16))
    lists = table["l"].to_pylist()
    plus = [v.tolist() for vals, off in got["l_plus"] for v in np.split(vals.numpy(), off.numpy()[1:-1])]
    assert plus == [[e + 1 for e in row] for row in lists]
    assert ds.reader.counters.decoded == len(ds.reader.chunks)
    ds.set_epoch(1)  # later epochs read the cache: the function is not called again
    calls = []
    ds2 = _ds(data, tmp_path / "c", transform=gpuload.Transform(lambda o: calls.append(1) or features(o),
                                                                  key="features-v1"), shuffle=False)
    assert calls == [1]  # the 0-row probe at open, nothing else
    assert all(torch.equal(a, b) for a, b in zip(_columns(ds2)["logw"], got["logw"]))
    assert calls == [1] and ds2.reader.counters.decoded == 0


def test_a_new_key_rebuilds_and_the_same_key_reuses(data, tmp_path):
    ds = _ds(data, tmp_path / "c", transform=gpuload.Transform(features, key="v1"))
    list(ds)
    n = len(ds.reader.chunks)
    assert ds.reader.counters.decoded == n
    same = _ds(data, tmp_path / "c", transform=gpuload.Transform(features, key="v1"))
    list(same)
    assert same.reader.counters.decoded == 0 and same.reader.spec_hash == ds.reader.spec_hash
    other = _ds(data, tmp_path / "c", transform=gpuload.Transform(features, key="v2"))
    list(other)
    assert other.reader.counters.decoded == n and other.reader.spec_hash != ds.reader.spec_hash
    plain = _ds(data, tmp_path / "c")  # no transform: a cache of its own
    assert plain.reader.spec_hash not in (ds.reader.spec_hash, other.reader.spec_hash)


def test_build_cache_with_a_transform_leaves_nothing_to_decode(data, tmp_path):
    t = gpuload.Transform(features, key="v1")
    s = gpuload.build_cache(data, tmp_path / "c", ["x", "w", "l"], transform=t, chunk_bytes=4096)
    assert s.built == s.chunks and s.outputs == ("x", "logw", "bucket", "cross", "half", "l", "l_plus")
    ds = _ds(data, tmp_path / "c", transform=t, batch_size=BATCH)
    assert sum(len(b["x"]) for b in ds) == N and ds.reader.counters.decoded == 0


def test_cache_info_names_the_transform(data, tmp_path, capsys):
    from gpuload.tools.cli import main

    list(_ds(data, tmp_path / "c", transform=gpuload.Transform(features, key="features-v3")))
    capsys.readouterr()
    assert main(["cache", "info", "--cache-dir", str(tmp_path / "c")]) in (0, None)
    out = capsys.readouterr().out
    assert "logw (float32)" in out and "made by transform 'features-v3'" in out


@pytest.mark.parametrize("fn, match", [
    (lambda o: {"x": o["x"].to(torch.float64) if len(o["x"]) and int(o["x"][0]) >= 500 else o["x"]},
     r"a\.parquet \(row groups 5-\d+\): transform 'k' output 'x' is float64"),
    (lambda o: {"x": o["x"][:-1] if len(o["x"]) else o["x"]}, r"row groups 0-\d+\): transform 'k' output 'x'.*rows"),
    (lambda o: {"x": o["x"]} if len(o["x"]) == 0 else {"y": o["x"]}, r"returned outputs \['y'\], not \['x'\]"),
    (lambda o: {"x": o["x"][:, None] if len(o["x"]) else o["x"]}, r"output 'x' is int64 \(\d+, 1\)"),
])
def test_a_chunk_whose_outputs_differ_from_the_probe_is_refused_naming_it(data, tmp_path, fn, match):
    ds = _ds(data, tmp_path / "c", transform=gpuload.Transform(fn, key="k"), shuffle=False)
    with pytest.raises(gpuload.SchemaError, match=match):
        list(ds)
    assert sum(len(b["x"]) for b in _ds(data, tmp_path / "c", shuffle=False)) == N  # nothing else harmed


def test_bad_transforms_are_refused_at_open(data, tmp_path):
    with pytest.raises(gpuload.ConfigError, match="must be a gpuload.Transform"):
        _ds(data, tmp_path / "c", transform=features)
    with pytest.raises(gpuload.ConfigError, match="key=''"):
        gpuload.Transform(features, key="")
    with pytest.raises(IndexError) as e:  # the function's own error, on the probe, said so
        _ds(data, tmp_path / "c", transform=gpuload.Transform(lambda o: {"x": o["x"][0:1] * o["x"][0]}, key="k"))
    assert "gpuload: raised by transform 'k' on the 0-row probe at open (it must accept 0 rows)" in e.value.__notes__
    with pytest.raises(gpuload.ConfigError, match="output 'x' has 3 dimensions"):
        _ds(data, tmp_path / "c", transform=gpuload.Transform(lambda o: {"x": o["x"][:, None, None]}, key="k"))
    with pytest.raises(gpuload.ConfigError, match="output 'x' is a list"):
        _ds(data, tmp_path / "c", transform=gpuload.Transform(lambda o: {"x": []}, key="k"))
    with pytest.raises(gpuload.ConfigError, match="returned list"):
        _ds(data, tmp_path / "c", transform=gpuload.Transform(lambda o: [o["x"]], key="k"))


@pytest.mark.gpu
@pytest.mark.parametrize("decode", ["cpu", "auto"], ids=["pyarrow-decode", "auto-decode"])
def test_on_a_gpu_the_transformed_cache_holds_the_cpus_values(data, tmp_path, decode):
    t = gpuload.Transform(features, key="v1")
    cpu = _columns(_ds(data, tmp_path / "cpu", transform=t, shuffle=False))
    gpu = _columns(_ds(data, tmp_path / "gpu", transform=t, shuffle=False, device="cuda", decode=decode))
    for k in ("x", "logw", "bucket", "cross", "half"):
        assert torch.equal(torch.cat(cpu[k]), torch.cat(gpu[k]).cpu()), k


def test_chunks_are_sized_by_what_the_transform_makes(data, tmp_path):
    """A transform that makes 64 floats of each row: chunk_bytes bounds the cached chunk, not its input."""
    wide = gpuload.Transform(lambda o: {"x": o["x"], "emb": o["w"][:, None].expand(-1, 64).to(torch.float32)}, "wide")
    plain = _ds(data, tmp_path / "c", chunk_bytes=16_384)
    ds = _ds(data, tmp_path / "c", transform=wide, chunk_bytes=16_384)
    assert len(ds.reader.chunks) > len(plain.reader.chunks)
    assert ds.reader.max_chunk_bytes() <= 16_384 + 100 * (8 + 256)  # one row group over at most
    list(ds)
    biggest = max(p.stat().st_size for p in (tmp_path / "c").rglob("*.glc"))
    assert biggest < 2 * 16_384 + 100 * (8 + 256) + 4096


def test_outputs_come_in_the_probes_order_whatever_order_a_chunk_gives(data, tmp_path):
    def flip(o):
        out = {"a": o["x"], "b": o["x"] * 2}
        return out if len(o["x"]) == 0 or int(o["x"][0]) % 200 else dict(reversed(list(out.items())))

    ds = _ds(data, tmp_path / "c", transform=gpuload.Transform(flip, "flip"), shuffle=False, layout="columns")
    assert all(list(b) == ["a", "b"] and torch.equal(b["b"], b["a"] * 2) for b in ds)


def test_notes_reach_the_error_on_every_python():
    from gpuload.transforms import note

    class Old(Exception):  # Python 3.10's exceptions have no add_note
        add_note = property(lambda self: (_ for _ in ()).throw(AttributeError("add_note")))

    for e in (ValueError("x"), Old("y")):
        note(e, "first")
        note(e, "second")
        assert e.__notes__ == ["first", "second"]


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_dataset_with_a_transform_resumes_from_its_own_state(data, tmp_path, shuffle):
    """A user's trial: state_dict() recorded no columns for a transform's outputs, and
    load_state_dict refused gpuload's own state; their columns are those the transform is given."""
    t = gpuload.Transform(features, key="features-v1")
    ds = _ds(data, tmp_path / "c", transform=t, shuffle=shuffle, seed=3)
    seen = []
    for i, b in enumerate(ds):
        seen += b["x"].tolist()
        if i == 2:
            break
    state = ds.state_dict()
    assert set(state["dataset"]["outputs"]["logw"]) == {"x", "w", "l"}
    again = _ds(data, tmp_path / "c", transform=t, shuffle=shuffle, seed=3)
    again.load_state_dict(state)
    seen += [v for b in again for v in b["x"].tolist()]
    assert sorted(seen) == list(range(N))
    other = _ds(data, tmp_path / "c", transform=gpuload.Transform(lambda o: {"x": o["x"]}, key="x-only"),
                columns=["x"], shuffle=shuffle, seed=3)
    with pytest.raises(gpuload.ConfigError, match="outputs: the columns differ"):
        other.load_state_dict(state)
