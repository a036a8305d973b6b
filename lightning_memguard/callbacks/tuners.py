"""BatchSizeTuner and AccumulationTuner: argument checks and Lightning hooks. What they decide, and how, is
:mod:`lightning_memguard.tuning` (:mod:`~lightning_memguard.tuning.workflow` first)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memguard._lightning.loaders import new_search
from lightning_memguard._lightning.privates import model_logging_dropped
from lightning_memguard.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memguard.core.checks import check_bool, check_int
from lightning_memguard.probes import MemoryProbe
from lightning_memguard.tuning import workflow
from lightning_memguard.tuning.search import MODES, Margin, TrialResult
from lightning_memguard.tuning.trainer_hands import (
    before_learning_rate_finder,
    refuse_accumulation_setters,
    refuse_two_batch_size_searches,
)
from lightning_memguard.tuning.training_state import restore_sigint_handler
from lightning_memguard.tuning.trials import require_batch_size_attribute, require_module_dataloaders
from lightning_memguard.tuning.tuner_settings import TunerSettings


class _Setting:
    """One of the shared settings, read and set on the tuner (``tuner.probe``) and kept in ``tuner.settings``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, tuner: Any, owner: type | None = None) -> Any:
        return self if tuner is None else getattr(tuner.settings, self.name)

    def __set__(self, tuner: Any, value: Any) -> None:
        setattr(tuner.settings, self.name, value)


class _Tuner(Callback):
    """What both tuners share: the settings, what they learned (their state), the checks in ``setup``."""

    accumulates = False  # its choice holds an accumulation (and whether checkpointing was turned on)
    capacity, headroom, probe, batch_arg_name, warmup_steps, timed_steps = (_Setting() for _ in range(6))
    min_gain, tolerance, cache, cache_dir, clock, predict, on_trial = (_Setting() for _ in range(7))

    def __init__(self, settings: TunerSettings) -> None:
        self.settings = settings
        # learned
        self.results: list[TrialResult] = []
        self.batch_size: int | None = None
        self.accumulate_grad_batches: int | None = None
        self.checkpointing = False  # AccumulationTuner: activation checkpointing turned on for the choice
        self.margin: Margin | None = None  # how far the last choice stood from the runner-up; cached with it
        self.from_cache = False
        self.search_s: float | None = None  # the last search's wall time, compiling included
        self.compile_s: float | None = None  # of it, the trial steps in which torch.compile compiled
        self.fit_state = workflow.FitBookkeeping()  # this fit's: a resume, the SIGINT handler, the optimizer steps

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "results": [r.to_dict() for r in self.results],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        workflow.load_learned(self, state_dict)
        self.fit_state.restored = self.batch_size is not None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _refuse_deepspeed(trainer, type(self).__name__)
        require_module_dataloaders(trainer, type(self).__name__, self.settings.batch_arg_name)
        refuse_two_batch_size_searches(trainer, (BatchSizeTuner, AccumulationTuner))
        before_learning_rate_finder(trainer, self)
        new_search()  # a warning the trials raise is shown once in this fit's search, not once per trial

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a state loaded after fit start (LearningRateFinder puts the model back from a checkpoint of its own) is
        # not a resume: the next fit measures or re-checks as usual
        self.fit_state.restored = False

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Ctrl+C during a search: Lightning then ignores Ctrl+C for the rest of the process; the handler the
        search started with is put back (a notebook's next Ctrl+C works)."""
        if isinstance(exception, KeyboardInterrupt) and self.fit_state.sigint is not None:
            restore_sigint_handler(self.fit_state.sigint)
        self.fit_state.sigint = None
        model_logging_dropped(self)  # Lightning calls no teardown after an exception

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        model_logging_dropped(self)  # what it learned stays; the fit's model is not kept

    def _ready(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        """At fit start: the batch-size attribute there, a budgeted ActivationCheckpointing planned first (the tuner
        measures the model as it will train, whatever the order in ``callbacks``); False where nothing is measured,
        under ``fast_dev_run`` (as Lightning's BatchSizeFinder) or ``limit_train_batches=0``."""
        require_batch_size_attribute(trainer, self.settings.batch_arg_name)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, ActivationCheckpointing):
                callback.prepare(trainer, pl_module)
        if getattr(trainer, "fast_dev_run", False):
            rank_zero_warn(f"Skipping {type(self).__name__} since `fast_dev_run` is enabled: nothing measured or set")
        elif trainer.limit_train_batches == 0:
            rank_zero_info(f"{type(self).__name__}: `limit_train_batches=0` trains nothing: nothing measured or set")
        else:
            return True
        self.fit_state.restored = False
        return False


def _refuse_deepspeed(trainer: Trainer, tuner: str) -> None:
    """DeepSpeed keeps the optimizer and its state inside its engine, which the trials' restore does not reach:
    refused before anything is measured (FSDP and ModelParallel are supported: each rank's shards are put back)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy):
        raise ValueError(
            f"{tuner} does not support DeepSpeedStrategy: its trials could not put DeepSpeed's engine, weights and"
            " optimizer state back. Search with strategy='fsdp', 'ddp' or one device, then pass the batch size it"
            " chose (`.batch_size`, `.accumulate_grad_batches`) to the DeepSpeed run"
        )


class BatchSizeTuner(_Tuner):
    """Picks the batch size by measuring throughput on this device, never a size that spills.

    A spill-aware, throughput-aware replacement for Lightning's ``BatchSizeFinder``: at fit start it trains a few
    steps at each size of a doubling ladder (``init_size`` ... ``max_size``), counts a size as not fitting on OOM, on
    a spill, or on peak memory within ``headroom`` of the capacity, and stops climbing once a step up gains less
    than ``min_gain``. The model, optimizer, schedulers, RNG state and Trainer counters are restored afterwards,
    then the batch size is set where Lightning's tuner sets it (model, hparams or datamodule) and the dataloaders
    are rebuilt.

    Args:
        mode: ``"throughput"`` (fastest samples/s) or ``"max_fit"`` (largest size that fits without spilling).
        init_size: first size tried.
        max_size: largest size tried.
        capacity: device memory to judge against (bytes or ``"16GB"``); default: the probe's.
        headroom: fraction of capacity a trial must leave free.
        probe: memory reader; default: the Trainer device's (``SysmemSpillEmulator(...).probe`` in tests).
        batch_arg_name: the attribute that holds the batch size.
        warmup_steps: untimed steps per trial; timed_steps: timed steps per trial (their median; their spread is the
            trial's noise).
        min_gain: stop climbing when a doubling gains less than this fraction of throughput.
        tolerance: sizes within this fraction of the best throughput are equal; the smaller is chosen.
        cache: reuse a choice stored for the same model (as it trains: checkpointed blocks included), input (the
            shapes of each train loader's first batch), samples one epoch of the train loader runs, datamodule,
            precision, device, capacity, tuner settings and versions (torch, Lightning, this library); the fields are
            listed in ``lightning_memguard.tuning.cache_key.cache_key``. A cached choice is re-checked against one
            epoch of the train loader and on its first optimizer step, and measured again if it no longer fits. An
            entry or a file that is not what the tuners write (hand-edited, truncated, another shape) is a miss with
            one warning, never an error; processes writing the cache at once each keep their entries (a lock file).
        cache_dir: the cache's folder, ``~`` expanded (default ``~/.cache/lightning-memguard``); it holds
            ``tuner-cache.json``. A folder that cannot be written, or a ``tuner-cache.json`` that is a folder, is
            reported with a warning and left as it is.
        predict: peak memory is close to affine in the batch size: a size the two largest measured ones put more
            than 10 % above the capacity is not run (a ``"predicted_over"`` row with the predicted peak), and the
            largest size predicted to fit is tried instead. ``False`` runs every size of the ladder (for a model
            whose memory is far from affine in the batch).
        clock: seconds for timing the trials (default ``time.perf_counter``; tests inject their own).
        on_trial: called with each trial's :class:`~lightning_memguard.tuning.search.TrialResult` as soon as it is
            measured (every rank's merged, on every rank), the re-check of an earlier choice included: a search's
            progress, for a command line or a notebook (``memguard plan`` prints each row). Sizes not run
            (``"predicted_over"``) are not trials.

    Raises:
        ValueError / TypeError: a bad argument (at construction); in ``setup``, a DataLoader passed to ``fit``, or
            another callback that sets the batch size at fit start as well (Lightning's ``BatchSizeFinder`` or a
            subclass, ``AccumulationTuner``, a second ``BatchSizeTuner``: the last to run would overwrite the
            other's choice); at fit start, an accumulation (``Trainer(accumulate_grad_batches)`` or a
            ``GradientAccumulationScheduler``) of more batches than one epoch runs at any batch size; in a trial, a
            train loader (any of a ``CombinedLoader``'s, named) whose batches do not hold the size set (it ignores
            ``batch_arg_name``).

    Under ``fast_dev_run`` or ``limit_train_batches=0`` nothing is measured or set (``fast_dev_run`` warns), as
    Lightning's ``BatchSizeFinder`` does. Sizes at which one epoch, as the Trainer will run it
    (``limit_train_batches`` as an int or a fraction, ``overfit_batches``, the loader's length and ``drop_last``),
    would not hold a whole optimizer step, or would run fewer batches than an int ``val_check_interval`` (with
    ``check_val_every_n_epoch`` set, Lightning refuses that), are not tried: a stand-in takes their place, said in
    one line (with no limit and no accumulation, the whole epoch as one batch), the largest that can unless the
    epoch would end in a short batch (21 + 21 + 21 + 1, which BatchNorm cannot train on): then the largest down to
    half of it whose batches are all full (16), else one whose last batch holds at least half a batch. A loader
    without length is counted by one pass, up to ``max_size`` samples per batch of a step: a shorter stream caps the
    sizes at what it delivers, a longer one caps nothing; of a ``CombinedLoader``'s loaders (``max_size_cycle``,
    ``min_size``, ``max_size``), each built from ``batch_arg_name``, the shortest caps. Throughput counts the
    samples really delivered, every loader's. With an accumulation in force (``Trainer(accumulate_grad_batches)``,
    or a ``GradientAccumulationScheduler``: its value for the first epoch, the cap at its largest) every trial runs
    at it, and each row of ``results`` says so. The search runs before ``Trainer(max_time=...)`` starts counting, as
    Lightning's ``BatchSizeFinder`` does.

    Under ``torch.compile`` (``fit(torch.compile(model))``, a compiled submodule, ``module.compile()``) each size
    tried compiles a graph of its own, static in its shapes, as training at that size alone would (a model compiled
    with ``dynamic=True`` stays dynamic); steps in which the compiler ran are left out of the timing (the trial runs
    as many more) and counted as ``compile_s``, and training after the search runs the chosen size's graph.

    Attributes:
        results: one :class:`~lightning_memguard.tuning.search.TrialResult` per trial (``compiled``, ``compile_s``
            say whether it ran compiled and how long its compiling steps took; ``spread``, its noise).
        batch_size: the choice.
        margin: how far the choice stood from the fastest other size that fit
            (:class:`~lightning_memguard.tuning.search.Margin`; None where no other fit, or in ``"max_fit"`` mode);
            within the measurement's noise both were measured again, and the one with the smaller peak memory taken.
        search_s: the last search's wall time in seconds; compile_s: the part of it spent in compiling steps.

    Example:
        >>> tuner = BatchSizeTuner(init_size=16, max_size=256)
        >>> BatchSizeTuner(mode="biggest")
        Traceback (most recent call last):
        ...
        ValueError: `mode` must be one of ('throughput', 'max_fit'), got 'biggest'
    """

    def __init__(
        self,
        mode: str = "throughput",
        init_size: int = 32,
        max_size: int = 4096,
        capacity: int | str | None = None,
        headroom: float = 0.05,
        probe: MemoryProbe | None = None,
        batch_arg_name: str = "batch_size",
        warmup_steps: int = 2,
        timed_steps: int = 4,
        min_gain: float = 0.05,
        tolerance: float = 0.01,
        cache: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] | None = None,
        predict: bool = True,
        on_trial: Callable[[TrialResult], None] | None = None,
    ) -> None:
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.init_size = check_int("init_size", init_size, 1)
        self.max_size = check_int("max_size", max_size, self.init_size)
        super().__init__(
            TunerSettings(
                capacity, headroom, probe, batch_arg_name, warmup_steps, timed_steps, min_gain, tolerance, cache,
                cache_dir, clock, predict, on_trial,
            )
        )  # fmt: skip

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._ready(trainer, pl_module):
            workflow.choose_batch_size(trainer, pl_module, self)


class AccumulationTuner(_Tuner):
    """Picks micro-batch x ``accumulate_grad_batches`` for a fixed effective batch by measuring this device.

    The effective batch is split per device (world size counted), candidate micro-batches halve it while it
    divides evenly, and each is trained for a few optimizer steps with the matching accumulation. Of those that fit
    (no OOM, no spill, memory within the headroom) the one that accumulates least is set, unless one that
    accumulates more is faster by more than ``min_gain``: the batch-size attribute (model, hparams or datamodule)
    and ``trainer.accumulate_grad_batches``. If even the smallest micro-batch does not fit and
    ``allow_checkpointing=True``, activation checkpointing is turned on and the search runs again.

    A micro-batch is a candidate only if one epoch, as the Trainer will run it (``limit_train_batches`` as an int or
    a fraction, ``overfit_batches``, the loader's length and ``drop_last``; the shortest of a ``CombinedLoader``'s
    loaders), holds a whole optimizer step of it: Lightning steps the optimizer at every epoch's end, so in a
    shorter epoch each step would hold less than the effective batch; and only if the epoch runs at least the
    batches of an int ``val_check_interval``, which Lightning requires (the others are left out, and logged). A
    loader without length is counted by one pass, up to one optimizer step's samples: a shorter stream is refused as
    any short epoch is, a longer one is taken to hold a step, unless an int ``limit_train_batches`` says otherwise.
    The search runs before ``Trainer(max_time=...)`` starts counting.

    Neither tuner steps the user's learning-rate schedulers in its trials (under manual optimization the user's
    ``training_step`` sees them and may step them: each trial starts from their state, put back afterwards); where
    the choice changes the run's optimizer steps (``trainer.estimated_stepping_batches``) and a scheduler steps every
    optimizer step, ``configure_optimizers`` runs again after the choice, so a schedule sized by steps
    (``OneCycleLR``) spans the run.
    Both run before Lightning's ``LearningRateFinder``, which then searches at the batch size chosen.

    Args:
        effective_batch_size: samples per optimizer step, all devices together.
        min_micro_batch: smallest micro-batch to consider; at most the per-device batch.
        allow_checkpointing: fall back to activation checkpointing when nothing fits.
        min_gain: how much faster (a fraction of throughput) a micro-batch that accumulates more must be than one
            that accumulates less to be chosen. The default, 5 %, is beyond the timing noise of a few timed steps,
            so identical runs choose alike, and the direct batch (BatchNorm statistics over all of it) is kept
            unless accumulating clearly pays.
        tolerance: throughputs within this fraction of each other count as equal.
        Other arguments as for :class:`BatchSizeTuner`.

    Raises:
        ValueError: a ``min_micro_batch`` above ``effective_batch_size`` (at construction); in ``setup``, an
            effective batch that cannot be split over the devices or whose per-device share is below
            ``min_micro_batch``, anything else that sets the accumulation (``Trainer(accumulate_grad_batches)``, a
            ``GradientAccumulationScheduler``) or the batch size (Lightning's ``BatchSizeFinder``,
            ``BatchSizeTuner``), manual optimization or a DataLoader passed to ``fit``; at fit start, an effective
            batch of which one epoch holds no whole optimizer step (or fewer batches than an int
            ``val_check_interval``) at any micro-batch; in a trial, a train loader that ignores the batch-size
            attribute. A choice made with checkpointing turned on turns it on again when it
            is re-applied (resume, cache, a second ``fit``).

    Under ``torch.compile`` each micro-batch tried gets its own static graph and compiling steps are not timed, as
    for :class:`BatchSizeTuner`.

    Attributes:
        results, batch_size (the micro-batch), accumulate_grad_batches, checkpointing (whether it was turned on),
        margin, search_s and compile_s (as for :class:`BatchSizeTuner`; within the noise, the larger micro-batch is
        taken).

    Example:
        >>> tuner = AccumulationTuner(effective_batch_size=256)
        >>> AccumulationTuner(effective_batch_size=0)
        Traceback (most recent call last):
        ...
        ValueError: `effective_batch_size` must be >= 1, got 0
    """

    accumulates = True

    def __init__(
        self,
        effective_batch_size: int,
        min_micro_batch: int = 8,
        allow_checkpointing: bool = False,
        capacity: int | str | None = None,
        headroom: float = 0.05,
        probe: MemoryProbe | None = None,
        batch_arg_name: str = "batch_size",
        warmup_steps: int = 2,
        timed_steps: int = 3,
        min_gain: float = 0.05,
        tolerance: float = 0.01,
        cache: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] | None = None,
        predict: bool = True,
        on_trial: Callable[[TrialResult], None] | None = None,
    ) -> None:
        self.effective_batch_size = check_int("effective_batch_size", effective_batch_size, 1)
        self.min_micro_batch = check_int("min_micro_batch", min_micro_batch, 1)
        if self.min_micro_batch > self.effective_batch_size:
            raise ValueError(
                f"`min_micro_batch` must be <= `effective_batch_size` ({self.effective_batch_size}), got"
                f" {min_micro_batch!r}"
            )
        self.allow_checkpointing = check_bool("allow_checkpointing", allow_checkpointing)
        self._world_size = 1
        super().__init__(
            TunerSettings(
                capacity, headroom, probe, batch_arg_name, warmup_steps, timed_steps, min_gain, tolerance, cache,
                cache_dir, clock, predict, on_trial,
            )
        )  # fmt: skip

    @property
    def per_device_batch(self) -> int:
        return self.effective_batch_size // max(self._world_size, 1)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        world = trainer.world_size
        if self.effective_batch_size % world:
            raise ValueError(
                f"`effective_batch_size` {self.effective_batch_size} cannot be split evenly over {world} devices"
            )
        if self.min_micro_batch > self.effective_batch_size // world:
            raise ValueError(
                f"`min_micro_batch` {self.min_micro_batch} is larger than the {self.effective_batch_size // world}"
                f" samples per device that `effective_batch_size` {self.effective_batch_size} gives over {world}"
                f" devices; lower `min_micro_batch` to at most {self.effective_batch_size // world}"
            )
        super().setup(trainer, pl_module, stage)
        refuse_accumulation_setters(trainer, self, self.accumulate_grad_batches)
        if not pl_module.automatic_optimization:
            raise ValueError("AccumulationTuner needs automatic optimization; this module optimizes manually")

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._world_size = trainer.world_size
        if self._ready(trainer, pl_module):
            workflow.choose_accumulation(trainer, pl_module, self)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "checkpointing": self.checkpointing}
