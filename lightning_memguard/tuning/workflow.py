"""How a tuner decides at fit start: resume, reuse, cache, search, apply; every rank alike.

:func:`choose_batch_size` (``BatchSizeTuner``) and :func:`choose_accumulation` (``AccumulationTuner``) say which
sizes one epoch can run and what to search; :func:`decide` then takes the first that holds of

1. a choice loaded from a checkpoint (a resume): applied as it is;
2. the tuner's own earlier choice (a second ``fit``): applied if it still fits on its first optimizer step;
3. a cached choice for the same model, data, Trainer and settings: applied if it still fits;
4. a search (:func:`search`): trials (:mod:`.trials`) proposed and judged by the step object (:mod:`.search`),
   each trial's result merged over the ranks (:func:`agree`) so that every rank decides alike; stored in the cache.

The tuner callback holds the settings (:class:`~lightning_memguard.tuning.tuner_settings.TunerSettings`) and what it
learned (:class:`Tuner`); the functions here read and write them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memguard._lightning.agreement import gather_rows
from lightning_memguard._lightning.loaders import reload_train_dataloader, rng_kept
from lightning_memguard.checkpointing import checkpoint_blocks, is_checkpointed
from lightning_memguard.core.units import format_size
from lightning_memguard.tuning.cache import ResultCache
from lightning_memguard.tuning.cache_key import cache_key
from lightning_memguard.tuning.epoch import EpochLength
from lightning_memguard.tuning.search import (
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
from lightning_memguard.tuning.trainer_hands import (
    accumulation_in_force,
    accumulation_setter,
    batch_limit,
    train_epoch,
    train_loaders_named,
    validation_every,
)
from lightning_memguard.tuning.training_state import sigint_handler
from lightning_memguard.tuning.trials import (
    TrialSession,
    optimizer_steps,
    probe_and_capacity,
    set_batch_size,
)
from lightning_memguard.tuning.tuner_settings import TunerSettings

_SEVERITY = (OK, OVER_HEADROOM, SPILL, OOM)  # the worst outcome on any rank is everyone's


@dataclass
class FitBookkeeping:
    """What a tuner keeps during one fit, owned by this module: set by the tuner's hooks and by the workflow."""

    restored: bool = False  # load_state_dict ran in this fit: a resume, re-applied as it is
    sigint: Any = None  # the SIGINT handler while a search runs
    steps_configured: int | float | None = None  # the run's optimizer steps when the schedulers were built


class Tuner(Protocol):
    """What a tuner callback holds: its settings, what it learned (kept in its state and the cache), and its fit's
    bookkeeping."""

    settings: TunerSettings
    accumulates: bool  # its choice holds an accumulation (and whether checkpointing was turned on)
    results: list[TrialResult]
    batch_size: int | None
    accumulate_grad_batches: int | None
    checkpointing: bool
    margin: Margin | None
    from_cache: bool
    search_s: float | None
    compile_s: float | None
    fit_state: FitBookkeeping  # this fit's, written here

    def state_dict(self) -> dict[str, Any]: ...


class BatchSizeChoice(Tuner, Protocol):
    mode: str
    init_size: int
    max_size: int


class AccumulationChoice(Tuner, Protocol):
    effective_batch_size: int
    min_micro_batch: int
    allow_checkpointing: bool

    @property
    def per_device_batch(self) -> int: ...


def _name(tuner: Tuner) -> str:
    return type(tuner).__name__


# ---------------------------------------------------------------------------------------------- BatchSizeTuner


def choose_batch_size(trainer: Trainer, pl_module: LightningModule, tuner: BatchSizeChoice) -> None:
    """The batch size: the ladder ``init_size`` ... ``max_size`` capped at what one epoch runs, searched at the
    accumulation training starts with."""
    start, most = accumulation_in_force(trainer)  # the Trainer's own, or its GradientAccumulationScheduler's
    epoch = count_epoch(trainer, tuner, most, tuner.max_size)
    if epoch.samples != 0 and epoch.largest_batch(most) == 0:  # (an empty loader: the ladder says so)
        limit = batch_limit(trainer) or "the train loader"
        raise ValueError(
            f"{limit} runs no batch in an epoch at any batch size; raise it"
            if most == 1
            else f"{accumulation_setter(trainer)} makes one optimizer step {most} batches, but {limit} gives an"
            f" epoch fewer at every batch size: every step would hold fewer samples than the batch size x {most};"
            f" raise the limit to at least {most} batches or lower the accumulation"
        )
    if tuner.batch_size is not None and not epoch.holds(tuner.batch_size, most):
        rank_zero_info(f"BatchSizeTuner: the earlier choice, {tuner.batch_size}, is above one epoch; measuring again")
        forget(tuner)
        tuner.fit_state.restored = False

    def run_search() -> None:
        full = power_ladder(tuner.init_size, tuner.max_size)
        ladder = capped_ladder(full, epoch, most)
        dropped = [size for size in full if size not in ladder]
        if dropped:
            rank_zero_info(_stand_in_said(trainer, epoch, dropped, ladder[-1], most))
        sizes = SizeSearch(
            ladder, tuner.mode, tuner.settings.min_gain, tuner.settings.tolerance, forecast=forecast(trainer, tuner)
        )
        chosen = search(trainer, tuner, sizes, lambda size: start)  # at the accumulation training starts with
        if chosen is None:
            raise RuntimeError(
                f"BatchSizeTuner: no batch size from {tuner.init_size} up fits on this device without spilling"
                f" ({', '.join(f'{r.size}: {r.outcome}' for r in tuner.results)}); lower `init_size`, or use"
                " AccumulationTuner / ActivationCheckpointing"
            )
        tuner.batch_size = chosen.size
        rank_zero_info(f"BatchSizeTuner: batch size {chosen.size} ({chosen.samples_per_sec:.1f} samples/s)")

    extra = {
        "mode": tuner.mode,
        "range": [tuner.init_size, tuner.max_size],
        "epoch": _epoch_fields(epoch),
        "accumulation": [start, most],
    }
    decide(trainer, pl_module, tuner, extra, run_search, (most, tuner.max_size))


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


# ---------------------------------------------------------------------------------------------- AccumulationTuner


def choose_accumulation(trainer: Trainer, pl_module: LightningModule, tuner: AccumulationChoice) -> None:
    """Micro-batch x accumulation for the effective batch: the pairs of which one epoch runs a whole optimizer step,
    searched; if none fits and ``allow_checkpointing``, searched again with activation checkpointing on."""
    epoch = count_epoch(trainer, tuner, 1, tuner.per_device_batch)  # each micro-batch is held to its own steps
    pairs = _pairs(trainer, tuner, epoch)
    steps_for = dict(pairs)
    if tuner.batch_size is not None and (tuner.batch_size, tuner.accumulate_grad_batches or 1) not in pairs:
        rank_zero_info(
            f"AccumulationTuner: the earlier choice ({tuner.batch_size} x {tuner.accumulate_grad_batches or 1}) is"
            " not a whole optimizer step of this run's effective batch and epoch; measuring again"
        )
        forget(tuner)
        tuner.fit_state.restored = False

    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in pl_module.modules())

    def micro_batches() -> AccumulationSearch:
        settings = tuner.settings
        return AccumulationSearch(
            [m for m, _ in pairs], settings.min_gain, settings.tolerance, forecast(trainer, tuner),
            batch_statistics=has_bn,
        )  # fmt: skip

    def run_search() -> None:
        chosen = search(trainer, tuner, micro_batches(), steps_for.get)
        if chosen is None and tuner.allow_checkpointing:
            plan = checkpoint_blocks(pl_module)
            tuner.checkpointing = True
            rank_zero_info(f"AccumulationTuner: nothing fit; activation checkpointing on ({plan.summary()})")
            chosen = search(trainer, tuner, micro_batches(), steps_for.get)
        if chosen is None:
            raise RuntimeError(
                f"AccumulationTuner: not even a micro-batch of {pairs[0][0]} fits on this device without"
                f" spilling ({', '.join(f'{r.size}: {r.outcome}' for r in tuner.results)}); "
                + _smaller_micro_batch(trainer, tuner, epoch, pairs[0])
                + ("" if tuner.checkpointing else ", or pass allow_checkpointing=True")
            )
        tuner.batch_size, tuner.accumulate_grad_batches = chosen.size, steps_for[chosen.size]

    extra = {
        "effective": tuner.effective_batch_size,
        "min_micro_batch": tuner.min_micro_batch,
        "allow_checkpointing": tuner.allow_checkpointing,
        "epoch": _epoch_fields(epoch),
    }
    decide(trainer, pl_module, tuner, extra, run_search, (1, tuner.per_device_batch))
    if tuner.accumulate_grad_batches and tuner.accumulate_grad_batches > 1 and has_bn:
        rank_zero_warn(
            f"AccumulationTuner: the model has BatchNorm, whose statistics are now per micro-batch of"
            f" {tuner.batch_size}, not per {tuner.per_device_batch}: not the same training as the direct batch"
        )
    rank_zero_info(
        f"AccumulationTuner: micro-batch {tuner.batch_size} x accumulate_grad_batches"
        f" {tuner.accumulate_grad_batches} = {tuner.effective_batch_size} samples per optimizer step"
    )


def _pairs(trainer: Trainer, tuner: AccumulationChoice, epoch: EpochLength) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs of the per-device batch of which one epoch runs a whole optimizer step,
    and at least the batches an int ``val_check_interval`` asks of it.

    Lightning steps the optimizer at an epoch's end whatever the accumulation: in an epoch of fewer batches
    every step would hold less than the effective batch. And it refuses to train when an epoch runs fewer
    batches than an int ``val_check_interval``. Those pairs are left out; if none is left, nothing is.

    Raises:
        ValueError: one epoch runs no whole optimizer step (or too few batches for validation) at any
            micro-batch.
    """
    per_device = tuner.per_device_batch
    candidates = accumulation_candidates(per_device, tuner.min_micro_batch)
    whole = [(m, a) for m, a in candidates if replace(epoch, val_check=None).holds(m, a)]
    pairs = [(m, a) for m, a in whole if epoch.holds(m, a)]
    limit = batch_limit(trainer)
    need = (
        f"`effective_batch_size` {tuner.effective_batch_size} needs {per_device} samples per device for one"
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
            f" {tuner.effective_batch_size} and `min_micro_batch` {tuner.min_micro_batch} allow; lower"
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


def _smaller_micro_batch(
    trainer: Trainer, tuner: AccumulationChoice, epoch: EpochLength, smallest: tuple[int, int]
) -> str:
    """How to allow a micro-batch below ``smallest``, the smallest pair tried: lower ``min_micro_batch`` where
    that was the bound; else the epoch's batch limit made smaller micro-batches too many batches for a whole
    optimizer step (a smaller one only needs more batches, never fewer, so validation cannot be the cause)."""
    m, a = accumulation_candidates(tuner.per_device_batch, tuner.min_micro_batch)[0]
    if smallest[0] == m:
        return "lower `min_micro_batch`"
    limit = batch_limit(trainer) or "the train loader's length"
    return (
        f"{limit} forces a micro-batch of at least {smallest[0]} (one epoch runs {epoch.batches(m)} batches of"
        f" {m}, not the {a} of an optimizer step of {m} x {a}); raise the limit"
    )


# ---------------------------------------------------------------------------------------------- both tuners


def decide(
    trainer: Trainer,
    pl_module: LightningModule,
    tuner: Tuner,
    extra: dict[str, Any],
    run_search: Callable[[], None],
    epoch_rule: tuple[int, int],
) -> None:
    """A resume's choice, the tuner's earlier choice, a cached one, or a new search (the module's docstring says in
    which order), applied. ``extra``: what the tuner adds to the cache key; ``epoch_rule``: the batches an optimizer
    step must fit in one epoch, and the largest size the tuner may try."""
    tuner.fit_state.steps_configured = optimizer_steps(trainer)  # what `configure_optimizers` saw in this fit
    restored, tuner.fit_state.restored = tuner.fit_state.restored, False
    tuner.from_cache = False
    if tuner.batch_size is not None and restored:  # resumed from a checkpoint: re-apply, do not search again
        apply(trainer, tuner)
        return
    samples = (
        _deliverable(trainer, tuner, *epoch_rule) if tuner.batch_size is not None or tuner.settings.cache else None
    )
    if tuner.batch_size is not None and still_fits(trainer, tuner, samples):  # this instance's earlier choice
        apply(trainer, tuner)
        return
    forget(tuner)
    cache = _result_cache(tuner) if tuner.settings.cache else None
    key = cache_key(trainer, pl_module, tuner.settings, _name(tuner), samples, extra) if cache is not None else ""
    cached = _cache_load(trainer, tuner, cache, key) if cache is not None else None
    if cached is not None:
        load_learned(tuner, cached)
        tuner.margin = None
        if still_fits(trainer, tuner, samples):
            tuner.from_cache = True
            margin = _cached_margin(tuner, cached)
            rank_zero_info(f"{_name(tuner)}: reusing a cached choice (batch size {tuner.batch_size}{margin})")
            apply(trainer, tuner)
            return
        forget(tuner)
    run_search()
    apply(trainer, tuner)
    if cache is not None:
        _cache_store(trainer, tuner, cache, key)


def search(
    trainer: Trainer, tuner: Tuner, sizes: SizeSearch | AccumulationSearch, accumulate_for: Any = None
) -> TrialResult | None:
    """Runs the step object's proposals as trials until it stops; each trial said on rank zero, handed to
    ``on_trial``, and kept in ``tuner.results``. The choice, or None where nothing fit."""
    settings = tuner.settings
    earlier = list(tuner.results)  # the session restores callback states on exit, this one's included
    clock = settings.clock if settings.clock is not None else time.perf_counter
    started = clock()
    tuner.fit_state.sigint = sigint_handler()  # put back in on_exception if Ctrl+C ends the search
    with _session(trainer, settings) as trials:
        said = again = 0  # the search's rows told so far; its pairs measured again, told so far
        while True:
            size = sizes.propose()
            for i, row in enumerate(sizes.results[said:], said):
                if row.outcome == PREDICTED:  # rows of sizes not run, added by propose()
                    if accumulate_for:
                        row = sizes.results[i] = replace(row, accumulate=accumulate_for(row.size))
                    rank_zero_info(
                        f"{_name(tuner)}: size {row.size} not run: predicted peak"
                        f" {format_size(row.peak_bytes or 0)}, clearly above the capacity"
                        f"{f'; trying {size} instead' if size is not None else ''}"
                    )
            said = len(sizes.results)
            if size is None:
                break
            if len(sizes.remeasured) > again and sizes.margin is not None:  # a close call: both again
                again = len(sizes.remeasured)
                rank_zero_info(f"{_name(tuner)}: {describe_margin(sizes.margin)}; measuring both again")
            accumulate = accumulate_for(size) if accumulate_for else 1
            result = _trial(trainer, tuner, trials, size, accumulate)
            sizes.observe(result)
            said = len(sizes.results)
            trials.best_rate = sizes.best_rate  # near the capacity, a collapse against it makes a spill
            noise = f" (±{result.spread * 100:.1f} %)" if result.spread is not None else ""
            rank_zero_info(
                f"{_name(tuner)}: size {size} x {accumulate}: {result.outcome}, "
                f"{result.samples_per_sec or 0:.1f} samples/s{noise}, peak {format_size(result.peak_bytes or 0)}"
            )
    tuner.fit_state.sigint = None
    tuner.margin = sizes.margin  # kept in the cache with the choice
    if tuner.margin is not None and (tuner.margin.within_noise or tuner.margin.remeasured):
        rank_zero_info(f"{_name(tuner)}: {describe_margin(tuner.margin, sizes.tie_rule)}")
    tuner.results = earlier + sizes.results
    tuner.search_s, tuner.compile_s = round(clock() - started, 3), round(trials.compile_s, 3)
    if tuner.compile_s:
        rank_zero_info(
            f"{_name(tuner)}: searched for {tuner.search_s:.1f} s, {tuner.compile_s:.1f} s of it in steps"
            " where torch.compile compiled (one static graph per size; not counted in the step times)"
        )
    return sizes.result


def _trial(
    trainer: Trainer, tuner: Tuner, trials: TrialSession, size: int, accumulate: int, steps: int | None = None
) -> TrialResult:
    """One trial, its result agreed by every rank, then handed to ``on_trial``."""
    result = agree(
        trainer, trials.run(size, accumulate) if steps is None else trials.run(size, accumulate, steps=steps)
    )
    if tuner.settings.on_trial is not None:
        tuner.settings.on_trial(result)
    return result


def agree(trainer: Trainer, result: TrialResult) -> TrialResult:
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


def still_fits(trainer: Trainer, tuner: Tuner, samples_per_epoch: int | None) -> bool:
    """Re-check a choice not measured in this fit (a cache entry, a reused tuner): against one epoch of the train
    loader, the cap the search itself applies, then on its first optimizer step."""
    assert tuner.batch_size is not None
    if samples_per_epoch is not None and tuner.batch_size > samples_per_epoch:
        rank_zero_warn(
            f"{_name(tuner)}: the earlier choice (batch size {tuner.batch_size}) is larger than one epoch of"
            f" the train loader ({samples_per_epoch} samples); measuring again"
        )
        return False
    _apply_model(tuner, trainer.lightning_module)
    with _session(trainer, tuner.settings) as trials:
        check = _trial(trainer, tuner, trials, tuner.batch_size, tuner.accumulate_grad_batches or 1, steps=1)
    if not check.fits:
        peak = format_size(check.peak_bytes or 0)
        rank_zero_warn(
            f"{_name(tuner)}: the earlier choice (batch size {tuner.batch_size} x"
            f" {tuner.accumulate_grad_batches or 1}) no longer fits: {check.outcome}, peak {peak} on its"
            " first step; measuring again"
        )
    return check.fits


def apply(trainer: Trainer, tuner: Tuner) -> None:
    """The choice set where the run reads it: the model (checkpointing on again), the batch-size attribute, the
    accumulation, the train loader built anew, the schedules resized."""
    assert tuner.batch_size is not None
    _apply_model(tuner, trainer.lightning_module)
    set_batch_size(trainer, tuner.settings.batch_arg_name, tuner.batch_size)
    if tuner.accumulate_grad_batches is not None:
        trainer.accumulate_grad_batches = tuner.accumulate_grad_batches
    reload_train_dataloader(trainer, for_the_run=True)
    _resize_schedules(trainer, tuner)


def _apply_model(tuner: Tuner, pl_module: LightningModule) -> None:
    """A choice made with activation checkpointing turned on needs it on again (resume, cache, a second fit)."""
    if tuner.checkpointing and not any(is_checkpointed(m) for m in pl_module.modules()):
        plan = checkpoint_blocks(pl_module)
        rank_zero_info(f"AccumulationTuner: checkpointing on again, as for the choice ({plan.summary()})")


def _resize_schedules(trainer: Trainer, tuner: Tuner) -> None:
    """A scheduler stepped every optimizer step was built by ``configure_optimizers`` before the choice, often
    sized by ``trainer.estimated_stepping_batches`` (``OneCycleLR``, a warmup by steps): where the choice changed
    the number of optimizer steps, ``configure_optimizers`` runs again, so the schedule spans the run as it
    will train. Nothing has trained yet (a checkpoint's optimizer and scheduler states are loaded after
    ``on_fit_start``), so the new optimizers lose nothing."""
    steps = optimizer_steps(trainer)
    before, tuner.fit_state.steps_configured = tuner.fit_state.steps_configured, steps
    if before is None or steps == before:
        return
    if not any(config.interval == "step" for config in trainer.lr_scheduler_configs):
        return
    trainer.strategy.setup_optimizers(trainer)
    rank_zero_info(
        f"{_name(tuner)}: the run now takes {steps} optimizer steps, not {before}: `configure_optimizers`"
        " ran again, so that a scheduler sized by `trainer.estimated_stepping_batches` spans the run"
    )


def load_learned(tuner: Tuner, state: dict[str, Any]) -> None:
    """What a state dict or a cache entry holds, taken by the tuner; a missing key keeps what the tuner has."""
    tuner.batch_size = state.get("batch_size", tuner.batch_size)
    tuner.accumulate_grad_batches = state.get("accumulate_grad_batches", tuner.accumulate_grad_batches)
    tuner.results = [TrialResult(**row) for row in state.get("results", [])]
    if tuner.accumulates:
        tuner.checkpointing = state.get("checkpointing", tuner.checkpointing)


def forget(tuner: Tuner) -> None:
    tuner.batch_size, tuner.accumulate_grad_batches, tuner.results = None, None, []


# ---------------------------------------------------------------------------------------------- measuring


def forecast(trainer: Trainer, tuner: Tuner) -> Forecast | None:
    """Sizes the measured ones put clearly above the capacity are not run (see :class:`Forecast`). Under DDP
    the smallest card's capacity counts on every rank, as every rank's trials count (and ranks must propose
    alike)."""
    if not tuner.settings.predict:
        return None
    capacity = probe_and_capacity(trainer, tuner.settings)[1]
    capacity = int(min(row[0] for row in gather_rows(trainer, [capacity])))
    return Forecast(capacity, tuner.settings.headroom)


def _session(trainer: Trainer, settings: TunerSettings) -> TrialSession:
    probe, capacity = probe_and_capacity(trainer, settings)
    return TrialSession(
        trainer, settings.batch_arg_name, probe, capacity, settings.headroom, settings.warmup_steps,
        settings.timed_steps, clock=settings.clock if settings.clock is not None else time.perf_counter,
    )  # fmt: skip


def count_epoch(trainer: Trainer, tuner: Tuner, step_batches: int, largest: int) -> EpochLength:
    """One epoch of the train loader as the Trainer will run it (``limit_train_batches``, ``overfit_batches``,
    ``drop_last``, the shortest of a ``CombinedLoader``'s loaders, an int ``val_check_interval``), on the rank
    whose loader holds the fewest samples. A loader without length is counted by one pass, up to the most any
    size tried could ask of an epoch: ``largest`` (the largest batch or micro-batch the tuner may try) times the
    batches of an optimizer step (``step_batches``) or of a validation interval."""
    batches = max(step_batches, validation_every(trainer) or 1)
    with rng_kept():
        reload_train_dataloader(trainer)
        epoch = train_epoch(trainer, count_up_to=largest * batches)
    if trainer.world_size > 1:
        samples = epoch.samples
        lengths = [int(v) for (v,) in gather_rows(trainer, [-1 if samples is None else samples]) if v >= 0]
        epoch = replace(epoch, samples=min(lengths) if lengths else None)
    return epoch


def _deliverable(trainer: Trainer, tuner: Tuner, step_batches: int, largest: int) -> int | None:
    """The samples one epoch of the train loader really runs, with the batch as large as it can be: the largest
    batch size at which an epoch still holds a whole optimizer step, the cap the search applies (the dataset's
    samples when nothing limits the epoch); None: a loader without length, nothing capped."""
    return count_epoch(trainer, tuner, step_batches, largest).stand_in(step_batches)


def _epoch_fields(epoch: EpochLength) -> list[Any]:
    """One epoch as the cache key holds it: what decides which sizes (and accumulations) can run."""
    return [epoch.samples, epoch.limit, epoch.drop_last, epoch.val_check]


# ---------------------------------------------------------------------------------------------- cache


def _result_cache(tuner: Tuner) -> ResultCache:
    """The cache file for one fit: each problem with the file is reported once (on rank zero)."""
    folder = str(tuner.settings.cache_dir)  # a str by now: TunerSettings fills in the default
    return ResultCache(folder, warn=lambda message: rank_zero_warn(f"{_name(tuner)}: {message}"))


def _entry_rules(tuner: Tuner) -> dict[str, Any]:
    """What :func:`~lightning_memguard.tuning.cache.check_entry` holds this tuner's entries to."""
    if tuner.accumulates:  # micro-batch x accumulation
        return {"accumulates": True, "per_step": tuner.per_device_batch}  # type: ignore[attr-defined]
    return {"accumulates": False}


def _cache_load(trainer: Trainer, tuner: Tuner, cache: ResultCache, key: str) -> dict[str, Any] | None:
    """The checked entry under ``key``; None on a miss, a bad file or a bad entry (never an exception). Rank
    zero reads it and every rank takes its answer: ranks that read files of their own could decide apart."""
    entry = cache.load(key, **_entry_rules(tuner)) if trainer.global_rank == 0 else None
    return trainer.strategy.broadcast(entry) if trainer.world_size > 1 else entry


def _cache_store(trainer: Trainer, tuner: Tuner, cache: ResultCache, key: str) -> None:
    """The choice with its margin: a later run that reuses it says how far it stood from the runner-up."""
    if trainer.global_rank == 0:
        cache.store(key, {**tuner.state_dict(), "margin": None if tuner.margin is None else tuner.margin.to_dict()})


def _cached_margin(tuner: Tuner, entry: dict[str, Any]) -> str:
    """What the reuse line says of a cached choice's margin. One within the measurement's noise is reused, not
    measured again: the two ran alike fast as far as could be measured, the tie rule chose, and a new search
    would choose between equals again at the cost of a search; reusing keeps identical runs alike."""
    if "margin" not in entry:
        return "; its margin over the other sizes was not recorded (an entry from an earlier version)"
    tuner.margin = None if entry["margin"] is None else Margin(**entry["margin"])
    if tuner.margin is None:
        return ""
    rule = (AccumulationSearch if tuner.accumulates else SizeSearch).tie_rule
    if not tuner.margin.within_noise:
        return f"; {describe_margin(tuner.margin, rule)}"
    return f"; {describe_margin(tuner.margin, rule)}: either trains about as fast (`cache=False` measures again)"
