"""Mix: several :class:`gpuload.ParquetDataset` sources in one run, mixed by weight.

Each batch of a mix (a *step*) joins whole batches of its sources (:mod:`gpuload.mixplan`
says which, and what an epoch is), so each source keeps its own order, caches, shards,
remote reads and Dask builds, and delivers every row once per pass. The mix runs on its
own background thread (``gpuload-mix``): it takes the sources' batches (each source's own
threads load them), joins them and hands the step out; the training thread only takes
finished steps. Its state holds, per source, the source's own state after the last step
handed out, so a restore is exact on the same ranks and every row stays once on others.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import numbers
import sys
from typing import Iterator, Mapping

import torch
import xxhash

from .agree import Agreement
from .consumers import NotCopied, check_iter_caller, check_set_epoch_caller
from .dataset import ParquetDataset
from .errors import ConfigError, counted, setting
from .mixsources import check_sources
from .mixsteps import mix_steps, receive
from .plan import MAX_KEY
from .mixplan import EXHAUSTED, MODES, MixPlan, labels, plan_mix, rest_labels, rest_steps
from .observe.metrics import Metrics
from .observe.ranks import gather
from .producer import Background, handed_out

__all__ = ["Mix", "FORMAT"]

FORMAT, VERSION = "gpuload.Mix", 2  # 2: its sources' orders no longer depend on where their files lie
log = logging.getLogger("gpuload")


class Mix(NotCopied, torch.utils.data.IterableDataset):
    """Batches drawn from several datasets by weight (see :mod:`gpuload.mixplan` for the exact rules).

    Parameters
    ----------
    sources : ``{name: ParquetDataset}``, at least one; each with the same outputs (names,
        kinds, dtypes, trailing shapes) on the same device, and its own source, filters,
        transform, seed and settings. The mix owns them: it selects their epochs and
        iterates them; do not iterate them elsewhere while it runs.
    weights : ``{name: weight > 0}`` for ``mode="proportion"`` (need not sum to 1): each
        epoch holds each source's batches in proportion, exactly (to one batch). None with
        ``mode="composition"``.
    mode : ``"proportion"`` (default when ``weights`` are given): each step joins
        ``batches_per_step`` source batches drawn by weight (the sources share one batch
        size); ``"composition"`` (default without weights): each step joins one batch of
        every source, so it holds exactly ``batch_size`` rows of each.
    batches_per_step : source batches per step with ``"proportion"`` (default 1: a step is
        one source's batch; 8 with batch_size=8192 gives steps of 65,536 rows of mixed sources).
    exhausted : ``"end"`` (default): an epoch ends before any source would run out;
        ``"repeat"``: it ends when every source was read whole, the smaller ones repeated.
    steps_per_epoch : a fixed number of steps per epoch instead (default None).
    seed : seed of the arrangement of sources within an epoch (default 0); the sources'
        own seeds order their rows.
    provenance : name of an extra int64 output holding, per row, the index of its source
        in ``sources`` (default None: none).
    prefetch : finished steps kept ready (default 2).
    """

    def __init__(self, sources: Mapping[str, ParquetDataset], weights: Mapping[str, float] | None = None, *,
                 mode: str | None = None, batches_per_step: int = 1, exhausted: str = "end",
                 steps_per_epoch: int | None = None, seed: int = 0, provenance: str | None = None,
                 prefetch: int = 2):
        super().__init__()
        if not isinstance(sources, Mapping) or not sources:
            raise ConfigError("sources= must be a non-empty dict {name: gpuload.ParquetDataset}")
        self.names = [str(n) for n in sources]
        self.sources = list(sources.values())
        for n, d in zip(self.names, self.sources):
            if not isinstance(d, ParquetDataset):
                raise ConfigError(f"source {n!r} is a {type(d).__name__}, not a gpuload.ParquetDataset")
        if len({id(d) for d in self.sources}) < len(self.sources):
            raise ConfigError("one ParquetDataset is given twice in sources=: a mix iterates each source itself; "
                              "make a second ParquetDataset of the same files (its cache is shared)")
        self.mode = mode or ("proportion" if weights is not None else "composition")
        _choice("mode", self.mode, MODES)
        _choice("exhausted", exhausted, EXHAUSTED)
        self.exhausted, self.seed, self.provenance = exhausted, counted("seed", seed, 0, MAX_KEY), provenance
        self.per_step = counted("batches_per_step", batches_per_step)
        self.steps_per_epoch = None if steps_per_epoch is None else counted("steps_per_epoch", steps_per_epoch)
        self.prefetch = counted("prefetch", prefetch)
        self.weights = self._check_weights(weights)
        check_sources(self.names, self.sources, self.provenance)
        self.device = self.sources[0].device
        self.metrics = Metrics()
        ident = [(n, d.reader.fingerprint, w) for n, d, w in zip(self.names, self.sources, self.weights or [1.0] * len(self.names))]
        self.key = f"{xxhash.xxh64_intdigest(repr((ident, self.mode, self.per_step, exhausted)).encode()):016x}"
        self._signature = {"sources": [[n, f"{d.reader.fingerprint:#x}"] for n, d in zip(self.names, self.sources)],
                           "weights": self.weights, "mode": self.mode, "batches_per_step": self.per_step,
                           "exhausted": exhausted, "steps_per_epoch": self.steps_per_epoch, "seed": self.seed}
        self._epoch, self._advance, self._restored, self._running = 0, False, False, False
        self._agreement = Agreement(repr(("mix", self.names, [d._given for d in self.sources])))  # across ranks
        self._stream = None  # the sources' consumer stream on a GPU: one for all epochs (their preloads are kept for it)
        self._counted = None  # (the state it was worked out for, len) of a restored rest
        self._epoch_set, self._after_run = False, None  # set_epoch called since the last iteration began; during one
        self._runs: list[list[int]] = []   # this epoch's runs [world, steps, taken, drawn] (see _run)
        self._states: dict = {}            # source name -> {"state", "epoch", "pass"} after the last step taken

    # -- checks ---------------------------------------------------------------------------
    def _check_weights(self, weights) -> list[float] | None:
        if self.mode == "composition":  # each step one batch of every source: nothing to weigh or count
            if weights is not None:
                raise ConfigError("mode='composition' joins one batch of every source per step, so weights= has "
                                  "no use there: leave mode= out (weights= mix by proportion) or weights= out")
            if self.per_step != 1:
                raise ConfigError(f"batches_per_step={self.per_step} counts the source batches drawn by weight per "
                                  "step: give weights= too; without them each step joins one batch of every source "
                                  "(mode='composition': set each source's batch_size to its rows per step)")
            return None
        if not isinstance(weights, Mapping) or set(map(str, weights)) != set(self.names):
            raise ConfigError(f"weights= must give a weight to each source and no other: sources {self.names}, "
                              f"weights {list(weights) if isinstance(weights, Mapping) else weights!r}")
        out = []
        for n in self.names:
            w = weights[n]
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not (0 < w < float("inf")):  # NumPy's too
                raise ConfigError(f"weights[{n!r}]={w!r} must be a positive number")
            out.append(float(w))
        sizes = {n: d.options.batch_size for n, d in zip(self.names, self.sources)}
        if len(set(sizes.values())) > 1:
            raise ConfigError(f"a mix by weights= joins whole source batches, so the sources need one batch_size: "
                              f"they have {sizes}; give them one, or leave out weights= (each step then joins one "
                              "batch of every source, of its own batch_size)")
        return out

    # -- epochs and state -----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next (or running) iteration follows."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration follows, from its first step (optional: otherwise
        each iteration follows the one after the previous iteration's). After
        :meth:`load_state_dict`, ``set_epoch`` of the restored epoch keeps its position (one
        restored after its last step then yields nothing), and of the next epoch (when the
        restored one was complete) starts it; another epoch drops the position, with a warning."""
        check_set_epoch_caller(sys._getframe(1))
        epoch = counted("epoch", epoch, 0, MAX_KEY)
        if self._running:  # the running iteration goes on; the next one follows this epoch
            self._after_run = epoch
            return
        if not (self._restored and epoch == self._epoch):
            if self._restored and self._runs and not (self._complete() and epoch == self._epoch + 1):
                log.warning("gpuload: Mix.set_epoch(%d) after load_state_dict drops the restored position in "
                            "epoch %d", epoch, self._epoch)
            self._runs, self._states, self._restored = [], {}, False
        self._epoch, self._advance, self._epoch_set = epoch, False, True

    def _complete(self) -> bool:
        return bool(self._runs) and self._runs[-1][2] >= self._runs[-1][1]

    def state_dict(self) -> dict:
        """Where the mix stands: the epoch, its runs of steps (``[ranks, steps, taken, drawn]``)
        and each started source's own state after the last step handed out (JSON-serialisable,
        the same on every rank). A state taken after an epoch's last step restores to the next."""
        return {"format": FORMAT, "version": VERSION, "epoch": self._epoch, "runs": copy.deepcopy(self._runs),
                "sources": copy.deepcopy(self._states), "mix": copy.deepcopy(self._signature)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict`): bit-exact on the same ranks; on
        others each source's pass goes on with every row once, and the rest of the epoch is
        drawn again for the new ranks and ended by the epoch's own rule (see :mod:`gpuload.mixplan`)."""
        if self._running:
            raise ConfigError("load_state_dict while an iteration of this mix is running: leave the loop first")
        if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
            raise ConfigError(f"this state is not a {FORMAT} state of version {VERSION}" + (
                ": a state of version 1, saved by an older gpuload whose shuffle orders differ, cannot be resumed "
                "exactly; do not load it (the epoch starts from its first batch)"
                if isinstance(state, dict) and state.get("format") == FORMAT and state.get("version") == 1 else ""))
        try:  # a hand-made or damaged state: said so, not a KeyError
            saved, sources, epoch = dict(state["mix"]), dict(state["sources"]), int(state["epoch"])
            runs = [list(map(int, r)) for r in state["runs"]]
            if any(len(r) != 4 for r in runs):
                raise ValueError("a run is [world, steps, taken, drawn]")
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"this {FORMAT} state is malformed ({type(e).__name__}: {e}): pass what "
                              "Mix.state_dict() returned") from None
        diff = sorted(k for k in set(saved) | set(self._signature) if saved.get(k) != self._signature.get(k))
        if diff:
            raise ConfigError(f"this state comes from a mix with other settings: {', '.join(diff)} differ "
                              f"(saved {[saved.get(k) for k in diff]}, here {[self._signature.get(k) for k in diff]})")
        while len(runs) > 1 and runs[-1][2] == 0:  # a run that took no step changed nothing
            runs.pop()
        was_set = self._epoch_set
        complete = bool(runs) and runs[-1][2] >= runs[-1][1]
        self._epoch_set = False
        if was_set and self._epoch != epoch:  # set_epoch came first (as a StatefulDataLoader restores)
            if complete and self._epoch == epoch + 1:  # the next epoch was selected: it begins
                self._runs, self._states, self._restored = [], {}, False
                return
            log.warning("gpuload: Mix.load_state_dict resumes epoch %d at step %d, not epoch %d given to set_epoch",
                        epoch, runs[-1][2] if runs else 0, self._epoch)
        self._epoch, self._runs, self._states = epoch, runs, copy.deepcopy(sources)
        self._restored, self._advance = True, complete and not was_set  # over: the next iteration begins the next

    def plan(self) -> MixPlan:
        """The :class:`gpuload.mixplan.MixPlan` of a whole epoch on the ranks of now (pure)."""
        worlds = {n: d.world_size for n, d in zip(self.names, self.sources)}
        if len(set(worlds.values())) > 1:
            raise ConfigError(f"the sources see different numbers of ranks {worlds}: give them the same "
                              "rank= and world_size= (or none)")
        sizes = [len(d.plan_epoch(0)[1]) for d in self.sources]
        return plan_mix(self.names, sizes, self.weights, mode=self.mode, per_step=self.per_step,
                        exhausted=self.exhausted, steps=self.steps_per_epoch)

    def __len__(self) -> int:
        """Steps each rank yields in a whole epoch, after :meth:`load_state_dict` too (as
        :class:`gpuload.ParquetDataset`'s ``len``: Lightning counts a resumed epoch's steps against
        it); the rest a restored epoch yields is :attr:`steps_left`. In an epoch begun on fewer ranks
        (restored, or running), the steps each rank took before plus those of the new ranks' run,
        where that is more (see :class:`gpuload.ParquetDataset`'s ``len``)."""
        whole, world = self.plan().steps, self.sources[0].world_size
        key = (self._epoch, world, self._restored, self._advance, self._running, str(self._runs))
        if self._counted is not None and self._counted[0] == key:  # a restored rest is worked out once (its
            return self._counted[1]  # sources' load_state_dict would log an elastic resume each time)
        runs = self._runs
        if self._restored and runs and not self._advance:
            run = self._run(self.plan(), world)
            runs = runs if run is runs[-1] else runs + [run]
        elif not (self._running and runs):
            return whole
        n = max(whole, sum(r[2] for r in runs[:-1]) + runs[-1][1])
        self._counted = (key, n)
        return n

    @property
    def steps_left(self) -> int:
        """Steps each rank's next iteration yields: after :meth:`load_state_dict`, the rest of the
        restored epoch (the same on every rank, on the ranks of now), else ``len(self)``."""
        if self._restored and self._runs and not self._advance:
            run = self._run(self.plan(), self.sources[0].world_size)
            return run[1] - run[2]
        return self.plan().steps

    def close(self) -> None:
        """Close every source (:meth:`gpuload.ParquetDataset.close`: remote fetches stopped, the next
        epoch's chunks loaded ahead dropped, their cached chunks evictable by other datasets); the mix
        can still be iterated, as a closed dataset can."""
        for d in self.sources:
            d.close()

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        check_iter_caller(sys._getframe(1))
        return self._iterate()

    def _run(self, p: MixPlan, world: int) -> list[int]:
        """The run ``[world, steps, taken, drawn]`` a restored epoch goes on with on ``world`` ranks:
        its last one, or on other ranks a new one over the rest (:func:`gpuload.mixplan.rest_steps`)."""
        last = self._runs[-1]
        if last[0] == world:
            return last
        left, first_pass = [], []
        for i, (n, d) in enumerate(zip(self.names, self.sources)):
            st = self._states.get(n)
            if st is None:  # not begun: its first pass, whole
                left.append(p.sizes[i])
                first_pass.append(True)
            else:
                d.load_state_dict(st["state"])
                left.append(d._cursor.left())  # the rest of its pass, shared among these ranks
                first_pass.append(st["pass"] == 0)
        steps = rest_steps(p, self.weights, left, first_pass, self.exhausted)  # each source its exact share
        if self.steps_per_epoch is not None:  # the epoch's own rule: its steps' worth of batches (on the first
            first = self._runs[0]  # run's ranks), less those taken, shared by these ranks (each the same steps)
            fixed = max(0, first[0] * first[1] - sum(r[0] * r[2] for r in self._runs)) // world
            steps = fixed if self.exhausted == "repeat" else min(fixed, steps)  # "end": never past a pass
        return [world, steps, 0, steps]  # (the labels of `steps` steps drawn: rest_labels)

    def _begin(self) -> tuple[MixPlan, list, int]:
        """(the plan, this run's labels from the next step on) for the iteration starting now."""
        if self._running:
            raise ConfigError("this Mix is being iterated already: one iteration at a time")
        if self._advance:  # a new iteration without set_epoch: the next epoch
            self._epoch, self._runs, self._states = self._epoch + 1, [], {}
        p, world = self.plan(), self.sources[0].world_size
        if not self._runs:
            self._runs, self._states = [[world, p.steps, 0, p.steps]], {}
        else:
            run = self._run(p, world)
            if run is not self._runs[-1]:  # resumed on other ranks: a new run over the rest
                self._runs.append(run)
        self._agreement.check(self._epoch, {**self._signature, "world": world, "runs": self._runs})
        self._advance, self._restored, self._epoch_set = True, False, False
        j = len(self._runs) - 1
        steps, taken, drawn = self._runs[j][1:]
        got = labels(p, self.key, self.seed, self._epoch) if j == 0 else \
            rest_labels(p, self.weights, drawn, self.key, self.seed, self._epoch, j)
        return p, got[taken * p.per_step:steps * p.per_step]

    def _iterate(self) -> Iterator[dict]:
        p, lab = self._begin()
        states, run, epoch = copy.deepcopy(self._states), self._runs[-1], self._epoch
        if self._stream is None and self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        producer = Background(lambda stop: mix_steps(self, p, lab, states, epoch, stream, stop), depth=self.prefetch,
                              name="gpuload-mix")
        self._running = True

        def taken(item) -> None:  # the step handed out: the run counts it, the sources' states follow it
            run[2] += 1
            self._states = item[1]

        try:
            hold = None if stream is None else self.sources[0].reader.device.hold(stream)
            yield from handed_out(producer, self.metrics, lambda item: receive(item[0], item[2], self.device, hold),
                                  taken)
            run[1] = run[2]  # ended (early, where exhausted='end' ran a source out)
        finally:
            self._running = False
            if not producer.finished:  # a source may be stalled (a remote store): let it go now
                for d in self.sources:
                    d.reader.interrupt()
            producer.close()
            if self._after_run is not None:  # set_epoch during the iteration: for the next one
                after_run, self._after_run = self._after_run, None
                self._runs, self._states, self._restored = [], {}, False
                self._epoch, self._advance, self._epoch_set = after_run, False, True

    # -- measurement ------------------------------------------------------------------------------
    def stats(self, all_ranks: bool = False):
        """The mix's :class:`gpuload.Stats` (the training thread's waits), with ``sources``: each
        source's own stats, whose waits are the mix thread's waits for that source
        (``all_ranks=True``: every rank's, gathered, as :meth:`ParquetDataset.stats` does)."""
        st = dataclasses.replace(self.metrics.stats(), loader="gpuload", loader_settings={"mix": self.names},
                                 sources={n: d.stats() for n, d in zip(self.names, self.sources)},
                                 during_waits=None)  # the sources' stages run in their own Metrics
        return gather(st, _Counters(self.sources)) if all_ranks else st

    def reset_stats(self) -> None:
        """Start :meth:`stats` afresh, for the mix and every source."""
        self.metrics.reset()
        for d in self.sources:
            d.reset_stats()

    def loader_description(self) -> tuple[str, dict]:
        return "gpuload", {"mix": self.names}

    @property
    def outputs(self) -> list[str]:
        """Names of the tensors in each batch (the provenance output last, when asked for)."""
        return self.sources[0].outputs + ([self.provenance] if self.provenance else [])

    def __repr__(self) -> str:
        what = f"weights={dict(zip(self.names, self.weights))}" if self.weights else "composition"
        return f"Mix({self.names}, {what}, batches_per_step={self.per_step}, exhausted={self.exhausted!r})"


class _Counters:
    """The chunk counters of all of a mix's sources, summed."""

    def __init__(self, sources):
        self.decoded = sum(d.reader.counters.decoded for d in sources)
        self.from_cache = sum(d.reader.counters.from_cache for d in sources)


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{setting(name, value)} is not one of {', '.join(map(repr, allowed))}")

