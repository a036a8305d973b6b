"""ActivationCheckpointing: checkpoint a LightningModule's blocks before training."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_memguard.checkpointing.plan import CheckpointPlan, apply_plan, checkpoint_blocks
from lightning_memguard.checkpointing.wrap import Units
from lightning_memguard.core.checks import check_memory_budget


class ActivationCheckpointing(Callback):
    """Checkpoints the model's residual blocks (``use_reentrant=False``), BatchNorm-correct, before training.

    Without ``memory_budget`` every block (and a torchvision ResNet's stem) is checkpointed in ``setup``, before the
    optimizer is built. With a budget, the blocks are measured at fit start on the module's ``example_input_array``
    (under the Trainer's precision) and only those that buy the most memory per millisecond of recomputation are
    checkpointed, adjacent ones as one run (see :func:`~lightning_memguard.checkpointing.checkpoint_blocks`).
    ``state_dict`` keys of the model do not change; the chosen runs are kept in the callback's state, so a resumed
    run re-applies them without measuring again.

    Args:
        units: ``"auto"``, a set of module classes, or a predicate ``(name, module) -> bool``.
        memory_budget: a float in (0, 1] is a fraction of the un-checkpointed peak; an int or a string (``"6GB"``) is
            a size in bytes, at least 1 MB (so ``1`` is refused, not read as one byte); None: every block.
        bn_correct: recomputation leaves BatchNorm running statistics alone (they update once per step).
        rebuild_bn_relu: torchvision BasicBlocks, Bottlenecks and ResNet stems left unchecked rebuild their
            BatchNorm + ReLU outputs (and a block its output, where the next block is rebuilt too) in backward
            instead of keeping them; without a budget, that alone (no block is checkpointed).

    Raises:
        TypeError: ``memory_budget`` of another type, or flags that are not bools.
        ValueError: bad ``memory_budget`` (a fraction outside (0, 1], a size below 1 MB); at fit start, no blocks
            found or a budget without ``example_input_array``.

    Example:
        >>> from lightning import Trainer
        >>> trainer = Trainer(callbacks=[ActivationCheckpointing(memory_budget=0.6)], logger=False)
        >>> ActivationCheckpointing(memory_budget=1.5)
        Traceback (most recent call last):
        ...
        ValueError: `memory_budget` as a fraction must be in (0, 1], got 1.5 (bytes: an int or '6GB')
    """

    def __init__(
        self,
        units: Units = "auto",
        memory_budget: float | int | str | None = None,
        bn_correct: bool = True,
        rebuild_bn_relu: bool = False,
    ):
        check_memory_budget(memory_budget)
        for name, flag in (("bn_correct", bn_correct), ("rebuild_bn_relu", rebuild_bn_relu)):
            if not isinstance(flag, bool):
                raise TypeError(f"`{name}` must be a bool, got {flag!r}")
        if isinstance(units, str) and units != "auto":
            raise ValueError(f"`units` must be 'auto', a set of module classes or a callable, got {units!r}")
        self.units = units
        self.memory_budget = memory_budget
        self.bn_correct = bn_correct
        self.rebuild_bn_relu = rebuild_bn_relu
        self.plan: CheckpointPlan | None = None
        self.runs: list[list[str]] | None = None  # the chosen runs of blocks: learned state

    @property
    def blocks(self) -> list[str] | None:
        """The checkpointed blocks, in model order (None before the plan is made)."""
        return None if self.runs is None else [name for run in self.runs for name in run]

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.memory_budget is None:
            self.plan = checkpoint_blocks(
                pl_module, self.units, bn_correct=self.bn_correct, rebuild_bn_relu=self.rebuild_bn_relu
            )
            self.runs = self.plan.runs
            rank_zero_info(f"ActivationCheckpointing: {self.plan.summary()}")
        elif pl_module.example_input_array is None:
            raise ValueError(
                "ActivationCheckpointing(memory_budget=...) measures the blocks on the module's"
                " `example_input_array`; set it to a real batch of inputs"
            )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.memory_budget is None or self.plan is not None:
            return
        if self.runs is not None:  # resumed: apply what was chosen before
            apply_plan(pl_module, self.runs, self.units, self.bn_correct, self.rebuild_bn_relu)
            return
        example = move_data_to_device(pl_module.example_input_array, trainer.strategy.root_device)
        with trainer.precision_plugin.train_step_context():
            self.plan = checkpoint_blocks(
                pl_module,
                self.units,
                self.memory_budget,
                example_input=example,
                bn_correct=self.bn_correct,
                rebuild_bn_relu=self.rebuild_bn_relu,
            )
        self.runs = self.plan.runs
        rank_zero_info(f"ActivationCheckpointing: {self.plan.summary()}")

    def state_dict(self) -> dict[str, Any]:
        return {"runs": self.runs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.runs = state_dict.get("runs", self.runs)
