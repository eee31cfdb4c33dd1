"""The package itself: ``import gpuload`` and the ``gpuload`` command start without torch.

The public names are imported on first use (``gpuload/__init__.py``, PEP 562): ``__all__``,
``dir()`` and ``from gpuload import X`` are what they were when ``import gpuload`` imported
everything.
"""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gpuload


def test_every_public_name_imports_and_is_listed():
    for name in gpuload.__all__:
        namespace: dict = {}
        exec(f"from gpuload import {name}", namespace)
        assert namespace[name] is getattr(gpuload, name), name
    assert set(gpuload.__all__) <= set(dir(gpuload))
    # what `import gpuload` used to import, submodules included, is still there by name
    for name in ("batch", "build", "cache", "dataset", "decode", "errors", "gpu", "observe", "pipeline", "reader",
                 "sources"):
        assert name in dir(gpuload) and getattr(gpuload, name).__name__ == f"gpuload.{name}", name
    assert gpuload.diagnose.__module__ == "gpuload.observe.diagnose"  # the function, not its module
    assert gpuload.__version__ and "__version__" in gpuload.__all__


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        gpuload.no_such_thing  # noqa: B018
    assert not hasattr(gpuload, "__no_such_dunder__")
    with pytest.raises(ImportError):
        exec("from gpuload import no_such_thing", {})


def _fresh(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_import_gpuload_does_not_import_torch(tmp_path):
    """Nor does a cache build on the CPU (``gpuload cache build``, a Dask worker's): its import takes seconds."""
    pq.write_table(pa.table({"x": [1.5, 2.5], "n": [[1], [2, 3]]}), tmp_path / "a.parquet")
    r = _fresh("import sys, gpuload\n"
               "assert 'torch' not in sys.modules, 'import gpuload imported torch'\n"
               "gpuload.ConfigError, gpuload.__version__\n"  # the errors are there without torch too
               "assert 'torch' not in sys.modules\n"
               f"s = gpuload.build_cache({str(tmp_path / 'a.parquet')!r}, {str(tmp_path / 'c')!r}, "
               "columns={'x': 'x', 'n': 'n'}, dtypes={'x': 'float16'}, progress=False)\n"
               "assert s.built == 1, s\n"
               "assert 'torch' not in sys.modules, 'a cache build imported torch'\n"
               "gpuload.ParquetDataset\n"
               "assert 'torch' in sys.modules  # and it comes with what needs it\n")
    assert r.returncode == 0, r.stderr
    # submodules used as attributes after `import gpuload` alone, as when it imported them all
    r = _fresh("import gpuload\n"
               "gpuload.gpu.runtime.gpu_usable, gpuload.cache.store.ChunkCache, gpuload.observe.metrics.STAGES\n"
               "gpuload.sources.fetch.Fetcher, gpuload.decode.ArrowDecoder\n")
    assert r.returncode == 0, r.stderr
    r = _fresh("import sys\nfrom gpuload import errors, tools\nfrom gpuload.tools import cli\nassert 'torch' not in sys.modules\n")
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_the_command_starts_without_torch(tmp_path):
    """``gpuload --help`` (and importing gpuload.tools.cli) imports no torch: the command starts in a
    fraction of the time torch's import takes; nor does ``gpuload cache build`` on the CPU."""
    pq.write_table(pa.table({"x": [1.5, 2.5]}), tmp_path / "a.parquet")
    build = ["cache", "build", str(tmp_path / "a.parquet"), "--cache-dir", str(tmp_path / "c"), "--columns", "x"]
    r = _fresh("import sys\nfrom gpuload.tools.cli import main\n"
               "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
               "assert 'torch' not in sys.modules, 'gpuload --help imported torch'\n"
               f"assert main({build!r}) == 0\n"
               "assert 'torch' not in sys.modules, 'gpuload cache build imported torch'\n")
    assert r.returncode == 0, r.stderr
    assert "1 built" in r.stdout
    assert "usage: gpuload" in r.stdout
    # the real entry point, every module it imports listed by -X importtime
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "gpuload.tools.cli", "--help"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "usage: gpuload" in r.stdout, r.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "gpuload" in imported and "torch" not in imported  # (gpuload.tools.cli runs as __main__)


@pytest.mark.slow
def test_a_plain_dataset_opens_without_pyarrow_dataset(tmp_path):
    """Opening files with neither ``filters=`` nor Hive folders imports no ``pyarrow.dataset`` (which
    brings pandas: 0.1-0.2 s of every first open); a Hive folder or a filter still gets it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "hive" / "day=1").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "hive" / "day=1" / "a.parquet")
    pq.write_table(pa.table({"x": [4, 5]}), tmp_path / "b.parquet")
    code = ("import sys, gpuload, pyarrow.compute as pc\n"
            "kw = dict(batch_size=2, device='cpu', cache_dir=sys.argv[2])\n"
            "ds = gpuload.ParquetDataset(sys.argv[1] + '/b.parquet', ['x'], **kw)\n"
            "assert sum(len(b['x']) for b in ds) == 2\n"
            "got = [m for m in ('pyarrow.dataset', 'pandas') if m in sys.modules]\n"
            "assert not got, f'imported: {got}'  # pyarrow 25's to_pandas_dtype() imported pandas (the H200 node's, 2026-11-27)\n"
            "ds = gpuload.ParquetDataset(sys.argv[1] + '/b.parquet', ['x'], filters=pc.field('x') > 4, **kw)\n"
            "assert [int(v) for b in ds for v in b['x']] == [5] and 'pyarrow.dataset' in sys.modules\n")
    hive = ("import sys, gpuload\n"
            "ds = gpuload.ParquetDataset(sys.argv[1] + '/hive', ['x', 'day'], batch_size=8, device='cpu',"
            " cache_dir=sys.argv[2])\n"
            "assert [int(v) for b in ds for v in b['day']] == [1, 1, 1] and 'pyarrow.dataset' in sys.modules\n")
    for code in (code, hive):  # each in a fresh interpreter
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(tmp_path / "cache")], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
