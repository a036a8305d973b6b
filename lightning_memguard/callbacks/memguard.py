"""MemGuard: peak memory against throughput every epoch, and a loud stop when memory spills into system RAM."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memguard import _compiler
from lightning_memguard.callbacks._agreement import StopVote
from lightning_memguard.callbacks._batches import loader_parts, loader_paths, samples_in
from lightning_memguard.callbacks._files import checkpoint_folder, write_checkpoint
from lightning_memguard.core.advice import FitAdvice
from lightning_memguard.core.checks import (
    MIN_CAPACITY,
    PROBE_NEEDS,
    check_bool,
    check_callable,
    check_fraction,
    check_greater,
    check_instance,
    check_int,
    check_size,
)
from lightning_memguard.core.detector import (
    FIXES,
    SpillDetector,
    SpillReport,
    SysmemSpillError,
    allocator_cap,
    fallback_advice,
    fallback_possible,
    format_spill_message,
    is_wsl2,
)
from lightning_memguard.core.report import EpochRecord, format_epoch_table, merge_epoch_records
from lightning_memguard.core.timeline import StepTimeline
from lightning_memguard.core.units import to_gb
from lightning_memguard.probes import MemoryProbe, MemoryReading, probe_for

_ON_SPILL = ("raise", "stop", "warn")


class MemGuard(Callback):
    """Logs peak memory against throughput every epoch and stops a run whose memory spills into system RAM.

    On Windows with WDDM drivers, a CUDA allocation that does not fit is silently moved to system RAM, and
    training goes on 7x-45x slower instead of raising an out-of-memory error. MemGuard watches for it: a peak
    above the physical capacity, or memory grown to the capacity while throughput collapses against the run's own
    pace. Step times are taken on the host without synchronising the device; memory is read every ``read_every``
    steps (and at once when steps turn slow), never on every step.

    Logged once per epoch through the Trainer's loggers (memory in decimal GB):
    ``memguard/peak_allocated_gb``, ``memguard/peak_reserved_gb`` (that epoch's own peaks),
    ``memguard/capacity_gb``, ``memguard/samples_per_sec`` (samples of the real batches over the summed step
    time; all ranks together under DDP) and ``memguard/step_ms`` (median time of one training batch). The progress
    bar shows the last epoch's ``peak/cap`` (peak as a share of capacity) and ``samples/s``. At the end of ``fit``
    rank zero prints a table with one row per epoch, with the logged (all-rank) figures. Several loaders in one batch
    (a ``CombinedLoader``) count all their samples (one that has run out, under ``mode="max_size"``, none).

    Each ``fit`` starts afresh (no earlier spill, table or reference), unless it resumes from a checkpoint that holds
    MemGuard's state. A spill found in the last steps of an epoch is acted on at that epoch's end, so the last
    epoch, ``fast_dev_run`` and ``limit_train_batches=1`` raise or stop too; under DDP every rank acts at the same
    step, and every rank's message carries the spilling rank's numbers.

    Under ``torch.compile``, steps in which the compiler ran (the first ones, a last short batch that recompiles)
    are compile time: they set no reference and are not taken for a slowdown.

    Args:
        capacity: physical memory to judge against: bytes or a string such as ``"16GB"``, ``"16GiB"``, from 1 MB
            to 1 EB (``16`` is 16 bytes: refused); default: the device's (or the probe's) capacity.
        headroom: fraction of capacity that counts as "at the capacity", in [0, 1).
        on_spill: ``"raise"`` raises :class:`SysmemSpillError`, ``"stop"`` stops the Trainer cleanly,
            ``"warn"`` only warns. Before raising or stopping after training progress, a checkpoint is saved (see
            ``spill_checkpoint``).
        prevent: cap PyTorch's CUDA allocator at the capacity less what other processes hold (from NVML; under
            WDDM the device's used memory less this run's) and ``prevent_margin``, so an overflow is a real,
            immediate out-of-memory error instead of a spill. On a device without that allocator (the CPU) it
            warns once and guards without the cap, so one script runs on a laptop and on a GPU box.
        probe: the memory reader, an instance (``CpuProbe()``, see :mod:`lightning_memguard.probes`); default: the
            one for the Trainer's device.
        preflight: at fit start, try to allocate more than the card's physical memory; if that succeeds, the
            fallback is on (warns).
        warmup_steps: steps left out of the throughput reference.
        reference_steps: steps whose median throughput is the run's reference.
        collapse: a step this many times slower than the reference counts as collapsed: a finite number > 1.
        read_every: read memory every this many steps (plus every step during warm-up and after a slow step).
        prevent_margin: with ``prevent=True``, memory left free beyond other processes' use (bytes or a string;
            0 for none): this process's CUDA context, which PyTorch does not count, and other processes' growth.
        clock: seconds as a float; ``time.perf_counter`` unless a test injects another.
        spill_checkpoint: where the checkpoint written before a spill stops the run goes: ``True`` (where Lightning
            writes this run's checkpoints: the ModelCheckpoint's folder, else ``<log_dir>/checkpoints``), a folder,
            or ``False`` for none. It is written beside its final name and renamed into place; if it cannot be
            written (a full disk), the spill is still reported, with the reason, and ``checkpoint_path`` stays None.

    Raises:
        TypeError: for arguments of the wrong type (a bool or a string where a number is meant, a probe class
            instead of an instance), naming the argument and the value.
        ValueError: for out-of-range arguments (``inf`` or ``nan`` included), naming the argument and the value.
        SysmemSpillError: during ``fit`` with ``on_spill="raise"``, when memory spills.

    Example:
        >>> from lightning import Trainer
        >>> from lightning_memguard import MemGuard
        >>> guard = MemGuard(capacity="16GB", on_spill="stop")
        >>> trainer = Trainer(callbacks=[guard], logger=False, enable_progress_bar=False)
        >>> guard.capacity
        16000000000
        >>> MemGuard(headroom=1.5)
        Traceback (most recent call last):
        ...
        ValueError: `headroom` must be in [0, 1), got 1.5
    """

    def __init__(
        self,
        capacity: int | str | None = None,
        headroom: float = 0.05,
        on_spill: str = "raise",
        prevent: bool = False,
        probe: MemoryProbe | None = None,
        *,
        preflight: bool = False,
        warmup_steps: int = 3,
        reference_steps: int = 5,
        collapse: float = 2.5,
        read_every: int = 50,
        prevent_margin: int | str = "512MiB",
        clock: Callable[[], float] = time.perf_counter,
        spill_checkpoint: bool | str | os.PathLike[str] = True,
    ) -> None:
        if not isinstance(spill_checkpoint, bool | str | os.PathLike) or not os.fspath(
            "." if isinstance(spill_checkpoint, bool) else spill_checkpoint
        ):
            raise TypeError(f"`spill_checkpoint` must be True, False or a folder, got {spill_checkpoint!r}")
        self.spill_checkpoint = spill_checkpoint
        self.capacity = None if capacity is None else check_size("capacity", capacity, MIN_CAPACITY)
        self.headroom = check_fraction("headroom", headroom)
        if on_spill not in _ON_SPILL:
            raise ValueError(f"`on_spill` must be one of {_ON_SPILL}, got {on_spill!r}")
        check_bool("prevent", prevent)
        check_bool("preflight", preflight)
        if probe is not None:
            check_instance("probe", probe, MemoryProbe, PROBE_NEEDS)
        collapse = check_greater("collapse", collapse, 1)
        check_callable("clock", clock)
        self.on_spill = on_spill
        self.prevent = prevent
        self.preflight = preflight
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.reference_steps = check_int("reference_steps", reference_steps, 1)
        self.collapse = float(collapse)
        self.read_every = check_int("read_every", read_every, 1)
        self.prevent_margin = check_size("prevent_margin", prevent_margin, 0)
        self._user_probe = probe
        self._clock = clock

        # what the run taught us (saved in checkpoints); each fit starts afresh, unless a checkpoint restores it
        self.epochs: list[EpochRecord] = []
        self.fallback_enabled: bool | None = None  # the preflight's answer, when it ran
        self.checkpoint_path: str | None = None  # the spill checkpoint, once written (a file that exists)
        self.checkpoint_error: str | None = None  # why it could not be written, if it could not

        # per-fit working state: the steps, the detector and the spill live in the timeline, made at fit start
        self._probe: MemoryProbe | None = None
        self._timeline: StepTimeline | None = None
        self._vote: StopVote | None = None
        self._restored_detector: dict[str, Any] = {}  # the detector's state from a checkpoint
        self._allocated_now: int | None = None  # what a step starts from, at the last reading
        self._prevent_fraction: float | None = None
        self._prevent_others: int | None = None
        self._loader_paths: list[tuple[Any, ...]] | None = None  # where each loader's batch sits in a combined batch
        self._shared_spill: tuple[int, SpillReport] | None = None  # the spilling rank and its report, once shared
        self._compiles = _compiler.CompileWatch()  # since the last batch start

    @property
    def spill(self) -> SpillReport | None:
        """The spill this fit found on this rank (None before one is found, and at the start of every fit)."""
        return self._timeline.spill if self._timeline is not None else None

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._start_fit()
        device = trainer.strategy.root_device
        self._probe = self._user_probe if self._user_probe is not None else probe_for(device)
        if self.prevent and device.type != "cuda":  # one script for the laptop and the GPU box
            rank_zero_warn(
                f"MemGuard(prevent=True) caps the CUDA allocator, and this Trainer runs on {device.type!r}: no cap;"
                " guarding as usual"
            )
        if device.type == "cuda" and self._user_probe is None:
            self._notice_platform()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        probe = self._require_probe()
        capacity = self.capacity if self.capacity is not None else probe.capacity()
        detector = SpillDetector(
            capacity, self.headroom, self.warmup_steps, self.reference_steps, self.collapse, patience=3
        )
        detector.load_state_dict(self._restored_detector)
        self._timeline = StepTimeline(detector=detector, read_every=self.read_every)
        self._compiles = _compiler.CompileWatch()
        self._vote = StopVote(trainer.strategy.root_device, trainer.world_size)
        probe.read()  # the first reading sets up NVML (milliseconds): here, not inside a training step
        if self.preflight:
            self._run_preflight(probe)
        if self.prevent and trainer.strategy.root_device.type == "cuda":  # (elsewhere: said in setup)
            self._cap_allocator(trainer.strategy.root_device, capacity, probe)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loader_paths = loader_paths(trainer.train_dataloader)
        if self._timeline is not None:
            self._timeline.start_epoch()
        self._require_probe().reset_peak()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # every training step passes here: a clock read, the batch's size and the timeline's two appends; now and
        # then memory is read
        now = self._clock()
        timeline = self._timeline
        if timeline is None:
            return
        # a step in which torch.compile compiled is compile time, not a slowdown
        if timeline.batch_start(now, self._batch_size(batch), self._compiles.moved()):
            self._read_and_judge(trainer)
        vote = self._vote
        if vote is not None:
            stop = timeline.spill is not None and self.on_spill != "warn"
            if vote.cast(stop) if vote.distributed else stop:
                self._act(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_step_early()

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._close_step_early()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        timeline = self._timeline
        if timeline is None:
            return
        self._close_step_early()
        timeline.feed()  # the steps since the last feed, before the epoch's reading
        reading = self._read_and_judge(trainer)  # the epoch's last steps are judged before the peak is reset
        stats = timeline.epoch_stats()
        capacity = self.capacity if self.capacity is not None else reading.capacity
        record = EpochRecord(
            epoch=trainer.current_epoch,
            step_ms=stats.step_ms if stats else float("nan"),
            peak_allocated_gb=round(to_gb(reading.peak_allocated), 6),
            peak_reserved_gb=round(to_gb(reading.peak_reserved), 6),
            capacity_gb=round(to_gb(capacity), 6),
            samples_per_sec=stats.samples_per_sec if stats else float("nan"),
        )
        record = self._merge_ranks(trainer, record)  # the table shows what the logged keys show: all ranks
        self.epochs.append(record)
        values = {
            "memguard/peak_allocated_gb": record.peak_allocated_gb,
            "memguard/peak_reserved_gb": record.peak_reserved_gb,
            "memguard/capacity_gb": record.capacity_gb,
            "memguard/samples_per_sec": record.samples_per_sec,
            "memguard/step_ms": record.step_ms,
        }
        # the progress bar: epoch figures, so that no step pays for logging
        bar = {"peak/cap": round(record.peak_allocated_gb / record.capacity_gb, 3), "samples/s": record.samples_per_sec}
        # every rank holds the same merged figures: "max" of equal values passes them on exactly
        sync = trainer.world_size > 1
        if trainer.barebones:  # no logging there (Lightning warns at every `log`): the table at fit end remains
            values, bar = {}, {}
        for key, value in values.items():
            pl_module.log(key, value, on_step=False, on_epoch=True, sync_dist=sync, reduce_fx="max", batch_size=1)
        for key, value in bar.items():
            pl_module.log(key, value, on_step=False, on_epoch=True, prog_bar=True, logger=False, batch_size=1,
                          sync_dist=sync, reduce_fx="max")  # fmt: skip
        self._settle(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.epochs:
            rank_zero_info("MemGuard: peak memory against throughput\n" + format_epoch_table(self.epochs))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._prevent_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, trainer.strategy.root_device)
            self._prevent_fraction = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._prevent_fraction is not None and isinstance(exception, torch.OutOfMemoryError) and exception.args:
            timeline = self._timeline
            capacity = timeline.detector.capacity if timeline is not None else 0
            held = self._prevent_others
            others = "use (unknown)" if held is None else f"{to_gb(held):.2f} GB"
            exception.args = (
                f"{exception.args[0]}\n\nMemGuard(prevent=True) capped PyTorch at {self._prevent_fraction:.1%} of"
                f" this GPU ({to_gb(capacity):.2f} GB capacity less other processes' {others} and a margin of"
                f" {to_gb(self.prevent_margin):.2f} GB) so that this overflow fails now instead of spilling into"
                " system RAM and running many times slower. "
                "Use less memory per step:\n" + FIXES,
                *exception.args[1:],
            )

    def state_dict(self) -> dict[str, Any]:
        timeline = self._timeline
        detector = timeline.detector.state_dict() if timeline is not None else self._restored_detector
        return {"epochs": [r.to_dict() for r in self.epochs], **detector, "fallback_enabled": self.fallback_enabled}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epochs = [EpochRecord(**row) for row in state_dict.get("epochs", [])]
        self._restored_detector = {k: v for k, v in state_dict.items() if k not in ("epochs", "fallback_enabled")}
        self.fallback_enabled = state_dict.get("fallback_enabled", self.fallback_enabled)

    # ------------------------------------------------------------------ steps and memory

    def _start_fit(self) -> None:
        """Forget the previous fit: its spill, table, checkpoint and reference (a checkpoint loaded after this, in
        the same fit, brings back its own)."""
        self.epochs = []
        self.fallback_enabled = None
        self.checkpoint_path = None
        self.checkpoint_error = None
        self._timeline = None
        self._vote = None
        self._restored_detector = {}
        self._shared_spill = None
        self._allocated_now = None

    def _close_step_early(self) -> None:
        """Validation, a checkpoint or the epoch's end comes before the next batch: the open step is timed up to now
        and kept aside, used only if the epoch has no complete interval."""
        timeline = self._timeline
        if timeline is not None and timeline.step_open:
            timeline.interrupt(self._clock())

    def _read_and_judge(self, trainer: Trainer) -> MemoryReading:
        """Read memory and, while watching for a spill, let the detector judge the latest steps by it."""
        reading = self._require_probe().read()
        if reading.allocated_now is not None:  # read between steps: what the next step starts from
            self._allocated_now = reading.allocated_now
        timeline = self._timeline
        if timeline is not None:
            report = timeline.judge(reading.used, trainer.global_step, reading.other_processes)
            if report is not None:
                self._on_spill_detected(report)
        return reading

    def _batch_size(self, batch: Any) -> int:
        """Samples in a training batch: every loader's, where several make one (a CombinedLoader; one that has run
        out counts none); a part that cannot be sized counts as one sample."""
        paths = self._loader_paths
        if paths is None:
            samples = samples_in(batch)
            return 1 if samples is None else samples
        return sum(1 if n is None else n for n in map(samples_in, loader_parts(batch, paths)))

    def _merge_ranks(self, trainer: Trainer, record: EpochRecord) -> EpochRecord:
        if trainer.world_size <= 1:
            return record
        fields = [record.step_ms, record.peak_allocated_gb, record.peak_reserved_gb, record.capacity_gb,
                  record.samples_per_sec]  # fmt: skip
        mine = torch.tensor(fields, dtype=torch.float64, device=trainer.strategy.root_device)
        rows = trainer.strategy.all_gather(mine).reshape(-1, len(fields)).tolist()
        return merge_epoch_records([EpochRecord(record.epoch, *row) for row in rows])

    # ------------------------------------------------------------------ acting on a spill

    def _on_spill_detected(self, report: SpillReport) -> None:
        if self.on_spill == "warn":  # called once a fit: detection stops when a spill is recorded
            batch = self._timeline.batch if self._timeline is not None else 0
            rank_zero_warn(format_spill_message(report, batch or None), category=RuntimeWarning)

    def _settle(self, trainer: Trainer) -> None:
        """At an epoch's end no later batch start may come to act on a spill found in its last steps (the last
        epoch, ``fast_dev_run``, ``limit_train_batches=1``): every rank decides now, together, without lag."""
        if self.on_spill == "warn":
            return
        if trainer.strategy.reduce_boolean_decision(self.spill is not None, all=False):
            self._act(trainer)

    def _spilling_rank(self) -> tuple[int, SpillReport] | None:
        """The lowest rank that found a spill, and its report, as every rank learns it (one gather, once)."""
        if self._shared_spill is None:
            vote = self._vote
            reports: list[SpillReport | None] = [self.spill]
            if vote is not None and vote.distributed:
                reports = [None] * dist.get_world_size()
                dist.all_gather_object(reports, self.spill)
            found = [(rank, r) for rank, r in enumerate(reports) if r is not None]
            self._shared_spill = found[0] if found else None
        return self._shared_spill

    def _act(self, trainer: Trainer) -> None:
        """Every rank arrives here at the same step: save if there is progress to keep, then raise or stop."""
        saved = self.checkpoint_path is not None or self.checkpoint_error is not None
        if not saved and self.spill_checkpoint is not False and trainer.global_step > 0:
            chosen = None if self.spill_checkpoint is True else self.spill_checkpoint
            path = os.path.join(checkpoint_folder(trainer, chosen), f"memguard-spill-step={trainer.global_step}.ckpt")
            error = write_checkpoint(trainer, path)
            self.checkpoint_path = None if error else path
            self.checkpoint_error = None if error is None else f"the checkpoint could not be written: {error}"
        report = self.spill
        spilling = self._spilling_rank()
        batch = (self._timeline.batch if self._timeline is not None else 0) or None
        if report is not None:
            message = format_spill_message(report, batch, self.checkpoint_path)
            advice = self._advice(report, batch, trainer.accumulate_grad_batches)
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
        if self.on_spill == "raise":
            raise SysmemSpillError(message, report, self.checkpoint_path)
        if not trainer.should_stop:
            rank_zero_warn(message + "\nMemGuard stopped the Trainer.", category=RuntimeWarning)
        trainer.should_stop = True

    def _advice(self, report: SpillReport, batch: int | None, accumulate: int) -> FitAdvice | None:
        """What would fit, from this run's readings: what a step starts from and the spilling step's peak."""
        if batch is None or self._allocated_now is None:
            return None
        return FitAdvice.from_run(
            report.used_bytes, self._allocated_now, report.other_bytes or 0, report.capacity, self.headroom, batch,
            accumulate,
        )  # fmt: skip

    # ------------------------------------------------------------------ platform, preflight, prevention

    def _notice_platform(self) -> None:
        probe = self._require_probe()
        driver = probe.driver_info() if hasattr(probe, "driver_info") else {}
        system, release = platform.system(), platform.release()
        if fallback_possible(system, release, driver.get("driver_model")):
            where = "inside WSL2" if is_wsl2(system, release) else "under a WDDM driver"
            rank_zero_warn(
                f"This GPU runs {where}, where the CUDA Sysmem Fallback Policy can move memory into system RAM instead"
                " of raising out-of-memory. MemGuard watches for it; to rule it out: "
                f"{fallback_advice(system, release)}; or use MemGuard(prevent=True).",
                category=UserWarning,
            )

    def _run_preflight(self, probe: MemoryProbe) -> None:
        trial = getattr(probe, "overallocation_succeeds", None)
        if trial is None:
            rank_zero_info(f"MemGuard: no preflight on {type(probe).__name__}: it cannot overallocate")
            return
        self.fallback_enabled = bool(trial())
        if self.fallback_enabled:
            rank_zero_warn(
                "MemGuard preflight: allocating more GPU memory than the card has succeeded, so the driver's sysmem"
                " fallback is on and an overflow will slow this run down instead of failing. MemGuard will stop the"
                " run if it spills.\n" + FIXES,
                category=RuntimeWarning,
            )

    def _cap_allocator(self, device: torch.device, capacity: int, probe: MemoryProbe) -> None:
        total = torch.cuda.get_device_properties(device).total_memory
        others = probe.read().other_processes
        allowed = allocator_cap(capacity, total, others, self.prevent_margin)
        if allowed <= 0:
            held = "unknown" if others is None else f"{to_gb(others):.2f} GB"
            raise ValueError(
                f"`prevent=True` leaves no memory: capacity {to_gb(min(capacity, total)):.2f} GB, other processes"
                f" hold {held}, margin {to_gb(self.prevent_margin):.2f} GB"
            )
        if others is None:
            rank_zero_warn(
                "MemGuard(prevent=True): other processes' use of this GPU is unknown (NVML unavailable), so the cap"
                f" leaves them only the margin of {to_gb(self.prevent_margin):.2f} GB (`prevent_margin`).",
                category=RuntimeWarning,
            )
        self._prevent_others = others
        self._prevent_fraction = allowed / total
        torch.cuda.set_per_process_memory_fraction(self._prevent_fraction, device)
        rank_zero_info(
            f"MemGuard(prevent=True): PyTorch may use {to_gb(allowed):.2f} GB of this GPU's {to_gb(total):.2f} GB"
            f" ({self._prevent_fraction:.1%}; other processes hold "
            f"{'an unknown amount' if others is None else f'{to_gb(others):.2f} GB'},"
            f" margin {to_gb(self.prevent_margin):.2f} GB)"
        )

    def _require_probe(self) -> MemoryProbe:
        if self._probe is None:
            self._probe = self._user_probe if self._user_probe is not None else probe_for(torch.device("cpu"))
        return self._probe
