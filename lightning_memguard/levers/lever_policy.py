"""The checkpointing settings with ``levers=True``, applied to a model once: the callback's and the strategies' budget
planned by :func:`~.plan_levers.plan_levers` instead of checkpointing alone."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_memguard.checkpointing.checkpointing_settings import CheckpointingSettings
from lightning_memguard.checkpointing.policy import CheckpointingPolicy, planned_on_rank_zero
from lightning_memguard.levers.choose import LeverPlan
from lightning_memguard.levers.plan_levers import applied_levers, apply_record, plan_levers, remove_levers


class LeverPolicy(CheckpointingPolicy):
    """A :class:`~lightning_memguard.checkpointing.policy.CheckpointingPolicy` whose budget is planned by
    :func:`~.plan_levers.plan_levers`: a Hugging Face model's fused loss, blocks or their parts checkpointed, pointwise
    recomputation. Offload is not offered: it is a context around each step, not a change to the model.

    :meth:`apply` plans on rank zero, on a real batch, and every other rank applies rank zero's
    :meth:`~.choose.LeverPlan.record` (``broadcast``); :attr:`lever_record` is what was chosen (plain data): a
    resumed run hands it back and :func:`~.plan_levers.apply_record` re-applies it, measuring nothing.

    Args:
        settings: with ``levers=True`` and a ``memory_budget`` (checked where they are made).

    Example:
        >>> import torch
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> block = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
        >>> model = torch.nn.Sequential(*(block() for _ in range(4)))
        >>> policy = LeverPolicy(CheckpointingSettings([torch.nn.Sequential], memory_budget=0.6, levers=True))
        >>> policy.apply(model, torch.randn(256, 64, requires_grad=True))
        >>> policy.lever_plan.held, sorted(policy.lever_record)
        (True, ['checkpointed', 'fused_loss', 'loss_module', 'pointwise', 'version'])
    """

    def __init__(self, settings: CheckpointingSettings) -> None:
        if not settings.levers:
            raise ValueError("LeverPolicy needs settings with levers=True (CheckpointingPolicy checkpoints alone)")
        super().__init__(settings)
        self.lever_plan: LeverPlan | None = None  # this process's plan, where it made one
        self.lever_record: dict[str, Any] | None = None  # the levers chosen: learned state

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
        """Apply the levers to ``model`` in place: re-apply :attr:`lever_record` if known, else plan (rank zero) and
        apply rank zero's record on every other rank.

        Args:
            model: the module to change.
            example_input: a real batch on the model's device (a Hugging Face model's with its ``labels``).
            is_rank_zero: whether this process plans for all.
            broadcast: hands rank zero's object to every rank (``strategy.broadcast``).
            measuring: the context to measure in (the Trainer's precision).
            every_rank_measures: refused (the planner times its recomputations on each rank, so ranks measuring
                alike could still choose apart).

        Raises:
            ValueError: no ``example_input`` to measure on; ``every_rank_measures``.
            PlanningFailed: on every rank but zero, where rank zero's planning raised (rank zero raises its error).
        """
        units = self.settings.units
        if self.lever_record is not None:  # a second fit of this model carries them still: taken off, then again
            if applied_levers(model):
                remove_levers(model)
            apply_record(model, self.lever_record, units)
            return
        if every_rank_measures:
            raise ValueError(
                "the levers' planner measures on rank zero alone; a sharded model measured on every rank could choose"
                " apart (its recomputations are timed on each rank)"
            )
        if example_input is None:
            raise ValueError(
                "a `memory_budget` is measured on a real batch: give the module an `example_input_array`, or a train"
                " loader whose first batch holds the model's inputs"
            )
        budget: Any = self.settings.memory_budget

        def plan() -> dict[str, Any]:
            with measuring():
                self.lever_plan = plan_levers(
                    model, example_input, budget, units=units, offload=False, fused_loss=self.settings.fused_loss
                )
            return self.lever_plan.record()

        record = planned_on_rank_zero(plan, is_rank_zero, broadcast)  # rank zero's, on every rank
        if not is_rank_zero:
            apply_record(model, record, units)
        self.lever_record = record

    @property
    def decided(self) -> bool:
        """Whether the levers are known (chosen in this process, by rank zero, or handed back on resume)."""
        return self.lever_record is not None

    def summary(self) -> str:
        if self.lever_plan is not None:
            return self.lever_plan.summary()
        r = self.lever_record or {"fused_loss": False, "checkpointed": [], "pointwise": []}
        return (
            f"levers (rank zero's plan): the fused loss {'applied' if r['fused_loss'] else 'not applied'},"
            f" {len(r['checkpointed'])} blocks or parts checkpointed, {len(r['pointwise'])} blocks' pointwise chains"
            " recomputed"
        )


def make_policy(settings: CheckpointingSettings) -> CheckpointingPolicy:
    """The policy for ``settings``: a :class:`LeverPolicy` with ``levers=True``, else a ``CheckpointingPolicy``."""
    return LeverPolicy(settings) if settings.levers else CheckpointingPolicy(settings)
