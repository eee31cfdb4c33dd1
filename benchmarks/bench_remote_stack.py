"""Which client should fetch remote column ranges? One run, side by side, same server.

Fetches the column chunks of a click log (every 4th column, ranges not merged, so many
requests) from a loopback S3 server (``gpuload.testing.S3Server``: moto, with per-request
latency and a per-response bandwidth cap) through gpuload's :class:`~gpuload.sources.fetch.Fetcher`
over two clients: s3fs (fsspec; gpuload's default for ``s3://`` URLs) and pyarrow's C++
``S3FileSystem`` (``filesystem=``). Prints MB/s and request latency for each.

    python benchmarks/bench_remote_stack.py [--rows 1000000] [--files 8] [--latencies 0,20,50]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import s3fs

from gpuload.sources.fetch import Fetcher
from gpuload.sources.settings import RemoteSettings
from gpuload.sources.ranges import column_ranges
from gpuload.sources.remote import Store
from gpuload.synth import write_clicklog
from gpuload.testing import S3Server


def fetch_all(store: Store, bucket: str, metas: dict, every: int) -> tuple[float, str]:
    f = Fetcher(store, RemoteSettings(coalesce_bytes=0))
    t0 = time.perf_counter()
    jobs = [f.start(f"{bucket}/x/{name}", column_ranges(m, 0, m.num_row_groups, range(0, m.num_columns, every)))
            for name, m in metas.items()]
    n = sum(len(v) for j in jobs for v in j.result().values())
    dt = time.perf_counter() - t0
    stats = f.stats()
    f.close()
    return n / dt / 1e6, str(stats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--latencies", default="0,20,50", help="ms per request, comma-separated")
    ap.add_argument("--bandwidth", type=float, default=200e6, help="bytes/s per response")
    ap.add_argument("--every", type=int, default=4, help="fetch every Nth column (default 4)")
    ap.add_argument("--repeat", type=int, default=3, help="passes; the best is kept")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = pathlib.Path(tmp) / "data"
        write_clicklog(data, rows=args.rows, files=args.files)
        metas = {p.name: pq.read_metadata(p) for p in sorted(data.glob("*.parquet"))}
        print("| latency | client | MB/s (best) | requests |\n|---:|---|---:|---|")
        for lat in (float(x) for x in args.latencies.split(",")):
            with S3Server(latency_s=lat / 1e3, bandwidth=args.bandwidth) as s3:
                bucket = f"stack{int(lat)}"
                s3.upload_folder(data, bucket, "x/")
                clients = {
                    "s3fs (fsspec)": lambda: Store(s3fs.S3FileSystem(**s3.storage_options), "s3"),
                    "pyarrow S3FileSystem": lambda: Store(pafs.S3FileSystem(
                        access_key="testing", secret_key="testing", endpoint_override=s3.endpoint, scheme="http",
                        region="us-east-1"), "s3"),
                }
                for name, make in clients.items():
                    runs = [fetch_all(make(), bucket, metas, args.every) for _ in range(args.repeat)]
                    best = max(runs)
                    print(f"| {lat:g} ms | {name} | {best[0]:.0f} | {best[1]} |")


if __name__ == "__main__":
    main()
