"""Loopback object stores for tests, benchmarks and demos: real servers, real protocols.

:class:`S3Server` serves the S3 protocol (moto's S3 backend) on ``127.0.0.1`` and
:class:`HttpServer` serves a folder over plain HTTP with ``Range``, ``ETag`` and
``Last-Modified`` (and an HTML index, so fsspec can list folders). Both run on a
thread of this process, count every request they receive (method and key), and can
inject per-request latency, a bandwidth cap and faults (503 answers, connection
resets, stalls), so that a test or a benchmark sees what a real remote store does to
a loader. They need the ``test`` extra (``pip install gpuload[test]``: moto, werkzeug).

    with S3Server(latency_s=0.02) as s3:
        s3.upload_folder("data/", "bucket", "prefix/")
        ds = gpuload.ParquetDataset("s3://bucket/prefix/", storage_options=s3.storage_options)
"""

from __future__ import annotations

import collections
import logging
import os
import random
import socket
import threading
import time
from email.utils import formatdate
from pathlib import Path

__all__ = ["Faults", "S3Server", "HttpServer"]


class Faults:
    """What the server does to requests: ``latency_s`` before each answer, ``bandwidth``
    (bytes/s per response, None: unlimited), and for a fraction of requests (``rate``,
    0 to 1; ``only`` restricts faults to GETs of keys containing that text) one of
    ``kinds``: ``"503"`` (Service Unavailable), ``"reset"`` (connection dropped
    without an answer), ``"stall"`` (no answer for ``stall_s`` seconds, then dropped).
    ``seed`` makes the choice of failed requests reproducible."""

    def __init__(self, latency_s: float = 0.0, bandwidth: float | None = None, rate: float = 0.0,
                 kinds=("503", "reset", "stall"), stall_s: float = 30.0, only: str | None = ".parquet", seed: int = 0):
        self.latency_s, self.bandwidth, self.rate, self.kinds = latency_s, bandwidth, rate, tuple(kinds)
        self.stall_s, self.only = stall_s, only
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def pick(self, method: str, key: str) -> str | None:
        if self.rate <= 0 or method != "GET" or (self.only and self.only not in key):
            return None
        with self._lock:
            return self._rng.choice(self.kinds) if self._rng.random() < self.rate else None


class _Reset(Exception):
    pass


class _QuietResets(logging.Filter):
    """Drops werkzeug's log of the connection resets injected on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_Reset" not in record.getMessage()


logging.getLogger("werkzeug").addFilter(_QuietResets())


class _Middleware:
    """WSGI wrapper: counts requests, then applies the :class:`Faults`."""

    def __init__(self, app, server: "_Server"):
        self.app, self.server = app, server

    def __call__(self, environ, start_response):
        method, key = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        self.server._count(method, key, environ.get("HTTP_RANGE"))
        f = self.server.faults
        if f.latency_s:
            time.sleep(f.latency_s)
        fault = f.pick(method, key)
        if fault == "503":
            body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                    b"<Message>Please reduce your request rate.</Message></Error>")
            start_response("503 Service Unavailable", [("Content-Type", "application/xml"),
                                                       ("Content-Length", str(len(body)))])
            return [body]
        if fault in ("reset", "stall"):
            if fault == "stall":
                self.server._stop.wait(f.stall_s)
            sock = environ.get("werkzeug.socket")
            if sock is not None:  # drop the connection without an answer
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            raise _Reset()
        out = self.app(environ, start_response)
        return self._sent(out, f.bandwidth, key)

    def _sent(self, chunks, rate: float | None, key: str):
        """The body in 64 KiB parts (each sent counted, so a client that hangs up stops it), at most
        ``rate`` bytes per second."""
        try:
            for chunk in chunks:
                for i in range(0, len(chunk), 1 << 16):
                    part = chunk[i:i + (1 << 16)]
                    if rate:
                        time.sleep(len(part) / rate)
                    yield part
                    with self.server._lock:
                        self.server.sent_bytes[key] += len(part)
        finally:
            if hasattr(chunks, "close"):
                chunks.close()


class _Server:
    """A threaded werkzeug server on a free loopback port, with request counts."""

    def __init__(self, faults: Faults | None = None):
        self.faults = faults or Faults()
        self.requests: collections.Counter = collections.Counter()  # (method, key) -> count
        self.range_bytes: collections.Counter = collections.Counter()  # key -> bytes asked by Range GETs
        self.sent_bytes: collections.Counter = collections.Counter()  # key -> body bytes handed to the socket
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._srv = None

    def _app(self):
        raise NotImplementedError

    def _count(self, method: str, key: str, rng: str | None) -> None:
        with self._lock:
            self.requests[(method, key)] += 1
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                if a and b:
                    self.range_bytes[key] += int(b) - int(a) + 1

    def count(self, method: str | None = None, contains: str = "") -> int:
        """Requests received so far, of ``method`` (None: any) for keys containing ``contains``."""
        with self._lock:
            return sum(n for (m, k), n in self.requests.items() if (method is None or m == method) and contains in k)

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.range_bytes.clear()
            self.sent_bytes.clear()

    def start(self, port: int = 0):
        """Serve on ``port`` (0: a free one; the port of a stopped server starts it again there)."""
        from werkzeug.serving import WSGIRequestHandler, make_server

        class Quiet(WSGIRequestHandler):
            def log_request(self, *a, **k):
                pass

            def log_error(self, *a, **k):
                pass

            def handle_one_request(self):
                try:
                    super().handle_one_request()
                except _Reset:
                    self.close_connection = True

        self._stop.clear()
        self._srv = make_server("127.0.0.1", port, _Middleware(self._app(), self), threaded=True,
                                request_handler=Quiet)
        self._srv.daemon_threads = True
        self.port = self._srv.server_port
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._srv.serve_forever, name="gpuload-test-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._srv is not None:
            self._srv.shutdown()
            self._srv.server_close()
            self._srv = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class S3Server(_Server):
    """An S3-protocol server (moto) on loopback. ``storage_options`` configure s3fs for it."""

    def __init__(self, faults: Faults | None = None, **fault_kwargs):
        super().__init__(faults or Faults(**fault_kwargs))

    def _app(self):
        from moto.server import DomainDispatcherApplication, create_backend_app

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        return DomainDispatcherApplication(create_backend_app)

    @property
    def storage_options(self) -> dict:
        """For fsspec's s3fs: this endpoint, test credentials, and s3fs/botocore retries off
        (gpuload retries each request itself)."""
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                "config_kwargs": {"retries": {"max_attempts": 1}, "read_timeout": 10, "connect_timeout": 5}}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def upload_folder(self, folder, bucket: str, prefix: str = "") -> list[str]:
        """Create ``bucket`` (if needed) and upload every file below ``folder`` under ``prefix``;
        returns the keys. Counts are reset afterwards."""
        c = self.client()
        try:
            c.create_bucket(Bucket=bucket)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        keys = []
        for p in sorted(Path(folder).rglob("*")):
            if p.is_file():
                key = prefix + p.relative_to(folder).as_posix()
                c.upload_file(str(p), bucket, key)
                keys.append(key)
        self.reset_counts()
        return keys


class HttpServer(_Server):
    """A plain HTTP object server for the files below ``root``: GET (with one ``Range``),
    HEAD, ``ETag`` (from size and mtime), ``Last-Modified``, and an HTML index for folders."""

    def __init__(self, root, faults: Faults | None = None, ranges: bool = True, **fault_kwargs):
        super().__init__(faults or Faults(**fault_kwargs))
        self.root = Path(root).resolve()
        self.ranges = ranges  # False: answer every GET with the whole file, as some servers do

    def url(self, rel: str = "") -> str:
        return f"{self.endpoint}/{rel}"

    def _app(self):
        from werkzeug.wrappers import Request, Response

        root, server = self.root, self

        @Request.application
        def app(request):
            path = (root / request.path.lstrip("/")).resolve()
            if root not in (path, *path.parents) or not path.exists():
                return Response("not found", status=404)
            if path.is_dir():
                here = request.path.rstrip("/")
                links = "".join(f'<a href="{here}/{q.name}{"/" if q.is_dir() else ""}">{q.name}</a>\n'
                                for q in sorted(path.iterdir()))
                return Response(f"<html><body>{links}</body></html>", mimetype="text/html")
            st = path.stat()
            headers = {"ETag": f'"{st.st_size:x}-{st.st_mtime_ns:x}"', "Accept-Ranges": "bytes",
                       "Last-Modified": formatdate(st.st_mtime, usegmt=True)}
            size = st.st_size
            rng = request.range
            if request.method == "HEAD":
                resp = Response(b"", headers=headers, mimetype="application/octet-stream")
                resp.automatically_set_content_length = False
                resp.headers["Content-Length"] = str(size)
                return resp
            if rng is not None and len(rng.ranges) == 1 and server.ranges:
                a, b = rng.range_for_length(size) or (0, 0)
                with open(path, "rb") as fh:
                    fh.seek(a)
                    data = fh.read(b - a)
                return Response(data, status=206, mimetype="application/octet-stream",
                                headers={**headers, "Content-Range": f"bytes {a}-{b - 1}/{size}"})
            return Response(path.read_bytes(), mimetype="application/octet-stream", headers=headers)

        return app
