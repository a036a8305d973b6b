"""The six checkpointing settings, declared once: the callback, the strategies and the policy share them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_memguard.checkpointing.families import Units, check_units
from lightning_memguard.checkpointing.recipes import RebuildConfig, check_config
from lightning_memguard.core.checks import check_bool, check_memory_budget


@dataclass(frozen=True)
class CheckpointingSettings:
    """What to checkpoint and how, checked on construction (``ActivationCheckpointing``, ``CheckpointingDDPStrategy``
    and ``CheckpointingSingleDeviceStrategy`` take these as their arguments and hand them over as they are).

    Args:
        units: ``"auto"``, module classes or module names (``["layer1.0"]``, as ``named_modules()`` gives them; kept
            as a tuple), or a predicate ``(name, module) -> bool``.
        memory_budget: a float in (0, 1] (a fraction of the un-checkpointed peak), a size of at least 1 MB (an int
            or a string such as ``"6GB"``, kept as given), or None (every block).
        bn_correct: recomputation leaves BatchNorm running statistics alone.
        rebuild_bn_relu: the cheap recomputation of ResNet blocks (torchvision's, timm's) and Conv2dNormActivation
            units (see ``checkpoint_blocks``).
        rebuild_config: how the rebuild makes its tensors (``RebuildConfig(fused=..., chain_kept=...)``); None:
            the defaults.
        levers: choose among every lever for the budget with :func:`~lightning_memguard.levers.plan_levers`
            (a Hugging Face model's fused loss, blocks or their parts checkpointed, pointwise recomputation) instead
            of checkpointing alone; needs a ``memory_budget``. The planner checkpoints BatchNorm-correct and offers no
            rebuild, so ``rebuild_bn_relu=True`` and ``bn_correct=False`` are refused beside it.
        fused_loss: with ``levers``, offer the fused loss (a Hugging Face model's output then has ``logits`` None);
            False for a step that reads the logits (a metric, a distillation loss). Checkpointing alone never fuses.

    Raises:
        TypeError, ValueError: a setting of the wrong kind or out of range, quoting it; ``levers=True`` without a
            budget, or beside ``rebuild_bn_relu=True`` or ``bn_correct=False``.

    Example:
        >>> CheckpointingSettings(memory_budget="6GB").memory_budget
        '6GB'
        >>> CheckpointingSettings(units=None)
        Traceback (most recent call last):
        ...
        TypeError: `units` must be 'auto', module classes or names, or a callable (name, module) -> bool, got None
    """

    units: Units = "auto"
    memory_budget: float | int | str | None = None
    bn_correct: bool = True
    rebuild_bn_relu: bool = False
    rebuild_config: RebuildConfig | None = None
    levers: bool = False
    fused_loss: bool = True

    def __post_init__(self) -> None:
        memory_budget: Any = self.memory_budget
        object.__setattr__(self, "units", check_units(self.units))
        checked = check_memory_budget(memory_budget)
        # a string as given ("6GB" stays "6GB"), a number as Python's (np.float32(0.6) is 0.6); checked again where
        # it is measured
        object.__setattr__(self, "memory_budget", memory_budget if isinstance(memory_budget, str) else checked)
        check_bool("bn_correct", self.bn_correct)
        check_bool("rebuild_bn_relu", self.rebuild_bn_relu)
        check_config(self.rebuild_config)
        check_bool("levers", self.levers)
        check_bool("fused_loss", self.fused_loss)
        if self.levers and checked is None:
            raise ValueError(
                "`levers=True` chooses among the levers for a budget, and `memory_budget` is None: give one"
                " (memory_budget=0.6, a fraction of the step's peak, or '6GB'), or drop levers=True to checkpoint"
                " every block"
            )
        if self.levers and (self.rebuild_bn_relu or not self.bn_correct):
            which = "rebuild_bn_relu=True" if self.rebuild_bn_relu else "bn_correct=False"
            raise ValueError(
                f"`levers=True` with `{which}`: the levers' planner checkpoints BatchNorm-correct and offers no"
                " rebuild; drop one of the two"
            )
