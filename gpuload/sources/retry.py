"""Retries: which failures of a remote store are worth another try, and trying again.

Stores share no exception hierarchy (botocore, aiohttp, gcsfs, adlfs, pyarrow's C++
clients), so a failure is classified by what it carries: an HTTP status, an errno, the
class name of a client's connection error, or words such as "SlowDown" (s3fs turns a
503 into ``OSError(EBUSY)``); the causes it wraps are looked at too. Retries wait with
exponential backoff and full jitter, and stop at once when their fetcher is stopped.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import random
import threading
import time
from typing import Callable

from ..errors import SourceError
from .settings import RemoteSettings

__all__ = ["retry", "transient", "Truncated", "Unreachable"]

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_jitter = random.Random()  # backoff jitter of its own: a retry never moves the training script's `random`
_PERMANENT_ERRNO = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EINVAL}
_TRANSIENT_ERRNO = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
                    errno.ECONNREFUSED, errno.EPIPE, errno.EREMOTEIO, errno.ENETUNREACH, errno.EHOSTUNREACH}
# connection-level failures of the stores' clients (botocore, aiohttp, urllib3, requests, google-auth), by class name
_TRANSIENT_CLASSES = {"ConnectTimeoutError", "ReadTimeoutError", "EndpointConnectionError", "ConnectionClosedError",
                      "ResponseStreamingError", "IncompleteReadError", "ProxyConnectionError", "ClientConnectionError",
                      "ClientConnectorError", "ServerDisconnectedError", "ClientPayloadError", "ClientOSError",
                      "ServerTimeoutError", "ConnectionTimeoutError", "SocketTimeoutError", "ProtocolError",
                      "ChunkedEncodingError", "TransportError", "FSTimeoutError"}


def _status(e: BaseException) -> int | None:
    """An HTTP status carried by a store's exception (aiohttp ``status``, gcsfs ``code``,
    botocore ``response``), if any."""
    for attr in ("status", "status_code", "code"):
        v = getattr(e, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and 100 <= v < 600:
            return v
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        v = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(v, int):
            return v
    return None


def transient(e: BaseException) -> bool:
    """Whether a failed request is worth trying again: a 5xx, 429 or 408 answer,
    throttling, a dropped or refused connection, a timeout, a truncated body. The
    exception's causes (``__cause__``, ``__context__``) are looked at too, since stores
    wrap their clients' errors (s3fs turns a 503 SlowDown into ``OSError(EBUSY)``)."""
    for e in _chain(e):
        if isinstance(e, FileNotFoundError) and _unreached(e) is not e:
            return True  # fsspec's HTTP store says "not found" for a refused connection too
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        if isinstance(e, (TimeoutError, asyncio.TimeoutError, ConnectionError, Truncated)):
            return True
        status = _status(e)
        if status is not None:
            return status in _TRANSIENT_STATUS or (status >= 500 and status not in (501, 505))  # not implemented,
            # HTTP version not supported: the server's answer whenever it is asked
        if type(e).__name__ in _TRANSIENT_CLASSES:
            return True
        if isinstance(e, OSError) and e.errno is not None:
            if e.errno in _TRANSIENT_ERRNO:
                return True
            if e.errno in _PERMANENT_ERRNO:
                return False
        text = str(e).lower()
        if any(w in text for w in ("slowdown", "slow down", "reduce your request rate", "throttl",
                                   "service unavailable", "too many requests", "internal error")):
            return True
    return False


def _chain(e: BaseException | None):
    """``e`` and what caused it (``__cause__``, else ``__context__``), each once."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


_CONNECT_CLASSES = {"EndpointConnectionError", "ClientConnectorError", "ClientConnectorDNSError",
                    "NewConnectionError", "ProxyConnectionError", "gaierror"}


def _unreached(e: BaseException) -> BaseException:
    """The error to name for ``e``: for a FileNotFoundError that a failed connection caused (fsspec's
    HTTP store raises ``FileNotFoundError(url)`` from any failure of its request), that failure;
    else ``e`` itself."""
    if not isinstance(e, FileNotFoundError):
        return e
    for c in itertools.islice(_chain(e), 1, None):
        if _status(c) is not None:  # an answer (a 404): the object is not there
            return e
        if isinstance(c, (ConnectionError, TimeoutError, asyncio.TimeoutError)) or type(c).__name__ in \
                _TRANSIENT_CLASSES | _CONNECT_CLASSES or (isinstance(c, OSError) and c.errno in _TRANSIENT_ERRNO):
            return c
    return e


def _no_connection(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is a connection that could not be made: a refused port, an
    unknown host, no route."""
    return any(type(c).__name__ in _CONNECT_CLASSES or isinstance(c, ConnectionRefusedError) or (
        isinstance(c, OSError) and c.errno in (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH))
        for c in _chain(e))


class Truncated(Exception):
    """A body shorter than the range asked for (a dropped connection): worth another try."""


class Unreachable(SourceError):
    """A request that failed every try for a reason worth another (the store down, throttling, no
    connection): what a fully cached source may open without (:mod:`gpuload.cache.listings`)."""


def retry(call: Callable[[], object], what: str, settings: RemoteSettings, on_retry: Callable[[], None] | None = None,
          stop: threading.Event | None = None):
    """``call()``, tried again on transient errors with backoff and jitter; a
    :class:`SourceError` naming ``what`` when it fails for good."""
    for attempt in range(settings.retries + 1):
        try:
            return call()
        except SourceError:
            raise
        except Exception as e:  # classified below: a store's errors have no common base
            if not transient(e):
                raise SourceError(f"{what}: {type(e).__name__}: {e}" + _hint(e)) from None
            if stop is not None and stop.is_set():  # closed, or its epoch ended: nothing the store did
                raise SourceError(f"{what}: the request was abandoned: the dataset was closed or its epoch "
                                  "ended") from None
            if attempt == settings.retries:
                last = _unreached(e)
                why = ("no connection to the store: check its address (the URL's host and port, or for S3 "
                       "the endpoint_url in storage_options) and that it is up; remote retries "
                       "($GPULOAD_REMOTE_RETRIES) set how long gpuload waits for it") if _no_connection(e) else \
                    "the store may be down or throttling: try again later, or raise remote retries"
                raise Unreachable(f"{what}: failed {attempt + 1} times, last with {type(last).__name__}: {last}; "
                                  + why) from None
            if on_retry is not None:
                on_retry()
            pause = _jitter.uniform(0, min(settings.max_backoff_s, settings.backoff_s * 2 ** attempt))
            if stop is None:
                time.sleep(pause)
            elif stop.wait(pause):  # closed while waiting to try again
                raise SourceError(f"{what}: abandoned after {attempt + 1} tries (last {type(e).__name__}: {e}): "
                                  "the dataset was closed or its epoch ended") from None
    raise AssertionError("unreachable")


def _hint(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError):
        return "; the object is gone: open the dataset again to list the source anew"
    if isinstance(e, PermissionError):
        return "; check the credentials in storage_options (or the environment)"
    return ""
