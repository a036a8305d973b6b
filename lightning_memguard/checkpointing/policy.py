"""What to checkpoint, and what was chosen: the settings the callback and the strategies share."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from torch import nn

from lightning_memguard import _compiler
from lightning_memguard.checkpointing.plan import CheckpointPlan, apply_plan, checkpoint_blocks, measured_alike
from lightning_memguard.checkpointing.rebuild import RebuildConfig, check_config
from lightning_memguard.checkpointing.wrap import Units, check_units
from lightning_memguard.core.checks import check_bool, check_memory_budget


class CheckpointingPolicy:
    """Which blocks to checkpoint (``units``), under which ``memory_budget``, and how; checked on construction.

    :meth:`apply` changes a model once: without a budget every block (and a ResNet's stem) is checkpointed, the
    same on every process; with one, rank zero measures on a real batch and every rank applies rank zero's runs
    (``broadcast``), so all ranks train the same model. :attr:`runs` is what was chosen: a resumed run hands it back
    and nothing is measured again.

    Args:
        units: ``"auto"``, module classes, or a predicate ``(name, module) -> bool``.
        memory_budget: a float in (0, 1] (a fraction of the un-checkpointed peak), a size of at least 1 MB (an int
            or a string such as ``"6GB"``), or None (every block).
        bn_correct: recomputation leaves BatchNorm running statistics alone.
        rebuild_bn_relu: the cheap recomputation of ResNet blocks (torchvision's, timm's) and Conv2dNormActivation
            units (see ``checkpoint_blocks``).
        rebuild_config: how the rebuild makes its tensors (``RebuildConfig(fused=..., chain_kept=...)``); None:
            the defaults.

    Example:
        >>> import torchvision
        >>> policy = CheckpointingPolicy()
        >>> policy.apply(torchvision.models.resnet18())
        >>> policy.runs[:2]
        [['stem'], ['layer1.0']]
        >>> CheckpointingPolicy(units=None)
        Traceback (most recent call last):
        ...
        TypeError: `units` must be 'auto', module classes or a callable (name, module) -> bool, got None
    """

    def __init__(
        self,
        units: Any = "auto",
        memory_budget: float | int | str | None = None,
        bn_correct: bool = True,
        rebuild_bn_relu: bool = False,
        rebuild_config: RebuildConfig | None = None,
    ) -> None:
        self.units: Units = check_units(units)
        checked = check_memory_budget(memory_budget)
        # a string as given ("6GB" stays "6GB"), a number as Python's (np.float32(0.6) is 0.6); checked again where
        # it is measured
        self.memory_budget = memory_budget if isinstance(memory_budget, str) else checked
        self.bn_correct = check_bool("bn_correct", bn_correct)
        self.rebuild_bn_relu = check_bool("rebuild_bn_relu", rebuild_bn_relu)
        check_config(rebuild_config)
        self.rebuild_config = rebuild_config
        self.plan: CheckpointPlan | None = None  # this process's plan, where it made one
        self.runs: list[list[str]] | None = None  # the chosen runs of blocks: learned state
        # under torch.compile, compile's activation_memory_budget chosen with the runs (None: compile's default)
        self.compile_setting: float | None = None
        # whether the runs' containers each begin a compiled graph of their own (CheckpointPlan.graph_splits)
        self.split_graphs = False
        self._compiling = ExitStack()  # the setting, held for a fit (hold_compile_setting)

    def apply(
        self,
        model: nn.Module,
        example_input: Any = None,
        *,
        is_rank_zero: bool = True,
        broadcast: Callable[[Any], Any] = lambda obj: obj,
        measuring: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        every_rank_measures: bool = False,
    ) -> None:
        """Checkpoint ``model`` in place: re-apply :attr:`runs` if known, else plan (rank zero) and agree.

        A compiled ``model`` (``fit(torch.compile(module))``) with a budget is measured compiled, and
        :attr:`compile_setting` is compile's ``activation_memory_budget`` chosen with the runs: the caller holds it
        for the training (:meth:`hold_compile_setting`).

        Args:
            model: the module to change.
            example_input: a real batch on the model's device, for a budget.
            is_rank_zero: whether this process plans for all.
            broadcast: hands rank zero's object to every rank (``strategy.broadcast``).
            measuring: the context to measure in (the Trainer's precision).
            every_rank_measures: every rank runs the measurement, as a sharded model's forward and backward hold
                collectives that need every rank; each takes rank zero's figures, so all reach rank zero's plan.
        """
        if self.runs is not None:
            self._apply_runs(model, self.runs, self.split_graphs)
            return
        if self.memory_budget is None:  # the same on every rank: nothing to agree on
            self.plan = checkpoint_blocks(
                model,
                self.units,
                bn_correct=self.bn_correct,
                rebuild_bn_relu=self.rebuild_bn_relu,
                rebuild_config=self.rebuild_config,
            )
            self.runs, self.split_graphs = self.plan.runs, bool(self.plan.graph_splits)
            return
        if example_input is None:
            raise ValueError("a `memory_budget` is measured on a real batch: give the module an `example_input_array`")
        runs, setting, split = None, None, False
        measures = is_rank_zero or every_rank_measures
        if measures:
            # a sharded forward holds collectives: every rank measures, each taking rank zero's figures, so all run
            # the same passes and reach rank zero's plan
            agreed = measured_alike(broadcast) if every_rank_measures else contextlib.nullcontext()
            with measuring(), agreed:
                self.plan = checkpoint_blocks(
                    model,
                    self.units,
                    self.memory_budget,
                    example_input=example_input,
                    bn_correct=self.bn_correct,
                    rebuild_bn_relu=self.rebuild_bn_relu,
                    rebuild_config=self.rebuild_config,
                )
            runs = self.plan.runs
            setting = self.plan.activation_memory_budget
            split = bool(self.plan.graph_splits)
        runs, setting, split = broadcast((runs, setting, split))  # rank zero's, on every rank
        if not measures:  # only a rank that measured has applied the plan
            self._apply_runs(model, runs, split)
        self.runs, self.compile_setting, self.split_graphs = runs, setting, split

    def _apply_runs(self, model: nn.Module, runs: list[list[str]], split_graphs: bool) -> None:
        apply_plan(
            model, runs, self.units, self.bn_correct, self.rebuild_bn_relu, self.rebuild_config, split_graphs
        )  # fmt: skip

    def hold_compile_setting(self) -> None:
        """Set compile's ``activation_memory_budget`` to :attr:`compile_setting` (nothing if None) until
        :meth:`release_compile_setting`: for the fit, while the model compiles (its first steps, recompiles)."""
        self._compiling.close()
        self._compiling.enter_context(_compiler.activation_memory_budget(self.compile_setting))

    def release_compile_setting(self) -> None:
        self._compiling.close()

    def summary(self) -> str:
        if self.plan is not None:
            return self.plan.summary()
        return f"{sum(len(r) for r in self.runs or [])} blocks in {len(self.runs or [])} runs (rank zero's plan)"
