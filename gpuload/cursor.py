"""Cursor: where a dataset's epochs stand, as ``set_epoch``, ``load_state_dict`` and its
iterations move it, and the state that records it.

The order of an epoch is pure (:class:`gpuload.epochs.EpochPlan`, :mod:`gpuload.resume`);
which epoch an iteration follows, and from which position, is the one stateful part of it.
A :class:`gpuload.ParquetDataset` keeps one :class:`Cursor` and hands it its epoch methods
(after checking who calls them). The cursor asks the ranks of its
:class:`~gpuload.ranks.RankLayout` when it needs them, as the dataset's methods do.

States
------
``epoch``
    The epoch the next iteration follows; once an iteration began (and no ``set_epoch``
    came since), the epoch that iteration follows, the next one following ``epoch + 1``.
``pending``
    A :class:`~gpuload.epochs.Position` restored by ``load_state_dict`` and not iterated yet,
    else None. It is fitted to this dataset's ranks when they are known: at the load, else
    when the iteration begins.
``position``
    The latest iteration's position: ``running`` while its iterator is open, afterwards what
    a state taken now records (until ``set_epoch`` or ``load_state_dict`` drops it). None
    before the first iteration.
``epoch_set``
    ``set_epoch`` was called since the last ``load_state_dict`` or since an iteration began.
``advance``
    The next iteration follows ``epoch + 1``: an iteration began and no ``set_epoch`` came
    since (Lightning never calls it), or the restored epoch was complete.

Transitions
-----------
``set_epoch(e)``
    ``epoch = e``, ``epoch_set``, no ``advance``. A pending position of another epoch is
    dropped, with a warning unless ``e`` is the epoch after a complete one. A position not
    running is dropped: the next iteration starts ``e`` from its first batch, or where a
    state loaded later puts it.
``load_state_dict(state)``
    Refused while an iteration runs. The state is checked (format, the dataset's signature,
    runs this dataset can have); runs after the first that took no batch changed nothing and
    go. The restored position becomes ``pending`` and its epoch ``epoch`` (``advance`` where
    that epoch was complete); ``position`` and ``epoch_set`` are cleared. When ``set_epoch``
    came first (a StatefulDataLoader restores the dataset inside ``iter()``): of the epoch
    after a complete restored one, that epoch begins and the state is dropped; of another
    epoch, the state wins with a warning.
``begin()``, an iteration begins
    The ranks are asked again and checked. With ``advance``, ``epoch + 1`` and no pending
    position. The iteration's position: the pending one's runs, as these ranks go on with
    them (an elastic resume is logged once), else the first run of ``epoch``. It becomes the
    running ``position``; ``pending`` and ``epoch_set`` are cleared, ``advance`` is set.
    Each batch handed out is counted (:meth:`~gpuload.epochs.Position.take`), so a state
    taken after it resumes after it; when the iteration ends (its last batch, left early,
    or failed) its position stops running.
``state_dict()``
    The running position, or the latest one while no position is pending and its epoch is
    ``epoch``; else the pending position as these ranks will go on with it (while they are
    unknown, as saved less runs after the first that took no batch); else the first run of
    ``epoch``, nothing taken. A complete position restores to the next epoch (see
    ``load_state_dict``).

Warnings are logged on the ``gpuload`` logger: a restored position dropped by
``set_epoch``, a state resumed at another epoch than ``set_epoch`` gave, and (by
:meth:`~gpuload.epochs.EpochPlan.go_on`) an elastic resume.
"""

from __future__ import annotations

import copy
import logging

from . import plan, resume
from .agree import Agreement
from .epochs import EpochPlan, Position
from .errors import ConfigError, counted
from .ranks import RankLayout, Ranks

__all__ = ["Cursor"]

log = logging.getLogger("gpuload")


class Cursor:
    """The epoch position of one dataset (see the module doc for its states and transitions).

    ``plan``: the dataset's epochs; ``layout``: where its ranks come from; ``signature``: the
    ``dataset`` field of its states (:func:`gpuload.resume.signature`); ``agreement``: where an
    iteration's order settings are compared with the other ranks' (default None: not compared).
    """

    def __init__(self, plan: EpochPlan, layout: RankLayout, signature: dict, agreement: Agreement | None = None):
        self._plan, self._layout, self._signature = plan, layout, signature
        self._agreement = agreement
        self.epoch = 0
        self.pending: Position | None = None
        self.position: Position | None = None
        self.epoch_set = False
        self.advance = False
        self.told: int | None = None  # what len() said last, until an iteration begins

    # -- transitions ----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration follows (see ``set_epoch`` in the module doc)."""
        epoch = counted("epoch", epoch, 0, plan.MAX_KEY)
        p = self.pending
        if p is not None and epoch != p.epoch:
            if not (epoch == p.epoch + 1 and p.complete):
                log.warning("gpuload: set_epoch(%d) after load_state_dict: the restored position (epoch %d, "
                            "batch %d) is dropped, and epoch %d starts from its first batch",
                            epoch, p.epoch, p.runs[-1].taken, epoch)
            self.pending = None
        if self.position is not None and not self.position.running:
            self.position = None  # the next iteration starts this epoch afresh (or where a state put it)
        self.epoch, self.epoch_set, self.advance = epoch, True, False

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (see ``load_state_dict`` in the module doc)."""
        if self.position is not None and self.position.running:
            raise ConfigError("load_state_dict while an iteration of this dataset is running: let it finish, "
                              "or close its iterator first (leave the for loop, or call it.close()); through a "
                              "StatefulDataLoader, restore with loader.load_state_dict, which drops its iterator")
        epoch, runs, saved = resume.check_state(state)
        resume.check_signature(saved, self._signature)
        self._plan.runs(runs)  # refuses runs this dataset cannot have
        while len(runs) > 1 and runs[-1].taken == 0:  # a run that took no batch changed nothing (even one
            runs = runs[:-1]  # with none to take: the ranks before it go on exactly, others share the rest)
        # complete as saved, whichever ranks go on: a rest with no batch for them (more ranks than
        # its rows, say) is still that epoch's rest, an empty iteration
        complete = self._plan.runs(runs)[-1].complete
        pending = Position(epoch, runs)
        pending.complete = complete
        ranks = self._layout.resolve(strict=False)
        if ranks is not None:  # how these ranks will go on, said now (else when the iteration begins)
            pending.runs, pending.ranks = self._plan.go_on(pending, self._plan.check(ranks), warn=True), ranks
        self.position = None
        was_set, self.epoch_set = self.epoch_set, False
        if was_set and self.epoch != epoch:
            if complete and self.epoch == epoch + 1:  # set_epoch(next) came first: that epoch begins
                self.pending = None
                return
            log.warning("gpuload: load_state_dict resumes epoch %d at batch %d, not epoch %d given to set_epoch",
                        epoch, runs[-1].taken, self.epoch)
        self.epoch, self.pending = epoch, pending
        self.advance = complete and not was_set  # an epoch that was over: the next iteration begins the next
        told, self.told = self.told, None
        # go_on adds a run where other ranks go on: an elastic restore
        if ranks is not None and not complete and pending.runs is not None and len(pending.runs) > len(runs):
            self._warn_elastic_count(epoch)
        if told is not None and ranks is not None and not complete:
            now = self.batches()
            if now > told:
                log.warning("gpuload: len() said %d batches before this restore of epoch %d, which began on fewer "
                            "ranks; it is %d now (the batches each rank took before plus this run's): a loop that "
                            "counted to len() before the restore stops %d batches a rank short of the epoch's end "
                            "(Lightning counts so when its own checkpoint restores the dataset: restore it in "
                            "on_load_checkpoint instead, see the README)", told, epoch, now, now - told)

    def _warn_elastic_count(self, epoch: int) -> None:
        """At a restore on other ranks than the epoch's: where the resumed epoch's count (what :meth:`batches`
        says) and a whole epoch's differ, a framework that reads ``len()`` once for the whole run ends an epoch
        before its count, and that epoch's end-of-epoch work (Lightning: validation) is skipped. Said once."""
        exact, whole = self._counted(self.pending.runs), self.whole()
        if exact == whole:
            return
        which = (f"epoch {epoch} ends {whole - exact} batches a rank before it" if exact < whole else
                 f"every later epoch ends {exact - whole} batches a rank before it")
        log.warning("gpuload: epoch %d resumes on other ranks than it began on: len() counts %d batches a rank for "
                    "it (those taken before and this run's: %d) and %d for each later epoch. A framework that reads "
                    "len() once for the whole run counts %d for every epoch: %s, and its end-of-epoch work (Lightning: "
                    "validation, checkpoints on a validation metric) is skipped there; every row is still delivered "
                    "once. Under Lightning, reload_dataloaders_every_n_epochs=1 reads len() each epoch (the later "
                    "epochs then count right); resuming on the ranks the epoch began on avoids it", epoch,
                    max(exact, whole), exact, whole, max(exact, whole), which)

    def begin(self) -> Position:
        """The running position of the iteration beginning now (see ``begin()`` in the module doc)."""
        ranks = self._plan.check(self._layout.resolve())  # each epoch asks torch.distributed again
        epoch, p = (self.epoch + 1, None) if self.advance else (self.epoch, self.pending)
        runs = self._plan.first_run(ranks) if p is None or p.epoch != epoch else \
            p.runs if p.ranks == ranks else self._plan.go_on(p, ranks, warn=True)
        if self._agreement is not None:  # the other ranks' settings: refused before anything changes here
            self._agreement.check(epoch, {**self._signature, "rank": ranks.rank, "world": ranks.world,
                                          "local": ranks.local, "runs": [r.to_list() for r in runs]})
        self.epoch = epoch
        pos = Position(self.epoch, runs, ranks)
        pos.running = True
        self.pending, self.position, self.epoch_set, self.advance, self.told = None, pos, False, True, None
        return pos

    # -- what the state is now -----------------------------------------------------------
    def state_dict(self) -> dict:
        """The state of now (see ``state_dict()`` in the module doc), as :func:`gpuload.resume.state_of` writes it."""
        p, pending = self.position, self.pending
        if p is not None and (p.running or (pending is None and p.epoch == self.epoch)):
            epoch, runs = p.epoch, p.runs
        elif pending is not None:
            ranks = self._layout.resolve(strict=False)  # the restored runs as these ranks will go on with them
            epoch = pending.epoch
            runs = pending.raw if ranks is None else pending.runs if ranks == pending.ranks else \
                self._plan.go_on(pending, self._plan.check(ranks), warn=False)
        else:
            epoch, runs = self.epoch, self._plan.first_run(self.ranks())
        return resume.state_of(epoch, runs, copy.deepcopy(self._signature))  # the caller's to change

    def ranks(self) -> Ranks:
        """The ranks of now: the running epoch's while an iteration runs (a process group changed
        since it began is the next epoch's concern), else the layout's, checked."""
        p = self.position
        if p is not None and p.running and p.ranks is not None:
            return p.ranks
        return self._plan.check(self._layout.resolve())

    # -- a whole epoch on the ranks of now -----------------------------------------------
    def whole(self) -> int:
        """Batches each rank yields in a whole epoch."""
        return self._plan.first(self.ranks()).batches

    def batches(self) -> int:
        """The epoch's batches per rank as a framework counts them: a whole epoch, except in an epoch
        begun on more ranks before (restored, or running, elastic), where the batches each rank took in
        the epoch's earlier runs plus those of the run that goes on are more. Lightning counts the
        batches done before a checkpoint and after it against this, and keeps the count it read for
        the epochs after: a whole epoch of the new ranks would stop the resumed one short of its rows,
        the resumed one's count alone (smaller, on fewer ranks) every later one; with the larger of
        the two an epoch ends with its last batch, at most a few batches before the count."""
        p, pending = self.position, self.pending
        if p is not None and p.running:
            runs = p.runs
        elif pending is not None and not self.advance and pending.epoch == self.epoch and not pending.complete:
            ranks = self.ranks()
            runs = pending.runs if pending.ranks == ranks else self._plan.go_on(pending, ranks, warn=False)
        else:
            self.told = self.whole()
            return self.told
        self.told = max(self.whole(), self._counted(runs))
        return self.told

    def _counted(self, runs) -> int:
        """Batches a rank takes in an epoch of ``runs``: those each rank took in the earlier runs, and the last run's."""
        done = self._plan.runs(runs)
        return sum(r.taken for r in done[:-1]) + done[-1].batches

    def fresh(self, epoch: int) -> None:
        """Select ``epoch`` from its first batch, dropping a restored or left position silently
        (a :class:`gpuload.Mix` starting one of its sources' passes)."""
        self.pending, self.position = None, None
        self.epoch, self.epoch_set, self.advance = epoch, True, False

    def batches_next(self) -> int:
        """Batches each rank's next iteration yields: the rest of the restored epoch it goes on
        with (see :meth:`begin`), else a whole epoch."""
        p = self.pending
        if p is not None and not self.advance and p.epoch == self.epoch:
            return self.left()
        return self.whole()

    def left(self) -> int | None:
        """Batches each rank has left of a restored position on the ranks of now (0 when it was
        complete); None when no position was restored (see :meth:`load_state_dict`)."""
        p = self.pending
        if p is None:
            return None
        if p.complete:
            return 0
        ranks = self.ranks()
        last = self._plan.runs(p.runs if p.ranks == ranks else self._plan.go_on(p, ranks, warn=False))[-1]
        return last.batches - last.taken

    def rows_per_epoch(self) -> int:
        """Rows a whole epoch delivers over all ranks."""
        ranks = self.ranks()
        run = self._plan.first(ranks)
        return sum(run.sizes(r).rows_before(run.batches) for r in range(ranks.world))

    def node_chunks(self) -> list[list[int]]:
        """The chunks each node owns (``shard="node"`` only)."""
        if not self._layout.node:
            raise ConfigError("node_chunks() is for shard='node'")
        ranks = self.ranks()
        return [o.tolist() for o in self._plan.node_plan(ranks.world, ranks.local)[0]]

    def plan_epoch(self, epoch: int | None = None) -> tuple[list[list[plan.Segment]], plan.BatchSizes]:
        """This rank's windows and batch sizes for a whole ``epoch`` (default: ``self.epoch``)."""
        epoch = self.epoch if epoch is None else counted("epoch", epoch, 0, plan.MAX_KEY)
        ranks = self.ranks()
        return (self._plan.windows(epoch, ranks.world, ranks.rank, ranks.local),
                self._plan.first(ranks).sizes(ranks.rank))
