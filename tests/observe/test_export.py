"""Live export: Prometheus metrics scraped over HTTP on loopback and parsed, equal to stats();
a Mix's sources labelled; the callback reporter; bad ports and a missing client refused."""

from __future__ import annotations

import threading
import urllib.request

import numpy as np
import pytest

import gpuload
from gpuload.observe import export

from conftest import open_dataset, write_parquet

prometheus = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    for name, base in (("a", 0), ("b", 10_000)):
        write_parquet(root / name / "p.parquet", {"row_id": np.arange(base, base + 900), "x": np.ones(900)},
                      row_group_size=100)
    return root


def _scrape(url: str) -> dict:
    """{(metric sample name, sorted label items): value} of one scrape."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_scrape_holds_what_stats_says(data, tmp_path):
    # prefetch=0: no next epoch's reads recorded between the scrape and stats()
    ds = open_dataset(data / "a", ["row_id", "x"], tmp_path / "c", batch_size=100, prefetch=0)
    with gpuload.serve_metrics(ds, port=0, labels={"run": "test"}) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/metrics")
        list(ds)
        ds.reader.cache.flush()  # the writer's last spans, recorded before the scrape
        got = _scrape(server.url)
        st = ds.stats()
    lab = (("rank", "0"), ("run", "test"), ("world_size", "1"))
    assert got[("gpuload_rows_total", lab)] == st.rows == 900
    assert got[("gpuload_batches_total", lab)] == st.batches == 9
    assert got[("gpuload_wait_fraction", lab)] == pytest.approx(st.starvation)
    assert got[("gpuload_chunks_total", tuple(sorted(lab + (("outcome", "decoded"),))))] == \
        ds.reader.counters.decoded > 0
    stages = {dict(k[1])["stage"]: v for k, v in got.items() if k[0] == "gpuload_stage_busy_seconds_total"}
    assert set(stages) == set(st.stages) - {"write_wait"} and stages["decode"] == pytest.approx(st.stages["decode"].seconds)
    with pytest.raises(OSError):  # closed: the port is free, nothing answers
        urllib.request.urlopen(server.url, timeout=2)


def test_a_mix_labels_each_source(data, tmp_path):
    srcs = {n: open_dataset(data / n, ["row_id", "x"], tmp_path / "c", batch_size=100) for n in "ab"}
    mix = gpuload.Mix(srcs, {"a": 1, "b": 1})
    list(mix)
    by_source = {s.labels.get("source"): s.value for s in export.samples(mix) if s.name == "gpuload_rows_total"}
    assert by_source[None] == mix.stats().rows == by_source["a"] + by_source["b"]
    assert by_source["a"] == by_source["b"] == 900
    with gpuload.serve_metrics(mix, port=0) as server:  # every sample of a family has the same label names
        got = _scrape(server.url)
    rows = {dict(k[1])["source"]: v for k, v in got.items() if k[0] == "gpuload_rows_total"}
    assert rows == {"": 1800, "a": 900, "b": 900}


def test_the_reporter_hands_the_same_samples_to_a_callback(data, tmp_path):
    ds = open_dataset(data / "a", ["row_id", "x"], tmp_path / "c", batch_size=100)
    got, called = [], threading.Event()

    def send(samples):
        got.append({s.name: s.value for s in samples if "stage" not in s.labels and "outcome" not in s.labels})
        called.set()

    reporter = gpuload.report_metrics(ds, send, every_s=0.05)
    assert called.wait(10)  # reports while training has not begun
    list(ds)
    reporter.close()  # one last report, after the epoch
    assert got[-1]["gpuload_rows_total"] == 900 and got[-1]["gpuload_passes_total"] == 1

    def broken(samples):
        raise RuntimeError("collector down")

    r = gpuload.report_metrics(ds, broken, every_s=10)
    r.close()
    assert [str(e) for e in r.errors] == ["collector down"]  # kept, never raised into training
    with pytest.raises(gpuload.ConfigError, match="every_s"):
        gpuload.report_metrics(ds, send, every_s=0)
    # a callback or a loader of another kind: refused at the call, not one error per report (or scrape)
    with pytest.raises(gpuload.ConfigError, match=r"report_metrics\(\): callback=5 must be a function"):
        gpuload.report_metrics(ds, 5)
    for fn in (lambda x: gpuload.report_metrics(x, send), lambda x: gpuload.serve_metrics(x, port=0)):
        with pytest.raises(gpuload.ConfigError, match=r"_metrics\(\) takes a loader with stats\(\) .*, not a str"):
            fn("data/clicks")


def test_a_port_in_use_is_refused_naming_the_setting(data, tmp_path):
    ds = open_dataset(data / "a", ["row_id", "x"], tmp_path / "c", batch_size=100)
    with gpuload.serve_metrics(ds, port=0) as first:
        port = int(first.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(gpuload.ConfigError, match=rf"127.0.0.1:{port}.*port="):
            gpuload.serve_metrics(ds, port=port)


def test_without_prometheus_client_serving_says_what_to_install(data, tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_prometheus(name, *a, **k):
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    ds = open_dataset(data / "a", ["row_id", "x"], tmp_path / "c", batch_size=100)
    with pytest.raises(gpuload.ConfigError, match=r"gpuload\[metrics\]"):
        gpuload.serve_metrics(ds, port=0)
    assert export.samples(ds)  # the figures themselves need nothing


def test_the_grafana_dashboard_asks_only_for_metrics_gpuload_exports(data, tmp_path):
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana" / "gpuload.json").read_text())
    asked = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"gpuload_\w+", t["expr"])}
    srcs = {n: open_dataset(data / n, ["row_id", "x"], tmp_path / "c", batch_size=100) for n in "ab"}
    mix = gpuload.Mix(srcs, {"a": 1, "b": 1}, prefetch=2)
    list(mix)
    names = {s.name for s in export.samples(mix)} | {m for m, _, _ in export._REMOTE}  # local sources: no remote
    assert asked and asked <= names, asked - names
    assert {s.name for s in export.samples(mix)} >= {"gpuload_queue_depth_mean", "gpuload_queue_empty_fraction"}


def test_waiting_for_the_cache_writer_is_not_exported_as_busy_time():
    """write_wait (loader threads held back by the writer) has a counter of its own: summing the
    stages' busy seconds must not count waiting as work."""
    import types

    from gpuload.observe.export import samples

    m = gpuload.Metrics(nvtx=False)
    m.record("decode", 0.0, 2.0)
    m.record("write_wait", 0.0, 0.5)
    got = {(s.name, s.labels.get("stage")): s.value for s in samples(types.SimpleNamespace(stats=m.stats))}
    assert got[("gpuload_stage_busy_seconds_total", "decode")] == 2.0
    assert ("gpuload_stage_busy_seconds_total", "write_wait") not in got
    assert got[("gpuload_write_wait_seconds_total", None)] == 0.5
