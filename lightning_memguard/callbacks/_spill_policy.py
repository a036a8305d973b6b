"""What a spill leads to in MemGuard, chosen once from ``on_spill`` (:func:`spill_policy`): one class a behaviour,
each owning its decision, the adaptation where it adapts, and when a memory report is triggered (on a spill, an
out-of-memory error, allocator thrash, each adaptation).

A spill that every rank agreed on, at a batch's start / at an epoch's end:

- ``"raise"``: saved and raised before the batch trains / saved and raised;
- ``"stop"``: the batch trains (its report measured as it does), then saved and stopped / saved and stopped;
- ``"warn"``: never voted on: each rank warns once, when it finds its spill / nothing;
- ``"adapt"``: the run goes on adapted (:class:`~lightning_memguard.tuning.adapter.RunAdapter`'s next lever); where
  no lever is left (the floor reached: micro-batches of one sample with checkpointing on), none can be used (manual
  optimization, a model with training BatchNorm and no blocks) or the readings say nothing fits, as ``"stop"``,
  saying why.

MemGuard watches (the steps, the detector, every rank's vote, the readings) and asks its policy at each hook; the
policy reads no memory itself, MemGuard reads where it asks (:attr:`SpillPolicy.judges_validation`,
:meth:`SpillPolicy.growth_due`). How a spill is said, saved, raised or stopped is
:class:`~lightning_memguard.callbacks._spill_response.SpillResponse`'s; how a report is measured and written,
:class:`~lightning_memguard.callbacks._reporting.MemoryReports`'.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memguard._lightning.agreement import StopVote
from lightning_memguard.callbacks._reporting import MemoryReports
from lightning_memguard.callbacks._spill_response import SpillResponse
from lightning_memguard.core.spill import SpillReport
from lightning_memguard.probes import MemoryReading
from lightning_memguard.tuning.adapt import Adaptation
from lightning_memguard.tuning.adapter import RunAdapter, refuse_to_adapt


class SpillPolicy:
    """What a spill leads to, and when a memory report is triggered: the base of the four policies. Here, what they
    share: allocator thrash and an out-of-memory error reported, and every question MemGuard asks answered as a
    policy that does not adapt answers it.

    Args:
        reports: MemGuard's memory reports, armed on the batch in flight or measured now where the policy says.
        spill_checkpoint: where the checkpoint written before a stop goes: ``True`` (Lightning's checkpoint folder),
            a folder, or ``False`` for none.
        headroom: the fraction of capacity a healthy run leaves free.
    """

    votes = True  # a spill found on one rank is voted on, and every rank acts on it at the same step
    raises = False  # acting on a spill raises SysmemSpillError (else it stops the Trainer)

    def __init__(
        self, reports: MemoryReports, spill_checkpoint: bool | str | os.PathLike[str], headroom: float
    ) -> None:
        self.reports = reports
        self.spill_checkpoint = spill_checkpoint
        self.headroom = headroom
        self.chosen_from: tuple[Any, ...] = ()  # the MemGuard settings it was made from
        self.start_fit()

    # ------------------------------------------------------------------ fit

    def start_fit(self) -> None:
        """Forget the previous fit: its response (the checkpoint, the message) and what waited for a report."""
        self.response = SpillResponse(self.spill_checkpoint, self.headroom)
        self._thrash: MemoryReading | None = None  # the reading whose thrash waits for the armed report

    def setup(self, trainer: Trainer) -> None:
        """Refuse a Trainer this policy cannot serve (``"adapt"`` under DeepSpeed)."""

    def train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Training starts, after the tuners' trials (they train steps of their own)."""

    def end_fit(self) -> None:
        """The fit ended: nothing of it kept beyond what it taught."""

    @property
    def adaptations(self) -> list[Adaptation]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """MemGuard's whole state, from a checkpoint: this policy's part of it, if any."""

    # ------------------------------------------------------------------ readings

    def read(self, trainer: Trainer, reading: MemoryReading) -> None:
        """Memory was read between steps: what the next step starts from (for the advice), and allocator thrash
        reported (once a fit)."""
        if reading.allocated_now is not None:
            self.response.allocated_now = reading.allocated_now
        if self.reports.retries_grew(reading.alloc_retries):
            note = self._report(trainer, "thrash")
            if note is None:
                self._thrash = reading
            else:
                _thrash_said(reading, note)

    def found(self, trainer: Trainer, report: SpillReport, size: int | None) -> None:
        """This rank found a spill (once a fit). ``size``: the run's batch size. Here: nothing until every rank
        agrees (:meth:`agreed`)."""

    # ------------------------------------------------------------------ a spill agreed

    def agreed(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        spill: SpillReport | None,
        vote: StopVote | None,
        size: int | None,
        batch: Any,
    ) -> bool:
        """Every rank agreed on a spill at the start of ``batch`` (this rank's ``spill``: None where another rank
        spilled). True: the run goes on adapted from this batch (MemGuard watches it afresh)."""
        return False

    def settle(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        spill: SpillReport | None,
        vote: StopVote | None,
        size: int | None,
    ) -> bool:
        """An epoch's end, where no later batch start may come to act on a spill found in its last steps (the last
        epoch, ``fast_dev_run``, ``limit_train_batches=1``): every rank decides now, together, without lag. True: the
        run goes on adapted."""
        return False

    def batch_started(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """MemGuard's batch start is done: a report the batch in flight is to be measured for, armed."""

    def growth_due(self, trainer: Trainer) -> bool:
        """Whether MemGuard should read memory now to let :meth:`grow` try a smaller split."""
        return False

    def grow(self, trainer: Trainer, reading: MemoryReading, capacity: int, size: int | None) -> bool:
        """True: the run goes on in fewer micro-batches (MemGuard watches it afresh)."""
        return False

    @property
    def judges_validation(self) -> bool:
        """Whether validation is judged by its own peak (MemGuard reads memory before and after it)."""
        return False

    def validation_end(self, trainer: Trainer, reading: MemoryReading, capacity: int) -> None:
        """Validation ended, ``reading`` taken after it (only where :attr:`judges_validation`)."""

    def batch_end(
        self,
        trainer: Trainer,
        note: str | None,
        spill: SpillReport | None,
        vote: StopVote | None,
        size: int | None,
    ) -> None:
        """The batch in flight trained; ``note``: the report armed on it, written (None: none was armed)."""
        if note is not None:
            self._noted(note)

    def out_of_memory(self, trainer: Trainer, pl_module: LightningModule, error: BaseException) -> None:
        """An exception ended the fit: an out-of-memory error's report, named in its message."""
        self.reports.out_of_memory(trainer, pl_module, error)

    # ------------------------------------------------------------------ shared

    def _report(self, trainer: Trainer, why: str, spill: SpillReport | None = None) -> str | None:
        """A report on the batch in flight as it trains (None: :meth:`batch_end` gets its note), else on the batch
        in hand, measured now (its note; empty where reports are off). ``spill``: the spill reported on."""
        module = trainer.lightning_module
        if self.reports.can_arm:
            self.reports.arm(trainer, module, why, spill=spill)
            return None
        return self.reports.now(trainer, module, why, spill=spill)

    def _noted(self, note: str) -> None:
        """The report armed in this step was written: ``note`` handed to whatever waited for it."""
        if self._thrash is not None:
            _thrash_said(self._thrash, note)
            self._thrash = None

    def _act(
        self,
        trainer: Trainer,
        spill: SpillReport | None,
        vote: StopVote | None,
        size: int | None,
        after_batch: bool = False,
    ) -> None:
        """Save, then raise or stop, every rank at this step; the batch in hand measured first where no report was
        armed on a training batch."""
        response = self.response
        if response.report_note is None:
            response.report_note = self.reports.now(trainer, trainer.lightning_module, "spill", spill=spill)
        response.act(trainer, spill, vote, size, self.raises, after_batch)


class RaiseOnSpill(SpillPolicy):
    """``on_spill="raise"``: every rank saves and raises :class:`SysmemSpillError` before the batch at whose start
    it agreed trains; the checkpoint holds every batch before it."""

    raises = True

    def agreed(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        spill: SpillReport | None,
        vote: StopVote | None,
        size: int | None,
        batch: Any,
    ) -> bool:
        self._act(trainer, spill, vote, size)
        return False

    def settle(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        spill: SpillReport | None,
        vote: StopVote | None,
        size: int | None,
    ) -> bool:
        if trainer.strategy.reduce_boolean_decision(spill is not None, all=False):
            self._act(trainer, spill, vote, size)
        return False


class StopOnSpill(SpillPolicy):
    """``on_spill="stop"``: the batch at whose start every rank agreed trains (a callback cannot skip it: only the
    LightningModule's ``on_train_batch_start`` can), its report measured as it does; at its end every rank saves and
    stops, so the checkpoint holds every batch the run trained."""

    def start_fit(self) -> None:
        super().start_fit()
        self._stop_due = False  # a stop agreed at this batch's start: acted on when it has trained

    def agreed(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        spill: SpillReport | None,
        vote: StopVote | None,
        size: int | None,
        batch: Any,
    ) -> bool:
        if self.reports.can_arm:  # measured as the batch trains
            self.reports.arm(trainer, pl_module, "spill", spill=spill)
        self._stop_due = True
        return False

    settle = RaiseOnSpill.settle  # at an epoch's end no batch is left to train first: every rank acts now

    def batch_end(
        self,
        trainer: Trainer,
        note: str | None,
        spill: SpillReport | None,
        vote: StopVote | None,
        size: int | None,
    ) -> None:
        super().batch_end(trainer, note, spill, vote, size)
        if self._stop_due:
            self._stop_due = False
            if note is not None:  # the batch's report, armed with the stop
                self.response.report_note = note
            self._act(trainer, spill, vote, size, after_batch=True)


class WarnOnSpill(SpillPolicy):
    """``on_spill="warn"``: each rank warns once, when it finds its spill, naming the report of that step; no rank
    votes, saves or stops."""

    votes = False

    def start_fit(self) -> None:
        super().start_fit()
        self._warning: tuple[SpillReport, int | None] | None = None  # a spill whose warning waits for its report

    def found(self, trainer: Trainer, report: SpillReport, size: int | None) -> None:
        note = self._report(trainer, "spill", spill=report)
        if note is None:
            self._warning = (report, size)
        else:
            self.response.warn(report, size, note)

    def _noted(self, note: str) -> None:
        super()._noted(note)
        if self._warning is not None:
            report, size = self._warning
            self._warning = None
            self.response.warn(report, size, note)


class AdaptOnSpill(StopOnSpill):
    """``on_spill="adapt"``: the run goes on in a configuration that fits, driving a
    :class:`~lightning_memguard.tuning.adapter.RunAdapter` (a fresh one each fit); where it cannot, it stops as
    ``"stop"`` does, saying why. Each adaptation's report is measured on the first step that runs in it.

    Args:
        reports: as :class:`SpillPolicy`'s.
        spill_checkpoint: as :class:`SpillPolicy`'s.
        headroom: as :class:`SpillPolicy`'s; also what a configuration must leave free to be grown into.
        allow_batchnorm: ``MemGuard(adapt_batchnorm=...)``.
        grow_every: ``MemGuard(grow_every=...)``.
        loss: ``MemGuard(adapt_loss=...)``.
        clock: ``MemGuard(clock=...)``: what times each switch of the savers.
    """

    def __init__(
        self,
        reports: MemoryReports,
        spill_checkpoint: bool | str | os.PathLike[str],
        headroom: float,
        allow_batchnorm: bool,
        grow_every: int,
        loss: str | Callable[[Any], Any],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.allow_batchnorm = allow_batchnorm
        self.grow_every = grow_every
        self.loss = loss
        self.clock = clock
        super().__init__(reports, spill_checkpoint, headroom)

    def start_fit(self) -> None:
        super().start_fit()
        self.adapter = RunAdapter(self.allow_batchnorm, self.grow_every, self.headroom, self.loss, self.clock)
        self._reported = 0  # adaptations whose report was armed, or that a resumed run brought
        self._adapted_due = False  # the report armed on the first step after an adaptation

    def setup(self, trainer: Trainer) -> None:
        refuse_to_adapt(trainer)

    def train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.adapter.start(trainer, pl_module)
        self._reported = len(self.adapter.adaptations)  # a resumed run's earlier ones are reported

    def end_fit(self) -> None:
        self.adapter.stop()

    @property
    def adaptations(self) -> list[Adaptation]:
        return list(self.adapter.adaptations)

    def state_dict(self) -> dict[str, Any]:
        return {"adapt": self.adapter.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adapter.load_state_dict(state.get("adapt", {}))  # a resumed run starts in the configuration it adapted to

    def read(self, trainer: Trainer, reading: MemoryReading) -> None:
        super().read(trainer, reading)
        self.adapter.read(reading, self.reports.capacity or reading.capacity)  # an out-of-memory error's room

    def agreed(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        spill: SpillReport | None,
        vote: StopVote | None,
        size: int | None,
        batch: Any,
    ) -> bool:
        if self._adapted(trainer, pl_module, spill, size, batch):
            return True
        return super().agreed(trainer, pl_module, spill, vote, size, batch)

    def settle(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        spill: SpillReport | None,
        vote: StopVote | None,
        size: int | None,
    ) -> bool:
        # a spill in the epoch's last steps: the next epoch runs adapted, or the run stops
        if not trainer.strategy.reduce_boolean_decision(spill is not None, all=False):
            return False
        if self._adapted(trainer, pl_module, spill, size):
            return True
        self._act(trainer, spill, vote, size)
        return False

    def _adapted(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        spill: SpillReport | None,
        size: int | None,
        batch: Any = None,
    ) -> bool:
        """The adapter's next lever (True), or why there is none, kept for the stop's message (False)."""
        why_not = self.adapter.after_spill(trainer, pl_module, spill, size or 1, self.response.allocated_now, batch)
        if why_not is not None:
            self.response.cannot_adapt = why_not
            return False
        self._leave_behind()
        return True

    def batch_started(self, trainer: Trainer, pl_module: LightningModule) -> None:
        adaptations = self.adapter.adaptations
        if len(adaptations) <= self._reported:
            return
        self._reported = len(adaptations)
        if self.reports.can_arm:  # the first step in the new configuration
            latest = adaptations[-1]
            grown = latest.after < latest.before or latest.savers_off
            grew_back = latest.line() if grown else None  # fits: nothing to fix
            self.reports.arm(trainer, pl_module, "adaptation", grew_back=grew_back)
            self._adapted_due = True

    def _noted(self, note: str) -> None:
        super()._noted(note)
        if self._adapted_due:
            self._adapted_due = False
            if note:
                rank_zero_info("MemGuard: the first step after adapting" + note)

    def growth_due(self, trainer: Trainer) -> bool:
        """Now and then, while adapted: whether fewer micro-batches, or (whole again) no savers, are to be tried."""
        adapter = self.adapter
        return adapter.can_grow and adapter.grow.due(trainer.global_step)

    def grow(self, trainer: Trainer, reading: MemoryReading, capacity: int, size: int | None) -> bool:
        if not self.adapter.maybe_grow(trainer, reading, capacity, size or 1):
            return False
        self._leave_behind()
        return True

    @property
    def judges_validation(self) -> bool:
        return self.adapter.installed

    def validation_end(self, trainer: Trainer, reading: MemoryReading, capacity: int) -> None:
        if trainer.strategy.reduce_boolean_decision(reading.used > capacity, all=False):
            self.adapter.after_validation_spill(trainer, reading, capacity)

    def _leave_behind(self) -> None:
        """A new configuration runs: the response to the one that spilled is left behind with it (its advice, its
        reason not to adapt)."""
        self.response = SpillResponse(self.spill_checkpoint, self.headroom)


POLICIES: dict[str, type[SpillPolicy]] = {"raise": RaiseOnSpill, "stop": StopOnSpill, "warn": WarnOnSpill}


def spill_policy(
    on_spill: str,
    reports: MemoryReports,
    spill_checkpoint: bool | str | os.PathLike[str],
    headroom: float,
    *,
    adapt_batchnorm: bool = False,
    grow_every: int = 200,
    adapt_loss: str | Callable[[Any], Any] = "auto",
    clock: Callable[[], float] = time.perf_counter,
) -> SpillPolicy:
    """The policy ``on_spill`` names: ``"raise"``, ``"stop"``, ``"warn"`` or ``"adapt"`` (with the adapter's
    settings, as :class:`~lightning_memguard.callbacks.memguard.MemGuard` takes them, and its clock)."""
    if on_spill == "adapt":
        return AdaptOnSpill(reports, spill_checkpoint, headroom, adapt_batchnorm, grow_every, adapt_loss, clock)
    return POLICIES[on_spill](reports, spill_checkpoint, headroom)


def _thrash_said(reading: MemoryReading, note: str) -> None:
    rank_zero_warn(
        f"MemGuard: PyTorch's CUDA allocator had to free its cache and retry allocations ({reading.alloc_retries} so"
        " far): memory is at its limit and steps slow down (allocator thrash). A smaller micro-batch or activation"
        " checkpointing leaves it room." + note,
        category=RuntimeWarning,
    )
