"""Applying the checkpointing settings to a model once, and what was chosen: what the callback and the strategies
share."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from torch import nn

from lightning_memguard import _compiler
from lightning_memguard.checkpointing.checkpointing_settings import CheckpointingSettings
from lightning_memguard.checkpointing.entrances import apply_plan, checkpoint_blocks
from lightning_memguard.checkpointing.measure import measured_alike
from lightning_memguard.checkpointing.result import CheckpointPlan


class PlanningFailed(RuntimeError):
    """Raised on every rank but zero where rank zero's planning raised (rank zero raises that error itself): the
    message names the error's type and says what it said, so no rank waits for a plan that never comes."""


@dataclasses.dataclass(frozen=True)
class _Failed:
    said: str


def planned_on_rank_zero(
    plan: Callable[[], Any],
    is_rank_zero: bool,
    broadcast: Callable[[Any], Any],
    failure: Callable[[str], Exception] | None = None,
) -> Any:
    """What ``plan()`` returned on rank zero, on every rank (``broadcast``): rank zero plans; where that raises,
    rank zero raises its error and every other rank ``failure(said)`` (default :class:`PlanningFailed`; ``said``:
    the error's type and message), after the broadcast they all wait in.

    Example:
        >>> planned_on_rank_zero(lambda: ["h.0"], True, lambda obj: obj)
        ['h.0']
    """
    planned, failed = None, None
    if is_rank_zero:
        try:
            planned = plan()
        except BaseException as err:  # the other ranks learn it below instead of waiting in the broadcast
            failed, planned = err, _Failed(f"{type(err).__name__}: {err}")
    planned = broadcast(planned)
    if failed is not None:
        raise failed
    if isinstance(planned, _Failed):
        if failure is not None:
            raise failure(planned.said)
        raise PlanningFailed(f"rank zero failed planning what to checkpoint: {planned.said}")
    return planned


class CheckpointingPolicy:
    """Applies :class:`~.checkpointing_settings.CheckpointingSettings` to a model once, and keeps what was chosen.

    :meth:`apply` changes a model once: without a budget every block (and a ResNet's stem) is checkpointed, the
    same on every process; with one, rank zero measures on a real batch and every rank applies rank zero's runs
    (``broadcast``), so all ranks train the same model. :attr:`runs` is what was chosen: a resumed run hands it back
    and nothing is measured again.

    The settings are read as ``policy.settings.memory_budget`` (``strategy.checkpointing.settings.memory_budget``);
    the old attributes ``policy.units``, ``memory_budget``, ``bn_correct``, ``rebuild_bn_relu`` and
    ``rebuild_config`` still read them, and setting one replaces the settings (checked again), each with a
    ``DeprecationWarning``: they go in the next release.

    Args:
        settings: what to checkpoint and how (checked where they are made); None: the defaults.

    Example:
        >>> import torchvision
        >>> policy = CheckpointingPolicy()
        >>> policy.apply(torchvision.models.resnet18())
        >>> policy.runs[:2]
        [['stem'], ['layer1.0']]
    """

    # the settings where they were before CheckpointingSettings held them: read and set through it, with a warning
    units = property(lambda self: self._moved("units"), lambda self, v: self._moved("units", v))
    memory_budget = property(lambda self: self._moved("memory_budget"), lambda self, v: self._moved("memory_budget", v))
    bn_correct = property(lambda self: self._moved("bn_correct"), lambda self, v: self._moved("bn_correct", v))
    rebuild_bn_relu = property(
        lambda self: self._moved("rebuild_bn_relu"), lambda self, v: self._moved("rebuild_bn_relu", v)
    )
    rebuild_config = property(
        lambda self: self._moved("rebuild_config"), lambda self, v: self._moved("rebuild_config", v)
    )

    def __init__(self, settings: CheckpointingSettings | None = None) -> None:
        self.settings = settings if settings is not None else CheckpointingSettings()
        self.plan: CheckpointPlan | None = None  # this process's plan, where it made one
        self.runs: list[list[str]] | None = None  # the chosen runs of blocks: learned state
        # under torch.compile, compile's activation_memory_budget chosen with the runs (None: compile's default)
        self.compile_setting: float | None = None
        # whether the runs' containers each begin a compiled graph of their own (CheckpointPlan.graph_splits)
        self.split_graphs = False
        self._compiling = ExitStack()  # the setting, held for a fit (hold_compile_setting)

    def _moved(self, name: str, *value: Any) -> Any:
        """The setting ``name`` read (or, given a value, set) at its old place, with a ``DeprecationWarning``."""
        warnings.warn(
            f"`checkpointing.{name}` moved to `checkpointing.settings.{name}` (a CheckpointingSettings); the old"
            " attribute goes in the next release",
            DeprecationWarning,
            stacklevel=3,
        )
        if value:
            self.settings = dataclasses.replace(self.settings, **{name: value[0]})  # checked again
            return None
        return getattr(self.settings, name)

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

        Raises:
            PlanningFailed: where rank zero alone plans (not ``every_rank_measures``), on every rank but zero where
                its planning raised (rank zero raises its error).
        """
        if self.runs is not None:
            self._apply_runs(model, self.runs, self.split_graphs)
            return
        settings = self.settings
        if settings.memory_budget is None:  # the same on every rank: nothing to agree on
            self.plan = checkpoint_blocks(
                model,
                settings.units,
                bn_correct=settings.bn_correct,
                rebuild_bn_relu=settings.rebuild_bn_relu,
                rebuild_config=settings.rebuild_config,
            )
            self.runs, self.split_graphs = self.plan.runs, bool(self.plan.graph_splits)
            return
        if example_input is None:
            raise ValueError(
                "a `memory_budget` is measured on a real batch: give the module an `example_input_array`, or a train"
                " loader whose first batch holds the model's inputs"
            )
        measures = is_rank_zero or every_rank_measures

        def plan() -> tuple[list[list[str]], float | None, bool]:
            # a sharded forward holds collectives: every rank measures, each taking rank zero's figures, so all run
            # the same passes and reach rank zero's plan
            agreed = measured_alike(broadcast) if every_rank_measures else contextlib.nullcontext()
            with measuring(), agreed:
                self.plan = checkpoint_blocks(
                    model,
                    settings.units,
                    settings.memory_budget,
                    example_input=example_input,
                    bn_correct=settings.bn_correct,
                    rebuild_bn_relu=settings.rebuild_bn_relu,
                    rebuild_config=settings.rebuild_config,
                )
            return self.plan.runs, self.plan.activation_memory_budget, bool(self.plan.graph_splits)

        if every_rank_measures:
            runs, setting, split = broadcast(plan())  # rank zero's, on every rank
        else:
            runs, setting, split = planned_on_rank_zero(plan, is_rank_zero, broadcast)
        if not measures:  # only a rank that measured has applied the plan
            self._apply_runs(model, runs, split)
        self.runs, self.compile_setting, self.split_graphs = runs, setting, split

    @property
    def decided(self) -> bool:
        """Whether what to checkpoint is known (chosen here, by rank zero, or handed back on resume)."""
        return self.runs is not None

    def _apply_runs(self, model: nn.Module, runs: list[list[str]], split_graphs: bool) -> None:
        s = self.settings
        apply_plan(model, runs, s.units, s.bn_correct, s.rebuild_bn_relu, s.rebuild_config, split_graphs)

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
        links = sum(len(run) for run in self.runs or [])
        return f"{links} blocks or parts of blocks in {len(self.runs or [])} runs (rank zero's plan)"
