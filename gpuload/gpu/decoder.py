"""The GPU decoder: libcudf reads a chunk's row groups, :mod:`gpuload.gpu.cudf_decode` converts them.

Behind the call of :class:`gpuload.decode.ArrowDecoder` (``decoder(file, chunk, specs) -> column
set``), on the loader's read stream; a chunk cuDF would not convert exactly as the CPU does is
decoded by the CPU decoder instead (:func:`check_gpu_columns` says which, before any read).
Imports nothing of the GPU stack until it decodes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable, Sequence

from ..batch import nbytes, nrows, take
from ..convert import needed_columns
from ..decode import ArrowDecoder, check_unchanged, chunk_where, kept_positions
from ..errors import SourceError
from ..plan import Chunk
from ..schema import OutputSpec, list_value, value_type
from ..sources.listing import SourceFile
from ..sources.ranges import coalesce, image_ranges

__all__ = ["GpuDecoder", "check_gpu_columns", "chunk_image"]

log = logging.getLogger("gpuload")


class GpuDecoder:
    """GPU decoder: libcudf reads the row groups, :mod:`gpuload.gpu.cudf_decode` converts.

    Returns a CuPy column set in the loader's memory of ``ctx`` (a
    :class:`gpuload.gpu.streams.DeviceContext`; call it inside ``ctx.reading()``). libcudf
    decodes on the read stream with stream-ordered memory
    (:meth:`~gpuload.gpu.streams.DeviceContext.decode_stream`), and the conversion kernels
    follow on that stream, so decoding a chunk never waits for, nor holds up, the
    training step's kernels on another stream. A chunk that cuDF would not convert
    exactly as the CPU does (see :class:`gpuload.gpu.cudf_decode.Unsupported`) is decoded
    by ``fallback`` on the CPU and returned as host arrays (the reader caches them and
    uploads them once); :attr:`fallbacks` counts such chunks.
    """

    name = "gpu"

    def __init__(self, ctx, fallback: ArrowDecoder | None = None, metrics=None):
        self.ctx = ctx
        self.fallback = fallback or ArrowDecoder(metrics)
        self.metrics = metrics
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.fallbacks = 0  #: chunks decoded on the CPU because cuDF would not give the CPU path's bytes

    def __call__(self, f: SourceFile, chunk: Chunk, specs: Sequence[OutputSpec]) -> dict:
        from .cudf_decode import Unsupported, columns_to_set, read_row_groups

        where = chunk_where(f, chunk)
        m = self.metrics
        try:
            check_gpu_columns(f, specs)
            stream = self.ctx.decode_stream()
            try:
                image = chunk_image(f, chunk, specs, self.fallback.fetch, m)
            except OSError as e:  # the CPU decoder reads it again and says what is wrong
                raise Unsupported(f"{where}: cannot be read ({e})") from None
            cpu = self.fallback
            # a row filter: pyarrow evaluates it on its columns alone (exactly pyarrow's rows); cuDF
            # decodes every row of the row groups, and the kept ones are gathered on the device
            kept = None if cpu.row_filter is None else kept_positions(f, chunk, cpu.row_filter, cpu.filter_columns,
                                                                      cpu.fetch)
            decoded = chunk.rows if kept is None else sum(f.metadata.row_group(g).num_rows
                                                          for g in range(chunk.rg_start, chunk.rg_stop))
            with m.span("decode", rows=chunk.rows) if m else contextlib.nullcontext():
                try:
                    raw = read_row_groups(image, chunk.rg_start, chunk.rg_stop, needed_columns(specs), stream=stream)
                    check_unchanged(f, during=True)
                    self.ctx.read_done()  # libcudf's copies and decoding are one call: both count as decode
                except MemoryError as e:
                    raise SourceError(f"{where}: out of GPU memory decoding it ({e}); lower chunk_bytes or "
                                      "pass decode='cpu'") from None
                # pyarrow reads it, or names the failing column; pylibcudf raises TypeError (cudf::data_type_error),
                # IndexError (std::out_of_range) and ArithmeticError (overflow, range) for libcudf's refusals too
                except (OSError, RuntimeError, ValueError, TypeError, IndexError, ArithmeticError) as e:
                    raise Unsupported(f"{where}: libcudf cannot read it ({type(e).__name__}: "
                                      f"{' '.join(str(e).split())})") from None
                finally:
                    image.close()  # after read_done: nothing on the device still reads it
            # convert on the read stream into the loader's memory (no view of cuDF's buffers is
            # kept); they go back to their stream-ordered pool when `raw` is dropped, after the
            # kernels that read them
            with m.span("convert", rows=chunk.rows) if m else contextlib.nullcontext() as span:
                try:
                    out = columns_to_set(raw, specs, f.schema, decoded, where, stream)
                except Exception as e:  # CuPy's OutOfMemoryError is a MemoryError, torch's a RuntimeError
                    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
                        raise SourceError(f"{where}: out of GPU memory converting it ({e}); lower chunk_bytes or "
                                          "pass decode='cpu'") from None
                    raise
                finally:  # also before a fallback to the CPU: cuDF's buffers are not needed there
                    del raw
                if kept is not None and len(kept) != decoded:
                    import cupy

                    out = take(out, cupy.asarray(kept))
                if nrows(out) != chunk.rows:
                    raise SourceError(f"{where}: kept {nrows(out)} rows where the filter kept {chunk.rows} when "
                                      "counted at open")
                self.ctx.read_done()  # so that the span times the kernels, not their launch (this chunk's, not later ones)
                if span is not None:
                    span.nbytes = nbytes(out)
            return out
        except Unsupported as e:
            with self._lock:
                self.fallbacks += 1
                first = str(e) not in self._warned
                self._warned.add(str(e))
            if first:
                log.info("gpuload: %s; decoding such chunks on the CPU so the bytes match the CPU path", e)
            return self.fallback(f, chunk, specs)


def check_gpu_columns(f: SourceFile, specs: Sequence[OutputSpec]) -> None:
    """libcudf selects nested fields by dotted path, and Hive keys are not in the file: decode
    such chunks on the CPU, where columns are selected by leaf index; so too chunks whose
    conversion is the CPU's alone (vocabulary lookups, decimals, a column the file stores in a
    narrower type than it is read in)."""
    from .cudf_decode import Unsupported

    for s in specs:  # known before reading: no chunk decoded by libcudf, then again by pyarrow
        for c, vt in zip(s.columns, s.sources):
            if vt.encode.startswith("vocab:"):
                raise Unsupported(f"column {c!r} takes its ids from a vocabulary, looked up on the CPU")
            if vt.temporal.startswith(("decimal:", "unscaled:")):
                raise Unsupported(f"column {c!r} is a decimal, converted on the CPU")
            if vt.temporal.startswith(("int:", "int96:")):
                raise Unsupported(f"column {c!r} is in several units across the files, converted on the CPU")
            if _narrower(f, c, vt):  # cuDF would read it in the file's type (cudf_decode refuses that, but decoded)
                raise Unsupported(f"column {c!r} is narrower in this file than the {vt.dtype} it is read in (the files' "
                                  "types differ, or a fill value needs the wider type): widened on the CPU")
    for c in needed_columns(specs):
        if "." in c:
            raise Unsupported(f"column {c!r} has a dot in its name, which libcudf reads as a nested path")
        if c in f.absent:
            raise Unsupported(f"column {c!r} is not in this file: nulls, made on the CPU")
        if c in f.partition_names:
            raise Unsupported(f"column {c!r} is a partition key")
        if c in f.int96:
            raise Unsupported(f"column {c!r} holds INT96 timestamps, read in microseconds and range-checked on the CPU")
        if f.remote and c in dict(f.file_keys):  # a local file's stored key was checked at open
            raise Unsupported(f"column {c!r} is a partition key stored in the file, checked on the CPU")


def _narrower(f: SourceFile, column: str, vt) -> bool:
    """Whether file ``f`` stores ``column``'s numbers (a list's values) in another type than ``vt.dtype``,
    which the CPU path casts them to first (:func:`gpuload.drift.widened`, a wider ``fill_nulls`` value)."""
    if vt.temporal or vt.encode or column in f.partition_names or column in f.absent or column not in f.schema.names:
        return False
    t = f.schema.field(column).type
    own = value_type(list_value(t) or t)
    return own is not None and not own.temporal and own.dtype != vt.dtype


def chunk_image(f: SourceFile, chunk: Chunk, specs: Sequence[OutputSpec], fetch: Callable, metrics=None):
    """``f`` as libcudf reads it for ``chunk`` (a :class:`gpuload.gpu.cudf_decode.HostImage`):
    the chunk's column ranges, the leading magic bytes and everything after the last column
    chunk (page indexes, footer), read from the local file or fetched from the remote object;
    the rest is never read (a local file's reads are ``read`` spans of ``metrics``). The caller
    closes it."""
    from .cudf_decode import HostImage

    leaves = [i for c in needed_columns(specs) if c not in f.partition_names for i in f.leaves(c)]
    image = HostImage(f.size)
    try:
        if f.remote:
            for start, data in fetch(f, chunk, leaves, footer=True).parts.items():
                image.put(start, data)
            return image
        ranges = image_ranges(f.metadata, f.size, f.tail, range(chunk.rg_start, chunk.rg_stop), leaves)
        fd = os.open(f.path, os.O_RDONLY)
        try:
            for a, b in coalesce(ranges, gap=1 << 16, longest=1 << 62):
                with metrics.span("read", nbytes=b - a) if metrics is not None else contextlib.nullcontext():
                    image.read_from(fd, a, b, f.path)
        finally:
            os.close(fd)
        return image
    except BaseException:
        image.close()
        raise
