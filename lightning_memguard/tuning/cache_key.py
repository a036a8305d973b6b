"""What a tuner's cached choice is keyed on: every field, read from the Trainer in this one place.

The file itself (its lock, atomic writes, the entries' schema) is :class:`lightning_memguard.tuning.cache.ResultCache`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import lightning
import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_memguard import __version__, _compiler
from lightning_memguard._lightning.loaders import first_batch_signature, reload_train_dataloader, rng_kept
from lightning_memguard.checkpointing.policy import CheckpointingPolicy
from lightning_memguard.tuning.cache import digest
from lightning_memguard.tuning.trials import probe_and_capacity
from lightning_memguard.tuning.tuner_settings import TunerSettings


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _hparams(obj: Any, batch_arg_name: str) -> dict[str, str]:
    hparams = getattr(obj, "hparams", None) or {}
    return {str(k): repr(v) for k, v in sorted(dict(hparams).items(), key=str) if k != batch_arg_name}


def _shapes(example: Any) -> Any:
    """An example input's shapes, as its structure holds them: a tensor's shape, a tuple's or list's items in order,
    a dict's values by key (a Hugging Face-style ``{"input_ids": ..., "attention_mask": ...}``); anything else by its
    type's name (None: no example)."""
    if torch.is_tensor(example):
        return list(example.shape)
    if isinstance(example, Mapping):
        return {str(key): _shapes(example[key]) for key in sorted(example, key=str)}
    if isinstance(example, list | tuple):
        return [_shapes(item) for item in example]
    return None if example is None else type(example).__name__


def cache_key(
    trainer: Trainer,
    pl_module: LightningModule,
    settings: TunerSettings,
    tuner: str,
    samples_per_epoch: int | None,
    extra: dict[str, Any],
) -> str:
    """The key of a tuner's choice for this fit (``tuner``: its class name): everything that decides memory, speed
    and which sizes can run.

    - ``model``, ``params``: the LightningModule's class and parameter count;
    - ``modules``: a hash of every submodule's name and class (a checkpointed or rebuilt block changes it);
    - ``checkpointing``: the settings of the ActivationCheckpointing callbacks;
    - ``compiled``: whether the model runs under ``torch.compile``;
    - ``input``, ``batch``: ``example_input_array``'s shapes (a tensor's, a tuple's or a dict's); the shapes and
      dtypes of each train loader's first batch;
    - ``samples_per_epoch``: the samples one epoch of the train loader runs (the search caps sizes at it);
    - ``hparams``, ``datamodule``: the module's hyperparameters but the batch size; the datamodule's class and
      hyperparameters;
    - ``precision``, ``device``, ``world_size``, ``accumulate_grad_batches``: the Trainer's;
    - ``torch``, ``lightning``, ``memguard``: the versions of the libraries that measured;
    - ``tuner``, ``probe``, ``capacity``: the tuner's class, its memory probe's class and the memory judged
      against;
    - ``headroom``, ``min_gain``, ``tolerance``: the tuner's settings, and ``extra``, what the tuner adds (its
      mode and range; the effective batch, ...).
    """
    device = trainer.strategy.root_device
    example = getattr(pl_module, "example_input_array", None)
    datamodule, arg = getattr(trainer, "datamodule", None), settings.batch_arg_name
    probe, capacity = probe_and_capacity(trainer, settings)
    with rng_kept():
        reload_train_dataloader(trainer)
        batch = first_batch_signature(trainer)
    fields = {
        "model": _qualname(pl_module),
        "params": sum(p.numel() for p in pl_module.parameters()),
        "modules": hashlib.sha256(
            json.dumps([[n, type(m).__qualname__] for n, m in pl_module.named_modules()]).encode()
        ).hexdigest(),
        "checkpointing": [
            [type(c).__name__, repr(c.units), repr(c.memory_budget), c.bn_correct, c.rebuild_bn_relu]
            + (["levers"] if c.settings.levers else [])  # keys made before levers existed stay the same
            + (["no fused loss"] if c.settings.levers and not c.settings.fused_loss else [])
            for c in trainer.callbacks  # type: ignore[attr-defined]
            if isinstance(getattr(c, "policy", None), CheckpointingPolicy)  # ActivationCheckpointing's
        ],
        "compiled": _compiler.is_compiled(pl_module),  # a compiled model's step times are its graph's
        "input": _shapes(example),
        "batch": batch,
        "samples_per_epoch": samples_per_epoch,
        "hparams": _hparams(pl_module, arg),
        "datamodule": None if datamodule is None else [_qualname(datamodule), _hparams(datamodule, arg)],
        "precision": str(trainer.precision),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "world_size": trainer.world_size,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "memguard": __version__,
        "tuner": tuner,
        "probe": type(probe).__name__,
        "capacity": capacity,
        "headroom": settings.headroom,
        "min_gain": settings.min_gain,
        "tolerance": settings.tolerance,
        "extra": extra,
    }
    return digest(fields)
