"""MemGuard: peak memory against throughput every epoch, and a loud stop when memory spills into system RAM."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memguard import _compiler
from lightning_memguard._lightning.agreement import StopVote
from lightning_memguard._lightning.batches import loader_parts, loader_paths, samples_in
from lightning_memguard._lightning.privates import model_logging_dropped
from lightning_memguard.callbacks._epoch_report import epoch_record, log_epoch
from lightning_memguard.callbacks._prevention import AllocatorCap, notice_platform, run_preflight
from lightning_memguard.callbacks._reporting import MemoryReports
from lightning_memguard.callbacks._spill_policy import SpillPolicy, spill_policy
from lightning_memguard.core.capacity import judged_capacity
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
from lightning_memguard.core.detector import SpillDetector
from lightning_memguard.core.epoch_record import EpochRecord, format_epoch_table
from lightning_memguard.core.spill import SpillReport
from lightning_memguard.core.timeline import StepTimeline
from lightning_memguard.probes import MemoryProbe, MemoryReading, probe_for
from lightning_memguard.tuning.adapt import Adaptation

_ON_SPILL = ("raise", "stop", "warn", "adapt")
_ADAPT_LOSS = ("auto", "mean", "sum", "coupled")


class OffloadHolder(Protocol):
    """What MemGuard reads of an offloader given as ``offload``: the bytes it keeps in host memory now."""

    @property
    def host_bytes(self) -> int: ...


class MemGuard(Callback):
    """Logs peak memory against throughput every epoch and stops a run whose memory spills into system RAM.

    On Windows with WDDM drivers, a CUDA allocation that does not fit is silently moved to system RAM, and
    training goes on 7x-45x slower instead of raising an out-of-memory error. MemGuard watches for it: a peak
    above the physical capacity, or memory grown to the capacity while throughput collapses against the run's own
    pace; on Windows also Windows' own count of this process's GPU memory in system RAM (see ``offload``). Step
    times are taken on the host without synchronising the device; memory is read every ``read_every`` steps (and at
    once when steps turn slow), never on every step.

    Logged once per epoch through the Trainer's loggers (memory in decimal GB):
    ``memguard/peak_allocated_gb``, ``memguard/peak_reserved_gb`` (that epoch's own peaks),
    ``memguard/capacity_gb``, ``memguard/samples_per_sec`` (samples of the real batches over the summed step
    time; all ranks together under DDP) and ``memguard/step_ms`` (median time of one training batch). The progress
    bar shows the last epoch's ``peak/cap`` (peak as a share of capacity) and ``samples/s``. At the end of ``fit``
    rank zero prints a table with one row per epoch, with the logged (all-rank) figures. Several loaders in one batch
    (a ``CombinedLoader``) count all their samples (one that has run out, under ``mode="max_size"``, none).

    Each ``fit`` starts afresh (no earlier spill, table or reference), unless it resumes from a checkpoint that holds
    MemGuard's state; memory readings start afresh at every training start too, so a fit resumed mid-epoch (from the
    spill checkpoint, in the same process, on the same card) is judged by its own peak. A spill found in the last
    steps of an epoch is acted on at that epoch's end, so the last epoch, ``fast_dev_run`` and
    ``limit_train_batches=1`` raise or stop too; under DDP every rank acts at the same step, and every rank's message
    carries the spilling rank's numbers.

    Under ``torch.compile``, steps in which the compiler ran (the first ones, a last short batch that recompiles)
    are compile time: they set no reference and are not taken for a slowdown.

    Args:
        capacity: physical memory to judge against: bytes or a string such as ``"16GB"``, ``"16GiB"``, from 1 MB
            to 1 EB (``16`` is 16 bytes: refused); default: the device's (or the probe's) capacity.
        headroom: fraction of capacity that counts as "at the capacity", in [0, 1).
        on_spill: ``"raise"`` raises :class:`SysmemSpillError` before the batch trains, ``"stop"`` stops the Trainer
            cleanly once the batch in flight has trained (a callback can stop a run only between batches),
            ``"warn"`` only warns, ``"adapt"`` goes on in a configuration that fits (see below). Before raising or
            stopping after training progress, a checkpoint of every batch trained is saved (see ``spill_checkpoint``):
            a run resumed from it trains each batch once.
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
        clock: seconds as a float; ``time.perf_counter`` unless a test injects another (it also times the switch of
            ``on_spill="adapt"``'s savers).
        spill_checkpoint: where the checkpoint written before a spill stops the run goes: ``True`` (where Lightning
            writes this run's checkpoints: the ModelCheckpoint's folder, else ``<log_dir>/checkpoints``), a folder,
            or ``False`` for none. It is written beside its final name and renamed into place; if it cannot be
            written (a full disk), the spill is still reported, with the reason, and ``checkpoint_path`` stays None.
        adapt_batchnorm: with ``on_spill="adapt"``, split the batches of a model whose BatchNorm layers train (their
            statistics then come from each micro-batch: not quite the same training); otherwise such a model adapts
            only by activation checkpointing.
        grow_every: with ``on_spill="adapt"``, optimizer steps between checks whether fewer micro-batches, or (whole
            again) the step without the savers, fit again (one memory reading each; twice as long after a check whose
            growth spilled again).
        adapt_loss: with ``on_spill="adapt"``, how the training loss weighs a batch's samples, so that micro-batches
            add up to the batch's gradients: ``"auto"`` (found out before the first split on the batch's first four
            samples: a mean over samples, a token mean over labels with ``ignore_index=-100``, a sum, or a loss that
            couples the samples, which is never split), ``"mean"`` (over samples), ``"sum"``, ``"coupled"`` (never
            split: an in-batch contrastive loss), or a function of a micro-batch returning the count its loss
            averages over (``lambda b: (b["labels"][:, 1:] != -100).sum()``).
        offload: bytes this run keeps in system RAM on purpose (activation offload, block swap; bytes or a
            string), or what holds them: an object with a ``host_bytes`` attribute (an
            :class:`~lightning_memguard.levers.offload.ActivationOffload`), read again at every memory reading. On
            Windows MemGuard reads how much of this process's GPU memory the driver counts in system RAM (Task
            Manager's "Shared GPU memory", through pywin32); beyond what was there at fit start, what PyTorch pins
            (``pin_memory=True`` loaders) and this, it is a spill.
        memory_report: on a spill, an out-of-memory error, allocator thrash (PyTorch's allocator retrying
            allocations after freeing its cache, read with MemGuard's memory readings) and each adaptation, write a
            report of which modules hold the step's memory beside the spill checkpoint
            (``memguard-report-step=<N>-<why>.json`` and ``.html``; see :attr:`reports`), and name it in the message.
            It costs nothing until then: one step is measured when the report is wanted (the batch in flight as it
            trains, or the batch in hand redone and undone: ``training_step`` runs once more, with ``self.log`` off;
            what it does beyond the model, a counter of its own, happens again).
        record_memory: record the CUDA allocator's history (``torch.cuda.memory._record_memory_history``, the
            latest 100,000 events with their stack traces) from fit start to teardown, and write it with each report
            as ``<stem>.pickle`` for PyTorch's memory viewer (https://pytorch.org/memory_viz). It costs every
            allocation a stack trace: 0.9 % of the step time of ResNet50 at batch 256 on an H200
            (``benchmarks/forensics.py``); off by default. On a device other than CUDA it warns once and records
            nothing.

    ``on_spill="adapt"``: instead of stopping, the run goes on in a configuration that fits, from the batch at which
    every rank agreed on the spill (the steps that spilled trained correctly, only slowly: they are kept), or, for
    an out-of-memory error inside a training step (``prevent=True`` turns a spill into one), by redoing that step
    from zeroed gradients. The levers, in order, each only where it keeps the training the same: first the savers
    that keep the batch whole, the levers' planner (:func:`~lightning_memguard.levers.plan_levers`) on the model for
    the memory free now (the card less its headroom, other processes' memory and what a step starts from), measured
    on the batch in hand: whole blocks or their parts checkpointed, pointwise chains recomputed (BatchNorm-exact,
    the gradients the plain step's bit for bit; not the fused loss, whose gradients agree only within floating-point
    tolerance and which leaves a Hugging Face model's output without logits; not offload, which needs a context
    around every step); every block where it cannot be planned. Where the plan meets that memory, the batch is not
    split. Where it does not (the floor reached), or could not be planned, or the model has no blocks, each loaded
    batch is then split into micro-batches whose gradients add up before the one optimizer step (the same samples
    per step, the same data order, the same optimizer and scheduler steps; each micro-batch's loss weighted by its
    share of what the loss averages over, ``adapt_loss``, so the gradients are the batch's; the outputs the hooks
    get joined into the batch's). Under FSDP and ModelParallelStrategy (a measurement on one rank would leave the
    others waiting in the shards' gathers) the split comes first, then activation checkpointing. Where neither is
    left (manual optimization, a model with training BatchNorm and no blocks, a loss that couples the samples of a
    batch and no blocks, micro-batches of one sample) the run stops as ``"stop"`` does, saying why; so it does at
    once where this run's readings say no micro-batch can fit (what a step starts from, alone or with other
    processes' memory, above the card), naming what holds the memory. Every ``grow_every`` steps the run grows back
    the same way: fewer micro-batches where this run's readings say they fit what is free now, then, whole again,
    the savers removed where the step's activations without them (the plan's measured baseline) fit. Each change is
    said in one line (with the wall seconds the savers' switch took, by ``clock``), logged
    (``memguard/micro_batches``, ``memguard/checkpointing``), kept in :attr:`adaptations` and in the checkpoint: a
    resumed run starts adapted, its savers applied again from their record without measuring. Under DDP, FSDP and
    ModelParallelStrategy every rank adapts at the same step to the same split (the largest any rank needs) and,
    under DDP, the same savers (rank zero plans for the least room of any rank; every rank applies its record); an
    out-of-memory error is recovered from on one device only. Refused in ``setup`` under DeepSpeed (its engine owns
    the backward).

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
        offload: int | str | OffloadHolder = 0,
        adapt_batchnorm: bool = False,
        grow_every: int = 200,
        adapt_loss: str | Callable[[Any], Any] = "auto",
        memory_report: bool = True,
        record_memory: bool = False,
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
        self.offload = offload if hasattr(offload, "host_bytes") else check_size("offload", offload, 0)
        check_bool("adapt_batchnorm", adapt_batchnorm)
        self.adapt_batchnorm = adapt_batchnorm
        self.grow_every = check_int("grow_every", grow_every, 1)
        if not callable(adapt_loss) and adapt_loss not in _ADAPT_LOSS:
            raise ValueError(f"`adapt_loss` must be one of {_ADAPT_LOSS} or a function of a batch, got {adapt_loss!r}")
        self.adapt_loss = adapt_loss
        check_bool("memory_report", memory_report)
        check_bool("record_memory", record_memory)
        self.memory_report = memory_report
        self.record_memory = record_memory
        self._user_probe = probe
        self._clock = clock

        # MemGuard is a shell over its parts: the timeline (steps, the detector, the spill; made at fit start), the
        # epoch report, the memory reports, the spill policy (what a spill leads to, chosen here once: it answers
        # every hook's question about a spill, an adaptation or a report), and the guards before training (the cap,
        # the notice, the preflight)
        self._reports = MemoryReports(memory_report, record_memory, spill_checkpoint)
        self._policy: SpillPolicy = self._chosen_policy()
        self._cap = AllocatorCap(self.prevent_margin)

        # what the run taught us (saved in checkpoints); each fit starts afresh, unless a checkpoint restores it
        self.epochs: list[EpochRecord] = []
        self.fallback_enabled: bool | None = None  # the preflight's answer, when it ran

        # per-fit working state
        self._probe: MemoryProbe | None = None
        self._timeline: StepTimeline | None = None
        self._vote: StopVote | None = None
        self._restored_detector: dict[str, Any] = {}  # the detector's state from a checkpoint
        self._loader_paths: list[tuple[Any, ...]] | None = None  # where each loader's batch sits in a combined batch
        self._compiles = _compiler.CompileWatch()  # since the last batch start

    @property
    def checkpoint_path(self) -> str | None:
        """The spill checkpoint, once written (a file that exists)."""
        return self._policy.response.checkpoint_path

    @property
    def checkpoint_error(self) -> str | None:
        """Why the spill checkpoint could not be written, if it could not."""
        return self._policy.response.checkpoint_error

    @property
    def adaptations(self) -> list[Adaptation]:
        """Every change ``on_spill="adapt"`` made in this fit (and, resumed, in the fit it resumes), in order."""
        return self._policy.adaptations

    @property
    def reports(self) -> list[str]:
        """The memory reports this fit wrote, in order: each one's JSON file (its page is beside it, ``.html``)."""
        return list(self._reports.paths)

    @property
    def spill(self) -> SpillReport | None:
        """The spill this fit found on this rank (None before one is found, and at the start of every fit)."""
        return self._timeline.spill if self._timeline is not None else None

    # ------------------------------------------------------------------ Lightning hooks

    @override
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
            notice_platform(self._probe)
        self._policy.setup(trainer)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        probe = self._require_probe()
        capacity = judged_capacity(self.capacity, probe.capacity())
        self._reports.capacity = capacity
        detector = self._new_detector(capacity)
        detector.load_state_dict(self._restored_detector)
        self._timeline = StepTimeline(detector=detector, read_every=self.read_every)
        self._compiles = _compiler.CompileWatch()
        self._vote = StopVote(trainer.strategy.root_device, trainer.world_size)
        self._reports.start(trainer, probe)
        # the first reading sets up NVML and Windows' counters (milliseconds): here, not inside a training step; what
        # Windows already counts in system RAM for this process is its baseline
        detector.set_baseline(probe.read())
        if self.preflight:
            self.fallback_enabled = run_preflight(probe)
        if self.prevent and trainer.strategy.root_device.type == "cuda":  # (elsewhere: said in setup)
            self._cap.apply(trainer.strategy.root_device, capacity, probe)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # an epoch resumed mid-way (from the spill checkpoint, say) has no epoch start: this fit's readings start here,
        # not from the peak of the preflight, of the tuners' trials or of an earlier fit in this process
        self._start_readings(trainer)
        self._policy.train_start(trainer, pl_module)  # after the tuners' trials: they train steps of their own

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_readings(trainer)
        self._reports.epoch_start()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # every training step passes here: a clock read, the batch's size and the timeline's two appends; now and
        # then memory is read
        now = self._clock()
        self._reports.batch_start(batch, batch_idx)  # a reference, for a report on this batch
        timeline = self._timeline
        if timeline is None:
            return
        # a step in which torch.compile compiled is compile time, not a slowdown
        if timeline.batch_start(now, self._batch_size(batch), self._compiles.moved()):
            self._read_and_judge(trainer)
        vote, policy = self._vote, self._policy
        if vote is not None:
            stop = timeline.spill is not None and policy.votes
            if vote.cast(stop) if vote.distributed else stop:
                # adapted, or "raise" now, "stop" (and "adapt" that cannot) at the batch's end
                if policy.agreed(trainer, pl_module, self.spill, vote, self._batch(), batch):
                    self._watch_again(trainer)
            elif policy.growth_due(trainer):
                self._grow(trainer, timeline)
        policy.batch_started(trainer, pl_module)  # an adaptation's report, on the first step in it

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        note = self._reports.batch_end(trainer, pl_module, batch, batch_idx)  # a report armed on it: written
        self._policy.batch_end(trainer, note, self.spill, self._vote, self._batch())

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_step_early()
        if self._policy.judges_validation:
            # validation judged by its own peak: the training steps' are read first, then forgotten
            self._read_and_judge(trainer)
            self._reset_peak()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        timeline = self._timeline
        if not self._policy.judges_validation or timeline is None or trainer.sanity_checking:
            return
        self._policy.validation_end(trainer, self._require_probe().read(), timeline.detector.capacity)
        self._reset_peak()  # the next training steps are judged by their own peak

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._close_step_early()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        timeline = self._timeline
        if timeline is None:
            return
        self._close_step_early()
        timeline.feed()  # the steps since the last feed, before the epoch's reading
        reading = self._read_and_judge(trainer)  # the epoch's last steps are judged before the peak is reset
        record = epoch_record(trainer, timeline.epoch_stats(), reading, timeline.detector.capacity)
        self.epochs.append(record)
        log_epoch(trainer, pl_module, record)
        # a spill in the epoch's last steps: every rank decides now; the next epoch runs adapted, or the run stops
        if self._policy.settle(trainer, pl_module, self.spill, self._vote, self._batch()):
            self._watch_again(trainer)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.epochs:
            rank_zero_info("MemGuard: peak memory against throughput\n" + format_epoch_table(self.epochs))

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._end_fit(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._cap.explain(exception)
        self._policy.out_of_memory(trainer, pl_module, exception)
        self._end_fit(trainer)  # Lightning calls no teardown after an exception

    def _end_fit(self, trainer: Trainer) -> None:
        """The fit ended (teardown, or an exception, Ctrl+C included): the cap lifted, the training step given back,
        and nothing kept that holds the fit's model, gradients, optimizer state or batches; what the fit learned
        stays (:attr:`epochs`, :attr:`adaptations`, :attr:`reports`, :attr:`spill`, the state for a resume)."""
        self._cap.release(trainer.strategy.root_device)
        self._policy.end_fit()
        self._reports.stop()
        self._vote = None
        model_logging_dropped(self)

    @override
    def state_dict(self) -> dict[str, Any]:
        timeline = self._timeline
        detector = timeline.detector.state_dict() if timeline is not None else self._restored_detector
        return {
            "epochs": [r.to_dict() for r in self.epochs], **detector, "fallback_enabled": self.fallback_enabled,
            **self._policy.state_dict(),
        }  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epochs = [EpochRecord.from_dict(row) for row in state_dict.get("epochs", [])]
        own = ("epochs", "fallback_enabled", "adapt")
        self._restored_detector = {k: v for k, v in state_dict.items() if k not in own}
        self.fallback_enabled = state_dict.get("fallback_enabled", self.fallback_enabled)
        self._policy.load_state_dict(state_dict)

    # ------------------------------------------------------------------ steps and memory

    def _policy_settings(self) -> tuple[Any, ...]:
        return (self.on_spill, self.spill_checkpoint, self.headroom, self.adapt_batchnorm, self.grow_every,
                self.adapt_loss)  # fmt: skip

    def _chosen_policy(self) -> SpillPolicy:
        """The spill policy ``on_spill`` names, with the settings as they are now (chosen in ``__init__``, and again
        at a fit's start where one was set anew between fits)."""
        on_spill, spill_checkpoint, headroom, adapt_batchnorm, grow_every, adapt_loss = settings = (
            self._policy_settings()
        )
        policy = spill_policy(
            on_spill, self._reports, spill_checkpoint, headroom, adapt_batchnorm=adapt_batchnorm,
            grow_every=grow_every, adapt_loss=adapt_loss, clock=self._clock,
        )  # fmt: skip
        policy.chosen_from = settings
        return policy

    def _start_fit(self) -> None:
        """Forget the previous fit: its spill, table, checkpoint and reference (a checkpoint loaded after this, in
        the same fit, brings back its own)."""
        self.epochs = []
        self.fallback_enabled = None
        if self._policy.chosen_from != self._policy_settings():  # a setting changed since: as it is now
            self._policy = self._chosen_policy()
        self._policy.start_fit()
        self._timeline = None
        self._vote = None
        self._restored_detector = {}

    def _new_detector(self, capacity: int) -> SpillDetector:
        return SpillDetector(
            capacity, self.headroom, self.warmup_steps, self.reference_steps, self.collapse, patience=3,
            offload=self._offloaded(),
        )  # fmt: skip

    def _offloaded(self) -> int:
        """The bytes kept in system RAM on purpose now: as given, or what the offloader given holds."""
        offload = self.offload
        return int(offload.host_bytes) if not isinstance(offload, int) else offload

    def _grow(self, trainer: Trainer, timeline: StepTimeline) -> None:
        """Now and then, while batches are split: fewer micro-batches where they fit what is free now."""
        reading = self._read_and_judge(trainer)
        # the next check reads the steps after this one only: a peak from before memory freed would hold it back
        self._reset_peak()
        if self._policy.grow(trainer, reading, timeline.detector.capacity, self._batch()):
            self._watch_again(trainer)

    def _watch_again(self, trainer: Trainer) -> None:
        """A new configuration runs from this batch: a fresh reference of its pace, no spill, readings afresh, every
        rank's vote afresh (the configuration that spilled is left behind)."""
        timeline = self._timeline
        if timeline is None:
            return
        timeline.detector = self._new_detector(timeline.detector.capacity)
        timeline.spill = None
        self._vote = StopVote(trainer.strategy.root_device, trainer.world_size)
        self._reset_peak()

    def _start_readings(self, trainer: Trainer) -> None:
        """Readings start afresh: the probe's peak, the epoch's steps, where each loader's batch sits in a batch."""
        self._loader_paths = loader_paths(trainer.train_dataloader)
        if self._timeline is not None:
            self._timeline.start_epoch()
        self._reset_peak()

    def _close_step_early(self) -> None:
        """Validation, a checkpoint or the epoch's end comes before the next batch: the open step is timed up to now
        and kept aside, used only if the epoch has no complete interval."""
        timeline = self._timeline
        if timeline is not None and timeline.step_open:
            timeline.interrupt(self._clock())

    def _reset_peak(self) -> None:
        self._require_probe().reset_peak()
        self._reports.carried = None  # a report's step reset the allocator's peak: what came before is forgotten now

    def _read_and_judge(self, trainer: Trainer) -> MemoryReading:
        """Read memory and, while watching for a spill, let the detector judge the latest steps by it."""
        reading = self._reports.with_carried(self._require_probe().read())
        self._reports.others = reading.other_processes  # what the next report says other processes hold
        self._policy.read(trainer, reading)  # read between steps: what the next step starts from; allocator thrash
        timeline = self._timeline
        if timeline is not None:
            timeline.detector.offload = self._offloaded()  # an offloader's pinned bytes change as it runs
            report = timeline.judge(reading, trainer.global_step)
            if report is not None:  # once a fit: detection stops when a spill is recorded
                self._policy.found(trainer, report, self._batch())
        return reading

    def _batch(self) -> int | None:
        """The run's batch size, judged and advised from: the largest batch of the epoch so far, the one in flight
        included (a short last batch is not the run's: its peak is the full batches'); None before one."""
        return (self._timeline.full_batch if self._timeline is not None else 0) or None

    def _batch_size(self, batch: Any) -> int:
        """Samples in a training batch: every loader's, where several make one (a CombinedLoader; one that has run
        out counts none); a part that cannot be sized counts as one sample."""
        paths = self._loader_paths
        if paths is None:
            samples = samples_in(batch)
            return 1 if samples is None else samples
        return sum(1 if n is None else n for n in map(samples_in, loader_parts(batch, paths)))

    def _require_probe(self) -> MemoryProbe:
        if self._probe is None:
            self._probe = self._user_probe if self._user_probe is not None else probe_for(torch.device("cpu"))
        return self._probe
