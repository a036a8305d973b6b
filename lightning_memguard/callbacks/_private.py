"""The Lightning internals this package relies on, named in one place.

Lightning offers no public way to rebuild the train loader after the batch size changed, to ask whether the loader
came from ``fit(train_dataloaders=...)``, to build a checkpoint without writing it, or to save and restore every
random number generator. Each function below names the private it uses; a Lightning release that moves one breaks
here and nowhere else.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.combined_loader import CombinedLoader


def rng_states() -> dict[str, Any]:
    """Every random number generator's state (Python, NumPy, torch, CUDA where initialised)."""
    return _collect_rng_states(include_cuda=torch.cuda.is_initialized())


def set_rng_states(states: dict[str, Any]) -> None:
    _set_rng_states(states)


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


def checkpoint_contents(trainer: Trainer) -> dict[str, Any]:
    """The full checkpoint that ``trainer.save_checkpoint`` would write, without writing it
    (``_CheckpointConnector.dump_checkpoint``); every rank calls it, as the strategy may gather."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
