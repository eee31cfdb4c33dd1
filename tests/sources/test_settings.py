"""Remote settings: checked, read from the environment, and public under the gpuload names."""

from __future__ import annotations

import pytest

import gpuload
import gpuload.sources.fetch
from gpuload import ConfigError, RemoteSettings
from gpuload.sources.settings import RemoteStats


def test_settings_are_checked_and_read_from_the_environment(monkeypatch):
    with pytest.raises(ConfigError, match="max_requests"):
        RemoteSettings(max_requests=0)
    with pytest.raises(ConfigError, match="unknown setting"):
        RemoteSettings.of({"retry": 3})
    monkeypatch.setenv("GPULOAD_REMOTE_RETRIES", "2")
    assert RemoteSettings().retries == 2
    monkeypatch.setenv("GPULOAD_REMOTE_RETRIES", "many")
    with pytest.raises(ConfigError, match="GPULOAD_REMOTE_RETRIES"):
        RemoteSettings()
    monkeypatch.delenv("GPULOAD_REMOTE_RETRIES")
    assert RemoteSettings().kept_listing_s == float("inf")
    monkeypatch.setenv("GPULOAD_REMOTE_KEPT_LISTING_S", "86400")
    assert RemoteSettings().kept_listing_s == 86400
    for bad in (float("nan"), -1):
        with pytest.raises(ConfigError, match="kept_listing_s"):
            RemoteSettings(kept_listing_s=bad)

def test_public_names_and_stats_text():
    assert gpuload.RemoteSettings is gpuload.sources.fetch.RemoteSettings is RemoteSettings
    assert gpuload.RemoteStats is gpuload.sources.fetch.RemoteStats is RemoteStats
    assert str(RemoteStats(0, 0, 0, 0, None, None, None)) == "no requests"
    assert str(RemoteStats(1200, 3_500_000, 2, 1, 0.0124, 0.05, 0.2)) == (
        "1,200 requests, 3.5 MB, latency p50/p90/p99 12/50/200 ms, 2 retried, 1 failed")
