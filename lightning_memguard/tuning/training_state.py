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
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from torch import nn
from torch.distributed.tensor import DTensor


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


def holds_shards(strategy: Strategy) -> bool:
    """Whether each rank holds only its shard of the weights and optimizer state (``FSDPStrategy``, and
    ``ModelParallelStrategy``'s FSDP2): their state dicts gather across ranks, and loading an optimizer state saved
    before the first step fails there; the training state is then kept as each rank's own tensors."""
    return isinstance(strategy, FSDPStrategy | ModelParallelStrategy)


def training_state(trainer: Trainer) -> dict[str, Any]:
    """What training changes and Lightning's loops do not hold, copied into host memory on this rank: the model's
    weights and buffers, the optimizers, schedulers, precision plugin (a loss scaler) and datamodule states.

    Read through the strategy, as Lightning's own checkpointing does, but without the ``on_save_checkpoint`` hooks
    and without a file; under a sharded strategy (:func:`holds_shards`) the weights and optimizer state are this
    rank's own tensors, its shards, with nothing gathered.
    """
    strategy = trainer.strategy
    datamodule = getattr(trainer, "datamodule", None)
    sharded = holds_shards(strategy)
    if sharded:
        model: Any = _own_tensors(trainer.lightning_module)
        optimizers = [_own_optimizer_state(o) for o in trainer.optimizers]
    else:
        model = strategy.lightning_module_state_dict()
        optimizers = [strategy.optimizer_state(o) for o in trainer.optimizers]
    return host_copy(
        {
            "sharded": sharded,
            "state_dict": model,
            "optimizer_states": optimizers,
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "precision": trainer.precision_plugin.state_dict(),
            "datamodule": datamodule.state_dict() if datamodule is not None else None,
        }
    )


def load_training_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Put back what :func:`training_state` copied. No ``on_load_checkpoint`` hook runs: nothing is resumed."""
    strategy = trainer.strategy
    if state["sharded"]:
        _load_own_tensors(trainer.lightning_module, state["state_dict"])
        for optimizer, saved in zip(trainer.optimizers, state["optimizer_states"], strict=True):
            _load_own_optimizer_state(optimizer, saved)
    else:
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


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (the storage itself, under ``no_grad``), else the
    tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by name, as this rank holds it (not copied)."""
    with torch.no_grad():
        return {name: _own(t) for name, t in [*module.named_parameters(), *module.named_buffers()]}


def _put(target: torch.Tensor, saved: torch.Tensor, what: str) -> None:
    if target.shape != saved.shape:
        raise RuntimeError(
            f"{what} changed shape from {tuple(saved.shape)} to {tuple(target.shape)} during the trials; the"
            " training state cannot be put back in place"
        )
    target.copy_(saved)


def _load_own_tensors(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy ``saved`` (:func:`_own_tensors`) back into the same tensors, in place: shards stay where the strategy
    put them, and the optimizer keeps pointing at the same parameters."""
    current = _own_tensors(module)
    if current.keys() != saved.keys():
        raise RuntimeError("the model's parameters and buffers changed during the trials; they cannot be put back")
    with torch.no_grad():
        for name, tensor in current.items():
            _put(tensor, saved[name], f"`{name}`")


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _own_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's per-parameter state (this rank's shards) in parameter order, None for a parameter without
    state yet, and its groups' settings (the learning rate a scheduler changed)."""
    with torch.no_grad():
        state = [
            {key: _own(v) if isinstance(v, torch.Tensor) else v for key, v in optimizer.state[p].items()}
            if p in optimizer.state
            else None
            for p in _params(optimizer)
        ]
    return {"state": state, "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def _load_own_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Put back :func:`_own_optimizer_state`'s copy: state the trials created is removed (a run that had not
    stepped yet has none again), state that existed is copied back into the same tensors."""
    with torch.no_grad():
        for i, (p, before) in enumerate(zip(_params(optimizer), saved["state"], strict=True)):
            if before is None:
                optimizer.state.pop(p, None)
                continue
            if p not in optimizer.state:
                raise RuntimeError(f"the optimizer's state of parameter {i} vanished during the trials")
            now = optimizer.state[p]
            for key in [k for k in now if k not in before]:
                del now[key]
            for key, value in before.items():
                if isinstance(value, torch.Tensor) and isinstance(now.get(key), torch.Tensor):
                    _put(_own(now[key]), value, f"the optimizer's `{key}` of parameter {i}")
                else:
                    now[key] = deepcopy(value)
        for group, settings in zip(optimizer.param_groups, saved["groups"], strict=True):
            for key, value in settings.items():
                if isinstance(value, torch.Tensor) and isinstance(group.get(key), torch.Tensor):
                    group[key].copy_(value)
                else:
                    group[key] = deepcopy(value)


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
