"""BatchSizeTuner and AccumulationTuner: measured choices, made at fit start."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memguard.callbacks._agreement import gather_rows
from lightning_memguard.callbacks._cache import cache_key
from lightning_memguard.callbacks._hands import (
    accumulation_in_force,
    accumulation_setter,
    batch_limit,
    before_learning_rate_finder,
    refuse_accumulation_setters,
    refuse_two_batch_size_searches,
    train_epoch,
    train_loaders_named,
    validation_every,
)
from lightning_memguard.callbacks._state import restore_sigint_handler, sigint_handler
from lightning_memguard.callbacks._trials import (
    TrialSession,
    new_search,
    optimizer_steps,
    reload_train_dataloader,
    require_batch_size_attribute,
    require_module_dataloaders,
    rng_kept,
    set_batch_size,
)
from lightning_memguard.checkpointing import checkpoint_blocks, is_checkpointed
from lightning_memguard.core.cache import ResultCache, cache_folder
from lightning_memguard.core.capacity import judged_capacity
from lightning_memguard.core.checks import (
    MIN_CAPACITY,
    PROBE_NEEDS,
    check_bool,
    check_callable,
    check_fraction,
    check_instance,
    check_int,
    check_size,
)
from lightning_memguard.core.epoch import EpochLength
from lightning_memguard.core.search import (
    MODES,
    OK,
    OOM,
    OVER_HEADROOM,
    PREDICTED,
    SPILL,
    AccumulationSearch,
    Forecast,
    Margin,
    SizeSearch,
    TrialResult,
    accumulation_candidates,
    capped_ladder,
    describe_margin,
    power_ladder,
)
from lightning_memguard.probes import MemoryProbe, probe_for

_SEVERITY = (OK, OVER_HEADROOM, SPILL, OOM)  # the worst outcome on any rank is everyone's


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


def _checkpointing_first(trainer: Trainer, pl_module: LightningModule) -> None:
    """A budgeted ActivationCheckpointing changes the model at fit start; where it comes after a tuner in
    ``callbacks`` it plans now, so the tuner measures the model as it will train, whatever the order."""
    from lightning_memguard.callbacks.checkpointing import ActivationCheckpointing

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ActivationCheckpointing):
            callback.prepare(trainer, pl_module)


def _epoch_fields(epoch: EpochLength) -> list[Any]:
    """One epoch as the cache key holds it: what decides which sizes (and accumulations) can run."""
    return [epoch.samples, epoch.limit, epoch.drop_last, epoch.val_check]


def _stand_in_said(trainer: Trainer, epoch: EpochLength, dropped: list[int], stand_in: int, accumulate: int) -> str:
    """The line that says which sizes one epoch cannot run, why, and which size takes their place, with its batches."""
    limit = batch_limit(trainer)
    epoch_is = f"one epoch of {epoch.samples} samples" if epoch.samples is not None else "one epoch"
    needs = [f"{accumulate} whole batches for an optimizer step" if accumulate > 1 else "a whole batch"]
    if epoch.val_check:
        needs.append(f"{epoch.val_check} batches for `val_check_interval={epoch.val_check}`")
    last = epoch.last_batch(stand_in)
    shape = f"{epoch.batches(stand_in)} batches of {stand_in}" + (
        f", the last of {last}" if last not in (None, stand_in) else ""
    )
    return (
        f"BatchSizeTuner: {', '.join(map(str, dropped))} not tried: {epoch_is}{f' under {limit}' if limit else ''}"
        f" needs at least {' and '.join(needs)}; {stand_in} stands in ({shape})"
    )


class _MeasuringTuner(Callback):
    """What both tuners share: trials, agreement across ranks, state, and the result cache."""

    def __init__(
        self,
        *,
        capacity: int | str | None,
        headroom: float,
        probe: MemoryProbe | None,
        batch_arg_name: str,
        warmup_steps: int,
        timed_steps: int,
        min_gain: float,
        tolerance: float,
        cache: bool,
        cache_dir: str | os.PathLike[str] | None,
        clock: Callable[[], float] | None,
        predict: bool = True,
    ) -> None:
        self.capacity = None if capacity is None else check_size("capacity", capacity, MIN_CAPACITY)
        if probe is not None:
            check_instance("probe", probe, MemoryProbe, PROBE_NEEDS)
        if not isinstance(batch_arg_name, str):
            raise TypeError(f"`batch_arg_name` must be a string, got {batch_arg_name!r}")
        if not batch_arg_name:
            raise ValueError(f"`batch_arg_name` must be a non-empty string, got {batch_arg_name!r}")
        check_bool("cache", cache)
        check_bool("predict", predict)
        self.predict = predict
        if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
            raise TypeError(f"`cache_dir` must be a path (str or os.PathLike) or None, got {cache_dir!r}")
        if cache_dir is not None and not os.fspath(cache_dir):
            raise ValueError(f"`cache_dir` must be a non-empty path or None, got {cache_dir!r}")
        check_callable("clock", clock, "a callable returning seconds,", optional=True)
        self.headroom = check_fraction("headroom", headroom)
        self.probe = probe
        self.batch_arg_name = batch_arg_name
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.timed_steps = check_int("timed_steps", timed_steps, 1)
        self.min_gain = check_fraction("min_gain", min_gain)
        self.tolerance = check_fraction("tolerance", tolerance)
        self.cache = cache
        self.cache_dir = cache_folder(cache_dir)  # `~` expanded
        self.clock = clock
        # learned
        self.results: list[TrialResult] = []
        self.batch_size: int | None = None
        self.accumulate_grad_batches: int | None = None
        self.from_cache = False
        self.search_s: float | None = None  # the last search's wall time, compiling included
        self.compile_s: float | None = None  # of it, the trial steps in which torch.compile compiled
        self._restored = False  # load_state_dict ran in this fit: a resume, re-applied as it is
        self._sigint: Any = None  # the SIGINT handler while a search runs
        self._steps_configured: int | float | None = None  # the run's optimizer steps when the schedulers were built

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "results": [r.to_dict() for r in self.results],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load(state_dict)
        self._restored = self.batch_size is not None

    def _load(self, state_dict: dict[str, Any]) -> None:
        self.batch_size = state_dict.get("batch_size", self.batch_size)
        self.accumulate_grad_batches = state_dict.get("accumulate_grad_batches", self.accumulate_grad_batches)
        self.results = [TrialResult(**row) for row in state_dict.get("results", [])]

    # ------------------------------------------------------------------ checks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _refuse_deepspeed(trainer, type(self).__name__)
        require_module_dataloaders(trainer, type(self).__name__, self.batch_arg_name)
        refuse_two_batch_size_searches(trainer)
        before_learning_rate_finder(trainer, self)
        new_search()  # a warning the trials raise is shown once in this fit's search, not once per trial

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a state loaded after fit start (LearningRateFinder puts the model back from a checkpoint of its own) is
        # not a resume: the next fit measures or re-checks as usual
        self._restored = False

    def _skipped(self, trainer: Trainer) -> bool:
        """Under ``fast_dev_run`` nothing is measured, as Lightning's BatchSizeFinder does."""
        if getattr(trainer, "fast_dev_run", False):
            rank_zero_warn(f"Skipping {type(self).__name__} since `fast_dev_run` is enabled: nothing measured or set")
            self._restored = False
            return True
        if trainer.limit_train_batches == 0:
            rank_zero_info(f"{type(self).__name__}: `limit_train_batches=0` trains nothing: nothing measured or set")
            self._restored = False
            return True
        return False

    # ------------------------------------------------------------------ measuring

    def _probe_and_capacity(self, trainer: Trainer) -> tuple[MemoryProbe, int]:
        probe = self.probe if self.probe is not None else probe_for(trainer.strategy.root_device)
        return probe, judged_capacity(self.capacity, probe.capacity())

    def _forecast(self, trainer: Trainer) -> Forecast | None:
        """Sizes the measured ones put clearly above the capacity are not run (see :class:`Forecast`). Under DDP
        the smallest card's capacity counts on every rank, as every rank's trials count (and ranks must propose
        alike)."""
        if not self.predict:
            return None
        capacity = self._probe_and_capacity(trainer)[1]
        capacity = int(min(row[0] for row in gather_rows(trainer, [capacity])))
        return Forecast(capacity, self.headroom)

    def _session(self, trainer: Trainer) -> TrialSession:
        probe, capacity = self._probe_and_capacity(trainer)
        return TrialSession(
            trainer, self.batch_arg_name, probe, capacity, self.headroom, self.warmup_steps, self.timed_steps,
            clock=self.clock if self.clock is not None else time.perf_counter,
        )  # fmt: skip

    def _epoch(self, trainer: Trainer) -> EpochLength:
        """One epoch of the train loader as the Trainer will run it (``limit_train_batches``, ``overfit_batches``,
        ``drop_last``, the shortest of a ``CombinedLoader``'s loaders, an int ``val_check_interval``), on the rank
        whose loader holds the fewest samples. A loader without length is counted by one pass, up to the most any
        size tried could ask of an epoch."""
        batches = max(self._step_batches(trainer), validation_every(trainer) or 1)
        with rng_kept():
            reload_train_dataloader(trainer)
            epoch = train_epoch(trainer, count_up_to=self._largest_size() * batches)
        if trainer.world_size > 1:
            samples = epoch.samples
            lengths = [int(v) for (v,) in gather_rows(trainer, [-1 if samples is None else samples]) if v >= 0]
            epoch = replace(epoch, samples=min(lengths) if lengths else None)
        return epoch

    def _step_batches(self, trainer: Trainer) -> int:
        """Batches per optimizer step that a size must fit in one epoch: the largest accumulation the Trainer uses."""
        return accumulation_in_force(trainer)[1]

    def _largest_size(self) -> int:
        """The largest batch (or micro-batch) this tuner may try."""
        raise NotImplementedError

    def _deliverable(self, trainer: Trainer) -> int | None:
        """The samples one epoch of the train loader really runs, with the batch as large as it can be: the largest
        batch size at which an epoch still holds a whole optimizer step, the cap the search applies (the dataset's
        samples when nothing limits the epoch); None: a loader without length, nothing capped."""
        return self._epoch(trainer).stand_in(self._step_batches(trainer))

    def _agree(self, trainer: Trainer, result: TrialResult) -> TrialResult:
        """Every rank adopts one result: it fits only if it fits everywhere, at the slowest rank's speed."""
        if trainer.world_size <= 1:
            return result
        mine = [
            _SEVERITY.index(result.outcome),
            result.samples_per_sec or 0.0,
            result.peak_bytes or 0,
            result.step_ms or 0,
            -1.0 if result.spread is None else result.spread,
        ]
        severity, rate, peak, step_ms, spread = zip(*gather_rows(trainer, mine), strict=True)
        return TrialResult(
            size=result.size,
            step_ms=float(max(step_ms)),
            peak_bytes=int(max(peak)),
            samples_per_sec=float(min(rate)),
            outcome=_SEVERITY[int(max(severity))],
            accumulate=result.accumulate,
            compiled=result.compiled,
            compile_s=result.compile_s,
            spread=None if max(spread) < 0 else float(max(spread)),  # the noisiest rank's
        )

    def _search(
        self, trainer: Trainer, search: SizeSearch | AccumulationSearch, accumulate_for: Any = None
    ) -> TrialResult | None:
        earlier = list(self.results)  # the session restores callback states on exit, this one's included
        clock = self.clock if self.clock is not None else time.perf_counter
        started = clock()
        self._sigint = sigint_handler()  # put back in on_exception if Ctrl+C ends the search
        with self._session(trainer) as trials:
            said = again = 0  # the search's rows told so far; its pairs measured again, told so far
            while True:
                size = search.propose()
                for i, row in enumerate(search.results[said:], said):
                    if row.outcome == PREDICTED:  # rows of sizes not run, added by propose()
                        if accumulate_for:
                            row = search.results[i] = replace(row, accumulate=accumulate_for(row.size))
                        rank_zero_info(
                            f"{type(self).__name__}: size {row.size} not run: predicted peak"
                            f" {(row.peak_bytes or 0) / 1e9:.2f} GB, clearly above the capacity"
                            f"{f'; trying {size} instead' if size is not None else ''}"
                        )
                said = len(search.results)
                if size is None:
                    break
                if len(search.remeasured) > again and search.margin is not None:  # a close call: both again
                    again = len(search.remeasured)
                    rank_zero_info(f"{type(self).__name__}: {describe_margin(search.margin)}; measuring both again")
                accumulate = accumulate_for(size) if accumulate_for else 1
                result = self._agree(trainer, trials.run(size, accumulate))
                search.observe(result)
                said = len(search.results)
                trials.best_rate = search.best_rate  # near the capacity, a collapse against it makes a spill
                noise = f" (±{result.spread * 100:.1f} %)" if result.spread is not None else ""
                rank_zero_info(
                    f"{type(self).__name__}: size {size} x {accumulate}: {result.outcome}, "
                    f"{result.samples_per_sec or 0:.1f} samples/s{noise}, peak {(result.peak_bytes or 0) / 1e9:.2f} GB"
                )
        self._sigint = None
        self.margin = search.margin  # kept in the cache with the choice
        if self.margin is not None and (self.margin.within_noise or self.margin.remeasured):
            rank_zero_info(f"{type(self).__name__}: {describe_margin(self.margin, search.tie_rule)}")
        self.results = earlier + search.results
        self.search_s, self.compile_s = round(clock() - started, 3), round(trials.compile_s, 3)
        if self.compile_s:
            rank_zero_info(
                f"{type(self).__name__}: searched for {self.search_s:.1f} s, {self.compile_s:.1f} s of it in steps"
                " where torch.compile compiled (one static graph per size; not counted in the step times)"
            )
        return search.result

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Ctrl+C during a search: Lightning then ignores Ctrl+C for the rest of the process; the handler the
        search started with is put back (a notebook's next Ctrl+C works)."""
        if isinstance(exception, KeyboardInterrupt) and self._sigint is not None:
            restore_sigint_handler(self._sigint)
        self._sigint = None

    # ------------------------------------------------------------------ cache

    _accumulates = False  # its entries hold an accumulation (and whether checkpointing was turned on)
    margin: Margin | None = None  # how far the last choice stood from the runner-up; the cache keeps it with it

    def _cache_key(
        self, trainer: Trainer, pl_module: LightningModule, extra: dict[str, Any], samples_per_epoch: int | None
    ) -> str:
        """The fields are listed in :func:`lightning_memguard.callbacks._cache.cache_key`, and only there."""
        return cache_key(self, trainer, pl_module, samples_per_epoch, extra)

    def _result_cache(self) -> ResultCache:
        """The cache file for one fit: each problem with the file is reported once (on rank zero)."""
        return ResultCache(self.cache_dir, warn=lambda message: rank_zero_warn(f"{type(self).__name__}: {message}"))

    def _entry_rules(self) -> dict[str, Any]:
        """What :func:`~lightning_memguard.core.cache.check_entry` holds this tuner's entries to."""
        return {"accumulates": self._accumulates}

    def _cache_load(self, trainer: Trainer, cache: ResultCache, key: str) -> dict[str, Any] | None:
        """The checked entry under ``key``; None on a miss, a bad file or a bad entry (never an exception). Rank
        zero reads it and every rank takes its answer: ranks that read files of their own could decide apart."""
        entry = cache.load(key, **self._entry_rules()) if trainer.global_rank == 0 else None
        return trainer.strategy.broadcast(entry) if trainer.world_size > 1 else entry

    def _cache_store(self, trainer: Trainer, cache: ResultCache, key: str) -> None:
        """The choice with its margin: a later run that reuses it says how far it stood from the runner-up."""
        if trainer.global_rank == 0:
            cache.store(key, {**self.state_dict(), "margin": None if self.margin is None else self.margin.to_dict()})

    def _cached_margin(self, entry: dict[str, Any]) -> str:
        """What the reuse line says of a cached choice's margin. One within the measurement's noise is reused, not
        measured again: the two ran alike fast as far as could be measured, the tie rule chose, and a new search
        would choose between equals again at the cost of a search; reusing keeps identical runs alike."""
        if "margin" not in entry:
            return "; its margin over the other sizes was not recorded (an entry from an earlier version)"
        self.margin = None if entry["margin"] is None else Margin(**entry["margin"])
        if self.margin is None:
            return ""
        rule = (AccumulationSearch if self._accumulates else SizeSearch).tie_rule
        if not self.margin.within_noise:
            return f"; {describe_margin(self.margin, rule)}"
        return f"; {describe_margin(self.margin, rule)}: either trains about as fast (`cache=False` measures again)"

    def _apply(self, trainer: Trainer) -> None:
        assert self.batch_size is not None
        self._apply_model(trainer.lightning_module)
        set_batch_size(trainer, self.batch_arg_name, self.batch_size)
        if self.accumulate_grad_batches is not None:
            trainer.accumulate_grad_batches = self.accumulate_grad_batches
        reload_train_dataloader(trainer, for_the_run=True)
        self._resize_schedules(trainer)

    def _resize_schedules(self, trainer: Trainer) -> None:
        """A scheduler stepped every optimizer step was built by ``configure_optimizers`` before the choice, often
        sized by ``trainer.estimated_stepping_batches`` (``OneCycleLR``, a warmup by steps): where the choice changed
        the number of optimizer steps, ``configure_optimizers`` runs again, so the schedule spans the run as it
        will train. Nothing has trained yet (a checkpoint's optimizer and scheduler states are loaded after
        ``on_fit_start``), so the new optimizers lose nothing."""
        steps = optimizer_steps(trainer)
        before, self._steps_configured = self._steps_configured, steps
        if before is None or steps == before:
            return
        if not any(config.interval == "step" for config in trainer.lr_scheduler_configs):
            return
        trainer.strategy.setup_optimizers(trainer)
        rank_zero_info(
            f"{type(self).__name__}: the run now takes {steps} optimizer steps, not {before}: `configure_optimizers`"
            " ran again, so that a scheduler sized by `trainer.estimated_stepping_batches` spans the run"
        )

    def _apply_model(self, pl_module: LightningModule) -> None:
        """What the choice changed in the model, made again (AccumulationTuner: activation checkpointing)."""

    def _still_fits(self, trainer: Trainer, samples_per_epoch: int | None) -> bool:
        """Re-check a choice not measured in this fit (a cache entry, a reused tuner): against one epoch of the train
        loader, the cap the search itself applies, then on its first optimizer step."""
        assert self.batch_size is not None
        if samples_per_epoch is not None and self.batch_size > samples_per_epoch:
            rank_zero_warn(
                f"{type(self).__name__}: the earlier choice (batch size {self.batch_size}) is larger than one epoch of"
                f" the train loader ({samples_per_epoch} samples); measuring again"
            )
            return False
        self._apply_model(trainer.lightning_module)
        with self._session(trainer) as trials:
            check = self._agree(trainer, trials.run(self.batch_size, self.accumulate_grad_batches or 1, steps=1))
        if not check.fits:
            peak = (check.peak_bytes or 0) / 1e9
            rank_zero_warn(
                f"{type(self).__name__}: the earlier choice (batch size {self.batch_size} x"
                f" {self.accumulate_grad_batches or 1}) no longer fits: {check.outcome}, peak {peak:.2f} GB on its"
                " first step; measuring again"
            )
        return check.fits

    def _decide(self, trainer: Trainer, pl_module: LightningModule, extra: dict[str, Any], search_fn: Any) -> None:
        self._steps_configured = optimizer_steps(trainer)  # what `configure_optimizers` saw in this fit
        restored, self._restored = self._restored, False
        self.from_cache = False
        if self.batch_size is not None and restored:  # resumed from a checkpoint: re-apply, do not search again
            self._apply(trainer)
            return
        samples = self._deliverable(trainer) if self.batch_size is not None or self.cache else None
        if self.batch_size is not None and self._still_fits(trainer, samples):  # this instance's earlier choice
            self._apply(trainer)
            return
        self._forget()
        cache = self._result_cache() if self.cache else None
        key = self._cache_key(trainer, pl_module, extra, samples) if cache is not None else ""
        cached = self._cache_load(trainer, cache, key) if cache is not None else None
        if cached is not None:
            self._load(cached)
            self.margin = None
            if self._still_fits(trainer, samples):
                self.from_cache = True
                margin = self._cached_margin(cached)
                rank_zero_info(f"{type(self).__name__}: reusing a cached choice (batch size {self.batch_size}{margin})")
                self._apply(trainer)
                return
            self._forget()
        search_fn()
        self._apply(trainer)
        if cache is not None:
            self._cache_store(trainer, cache, key)

    def _forget(self) -> None:
        self.batch_size, self.accumulate_grad_batches, self.results = None, None, []


class BatchSizeTuner(_MeasuringTuner):
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
            listed in ``lightning_memguard.callbacks._cache.cache_key``. A cached choice is re-checked against one
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
        results: one :class:`~lightning_memguard.core.search.TrialResult` per trial (``compiled``, ``compile_s``
            say whether it ran compiled and how long its compiling steps took; ``spread``, its noise).
        batch_size: the choice.
        margin: how far the choice stood from the fastest other size that fit
            (:class:`~lightning_memguard.core.search.Margin`; None where no other fit, or in ``"max_fit"`` mode);
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
    ) -> None:
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.init_size = check_int("init_size", init_size, 1)
        self.max_size = check_int("max_size", max_size, self.init_size)
        super().__init__(
            capacity=capacity, headroom=headroom, probe=probe, batch_arg_name=batch_arg_name,
            warmup_steps=warmup_steps, timed_steps=timed_steps, min_gain=min_gain, tolerance=tolerance,
            cache=cache, cache_dir=cache_dir, clock=clock, predict=predict,
        )  # fmt: skip

    def _largest_size(self) -> int:
        return self.max_size

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        require_batch_size_attribute(trainer, self.batch_arg_name)
        _checkpointing_first(trainer, pl_module)
        if self._skipped(trainer):
            return
        start, most = accumulation_in_force(trainer)  # the Trainer's own, or its GradientAccumulationScheduler's
        epoch = self._epoch(trainer)
        if epoch.samples != 0 and epoch.largest_batch(most) == 0:  # (an empty loader: the ladder says so)
            limit = batch_limit(trainer) or "the train loader"
            raise ValueError(
                f"{limit} runs no batch in an epoch at any batch size; raise it"
                if most == 1
                else f"{accumulation_setter(trainer)} makes one optimizer step {most} batches, but {limit} gives an"
                f" epoch fewer at every batch size: every step would hold fewer samples than the batch size x {most};"
                f" raise the limit to at least {most} batches or lower the accumulation"
            )
        if self.batch_size is not None and not epoch.holds(self.batch_size, most):
            rank_zero_info(
                f"BatchSizeTuner: the earlier choice, {self.batch_size}, is above one epoch; measuring again"
            )
            self._forget()
            self._restored = False

        def search() -> None:
            full = power_ladder(self.init_size, self.max_size)
            ladder = capped_ladder(full, epoch, most)
            dropped = [size for size in full if size not in ladder]
            if dropped:
                rank_zero_info(_stand_in_said(trainer, epoch, dropped, ladder[-1], most))
            sizes = SizeSearch(ladder, self.mode, self.min_gain, self.tolerance, forecast=self._forecast(trainer))
            chosen = self._search(trainer, sizes, lambda size: start)  # at the accumulation training starts with
            if chosen is None:
                raise RuntimeError(
                    f"BatchSizeTuner: no batch size from {self.init_size} up fits on this device without spilling"
                    f" ({', '.join(f'{r.size}: {r.outcome}' for r in self.results)}); lower `init_size`, or use"
                    " AccumulationTuner / ActivationCheckpointing"
                )
            self.batch_size = chosen.size
            rank_zero_info(f"BatchSizeTuner: batch size {chosen.size} ({chosen.samples_per_sec:.1f} samples/s)")

        extra = {
            "mode": self.mode,
            "range": [self.init_size, self.max_size],
            "epoch": _epoch_fields(epoch),
            "accumulation": [start, most],
        }
        self._decide(trainer, pl_module, extra, search)


class AccumulationTuner(_MeasuringTuner):
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

    Neither tuner steps the user's learning-rate schedulers in its trials; where the choice changes the run's
    optimizer steps (``trainer.estimated_stepping_batches``) and a scheduler steps every optimizer step,
    ``configure_optimizers`` runs again after the choice, so a schedule sized by steps (``OneCycleLR``) spans the run.
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
    ) -> None:
        self.effective_batch_size = check_int("effective_batch_size", effective_batch_size, 1)
        self.min_micro_batch = check_int("min_micro_batch", min_micro_batch, 1)
        if self.min_micro_batch > self.effective_batch_size:
            raise ValueError(
                f"`min_micro_batch` must be <= `effective_batch_size` ({self.effective_batch_size}), got"
                f" {min_micro_batch!r}"
            )
        check_bool("allow_checkpointing", allow_checkpointing)
        self.allow_checkpointing = allow_checkpointing
        self.checkpointing = False
        super().__init__(
            capacity=capacity, headroom=headroom, probe=probe, batch_arg_name=batch_arg_name,
            warmup_steps=warmup_steps, timed_steps=timed_steps, min_gain=min_gain, tolerance=tolerance,
            cache=cache, cache_dir=cache_dir, clock=clock, predict=predict,
        )  # fmt: skip

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

    @property
    def per_device_batch(self) -> int:
        return self.effective_batch_size // max(self._world_size, 1)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        require_batch_size_attribute(trainer, self.batch_arg_name)
        _checkpointing_first(trainer, pl_module)
        self._world_size = trainer.world_size
        if self._skipped(trainer):
            return
        epoch = self._epoch(trainer)
        pairs = self._pairs(trainer, epoch)
        steps_for = dict(pairs)
        if self.batch_size is not None and (self.batch_size, self.accumulate_grad_batches or 1) not in pairs:
            rank_zero_info(
                f"AccumulationTuner: the earlier choice ({self.batch_size} x {self.accumulate_grad_batches or 1}) is"
                " not a whole optimizer step of this run's effective batch and epoch; measuring again"
            )
            self._forget()
            self._restored = False

        def micro_batches() -> AccumulationSearch:
            return AccumulationSearch([m for m, _ in pairs], self.min_gain, self.tolerance, self._forecast(trainer))

        def search() -> None:
            chosen = self._search(trainer, micro_batches(), steps_for.get)
            if chosen is None and self.allow_checkpointing:
                plan = checkpoint_blocks(pl_module)
                self.checkpointing = True
                rank_zero_info(f"AccumulationTuner: nothing fit; activation checkpointing on ({plan.summary()})")
                chosen = self._search(trainer, micro_batches(), steps_for.get)
            if chosen is None:
                raise RuntimeError(
                    f"AccumulationTuner: not even a micro-batch of {pairs[0][0]} fits on this device without"
                    f" spilling ({', '.join(f'{r.size}: {r.outcome}' for r in self.results)}); "
                    + self._smaller_micro_batch(trainer, epoch, pairs[0])
                    + ("" if self.checkpointing else ", or pass allow_checkpointing=True")
                )
            self.batch_size, self.accumulate_grad_batches = chosen.size, steps_for[chosen.size]

        extra = {
            "effective": self.effective_batch_size,
            "min_micro_batch": self.min_micro_batch,
            "allow_checkpointing": self.allow_checkpointing,
            "epoch": _epoch_fields(epoch),
        }
        self._decide(trainer, pl_module, extra, search)
        if self.accumulate_grad_batches and self.accumulate_grad_batches > 1:
            has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in pl_module.modules())
            if has_bn:
                rank_zero_warn(
                    f"AccumulationTuner: the model has BatchNorm, whose statistics are now per micro-batch of"
                    f" {self.batch_size}, not per {self.per_device_batch}: not the same training as the direct batch"
                )
        rank_zero_info(
            f"AccumulationTuner: micro-batch {self.batch_size} x accumulate_grad_batches"
            f" {self.accumulate_grad_batches} = {self.effective_batch_size} samples per optimizer step"
        )

    def _pairs(self, trainer: Trainer, epoch: EpochLength) -> list[tuple[int, int]]:
        """(micro-batch, accumulation) pairs of the per-device batch of which one epoch runs a whole optimizer step,
        and at least the batches an int ``val_check_interval`` asks of it.

        Lightning steps the optimizer at an epoch's end whatever the accumulation: in an epoch of fewer batches
        every step would hold less than the effective batch. And it refuses to train when an epoch runs fewer
        batches than an int ``val_check_interval``. Those pairs are left out; if none is left, nothing is.

        Raises:
            ValueError: one epoch runs no whole optimizer step (or too few batches for validation) at any
                micro-batch.
        """
        per_device = self.per_device_batch
        candidates = accumulation_candidates(per_device, self.min_micro_batch)
        whole = [(m, a) for m, a in candidates if replace(epoch, val_check=None).holds(m, a)]
        pairs = [(m, a) for m, a in whole if epoch.holds(m, a)]
        limit = batch_limit(trainer)
        need = (
            f"`effective_batch_size` {self.effective_batch_size} needs {per_device} samples per device for one"
            " optimizer step"
        )
        if not whole:
            if epoch.samples is not None and epoch.samples < per_device:
                where, advice = f"an epoch of {train_loaders_named(trainer)} holds only {epoch.samples}", ""
            else:
                most = max(epoch.samples_at(m) or 0 for m, _ in candidates)
                where = f"with {limit or 'the batch limit'} an epoch runs at most {most} samples"
                advice = f"; raise {limit or 'the limit'}"
            raise ValueError(
                f"{need}, but {where} per device: every step would be smaller than the effective batch{advice} or"
                " lower `effective_batch_size`"
                if advice
                else f"{need}, but {where} per device: every step would be smaller than the effective batch"
            )
        validation = (
            f"`Trainer(val_check_interval={epoch.val_check})` validates every {epoch.val_check} batches of an epoch"
        )
        if not pairs:
            raise ValueError(
                f"{validation}, and Lightning refuses an epoch of fewer, but one epoch runs at most"
                f" {epoch.batches(whole[0][0])} batches at the micro-batches `effective_batch_size`"
                f" {self.effective_batch_size} and `min_micro_batch` {self.min_micro_batch} allow; lower"
                " `val_check_interval`, count it across epochs with `check_val_every_n_epoch=None`, or lower"
                " `min_micro_batch`"
            )
        short = [f"{m} x {a}" for m, a in candidates if (m, a) not in whole]
        if short:
            rank_zero_info(
                f"AccumulationTuner: {', '.join(short)} left out: {need}, and one epoch"
                f"{' with ' + limit if limit else ''} runs fewer batches than that at those micro-batches"
            )
        few = [f"{m} x {a}" for m, a in whole if (m, a) not in pairs]
        if few:
            rank_zero_info(
                f"AccumulationTuner: {', '.join(few)} left out: {validation}, and one epoch runs fewer at those"
                " micro-batches (Lightning would refuse to train)"
            )
        return pairs

    def _smaller_micro_batch(self, trainer: Trainer, epoch: EpochLength, smallest: tuple[int, int]) -> str:
        """How to allow a micro-batch below ``smallest``, the smallest pair tried: lower ``min_micro_batch`` where
        that was the bound; else the epoch's batch limit made smaller micro-batches too many batches for a whole
        optimizer step (a smaller one only needs more batches, never fewer, so validation cannot be the cause)."""
        m, a = accumulation_candidates(self.per_device_batch, self.min_micro_batch)[0]
        if smallest[0] == m:
            return "lower `min_micro_batch`"
        limit = batch_limit(trainer) or "the train loader's length"
        return (
            f"{limit} forces a micro-batch of at least {smallest[0]} (one epoch runs {epoch.batches(m)} batches of"
            f" {m}, not the {a} of an optimizer step of {m} x {a}); raise the limit"
        )

    def _step_batches(self, trainer: Trainer) -> int:
        return 1  # the accumulation is this tuner's own choice: `_pairs` holds each micro-batch to its own

    def _largest_size(self) -> int:
        return self.per_device_batch

    _world_size = 1
    _accumulates = True

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "checkpointing": self.checkpointing}

    def _entry_rules(self) -> dict[str, Any]:
        return {**super()._entry_rules(), "per_step": self.per_device_batch}  # micro-batch x accumulation

    def _load(self, state_dict: dict[str, Any]) -> None:
        super()._load(state_dict)
        self.checkpointing = state_dict.get("checkpointing", self.checkpointing)

    def _apply_model(self, pl_module: LightningModule) -> None:
        """A choice made with activation checkpointing turned on needs it on again (resume, cache, a second fit)."""
        if self.checkpointing and not any(is_checkpointed(m) for m in pl_module.modules()):
            plan = checkpoint_blocks(pl_module)
            rank_zero_info(f"AccumulationTuner: checkpointing on again, as for the choice ({plan.summary()})")
