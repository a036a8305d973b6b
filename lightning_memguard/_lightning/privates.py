"""The Lightning internals this package relies on, named in one place and grouped by what they touch.

Lightning offers no public way to do what the tuners' trials and the strategies need: to save and restore every
random number generator, to ask whether the train loader came from ``fit(train_dataloaders=...)``, to rebuild the
loaders after the batch size changed, to run the fit loop for a few steps and put it back as it was, to reach the
strategy's calls of the training step, to act before the strategy wraps the model, to build a checkpoint without
writing it, or to learn how ``fit`` found a LightningModule compiled. Each function below names the private it uses;
a Lightning release that moves one breaks here and nowhere else. Everything else goes through Lightning's public API
where it is used (the Trainer's and the strategy's public attributes and methods, the callback hooks).

- Random number generators (``lightning.fabric.utilities.seed``'s private helpers): :func:`rng_states` and
  :func:`set_rng_states`, so building or reading a loader, and a trial, leave every generator as it was.
- The fit loop's data (``FitLoop._data_source``, ``FitLoop._combined_loader``, ``FitLoop.setup_data``,
  ``Trainer._val_check_time_interval``): :func:`loader_passed_to_fit` (a tuner cannot change that loader's batch
  size), :func:`train_loader` (the loaders' lengths, the first batch's shapes), :func:`validation_by_time`,
  :func:`drop_loaders` and :func:`setup_loaders` (the loaders built again at the size set); and the batch transfer
  (``LightningModule._on_before_batch_transfer``): :func:`as_training_step_gets_it`, the first batch a budget is
  measured on where the module has no ``example_input_array``.
- The fit loop driven by the trials (Lightning's loops, ``_FitLoop`` and its ``_TrainingEpochLoop``, are internal):
  :func:`loop_limits` and :func:`set_loop_limits` (a trial runs a set number of steps, into the next epoch if need
  be, and the run's limits come back), :func:`one_more_step` (a step that compiled is replaced),
  :func:`loop_state` and :func:`load_loop_state` (every trial starts from the run's progress, and the run resumes
  from it), :func:`reset_progress` (a trial's steps count from zero), :func:`run_fit_loop` and
  :func:`reset_fit_loop`.
- The strategy: :func:`strategy_methods_replaced` (its ``training_step``, ``backward`` and ``optimizer_step``,
  which the loops call through the instance, replaced on it so DDP ranks agree on an out-of-memory error within the
  same step); :class:`BeforeModelWrapped` (``Strategy._setup_model``, the one place between the model on its device
  and the model wrapped, where the strategies checkpoint it).
- Checkpoints (``Trainer._checkpoint_connector``): :func:`checkpoint_contents`, the spill checkpoint's contents.
- FSDP's own checkpointing (``FSDPStrategy._activation_checkpointing_kwargs``): :func:`fsdp_checkpoints_itself`,
  so that ActivationCheckpointing is refused beside ``FSDPStrategy(activation_checkpointing_policy=...)``.
- The model's logging set on every callback (``_CallbackConnector._attach_model_logging_functions``):
  :func:`model_logging_dropped`, so that a callback kept after its fit does not keep the fit's model alive.

The ``torch.compile`` context ``fit`` keeps on a LightningModule it unwrapped (``LightningModule._compiler_ctx``) is
read where the other compile contexts are, in :mod:`lightning_memguard._compiler.dynamo_state`, by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch import nn

# ---------------------------------------------------------------- random number generators


def rng_states() -> dict[str, Any]:
    """Every random number generator's state (Python, NumPy, torch, CUDA where initialised)."""
    return _collect_rng_states(include_cuda=torch.cuda.is_initialized())


def set_rng_states(states: dict[str, Any]) -> None:
    _set_rng_states(states)


# ---------------------------------------------------------------- the fit loop's data


def loader_passed_to_fit(trainer: Trainer) -> bool:
    """Whether the train loader came from ``fit(train_dataloaders=...)`` (``FitLoop._data_source``)."""
    return not trainer.fit_loop._data_source.is_module()


def train_loader(trainer: Trainer) -> CombinedLoader | None:
    """The fit loop's train loader as built (``FitLoop._combined_loader``), or None before it is."""
    return trainer.fit_loop._combined_loader


def validation_by_time(trainer: Trainer) -> bool:
    """Whether ``val_check_interval`` is a time (``Trainer._val_check_time_interval``), not batches."""
    return getattr(trainer, "_val_check_time_interval", None) is not None


def drop_loaders(trainer: Trainer) -> None:
    """Forget the built train and validation loaders (``_combined_loader``), so the next setup builds them anew."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.epoch_loop.val_loop._combined_loader = None


def setup_loaders(trainer: Trainer) -> None:
    """Build the train loader now (``FitLoop.setup_data``), from the module or datamodule's ``train_dataloader()``;
    the validation loader is built when validation first runs."""
    trainer.fit_loop.setup_data()


def as_training_step_gets_it(trainer: Trainer, batch: Any) -> Any:
    """A train loader's batch as the training loop hands it to ``training_step``: the ``on_before_batch_transfer``
    hook (``LightningModule._on_before_batch_transfer``, which calls the datamodule's where that one is the hook),
    then the strategy's ``batch_to_device`` (``transfer_batch_to_device`` and ``on_after_batch_transfer``)."""
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


# ---------------------------------------------------------------- the fit loop driven by the trials

_LIMITS = ("max_steps", "min_steps", "max_epochs", "min_epochs")


def loop_limits(trainer: Trainer) -> dict[str, Any]:
    """The fit loop's step and epoch limits (``max_steps``, ``min_steps`` of its epoch loop, ``max_epochs``,
    ``min_epochs`` of its own), to be put back with :func:`set_loop_limits`."""
    fit_loop, epoch_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
    return {
        "max_steps": epoch_loop.max_steps,
        "min_steps": epoch_loop.min_steps,
        "max_epochs": fit_loop.max_epochs,
        "min_epochs": fit_loop.min_epochs,
    }


def set_loop_limits(trainer: Trainer, limits: dict[str, Any]) -> None:
    """Set the limits named in ``limits`` (any of ``max_steps``, ``min_steps``, ``max_epochs``, ``min_epochs``;
    ``max_epochs=-1``: no epoch limit) on the loop that holds each."""
    unknown = set(limits) - set(_LIMITS)
    if unknown:
        raise KeyError(f"not a fit loop limit: {sorted(unknown)}")
    fit_loop, epoch_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
    for name, value in limits.items():
        setattr(epoch_loop if name.endswith("_steps") else fit_loop, name, value)


def one_more_step(trainer: Trainer) -> None:
    """The fit loop runs one optimizer step more than it was going to (its epoch loop's ``max_steps``)."""
    trainer.fit_loop.epoch_loop.max_steps += 1


def loop_state(trainer: Trainer) -> dict[str, Any]:
    """The fit loop's progress, as a checkpoint holds it (``FitLoop.state_dict``); not a copy."""
    return trainer.fit_loop.state_dict()


def load_loop_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Put the fit loop's progress back to ``state`` (:func:`loop_state`), as a run that starts there, not one that
    resumes halfway (``restarting`` off)."""
    loop = trainer.fit_loop
    loop.load_state_dict(state)
    loop.restarting = False


def reset_progress(trainer: Trainer) -> None:
    """The fit loop's epoch, batch and optimizer-step counters back to zero, so a trial's steps count from its
    first (``max_steps`` is compared with them)."""
    loop = trainer.fit_loop
    if trainer.lightning_module.automatic_optimization:
        loop.epoch_loop.automatic_optimization.optim_progress.reset()
    else:
        loop.epoch_loop.manual_optimization.optim_step_progress.reset()
    loop.epoch_progress.reset()
    loop.epoch_loop.batch_progress.reset()


def run_fit_loop(trainer: Trainer) -> None:
    """Train with the fit loop as it is set now, inside the running ``fit`` (``FitLoop.run``)."""
    trainer.fit_loop.run()


def reset_fit_loop(trainer: Trainer) -> None:
    """The fit loop's per-run state set up again for the run (``FitLoop.reset``), after trials ran it."""
    trainer.fit_loop.reset()


# ---------------------------------------------------------------- the strategy


@contextmanager
def logged_as_batch(trainer: Trainer, part: Any, samples: int) -> Iterator[None]:
    """Inside, ``self.log`` weighs what it averages over an epoch by ``part``'s ``samples``, not by the whole batch
    the loop is on: the loop's result collection (``trainer._results``) holds the batch and its size (given, not
    read from the batch: a part that opens with a list of names would not be sized right). A batch split into
    micro-batches then averages as the whole batch would. Put back on exit."""
    results = trainer._results
    if results is None:
        yield
        return
    batch, batch_size = results.batch, results.batch_size
    results.batch, results.batch_size = part, samples
    try:
        yield
    finally:
        results.batch, results.batch_size = batch, batch_size


@contextmanager
def strategy_methods_replaced(strategy: Strategy, replacements: dict[str, Callable[..., Any]]) -> Iterator[None]:
    """Inside, the strategy's methods named in ``replacements`` are the functions given: set on the instance,
    since Lightning's loops call them through it (``trainer.strategy.training_step(...)``). On exit the class's
    methods again, or what was set on the instance before."""
    own = {name: strategy.__dict__[name] for name in replacements if name in strategy.__dict__}
    for name, fn in replacements.items():
        setattr(strategy, name, fn)
    try:
        yield
    finally:
        for name in replacements:
            delattr(strategy, name)  # the class's methods again, or what was set on the instance before
        for name, fn in own.items():
            setattr(strategy, name, fn)


class BeforeModelWrapped:
    """A strategy mixin, listed before the strategy among the bases: :meth:`before_model_wrapped` runs once the model
    is on its device and before the strategy wraps it (in ``DistributedDataParallel`` for DDP), in
    ``Strategy._setup_model``, which Lightning calls during ``setup`` and has no public hook for."""

    def before_model_wrapped(self) -> None:
        """What the strategy does to the LightningModule before it is wrapped."""

    def _setup_model(self, model: nn.Module) -> Any:
        self.before_model_wrapped()
        return super()._setup_model(model)  # type: ignore[misc]


# ---------------------------------------------------------------- checkpoints


def checkpoint_contents(trainer: Trainer) -> dict[str, Any]:
    """The full checkpoint that ``trainer.save_checkpoint`` would write, without writing it
    (``_CheckpointConnector.dump_checkpoint``); every rank calls it, as the strategy may gather."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def fsdp_checkpoints_itself(strategy: Strategy) -> bool:
    """Whether ``strategy`` is Lightning's ``FSDPStrategy`` given its own ``activation_checkpointing_policy``."""
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(strategy, FSDPStrategy) and bool(getattr(strategy, "_activation_checkpointing_kwargs", None))


# ---------------------------------------------------------------- callbacks


def model_logging_dropped(callback: Any) -> None:
    """Forget the ``log`` and ``log_dict`` that Lightning set on ``callback`` at fit start
    (``_CallbackConnector._attach_model_logging_functions``): the LightningModule's bound methods, which would keep the
    finished fit's model, its gradients and its optimizer state alive as long as the callback. Lightning sets them
    again at the next ``fit``, ``validate``, ``test`` or ``predict``."""
    for name in ("log", "log_dict"):
        vars(callback).pop(name, None)
