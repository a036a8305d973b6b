"""The memory levers beyond checkpointing: changes to what a step computes that keep its result and hold less.

:func:`fused_linear_cross_entropy` (in :mod:`.fused_loss`) computes a language model's loss without its logits;
:func:`apply_fused_loss` (in :mod:`.huggingface_loss`) makes a Hugging Face model's own ``forward(labels=...)`` use it.
:class:`ActivationOffload` (in :mod:`.offload`) keeps chosen blocks' saved activations in pinned host memory, copied on
side streams while the step computes. :func:`recompute_pointwise` (in :mod:`.pointwise`) keeps a block's matrix
products saved and recomputes the pointwise work between them in backward (:func:`pointwise_policy` for a checkpoint of
your own; :func:`measure_pointwise`: per link, the bytes it frees and the milliseconds it adds). :func:`plan_levers`
(in :mod:`.plan_levers`) chooses among them and activation checkpointing for a memory budget, measured (the pure
choice in :mod:`.choose`); :func:`apply_record` applies its choice again from ``plan.record()``, measuring nothing.
"""

from __future__ import annotations

from lightning_memguard.levers.fused_loss import fused_linear_cross_entropy
from lightning_memguard.levers.huggingface_loss import FusedLossRefused, apply_fused_loss, remove_fused_loss
from lightning_memguard.levers.offload import ActivationOffload
from lightning_memguard.levers.plan_levers import (
    InjectedLever,
    LeverPlan,
    applied_levers,
    apply_record,
    find_loss_target,
    plan_levers,
    remove_levers,
)
from lightning_memguard.levers.pointwise import (
    PointwiseCost,
    measure_pointwise,
    pointwise_policy,
    recompute_pointwise,
    remove_pointwise,
)

__all__ = [
    "ActivationOffload",
    "FusedLossRefused",
    "PointwiseCost",
    "apply_fused_loss",
    "applied_levers",
    "apply_record",
    "fused_linear_cross_entropy",
    "measure_pointwise",
    "pointwise_policy",
    "recompute_pointwise",
    "InjectedLever",
    "LeverPlan",
    "find_loss_target",
    "plan_levers",
    "remove_fused_loss",
    "remove_levers",
    "remove_pointwise",
]
