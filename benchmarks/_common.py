"""Shared pieces of the benchmark scripts: the standard Trainer, medians, environment and JSON output."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, Trainer
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential


def make_trainer(
    callbacks: list[Callback], max_steps: int, root: str, precision: str = "bf16-mixed", **kwargs: Any
) -> Trainer:
    if not torch.cuda.is_available():  # a CPU smoke test of the script
        precision = "32-true"
    return Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        devices=1,
        precision=precision,  # type: ignore[arg-type]
        max_steps=max_steps,
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        **kwargs,
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def environment() -> dict[str, Any]:
    """Where a result was measured: the card, the releases (the model libraries' too, where installed: a family's
    kernels change with them, as T5's attention did between transformers 5.17 and 5.25) and the date."""
    found = {}
    for name in ("transformers", "timm"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        **found,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _switch(model: Any) -> tuple[Any, str]:
    """A Hugging Face model's (or class's) own switch and the name of its keyword for ``torch.utils.checkpoint``'s
    arguments: ``activation_checkpointing_enable`` where this transformers has it, else the name it had before
    (``gradient_checkpointing_enable``, its deprecated alias since, to be removed in transformers 6)."""
    switch = getattr(model, "activation_checkpointing_enable", None)
    if switch is not None:
        return switch, "activation_checkpointing_kwargs"
    return model.gradient_checkpointing_enable, "gradient_checkpointing_kwargs"


def partial_switch_exists() -> bool:
    """Whether the installed transformers' switch checkpoints every n-th layer (``every_n_layers``)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return "every_n_layers" in inspect.signature(_switch(PreTrainedModel)[0]).parameters


def hugging_face_switch(model: Any, every_n_layers: int = 1) -> None:
    """A Hugging Face model's own activation checkpointing on (:func:`_switch`), with ``use_reentrant=False`` and
    ``use_cache`` off, as its users turn it on. ``every_n_layers``: every n-th layer only (transformers' own partial
    switch, where it has one)."""
    switch, keyword = _switch(model)
    kwargs: dict[str, Any] = {keyword: {"use_reentrant": False}}
    if every_n_layers != 1:
        if not partial_switch_exists():
            raise RuntimeError("this transformers' switch has no every_n_layers")
        kwargs["every_n_layers"] = every_n_layers
    switch(**kwargs)
    model.config.use_cache = False


def free_memory() -> None:
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()
    torch.cuda.reset_peak_memory_stats()


def write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:  # then replaced whole: a run cut short leaves no half file
        json.dump(data, f, indent=2)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")


def sequential_forward(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A torchvision ResNet's forward with its four stages under ``checkpoint_sequential`` (4 segments), as the
    write-up checkpointed it."""
    body = nn.Sequential(model.layer1, model.layer2, model.layer3, model.layer4)

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        x = checkpoint_sequential(body, 4, x, use_reentrant=False)
        return model.fc(torch.flatten(model.avgpool(x), 1))

    return forward


class StepPeak(Callback):
    """Each training step's forward and backward peak above what was allocated before it, the gradients set to
    None first (as the checkpointing plan measures; Lightning zeroes them next anyway), on CUDA; the optimizer step
    left out."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._before = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if torch.cuda.is_available():
            pl_module.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            self._before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if torch.cuda.is_available():
            self.peaks.append(torch.cuda.max_memory_allocated() - self._before)
