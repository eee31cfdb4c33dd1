"""Transforms: users' functions over chunks when they are cached, and over every batch.

``transform=`` (a :class:`Transform`) is applied to each chunk's converted outputs once, when
the chunk is cached: features computed once and read from the cache in every later epoch.
Its outputs are learnt at open from one call on 0-row tensors of the converted outputs
(:func:`transform_outputs`), and each chunk's outputs must match them (dtype, trailing
shape, rows). The transform's ``key`` is part of the cache key: a new key rebuilds the cache,
the same key reuses it (say so with a new key when the function changes).

``ParquetDataset(..., batch_transform=fn)`` calls ``fn(batch, generator)`` for each batch after
the shuffle and before the hand-off: on the producer thread (the training thread never runs
it) and, on a GPU, on the loader's batch stream, so its kernels are queued before the batch's
ready event and the training step waits for them only when it uses the batch. It is for work
that must differ each epoch (augmentation, masking, negative sampling); work that is the same
every epoch belongs in the cache instead.

``generator`` is a ``torch.Generator`` on the batch's device, seeded from the dataset's
fingerprint and ``seed``, the epoch, the run of the epoch (a resume on another number of ranks
starts a new run), the rank and the batch's position in the rank's run: an uninterrupted
epoch and one resumed from a state give every batch the same generator, so a transform that
draws its randomness from it gives the same batches (bit for bit, on the same device and
library versions).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from .batch import Ragged, nrows
from .errors import ConfigError, SchemaError
from .dtypes import BFLOAT16, parse_dtype, storage_dtype
from .schema import FIXED, RAGGED, SCALAR, OutputSpec

if TYPE_CHECKING:
    import torch
# torch is imported where it is used: config imports this module, and the command starts without torch

__all__ = ["Transform", "transform_outputs", "apply_transform", "BatchTransform", "check_batch_transform",
           "batch_seed"]


@dataclass(frozen=True)
class Transform:
    """``fn(outputs) -> outputs`` applied to each chunk when it is cached; ``key`` names it in the
    cache key (a name and version you choose: ``"features-v3"``; change it when ``fn`` changes).

    ``fn`` gets a dict of output name -> torch tensor (``[rows]`` or ``[rows, k]``) or
    :class:`gpuload.Ragged` on the device that decoded the chunk (CPU, or CUDA where cuDF
    decoded it: write it for either), and returns such a dict with the same number of rows
    (outputs may be dropped, changed or added), in the order of the first (the probe's) result. It must also accept 0 rows:
    it is called once at open with empty tensors to learn its outputs. In Dask builds it
    travels pickled (cloudpickle) to the workers.
    """

    fn: Callable
    key: str

    def __post_init__(self):
        if not callable(self.fn) or not _takes(self.fn, 1):
            raise ConfigError(f"transform: Transform(fn={self.fn!r}) must be given a function outputs -> outputs "
                              "(one argument)")
        if not isinstance(self.key, str) or not self.key.strip() or len(self.key) > 200:
            raise ConfigError(f"transform: Transform(key={self.key!r}) must be a non-empty name of at most 200 "
                              "characters, e.g. 'features-v3': the cache key holds it")


def note(e: BaseException, text: str) -> None:
    """Add ``text`` to ``e``'s notes (shown under its traceback from Python 3.11; on 3.10 kept
    in ``__notes__`` only)."""
    if hasattr(e, "add_note"):
        e.add_note(text)
    else:
        e.__notes__ = [*getattr(e, "__notes__", []), text]


def check_transform(t) -> Transform | None:
    if t is not None and not isinstance(t, Transform):
        raise ConfigError(f"transform={t!r} must be a gpuload.Transform(fn, key='name-v1') (or None)")
    return t


def _shown(dtype: str) -> str:
    """An output dtype as people name it (``float64``, ``bfloat16``)."""
    return dtype if dtype == BFLOAT16 else np.dtype(dtype).name


def _empty(s: OutputSpec):
    """0-row tensors of output ``s`` (as its chunk's arrays would be handed to the transform)."""
    import torch

    t = torch.from_numpy(np.empty((0, s.width) if s.ndim == 2 else (0,), storage_dtype(s.dtype)))
    t = t.view(torch.bfloat16) if s.dtype == BFLOAT16 else t
    return Ragged(t, torch.zeros(1, dtype=torch.int64)) if s.kind == RAGGED else t


def _spec_of(name: str, value, key: str, where: str) -> OutputSpec:
    """The output spec a transform's output ``value`` (a 0-row probe) stands for."""
    import torch

    t = value.values if isinstance(value, Ragged) else value
    if not isinstance(t, torch.Tensor) or (isinstance(value, Ragged) and not isinstance(value.offsets, torch.Tensor)):
        raise ConfigError(f"transform {key!r}: output {name!r} is a {type(value).__name__}{where}; return tensors "
                          "(or gpuload.Ragged of tensors)")
    dtype = parse_dtype(t.dtype, f"transform {key!r}: output {name!r}{where}: dtype")  # as dtypes= takes them
    if isinstance(value, Ragged):
        if t.dim() != 1:
            raise ConfigError(f"transform {key!r}: output {name!r}: a Ragged's values must be 1-D{where}")
        return OutputSpec(name, (), RAGGED, dtype, 1, (), ())
    if t.dim() == 1:
        return OutputSpec(name, (), SCALAR, dtype, 1, (), ())
    if t.dim() == 2:
        return OutputSpec(name, (), FIXED, dtype, int(t.shape[1]), (), ())
    raise ConfigError(f"transform {key!r}: output {name!r} has {t.dim()} dimensions{where}; outputs are [rows] "
                      "or [rows, k] (flatten the trailing dimensions)")


def _call(t: Transform, outputs: dict, where: str) -> dict:
    try:
        out = t.fn(outputs)
    except Exception as e:
        note(e, f"gpuload: raised by transform {t.key!r}{where}")
        raise
    if not isinstance(out, Mapping) or not out or not all(isinstance(k, str) and k for k in out):
        raise ConfigError(f"transform {t.key!r} returned {type(out).__name__}{where}: it must return a non-empty "
                          "dict of output name -> tensor")
    return dict(out)


def transform_outputs(t: Transform, specs: Sequence[OutputSpec]) -> list[OutputSpec]:
    """The outputs ``t`` makes of ``specs``' outputs, learnt from one call on 0-row tensors."""
    out = _call(t, {s.name: _empty(s) for s in specs}, " on the 0-row probe at open (it must accept 0 rows)")
    return [_spec_of(name, v, t.key, " on the 0-row probe") for name, v in out.items()]


def _to_torch(a):
    import torch

    if isinstance(a, np.ndarray):
        return torch.from_numpy(a if a.flags.writeable else a.copy())
    return torch.from_dlpack(a)  # CuPy on the read stream: torch's current stream there too


def apply_transform(t: Transform, cols: dict, specs: Sequence[OutputSpec], outputs: Sequence[OutputSpec],
                    where: str) -> dict:
    """Chunk column set ``cols`` (NumPy or CuPy arrays of ``specs``' outputs; bfloat16 as uint16)
    through ``t``: the column set of ``outputs`` (as :func:`transform_outputs` gave them), in new
    memory of the chunk's kind. :class:`SchemaError` names the chunk (``where``) and the output
    whose dtype or shape is not the probed one, or whose rows differ."""
    import torch

    views = {s.name for s in specs if s.dtype == BFLOAT16}
    rows = nrows(cols)
    gpu = any(not isinstance(v.values if isinstance(v, Ragged) else v, np.ndarray) for v in cols.values())
    given = {}
    for k, v in cols.items():
        if isinstance(v, Ragged):
            vals = _to_torch(v.values)
            given[k] = Ragged(vals.view(torch.bfloat16) if k in views else vals, _to_torch(v.offsets))
        else:
            x = _to_torch(v)
            given[k] = x.view(torch.bfloat16) if k in views else x
    got = _call(t, given, f" on {where}")
    want = {s.name: s for s in outputs}
    if set(got) != set(want):
        raise SchemaError(f"{where}: transform {t.key!r} returned outputs {sorted(got)}, not {sorted(want)} as on "
                          "the 0-row probe at open; return the same outputs for every chunk")
    out = {}
    for name in want:  # in the outputs' order, whatever order this chunk's dict has
        v, s = got[name], want[name]
        spec = _spec_of(name, v, t.key, f" on {where}")
        n = len(v.offsets) - 1 if isinstance(v, Ragged) else int(v.shape[0])
        if spec != s or n != rows:
            shape = "Ragged" if isinstance(v, Ragged) else tuple(v.shape)
            raise SchemaError(f"{where}: transform {t.key!r} output {name!r} is {_shown(spec.dtype)} {shape}, where "
                              f"the 0-row probe at open gave {_shown(s.dtype)} {s.kind} of width {s.width} and the "
                              f"chunk has {rows} rows; every chunk's output must have the dtype and trailing shape "
                              "of the probe's, and the chunk's rows")
        if isinstance(v, Ragged):
            off = v.offsets.to(torch.int64)
            if len(off) == 0 or int(off[0]) != 0 or int(off[-1]) != len(v.values) or bool((off[1:] < off[:-1]).any()):
                raise SchemaError(f"{where}: transform {t.key!r} output {name!r}: a Ragged's offsets must start at "
                                  "0, never decrease and end at the number of values")
            out[name] = Ragged(_back(v.values, gpu), _back(off, gpu))
        else:
            out[name] = _back(v, gpu)
    return out


def _back(t: torch.Tensor, gpu: bool):
    """A transform's output tensor as the chunk's kind of array, in new memory (a GPU chunk's in
    gpuload's own device memory: the current CuPy allocator copies it there); bfloat16 as its
    uint16 bit patterns, as the cache stores it."""
    import torch

    bf16 = t.dtype == torch.bfloat16
    t = (t.view(torch.int16) if bf16 else t).detach()
    if not gpu:
        a = t.cpu().numpy().copy()
    else:
        import cupy

        a = cupy.array(cupy.from_dlpack((t if t.is_cuda else t.cuda()).contiguous()), copy=True)
    return a.view(np.uint16) if bf16 else a


def _takes(fn, n: int) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments (True where its signature
    cannot be read: a builtin, some C extensions)."""
    try:
        inspect.signature(fn, follow_wrapped=False).bind(*([None] * n))  # a wrapper's own, not what it wraps
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def check_batch_transform(fn) -> Callable | None:
    """``fn`` if it is None or a callable taking ``(batch, generator)``, else :class:`ConfigError`
    naming the setting (at open, not at the first batch)."""
    if fn is not None and (not callable(fn) or not _takes(fn, 2)):
        raise ConfigError(f"batch_transform={fn!r} must be a function fn(batch, generator) -> batch taking those two "
                          "arguments (or None)")
    return fn


def batch_seed(fingerprint: int, seed: int, epoch: int, run: int, rank: int, index: int) -> int:
    """The seed (0 <= seed < 2**63) of the generator of batch ``index`` of ``rank`` in run ``run``
    of ``epoch``."""
    key = [int(k) & (2**63 - 1) for k in (fingerprint, seed, epoch, 2, run, rank, index)]  # 2: not a permutation's key
    return int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0]) & (2**63 - 1)


class BatchTransform:
    """``fn`` applied to one iteration's batches in turn (on the producer thread).

    ``key``: ``(fingerprint, seed, epoch, run, rank)`` of the iteration; ``first``: the
    position in the rank's run of the first batch it yields (the batches a resumed run took
    already); ``device``: the batches' torch device, where the generator lives.
    """

    def __init__(self, fn: Callable, key: tuple[int, int, int, int, int], first: int, device):
        self.fn, self.key, self.index, self.device = fn, key, first, device

    @classmethod
    def starting(cls, fn: Callable, pos, fingerprint: int, seed: int, device) -> BatchTransform:
        """The transform of an iteration beginning at position ``pos`` (a
        :class:`gpuload.epochs.Position` whose ranks are known)."""
        return cls(fn, (fingerprint, seed, pos.epoch, len(pos.runs) - 1, pos.ranks.rank), pos.runs[-1].taken, device)

    def __call__(self, batch: dict) -> dict:
        import torch

        g = torch.Generator(device=self.device)
        g.manual_seed(batch_seed(*self.key, self.index))
        where = f"batch {self.index} of epoch {self.key[2]} (rank {self.key[4]}, run {self.key[3]})"
        try:
            out = self.fn(batch, g)
        except Exception as e:
            note(e, f"gpuload: raised by batch_transform on {where}")
            raise
        if not isinstance(out, Mapping) or not all(isinstance(k, str) for k in out):
            raise ConfigError(f"batch_transform returned {type(out).__name__} for {where}: it must return a dict "
                              "of output name -> tensor (the batch it was given, changed or not)")
        self.index += 1
        return dict(out)
