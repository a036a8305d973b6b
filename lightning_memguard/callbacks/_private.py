"""The Lightning internals this package relies on, named in one place.

Lightning offers no public way to rebuild the train loader after the batch size changed, to ask whether the loader
came from ``fit(train_dataloaders=...)``, to leave a checkpoint that ``fit(ckpt_path=...)`` loaded but has not
applied yet untouched, or to save and restore every random number generator. Each function below names the private
it uses; a Lightning release that moves one breaks here and nowhere else.
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


def drop_loaders(trainer: Trainer) -> None:
    """Forget the built train and validation loaders (``_combined_loader``), so the next setup builds them anew."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.epoch_loop.val_loop._combined_loader = None


def pending_checkpoint(trainer: Trainer) -> tuple[Any, Any, Any]:
    """What ``fit(ckpt_path=...)`` set and loaded but has not applied yet (the checkpoint connector's state)."""
    connector = trainer._checkpoint_connector
    return connector._ckpt_path, connector._user_managed, connector._loaded_checkpoint


def set_pending_checkpoint(trainer: Trainer, state: tuple[Any, Any, Any]) -> None:
    connector = trainer._checkpoint_connector
    connector._ckpt_path, connector._user_managed, connector._loaded_checkpoint = state


def apply_checkpoint(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Restore datamodule, model, callbacks and training state from ``checkpoint``, as ``fit(ckpt_path=...)`` does,
    without naming a path; the connector's own pending checkpoint is the caller's to put back."""
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    connector.restore_datamodule()
    connector.restore_model()
    connector.restore_callbacks()
    connector.restore_training_state()
