"""DDP and single-device strategies taking ``activation_checkpointing_policy``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_memguard import _compiler
from lightning_memguard._lightning.loaders import example_for_budget, measuring_said
from lightning_memguard._lightning.privates import BeforeModelWrapped
from lightning_memguard.checkpointing.checkpointing_settings import CheckpointingSettings
from lightning_memguard.checkpointing.policy import CheckpointingPolicy
from lightning_memguard.checkpointing.recipes import RebuildConfig
from lightning_memguard.levers.lever_policy import LeverPolicy, make_policy


class _ChecksBeforeWrapping(BeforeModelWrapped):
    """What both strategies add to theirs: checkpointing before the model is wrapped (Lightning's hook for that is
    private: :class:`~lightning_memguard._lightning.privates.BeforeModelWrapped`), and compile's setting released at
    ``teardown``. Listed first among the bases, so ``super()`` is the strategy."""

    checkpointing: CheckpointingPolicy

    @override
    def before_model_wrapped(self) -> None:
        _checkpoint_before_wrapping(self, self.checkpointing)  # type: ignore[arg-type]

    def teardown(self) -> None:  # the strategy's, through the class this is mixed into
        self.checkpointing.release_compile_setting()
        super().teardown()  # type: ignore[misc]


def _checkpoint_before_wrapping(strategy: Strategy, policy: CheckpointingPolicy) -> None:
    """Checkpoint the LightningModule in place, on its device, before the strategy wraps it."""
    module = strategy.lightning_module
    if module is None or module.trainer.state.fn != "fit":
        return
    who = type(strategy).__name__
    if isinstance(policy, LeverPolicy) and _compiler.is_compiled(module):
        raise ValueError(
            f"{who}(levers=True) on a compiled module: the levers' planner measures the step eagerly, and a compiled"
            " step's peak is compile's graph's, which those measurements do not predict. Use memory_budget without"
            " levers (measured compiled), or fit the module uncompiled"
        )
    example, from_batch = None, None
    if policy.settings.memory_budget is not None and not policy.decided:
        example, from_batch = example_for_budget(module.trainer, who, policy.settings.units)
    with measuring_said(from_batch, who):
        policy.apply(
            module,
            example,
            is_rank_zero=strategy.is_global_zero,
            broadcast=strategy.broadcast,
            measuring=strategy.precision_plugin.train_step_context,
        )
    rank_zero_info(f"{type(strategy).__name__}: {policy.summary()}")
    policy.hold_compile_setting()  # a plan made under torch.compile may rely on compile's own setting


class CheckpointingDDPStrategy(_ChecksBeforeWrapping, DDPStrategy):
    """``DDPStrategy`` that checkpoints the model's blocks before wrapping it in ``DistributedDataParallel``.

    Args:
        activation_checkpointing_policy: the blocks (``CheckpointingSettings.units``): ``"auto"`` (found by
            structure), module classes (a set), module names (a list, as the LightningModule's ``named_modules()``
            gives them or relative to the model it holds), or a predicate ``(name, module) -> bool``; the name
            ``FSDPStrategy`` gives the same argument.
        memory_budget: a float in (0, 1] of the un-checkpointed peak, a size of at least 1 MB, or None (every block).
            With a budget, rank zero measures on the module's ``example_input_array`` (a tensor, a tuple of
            positional or a dict of keyword arguments of ``forward``), or without one on the first training batch's
            model inputs (see :class:`~lightning_memguard.ActivationCheckpointing`), and every rank applies its
            plan; the plan is made anew in each ``fit``. On a compiled module the budget is measured compiled, and
            compile's ``activation_memory_budget`` the plan chose is set for the fit.
        rebuild_bn_relu, rebuild_config, bn_correct: as
            :class:`~lightning_memguard.checkpointing.checkpointing_settings.CheckpointingSettings` declares them.
        levers: plan the budget with every lever (:func:`~lightning_memguard.levers.plan_levers`: a Hugging Face
            model's fused loss, blocks or parts checkpointed, pointwise recomputation) instead of checkpointing
            alone, as ``ActivationCheckpointing(levers=True)`` does: rank zero measures, every rank applies its
            ``LeverPlan.record()``; needs a budget. Refused in ``setup`` on a compiled module (the planner measures
            eagerly). Offload is not offered (a context around each step, not a change to the model).
        fused_loss: with ``levers``, offer the fused loss; False where the step reads the model's logits (see
            :class:`~lightning_memguard.checkpointing.checkpointing_settings.CheckpointingSettings`).
        *args, **kwargs: ``DDPStrategy``'s own.

    Raises:
        TypeError, ValueError: bad arguments, at construction.

    Example:
        >>> from torchvision.models.resnet import Bottleneck
        >>> strategy = CheckpointingDDPStrategy(activation_checkpointing_policy={Bottleneck}, memory_budget=0.6)
        >>> strategy.checkpointing.settings.memory_budget
        0.6
    """

    def __init__(
        self,
        *args: Any,
        activation_checkpointing_policy: Any = "auto",
        memory_budget: float | int | str | None = None,
        rebuild_bn_relu: bool = False,
        bn_correct: bool = True,
        rebuild_config: RebuildConfig | None = None,
        levers: bool = False,
        fused_loss: bool = True,
        **kwargs: Any,
    ) -> None:
        checkpointing = (activation_checkpointing_policy, memory_budget, bn_correct, rebuild_bn_relu, rebuild_config)
        self.checkpointing = make_policy(CheckpointingSettings(*checkpointing, levers, fused_loss))
        super().__init__(*args, **kwargs)


class CheckpointingSingleDeviceStrategy(_ChecksBeforeWrapping, SingleDeviceStrategy):
    """``SingleDeviceStrategy`` that checkpoints the model's blocks once the model is on its device.

    Args:
        device: the device to train on (``"cuda:0"``, ``"cpu"``).
        activation_checkpointing_policy, memory_budget, rebuild_bn_relu, bn_correct, rebuild_config, levers,
            fused_loss: as for :class:`CheckpointingDDPStrategy`.
        **kwargs: ``SingleDeviceStrategy``'s own.

    Example:
        >>> CheckpointingSingleDeviceStrategy("cpu", memory_budget=1)
        Traceback (most recent call last):
        ...
        ValueError: `memory_budget` in bytes must be at least 1MB, got 1 (a fraction: a float such as 0.6)
    """

    def __init__(
        self,
        device: Any = "cpu",
        *,
        activation_checkpointing_policy: Any = "auto",
        memory_budget: float | int | str | None = None,
        rebuild_bn_relu: bool = False,
        bn_correct: bool = True,
        rebuild_config: RebuildConfig | None = None,
        levers: bool = False,
        fused_loss: bool = True,
        **kwargs: Any,
    ) -> None:
        checkpointing = (activation_checkpointing_policy, memory_budget, bn_correct, rebuild_bn_relu, rebuild_config)
        self.checkpointing = make_policy(CheckpointingSettings(*checkpointing, levers, fused_loss))
        super().__init__(device, **kwargs)
