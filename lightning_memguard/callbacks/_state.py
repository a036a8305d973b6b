"""Keeping the user's training state safe while the library works on it: a host copy of what training changes, put
back without calling anyone's ``on_load_checkpoint``, and interrupts held while it is put back."""

from __future__ import annotations

import signal
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from copy import deepcopy
from typing import Any

import torch
from lightning.pytorch import Trainer


def host_copy(obj: Any) -> Any:
    """A copy of ``obj`` that shares no tensor with it: tensors are copied into host memory (the device's memory is
    what the trials measure), containers are rebuilt, other values deep-copied. A state dict's ``_metadata`` (module
    versions that ``load_state_dict`` reads) is kept."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if type(obj) in (dict, OrderedDict):
        copied = type(obj)((key, host_copy(value)) for key, value in obj.items())
        if hasattr(obj, "_metadata"):
            copied._metadata = deepcopy(obj._metadata)  # type: ignore[union-attr]
        return copied
    if type(obj) in (list, tuple):
        return type(obj)(host_copy(value) for value in obj)
    try:
        return deepcopy(obj)
    except Exception:  # an object that cannot be copied (a lambda in a scheduler's state) is not changed by training
        return obj


def training_state(trainer: Trainer) -> dict[str, Any]:
    """What training changes and Lightning's loops do not hold, copied into host memory on this rank: the model's
    weights and buffers, the optimizers, schedulers, precision plugin (a loss scaler) and datamodule states.

    Read through the strategy, as Lightning's own checkpointing does, but without the ``on_save_checkpoint`` hooks
    and without a file.
    """
    strategy = trainer.strategy
    datamodule = getattr(trainer, "datamodule", None)
    return host_copy(
        {
            "state_dict": strategy.lightning_module_state_dict(),
            "optimizer_states": [strategy.optimizer_state(o) for o in trainer.optimizers],
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "precision": trainer.precision_plugin.state_dict(),
            "datamodule": datamodule.state_dict() if datamodule is not None else None,
        }
    )


def load_training_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Put back what :func:`training_state` copied. No ``on_load_checkpoint`` hook runs: nothing is resumed."""
    strategy = trainer.strategy
    strategy.load_model_state_dict(state, strict=trainer.lightning_module.strict_loading)
    if strategy.lightning_restore_optimizer:
        strategy.load_optimizer_state_dict(state)
    for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["lr_schedulers"], strict=True):
        config.scheduler.load_state_dict(scheduler_state)
    if state["precision"]:
        trainer.precision_plugin.load_state_dict(state["precision"])
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and state["datamodule"]:
        datamodule.load_state_dict(state["datamodule"])


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl+C (SIGINT) until the block is done, then deliver it as the handler in force would have.

    Outside the main thread (where Python delivers signals) the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if received:
        if previous is signal.default_int_handler or previous in (None, signal.SIG_DFL):
            raise KeyboardInterrupt
        if callable(previous):
            previous(signal.SIGINT, None)


def sigint_handler() -> Any:
    """The SIGINT handler in force (None outside the main thread, where it cannot be set)."""
    return signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None


def restore_sigint_handler(handler: Any) -> None:
    """Put ``handler`` back: Lightning ignores Ctrl+C for the rest of the process once it handled one in ``fit``,
    so a notebook's next Ctrl+C would do nothing."""
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)
