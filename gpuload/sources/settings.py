"""Remote settings: how remote sources are read, and what the requests to a store did.

:class:`RemoteSettings` bounds and paces the requests (:mod:`gpuload.sources.fetch`)
and sets their retries (:mod:`gpuload.sources.retry`); each of its defaults that an
operator may want to change without touching code comes from an environment variable,
read when the settings are made. :class:`RemoteStats` counts a fetcher's requests.
Both are public as ``gpuload.RemoteSettings`` and ``gpuload.RemoteStats``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from ..errors import ConfigError

__all__ = ["RemoteSettings", "RemoteStats"]


def _env(name: str, default, kind):
    """``$name`` read as ``kind`` (int or float), ``default`` when unset or blank; a
    :class:`ConfigError` when it is not a ``kind``."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"${name}={text!r} must be a {kind.__name__}") from None


@dataclass(frozen=True)
class RemoteSettings:
    """How remote sources are read; each default comes from an environment variable.

    Attributes
    ----------
    max_requests : requests in flight at once (``$GPULOAD_REMOTE_REQUESTS``, default 32).
    max_inflight_bytes : bytes of requests in flight at once (``$GPULOAD_REMOTE_INFLIGHT_BYTES``,
        default 256 MiB); a single larger range runs alone.
    readahead_bytes : fetched bytes of chunks started ahead of decoding
        (``$GPULOAD_REMOTE_READAHEAD_BYTES``, default 512 MiB; at least one chunk is started).
    coalesce_bytes : ranges this close are merged into one request (default 1 MiB).
    max_range_bytes : longer ranges are split into requests of at most this (default 16 MiB).
    retries : tries per request after the first (``$GPULOAD_REMOTE_RETRIES``, default 6).
    backoff_s, max_backoff_s : first and largest backoff in seconds (defaults 0.2 and 10); the
        wait after the ``k``-th failed try (k = 0, 1, ...) is uniform in
        ``[0, min(max_backoff_s, backoff_s * 2**k)]``.
    timeout_s : seconds one request may take in all (its whole range received, not only a first
        byte) before it counts as stalled and is retried; give a slow link more
        (``$GPULOAD_REMOTE_TIMEOUT``, default 60; fsspec's async stores only; pyarrow's
        filesystems use their own ``request_timeout``).
    kept_listing_s : how old, in seconds, the listing kept at a source's last open may be for the
        source to open from it while its store cannot be reached, provided every chunk is cached
        (``$GPULOAD_REMOTE_KEPT_LISTING_S``, default inf: any age; 0: never, the listing's error is
        raised). See :mod:`gpuload.sources.offline`.
    """

    max_requests: int = field(default_factory=lambda: _env("GPULOAD_REMOTE_REQUESTS", 32, int))
    max_inflight_bytes: int = field(default_factory=lambda: _env("GPULOAD_REMOTE_INFLIGHT_BYTES", 256 << 20, int))
    readahead_bytes: int = field(default_factory=lambda: _env("GPULOAD_REMOTE_READAHEAD_BYTES", 512 << 20, int))
    coalesce_bytes: int = 1 << 20
    max_range_bytes: int = 16 << 20
    retries: int = field(default_factory=lambda: _env("GPULOAD_REMOTE_RETRIES", 6, int))
    backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    timeout_s: float = field(default_factory=lambda: _env("GPULOAD_REMOTE_TIMEOUT", 60.0, float))
    kept_listing_s: float = field(default_factory=lambda: _env("GPULOAD_REMOTE_KEPT_LISTING_S", float("inf"), float))

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:  # NaN too
                raise ConfigError(f"remote {f.name}={v!r} must be a non-negative number")
        for name in ("max_requests", "max_inflight_bytes", "max_range_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"remote {name}={getattr(self, name)!r} must be at least 1")

    @classmethod
    def of(cls, value) -> "RemoteSettings":
        """``value`` as settings: None (defaults), a :class:`RemoteSettings`, or a dict of its fields."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in fields(cls)}
            if unknown:
                raise ConfigError(f"remote: unknown setting(s) {', '.join(sorted(unknown))}; known: "
                                  f"{', '.join(f.name for f in fields(cls))}")
            return cls(**value)
        raise ConfigError(f"remote={value!r}: pass None, a dict or a gpuload.RemoteSettings")


@dataclass(frozen=True)
class RemoteStats:
    """Requests made to a remote store. Sizes in bytes, times in seconds.

    ``latency_p50_s`` / ``p90`` / ``p99``: per successful request, from its start to its
    last byte (None without requests). ``retried``: requests tried again; ``failed``:
    requests that failed on every try.
    """

    requests: int
    bytes: int
    retried: int
    failed: int
    latency_p50_s: float | None
    latency_p90_s: float | None
    latency_p99_s: float | None

    def __str__(self) -> str:
        if not self.requests:
            return "no requests"
        ms = [f"{v * 1e3:.0f}" for v in (self.latency_p50_s, self.latency_p90_s, self.latency_p99_s)]
        return (f"{self.requests:,} requests, {self.bytes / 1e6:.1f} MB, latency p50/p90/p99 {'/'.join(ms)} ms, "
                f"{self.retried} retried, {self.failed} failed")
