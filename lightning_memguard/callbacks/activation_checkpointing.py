"""ActivationCheckpointing: checkpoint a LightningModule's blocks before training."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_memguard import _compiler
from lightning_memguard._lightning.loaders import example_for_budget, measuring_said
from lightning_memguard._lightning.privates import (
    fsdp_checkpoints_itself,
    model_logging_dropped,
)
from lightning_memguard.checkpointing.checkpointing_settings import CheckpointingSettings
from lightning_memguard.checkpointing.families import Units
from lightning_memguard.checkpointing.policy import CheckpointingPolicy
from lightning_memguard.checkpointing.recipes import RebuildConfig
from lightning_memguard.checkpointing.result import CheckpointPlan
from lightning_memguard.levers.choose import LeverPlan
from lightning_memguard.levers.lever_policy import LeverPolicy, make_policy
from lightning_memguard.tuning.training_state import holds_shards


class ActivationCheckpointing(Callback):
    """Checkpoints the model's residual blocks (``use_reentrant=False``), BatchNorm-correct, before training.

    Without ``memory_budget`` every block (and a torchvision ResNet's stem) is checkpointed in ``setup``, before the
    optimizer is built; a module that builds its layers in ``configure_model`` is checkpointed right after that hook,
    still before the strategy wraps the model and builds the optimizer. With a budget, the blocks are measured at
    fit start (under the Trainer's precision) and only those that buy the most memory per millisecond of
    recomputation are checkpointed, adjacent ones as one run (see
    :func:`~lightning_memguard.checkpointing.checkpoint_blocks`).

    A budget is measured on the module's ``example_input_array``, taken as Lightning takes it: a tensor is
    ``forward(x)``, a tuple or list ``forward(*x)``, a dict ``forward(**x)`` (a Hugging Face-style
    ``forward(input_ids, attention_mask)``). Without one (a model configured from LightningCLI), on the first
    training batch's model inputs, said in one info line: a tensor batch is the input; a tuple or list ``(x, y,
    ...)``, its first element (a tensor, a tuple of positional or a dict of keyword arguments); a dict, the entries
    ``forward`` names as parameters (``labels`` left out where ``forward`` takes none). Set ``example_input_array``
    where the batch holds the inputs otherwise (indices into data held on the module, several inputs in a flat
    tuple). The batch is taken at fit start, where the data is attached but the loaders not yet built (this is
    where the model as the strategy holds it can be measured): the train loader is built as the run builds it, its
    first batch read from a fresh iterator through the batch hooks, and every random number generator put back, so
    the run builds its own loader and sees every batch in the same order.

    ``state_dict`` keys of the model do not change; the chosen runs are kept in the callback's state, so a resumed
    run re-applies them without measuring again. Under DDP rank zero measures and every rank applies its plan; under
    ``ModelParallelStrategy`` (FSDP2) on several devices every rank measures, as the sharded forward needs them all,
    and rank zero's plan is applied on every rank. Its place in ``callbacks`` does not matter: a tuner listed before
    it has it plan first, and measures the model as it will train. Lightning's ``BatchSizeFinder`` runs first
    whatever the order (Lightning moves it there): with a budget its trials run on the model not yet planned, and the
    budget is then measured on a first batch of the size it chose (an ``example_input_array`` as it is given).

    On a compiled module (``fit(torch.compile(module))``) a budget is measured compiled and may use compile's own
    ``activation_memory_budget`` (see :func:`~lightning_memguard.checkpointing.checkpoint_blocks`); the setting
    chosen is set for the fit (restored at its end) and kept in the callback's state with the runs.

    With ``levers=True`` (and a budget) the budget is planned by :func:`~lightning_memguard.levers.plan_levers`, the
    planner of every lever, in place of checkpointing alone, on the same example and under the same precision: a
    Hugging Face model's fused loss (the model, or the one the LightningModule holds as an attribute, called with
    ``labels``), whole blocks or their parts checkpointed, and pointwise recomputation, each where it buys the most
    memory per millisecond. The levers chosen (``LeverPlan.record()``, plain data) are kept in the callback's state:
    a resumed run, and the same callback in a second fit, re-apply them
    (:func:`~lightning_memguard.levers.apply_record`) without measuring; under DDP rank zero measures and every rank
    applies its record. Under ``ddp_spawn`` that happens in the spawned processes, each with its own copy of the
    callback; Lightning hands the launching process back the weights, not the callbacks, so this instance keeps no
    record there and a second fit with it measures again. The callback does not offer offload: offload is not a
    change to the model but a context to enter around every step, which the fit would have to hold for each step and
    MemGuard to count as the user's own host memory; use ``plan_levers(..., offload=True)`` and
    ``with plan.offload:`` in a loop of your own for it.
    ``levers=True`` is refused on a compiled module and under ``ModelParallelStrategy`` on several devices (see
    Raises).

    Args:
        units: ``"auto"``, a set of module classes, a list of module names (``["net.layer1.0", "net.layer2.1"]``
            as the LightningModule's ``named_modules()`` gives them, or relative to the model it holds:
            ``["layer1.0", "layer2.1"]``; exactly those modules, as a memory report's fix names them), or a predicate
            ``(name, module) -> bool``.
        memory_budget: a float in (0, 1] is a fraction of the un-checkpointed peak; an int or a string (``"6GB"``) is
            a size in bytes, at least 1 MB (so ``1`` is refused, not read as one byte); None: every block. Measured
            on ``example_input_array``, or without one on the first training batch (see above).
        bn_correct: recomputation leaves BatchNorm running statistics alone (they update once per step).
        rebuild_bn_relu: torchvision BasicBlocks, Bottlenecks and ResNet stems left unchecked rebuild their
            BatchNorm + ReLU outputs (and a block its output, where the next block is rebuilt too) in backward
            instead of keeping them, and so do the Conv2dNormActivation units inside blocks left unchecked
            (MobileNet, EfficientNet, RegNet) with their BatchNorm and activation outputs; without a budget, that
            alone (no block is checkpointed).
        rebuild_config: how the rebuild makes its tensors (``RebuildConfig(fused=..., chain_kept=...)``, from
            ``lightning_memguard.checkpointing``); None: the defaults.
        levers: choose among every lever for ``memory_budget`` (see above) instead of checkpointing alone; needs a
            budget; BatchNorm-correct always and without the rebuild.
        fused_loss: with ``levers=True``, offer the fused loss. Where it is applied the Hugging Face model's output
            has ``logits`` None (its loss is the same), in validation too: pass False where a step reads the logits
            (a metric, a distillation loss), and the other levers are planned without it.

    Raises:
        TypeError: ``memory_budget`` of another type, or flags that are not bools.
        ValueError: bad ``memory_budget`` (a fraction outside (0, 1], a size below 1 MB); where the blocks are
            chosen, none found or a name in ``units`` that names no module of the LightningModule (said with the
            closest names); at fit start, a budget with neither ``example_input_array`` nor a first training batch
            whose model inputs can be told (no train loader, an empty one, several, a batch of another kind, or one
            the model's forward fails on); in ``setup``, beside ``FSDPStrategy``'s own
            ``activation_checkpointing_policy``, under ``DeepSpeedStrategy``, and a budget under ``FSDPStrategy``
            on several devices (:class:`~lightning.pytorch.strategies.ModelParallelStrategy` measures on every
            rank); ``levers=True`` without a ``memory_budget`` or beside ``rebuild_bn_relu=True`` or
            ``bn_correct=False`` (at construction), and in ``setup`` on a compiled module (the planner measures eagerly;
            a compiled step's peak is its graph's) or under ``ModelParallelStrategy`` on several devices (a sharded
            forward needs every rank; the planner measures on rank zero alone).

    Example:
        >>> from lightning import Trainer
        >>> trainer = Trainer(callbacks=[ActivationCheckpointing(memory_budget=0.6)], logger=False)
        >>> ActivationCheckpointing(memory_budget=1.5)
        Traceback (most recent call last):
        ...
        ValueError: `memory_budget` as a fraction must be in (0, 1], got 1.5 (bytes: an int or '6GB')

        Every lever for a Hugging Face language model inside a LightningModule:

        >>> import torch
        >>> from lightning import LightningModule
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> class LanguageModel(LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000))
        ...         self.example_input_array = {"input_ids": torch.zeros(2, 32, dtype=torch.long)}
        ...         self.example_input_array["labels"] = self.example_input_array["input_ids"]
        ...     def forward(self, input_ids, labels):
        ...         return self.model(input_ids=input_ids, labels=labels)
        ...     def training_step(self, batch, batch_idx):
        ...         return self(batch, batch).loss
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        ...     def train_dataloader(self):
        ...         return torch.utils.data.DataLoader(torch.randint(0, 1000, (4, 32)), batch_size=2)
        >>> levers = ActivationCheckpointing(memory_budget=0.5, levers=True)
        >>> trainer = Trainer(callbacks=[levers], max_steps=1, logger=False, enable_checkpointing=False,
        ...                   enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        >>> trainer.fit(LanguageModel())
        >>> levers.lever_record["fused_loss"], levers.lever_plan.held
        (True, True)
        >>> ActivationCheckpointing(levers=True)
        Traceback (most recent call last):
        ...
        ValueError: `levers=True` chooses among the levers for a budget, and `memory_budget` is None: give one ...
    """

    def __init__(
        self,
        units: Units = "auto",
        memory_budget: float | int | str | None = None,
        bn_correct: bool = True,
        rebuild_bn_relu: bool = False,
        rebuild_config: RebuildConfig | None = None,
        levers: bool = False,
        fused_loss: bool = True,
    ):
        settings = CheckpointingSettings(
            units, memory_budget, bn_correct, rebuild_bn_relu, rebuild_config, levers, fused_loss
        )
        self.policy: CheckpointingPolicy = make_policy(settings)
        self._planned = False  # in this fit, by on_fit_start or by a tuner listed before it

    @property
    def settings(self) -> CheckpointingSettings:
        """What to checkpoint and how: the policy's, one object."""
        return self.policy.settings

    # the settings, read as the callback's own (the tuners' cache key reads them)
    units = property(lambda self: self.settings.units)
    memory_budget = property(lambda self: self.settings.memory_budget)
    bn_correct = property(lambda self: self.settings.bn_correct)
    rebuild_bn_relu = property(lambda self: self.settings.rebuild_bn_relu)
    rebuild_config = property(lambda self: self.settings.rebuild_config)
    levers = property(lambda self: self.settings.levers)
    fused_loss = property(lambda self: self.settings.fused_loss)

    @property
    def plan(self) -> CheckpointPlan | None:
        """This process's plan (None before it is made, on ranks that applied rank zero's, on resume, and with
        ``levers=True``: see :attr:`lever_plan`)."""
        return self.policy.plan

    @property
    def lever_plan(self) -> LeverPlan | None:
        """With ``levers=True``: this process's :class:`~lightning_memguard.levers.LeverPlan` (None before it is made,
        on ranks that applied rank zero's, and on resume)."""
        return self.policy.lever_plan if isinstance(self.policy, LeverPolicy) else None

    @property
    def lever_record(self) -> dict[str, Any] | None:
        """With ``levers=True``: the levers chosen, as plain data (``LeverPlan.record()``; None before they are)."""
        return self.policy.lever_record if isinstance(self.policy, LeverPolicy) else None

    @property
    def runs(self) -> list[list[str]] | None:
        """The chosen runs of blocks (None before the plan is made); with ``levers=True`` the blocks and parts
        checkpointed, each a run of its own."""
        record = self.lever_record
        if record is not None:
            return [[name] for name in record["checkpointed"]]
        return self.policy.runs

    @property
    def blocks(self) -> list[str] | None:
        """The checkpointed blocks, in model order (None before the plan is made)."""
        return None if self.runs is None else [name for run in self.runs for name in run]

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if fsdp_checkpoints_itself(trainer.strategy):
            raise ValueError(
                "ActivationCheckpointing beside FSDPStrategy(activation_checkpointing_policy=...) would checkpoint the"
                " same blocks twice; use one: drop the strategy's `activation_checkpointing_policy` to keep this"
                " callback (BatchNorm-correct, with a `memory_budget`), or remove this callback"
            )
        _refuse_what_cannot_be_measured(trainer, self.memory_budget)
        if self.levers:
            _refuse_what_the_levers_cannot_plan(trainer, pl_module)
        self._planned = False
        if self.memory_budget is None:  # before the optimizer is built; the same on every rank
            if is_overridden("configure_model", pl_module):
                self._after_configure_model(pl_module)  # the layers do not exist yet
            else:
                self._every_block(pl_module)

    def _every_block(self, pl_module: LightningModule) -> None:
        self.policy.apply(pl_module)
        rank_zero_info(f"ActivationCheckpointing: {self.policy.summary()}")

    def _after_configure_model(self, pl_module: LightningModule) -> None:
        """Checkpoint right after the module's own ``configure_model`` has built its layers (Lightning calls it after
        ``setup`` and before the strategy wraps the model or builds the optimizer): the hook is wrapped on this
        instance for one call, then given back."""
        configure = pl_module.configure_model

        def configure_then_checkpoint() -> None:
            _give_back_configure_model(pl_module)
            configure()
            self._every_block(pl_module)

        configure_then_checkpoint.memguard_wrapped = True  # type: ignore[attr-defined]
        pl_module.configure_model = configure_then_checkpoint  # type: ignore[method-assign]

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.prepare(trainer, pl_module)

    def prepare(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Plan and apply the budget now, once per fit. The tuners call it when they come first in ``callbacks``,
        so that they measure the model as it will train, whatever the order."""
        if self.memory_budget is None or self._planned:
            return
        self._planned = True
        resumed = self.policy.decided
        strategy = trainer.strategy
        who = "ActivationCheckpointing"
        example, from_batch = (None, None) if resumed else example_for_budget(trainer, who, self.units)
        with measuring_said(from_batch, "ActivationCheckpointing"):
            self.policy.apply(
                pl_module,
                example,
                is_rank_zero=strategy.is_global_zero,
                broadcast=strategy.broadcast,
                measuring=trainer.precision_plugin.train_step_context,
                every_rank_measures=holds_shards(strategy) and trainer.world_size > 1,
            )
        if not resumed:
            rank_zero_info(f"ActivationCheckpointing: {self.policy.summary()}")
        self.policy.hold_compile_setting()  # compile's own setting, chosen with the blocks, while this fit compiles

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _give_back_configure_model(pl_module)  # a fit that ended before configure_model ran
        self.policy.release_compile_setting()
        model_logging_dropped(self)  # the chosen runs stay; the fit's model is not kept

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning calls no teardown after an exception

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "runs": self.policy.runs,
            "compile_setting": self.policy.compile_setting,
            "split_graphs": self.policy.split_graphs,
            "levers": self.lever_record,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.runs = state_dict.get("runs", self.policy.runs)
        self.policy.compile_setting = state_dict.get("compile_setting", self.policy.compile_setting)
        self.policy.split_graphs = state_dict.get("split_graphs", self.policy.split_graphs)
        if isinstance(self.policy, LeverPolicy):  # a checkpoint made with levers=False has none: planned anew
            self.policy.lever_record = state_dict.get("levers") or self.policy.lever_record


def _refuse_what_cannot_be_measured(trainer: Trainer, memory_budget: Any) -> None:
    """A budget is measured at fit start on the model as the strategy holds it. Under ``FSDPStrategy`` on several
    devices each rank holds a flat shard of the weights, whole only inside FSDP's own forward, so the blocks cannot be
    measured one by one; DeepSpeed keeps the model inside its engine. Both are refused in ``setup``."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        raise ValueError(
            "ActivationCheckpointing does not support DeepSpeedStrategy: DeepSpeed keeps the model inside its engine"
            " (use DeepSpeed's own activation checkpointing there, or strategy='fsdp')"
        )
    if memory_budget is not None and isinstance(strategy, FSDPStrategy) and trainer.world_size > 1:
        raise ValueError(
            "ActivationCheckpointing(memory_budget=...) under FSDPStrategy on several devices cannot measure the"
            " blocks: each rank holds a flat shard of the weights. Use ModelParallelStrategy (FSDP2's fully_shard,"
            " measured on every rank), or ActivationCheckpointing() without a budget (every block, before FSDP wraps"
            " the model)"
        )


def _refuse_what_the_levers_cannot_plan(trainer: Trainer, pl_module: LightningModule) -> None:
    """``levers=True`` measures on rank zero alone, eagerly. A compiled module's step is compile's graph, whose peak
    the eager measurements of the fused loss and the pointwise chains do not predict; a sharded model
    (``ModelParallelStrategy`` on several devices) needs every rank in its forward, and the planner's timings on each
    rank could choose apart. Both are refused in ``setup``."""
    if _compiler.is_compiled(pl_module):
        raise ValueError(
            "ActivationCheckpointing(levers=True) on a compiled module: the levers' planner measures the step eagerly,"
            " and a compiled step's peak is compile's graph's, which those measurements do not predict. Use"
            " ActivationCheckpointing(memory_budget=...) without levers (measured compiled), or fit the module"
            " uncompiled"
        )
    if holds_shards(trainer.strategy) and trainer.world_size > 1:
        raise ValueError(
            f"ActivationCheckpointing(levers=True) under {type(trainer.strategy).__name__} on several devices: a"
            " sharded forward needs every rank, and the levers' planner measures on rank zero alone (its timings on"
            " each rank could choose apart). Use ActivationCheckpointing(memory_budget=...) without levers there"
            " (measured on every rank)"
        )


def _give_back_configure_model(pl_module: LightningModule) -> None:
    """Remove the instance's wrapped ``configure_model``, so that the class's own is the hook again."""
    if getattr(pl_module.__dict__.get("configure_model"), "memguard_wrapped", False):
        del pl_module.__dict__["configure_model"]
