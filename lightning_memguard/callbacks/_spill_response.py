"""How MemGuard says and acts on a spill its policy chose to: warn, or, every rank at the same step, save and raise or
stop."""

from __future__ import annotations

import os

import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_memguard._lightning.agreement import StopVote
from lightning_memguard._lightning.spill_checkpoint import checkpoint_folder, write_checkpoint
from lightning_memguard.core.advice import FitAdvice
from lightning_memguard.core.messages import FIXES, SysmemSpillError, format_spill_message
from lightning_memguard.core.spill import SpillReport


class SpillResponse:
    """How a spill is said and acted on, once the policy (:mod:`lightning_memguard.callbacks._spill_policy`) has
    chosen: a warning, or a checkpoint then a raise or a stop on every rank together, each rank's message carrying
    the spilling rank's figures.

    Args:
        spill_checkpoint: ``True`` (Lightning's checkpoint folder), a folder, or ``False`` for none.
        headroom: the fraction of capacity a healthy run leaves free (for what would fit).
    """

    def __init__(self, spill_checkpoint: bool | str | os.PathLike[str], headroom: float) -> None:
        self.spill_checkpoint = spill_checkpoint
        self.headroom = headroom
        self.checkpoint_path: str | None = None  # the spill checkpoint, once written (a file that exists)
        self.checkpoint_error: str | None = None  # why it could not be written, if it could not
        self.allocated_now: int | None = None  # what a step starts from, at the last reading between steps
        self.cannot_adapt: str | None = None  # with on_spill="adapt": why the run could not go on adapted
        self.report_note: str | None = None  # the memory report's path and verdict, once written
        self._shared: tuple[int, SpillReport] | None = None  # the spilling rank and its report, once shared
        self._warned = False  # the stop's warning was given

    def warn(self, report: SpillReport, batch: int | None, note: str = "") -> None:
        """``"warn"``: a spill was found on this rank (once a fit); ``note``: the memory report's."""
        rank_zero_warn(format_spill_message(report, batch) + note, category=RuntimeWarning)

    def act(
        self,
        trainer: Trainer,
        spill: SpillReport | None,
        vote: StopVote | None,
        batch: int | None,
        raises: bool,
        after_batch: bool = False,
    ) -> None:
        """Every rank arrives here at the same step: save if there is progress to keep, then raise (``raises``) or
        stop. ``after_batch``: at the end of the batch during which the stop was agreed (it trained, and is saved)."""
        saved = self.checkpoint_path is not None or self.checkpoint_error is not None
        if not saved and self.spill_checkpoint is not False and trainer.global_step > 0:
            chosen = None if self.spill_checkpoint is True else self.spill_checkpoint
            path = os.path.join(checkpoint_folder(trainer, chosen), f"memguard-spill-step={trainer.global_step}.ckpt")
            error = write_checkpoint(trainer, path)
            self.checkpoint_path = None if error else path
            self.checkpoint_error = None if error is None else f"the checkpoint could not be written: {error}"
        spilling = self._spilling_rank(spill, vote)
        if spill is not None:
            advice = self._advice(spill, batch, trainer.accumulate_grad_batches)
            batch_helps = advice is None or advice.held_by is None  # else no batch or checkpointing fits: not said
            message = format_spill_message(spill, batch, self.checkpoint_path, batch_helps)
            if advice is not None:
                message += "\n" + advice.sentence()
        elif spilling is not None:  # the numbers of the rank that spilled, on every rank (and in rank zero's warning)
            rank, theirs = spilling
            message = (
                f"Another rank's GPU memory spilled into system RAM (rank {rank}); every rank stops with it."
                f" Rank {rank}: " + format_spill_message(theirs, batch, self.checkpoint_path)
            )
        else:
            message = "Another rank's GPU memory spilled into system RAM; every rank stops with it."
            if self.checkpoint_path:
                message += f" A checkpoint was saved to {self.checkpoint_path}."
            message += "\n" + FIXES
        if self.checkpoint_error is not None:
            message += f"\nNo checkpoint was kept: {self.checkpoint_error}."
        if self.cannot_adapt is not None:
            message += f"\nMemGuard(on_spill='adapt') could not adapt: {self.cannot_adapt}."
        if self.report_note:
            message += self.report_note
        if raises:
            raise SysmemSpillError(message, spill, self.checkpoint_path)
        if not self._warned:
            self._warned = True
            when = " after the batch in flight had trained (a run stops between batches)" if after_batch else ""
            rank_zero_warn(f"{message}\nMemGuard stopped the Trainer{when}.", category=RuntimeWarning)
        trainer.should_stop = True

    def _spilling_rank(self, spill: SpillReport | None, vote: StopVote | None) -> tuple[int, SpillReport] | None:
        """The lowest rank that found a spill, and its report, as every rank learns it (one gather, once)."""
        if self._shared is None:
            reports: list[SpillReport | None] = [spill]
            if vote is not None and vote.distributed:
                reports = [None] * dist.get_world_size()
                dist.all_gather_object(reports, spill)
            found = [(rank, r) for rank, r in enumerate(reports) if r is not None]
            self._shared = found[0] if found else None
        return self._shared

    def _advice(self, report: SpillReport, batch: int | None, accumulate: int) -> FitAdvice | None:
        """What would fit, from this run's readings: what a step starts from and the spilling step's peak."""
        if batch is None or self.allocated_now is None:
            return None
        return FitAdvice.from_run(
            report.used_bytes, self.allocated_now, report.other_bytes or 0, report.capacity, self.headroom, batch,
            accumulate,
        )  # fmt: skip
