"""The Trainer's other hands on the batch size, the accumulation and the data, known in one place.

A tuner is not alone in a Trainer: Lightning's ``BatchSizeFinder`` (or another tuner) may set the same batch size,
``Trainer(accumulate_grad_batches)`` or a ``GradientAccumulationScheduler`` the accumulation, and
``limit_train_batches`` / ``overfit_batches`` with the loaders' lengths and ``drop_last`` decide how much one epoch
really runs, an int ``val_check_interval`` how few batches it may run. What cannot work together is refused here, in
``setup``, before anything is measured; what can is read from here, so the search, the checks and the cache see the
same thing.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, GradientAccumulationScheduler, LearningRateFinder
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_memguard._lightning.batches import samples_in
from lightning_memguard._lightning.privates import train_loader, validation_by_time
from lightning_memguard.tuning.epoch import EpochLength
from lightning_memguard.tuning.trials import loader_samples


def _rank(callback: Callback, kinds: tuple[type[Callback], ...]) -> tuple[int, str]:
    """Lightning's finder first, then the tuners in the order given: the message reads the same whatever the order
    in ``callbacks`` and whichever of them refuses first."""
    rank = next((i for i, kind in enumerate(kinds) if isinstance(callback, kind)), len(kinds))
    return rank, type(callback).__name__


def _name(callback: Callback) -> str:
    name = type(callback).__name__
    if isinstance(callback, BatchSizeFinder) and type(callback) is not BatchSizeFinder:
        return f"{name} (a BatchSizeFinder)"
    return name


def refuse_two_batch_size_searches(trainer: Trainer, tuners: tuple[type[Callback], ...]) -> None:
    """Two callbacks that each set the batch size at fit start: the last to run would silently overwrite the
    other's choice (Lightning moves its ``BatchSizeFinder`` first, whatever the order given). ``tuners``: this
    library's callbacks that set it (``BatchSizeTuner``, ``AccumulationTuner``), in the order a message names them.

    Raises:
        ValueError: naming every one of them and what to remove; the same message from each of them.
    """
    kinds: tuple[type[Callback], ...] = (BatchSizeFinder, *tuners)
    searches = sorted(
        (c for c in trainer.callbacks if isinstance(c, kinds)),  # type: ignore[attr-defined]
        key=lambda c: _rank(c, kinds),
    )
    if len(searches) < 2:
        return
    names = [_name(c) for c in searches]
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    advice = "keep one of them in `Trainer(callbacks=...)` and remove the other" + ("s" if len(names) > 2 else "")
    if isinstance(searches[0], BatchSizeFinder):
        advice += (
            f" (moving from Lightning's tuner: remove {names[0]}; {names[-1]} replaces it)"
            if len(names) == 2
            else f" (moving from Lightning's tuner: remove {names[0]})"
        )
    elif len(names) == 2 and names == ["BatchSizeTuner", "AccumulationTuner"]:
        advice += (
            " (AccumulationTuner chooses the micro-batch for a fixed effective batch; BatchSizeTuner the batch size"
            " alone)"
        )
    raise ValueError(
        f"{listed} are {'both' if len(names) == 2 else 'all'} in the Trainer's callbacks and each sets the batch"
        f" size at fit start: the last to run would silently overwrite the other's choice; {advice}"
    )


def refuse_accumulation_setters(trainer: Trainer, tuner: Callback, own: int | None) -> None:
    """For a tuner that sets ``accumulate_grad_batches`` itself: nothing else in the Trainer may set it.

    ``own``: the accumulation this tuner set in an earlier ``fit`` of the same Trainer (it is the Trainer's now).

    Raises:
        ValueError: a ``GradientAccumulationScheduler`` in the callbacks (it resets the accumulation at every epoch
            start), or ``Trainer(accumulate_grad_batches>1)``.
    """
    name = type(tuner).__name__
    schedulers = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]  # type: ignore[attr-defined]
    if schedulers:
        scheduling = dict(sorted(schedulers[0].scheduling.items()))
        raise ValueError(
            f"GradientAccumulationScheduler(scheduling={scheduling}) and {name} both set `accumulate_grad_batches`:"
            f" the scheduler would reset {name}'s choice at every epoch start, and optimizer steps would no longer"
            f" hold the effective batch; remove GradientAccumulationScheduler from `Trainer(callbacks=...)`"
            f" ({name} keeps the effective batch), or remove {name}"
        )
    if trainer.accumulate_grad_batches != 1 and own is None:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and {name} both set the"
            f" accumulation; remove `accumulate_grad_batches` from the Trainer ({name} sets it), or remove {name}"
        )


def before_learning_rate_finder(trainer: Trainer, tuner: Callback) -> None:
    """Lightning moves its ``LearningRateFinder`` to the front of the callbacks, so it would search a learning rate
    at the batch size the tuner is about to change: the tuner is moved ahead of it (a new list, so the hook
    being called now goes on over the old one), and the finder searches at the batch the run will train with."""
    callbacks = list(trainer.callbacks)  # type: ignore[attr-defined]
    finders = [i for i, c in enumerate(callbacks) if isinstance(c, LearningRateFinder)]
    if not finders or callbacks.index(tuner) < finders[0]:
        return
    callbacks.remove(tuner)
    callbacks.insert(finders[0], tuner)
    trainer.callbacks = callbacks  # type: ignore[attr-defined]
    rank_zero_info(
        f"{_name(tuner)} runs before LearningRateFinder, which then searches at the batch size the run trains with"
    )


def accumulation_in_force(trainer: Trainer) -> tuple[int, int]:
    """The accumulation training will start with and the largest it will use: the Trainer's, or a
    ``GradientAccumulationScheduler``'s (it sets the Trainer's at every epoch start)."""
    schedulers = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]  # type: ignore[attr-defined]
    if not schedulers:
        return trainer.accumulate_grad_batches, trainer.accumulate_grad_batches
    scheduler = schedulers[0]
    return scheduler.get_accumulate_grad_batches(trainer.current_epoch), max(scheduler.scheduling.values())


def train_epoch(trainer: Trainer, count_up_to: int | None = None) -> EpochLength:
    """One epoch of the train loaders on this rank, as the Trainer will run it: the loaders must be built.

    The samples are the sampler's (or the dataset's) length, of the shortest loader where several make each batch
    (a ``CombinedLoader``: every one must deliver whole batches); the batch limit is ``limit_train_batches``, which
    Lightning sets to ``overfit_batches`` when that is on. A loader without length (an ``IterableDataset``) is
    counted by one pass over it, stopped past ``count_up_to`` samples (the most a tuner could ask of an epoch):
    a finite stream shorter than that is known by what it delivers, a longer one stays unknown (None).
    """
    combined = train_loader(trainer)
    loaders = combined.flattened if combined is not None else []
    lengths = [
        (loader_samples(loader) if count_up_to is None else _samples_or_count(loader, count_up_to),
         bool(getattr(loader, "drop_last", False)))
        for loader in loaders
    ]  # fmt: skip
    return EpochLength.of_loaders(lengths, trainer.limit_train_batches, validation_every(trainer))


def _samples_or_count(loader: Any, up_to: int) -> int | None:
    """The loader's length in samples, or the samples one pass over it delivers; None: more than ``up_to``."""
    samples = loader_samples(loader)
    if samples is not None:
        return samples
    delivered = 0
    for batch in loader:
        delivered += samples_in(batch) or 0
        if delivered > up_to:
            return None
    return delivered


def validation_every(trainer: Trainer) -> int | None:
    """An int ``val_check_interval`` that Lightning holds every epoch to: with ``check_val_every_n_epoch`` set and
    validation on, it refuses an epoch of fewer batches (``FitLoop.setup_data``). None where no such rule holds: a
    fraction, a time, or batches counted across epochs (``check_val_every_n_epoch=None``)."""
    if validation_by_time(trainer):  # then the Trainer has no `val_check_interval` in batches
        return None
    interval = trainer.val_check_interval
    if isinstance(interval, bool) or not isinstance(interval, int):
        return None
    if trainer.check_val_every_n_epoch is None or not trainer.limit_val_batches > 0:
        return None
    return interval


def train_loaders_named(trainer: Trainer) -> str:
    """The train loader(s) an epoch is judged by, as a message names them."""
    combined = train_loader(trainer)
    count = len(combined.flattened) if combined is not None else 1
    return "the train loader" if count <= 1 else f"the shortest train loader (of {count})"


def batch_limit(trainer: Trainer) -> str:
    """The Trainer's argument that limits an epoch, as the user wrote it ("" when none does)."""
    overfit = getattr(trainer, "overfit_batches", 0)  # set by the Trainer's debugging flags, not declared
    if overfit:
        return f"`Trainer(overfit_batches={overfit!r})`"
    limit = trainer.limit_train_batches
    if not (isinstance(limit, float) and limit == 1.0):
        return f"`Trainer(limit_train_batches={trainer.limit_train_batches!r})`"
    return ""


def accumulation_setter(trainer: Trainer) -> str:
    """What sets the accumulation in this Trainer, as the user wrote it."""
    schedulers = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]  # type: ignore[attr-defined]
    if schedulers:
        return f"GradientAccumulationScheduler(scheduling={dict(sorted(schedulers[0].scheduling.items()))})"
    return f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})`"
