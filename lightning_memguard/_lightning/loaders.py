"""The train loader as the run builds it: built again without Lightning's remarks on each trial, the random number
generators kept, its first batch read (a tuner's cache key, a checkpointing budget's example)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_memguard._lightning.batches import inputs_from_batch
from lightning_memguard._lightning.privates import (
    as_training_step_gets_it,
    drop_loaders,
    rng_states,
    set_rng_states,
    setup_loaders,
    train_loader,
)
from lightning_memguard.checkpointing.families import Units, find_units


def reload_train_dataloader(trainer: Trainer, *, for_the_run: bool = False) -> None:
    """Build the train loader again now (the validation one when validation first runs). Lightning's remarks on a
    loader (its worker count, an epoch shorter than the logging interval) are made only ``for_the_run``: once, for
    the loader the run trains with, not for every loader a tuner builds to measure."""
    drop_loaders(trainer)
    with nullcontext() if for_the_run else about_the_run_only():
        setup_loaders(trainer)


@contextmanager
def rng_kept() -> Iterator[None]:
    """Building or reading a loader can draw random numbers (a sampler's seed): put every RNG back afterwards."""
    states = rng_states()
    try:
        yield
    finally:
        set_rng_states(states)


def first_batch_signature(trainer: Trainer) -> list[Any] | None:
    """Shape (without the batch dimension) and dtype of every tensor in the first batch of each train loader: what
    sets memory."""
    combined = train_loader(trainer)
    if combined is None or not combined.flattened:
        return None
    batches = []
    for loader in combined.flattened:
        try:
            batches.append(next(iter(loader)))
        except StopIteration:
            continue
    if not batches:
        return None
    signature: list[Any] = []

    def visit(obj: Any) -> None:
        if torch.is_tensor(obj):
            signature.append([list(obj.shape[1:]), str(obj.dtype)])
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                visit(obj[key])
        elif isinstance(obj, list | tuple):
            for item in obj:
                visit(item)

    for batch in batches:
        visit(batch)
    return signature


class _Drop(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


# What the trials' warnings already showed in this search: each is shown once, not once per trial
_shown: set[tuple[str, type[Warning], str, int]] = set()


_NOT_ABOUT_THE_RUN = (r"The number of training batches .* logging interval", r".*does not have many workers")


def new_search() -> None:
    """A search starts: a warning its trials raise is shown once in it (the first time)."""
    _shown.clear()


@contextmanager
def about_the_run_only() -> Iterator[None]:
    """What Lightning says of each trial as if it were the run is not shown: "`Trainer.fit` stopped: `max_steps=5`
    reached", the logging interval longer than a trial's epoch, the loader's worker count (said once, when the
    loader is built again for the run). Any other warning is shown once per search, not once per trial: entering a
    ``catch_warnings`` block clears Python's record of the warnings already shown, so each is caught here and shown
    again only the first time."""
    drop = _Drop("`Trainer.fit` stopped:")
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    log.addFilter(drop)
    try:
        with warnings.catch_warnings(record=True) as caught:
            for message in _NOT_ABOUT_THE_RUN:
                warnings.filterwarnings("ignore", message=message)
            yield
    finally:
        log.removeFilter(drop)
        for w in caught:
            key = (str(w.message), w.category, w.filename, w.lineno)
            if key not in _shown:
                _shown.add(key)
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


_NO_EXAMPLE = (
    "{who}(memory_budget=...) measures the blocks on the module's `example_input_array`, or without one on the"
    " first training batch's model inputs"
)


_SET_IT = (
    "set `example_input_array` to a real batch of inputs (a tensor: forward(x); a tuple: forward(*x); a dict:"
    " forward(**x))"
)


def example_for_budget(trainer: Trainer, who: str, units: Units) -> tuple[Any, str | None]:
    """The real batch a budget is measured on, on the strategy's device, and where it came from (None: the module's
    ``example_input_array``; else what part of the first training batch, as :func:`inputs_from_batch` read it, said
    in one rank-zero info line). A model in which ``units`` finds no blocks is told so first: no input would help.

    Without ``example_input_array`` the train loader is built as the run builds it and its first batch taken from a
    fresh iterator, handed through the batch hooks as ``training_step`` gets it; every random number generator is
    put back and the built loader dropped, so the run builds its own and sees every batch, in the same order, as it
    would have. A loader whose every iterator restarts a one-shot stream would lose that batch. Called at fit start
    (by the callback, after the strategy has set up the model: the data is attached, the loaders not yet built) or
    in the strategies' ``setup`` before the model is wrapped (the same).

    Raises:
        ValueError: no blocks found (said first, with ``who``); no ``example_input_array`` and no first training batch
            (no train loader, an empty one, several train loaders), or none whose model inputs
            :func:`inputs_from_batch` can tell; the message names both ways.
    """
    module, strategy = trainer.lightning_module, trainer.strategy
    try:
        find_units(module, units)
    except ValueError as err:
        raise ValueError(f"{who}: {err}") from None
    if module.example_input_array is not None:
        return move_data_to_device(module.example_input_array, strategy.root_device), None
    batch, why = _first_training_batch(trainer)
    if batch is None:
        raise ValueError(f"{_NO_EXAMPLE.format(who=who)}, and it has neither ({why}): {_SET_IT}")
    try:
        inputs, what = inputs_from_batch(batch, module.forward)
    except ValueError as err:
        raise ValueError(
            f"{_NO_EXAMPLE.format(who=who)}, and the first training batch's cannot be told ({err}): {_SET_IT}"
        ) from None
    rank_zero_info(f"{who}: no example_input_array: measuring the budget on the first training batch's {what}")
    return inputs, what


def _first_training_batch(trainer: Trainer) -> tuple[Any, str]:
    """The train loader's first batch as ``training_step`` gets it, or None and why there is none."""
    with rng_kept():  # a shuffling sampler draws its seed from torch's generator
        reload_train_dataloader(trainer)  # built as the run builds it, its remarks left to the run's own
        combined = train_loader(trainer)
        try:
            if combined is None:
                return None, "no train loader"
            if len(combined.flattened) != 1:
                return None, f"{len(combined.flattened)} train loaders"
            batch = next(iter(combined.flattened[0]), None)
        finally:
            drop_loaders(trainer)  # the run builds its own loader, whose iterator starts at the first batch
        if batch is None:
            return None, "an empty train loader"
        return as_training_step_gets_it(trainer, batch), ""


@contextmanager
def measuring_said(what: str | None, who: str) -> Iterator[None]:
    """Inside, a measurement on the inputs read from the first training batch (``what``) that fails says so and how
    to give the inputs instead; an out-of-memory error is left as it is."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except Exception as err:
        if what is None:
            raise
        raise ValueError(
            f"{_NO_EXAMPLE.format(who=who)}; measuring on the first training batch's {what} failed"
            f" ({type(err).__name__}: {err}): {_SET_IT}"
        ) from err
