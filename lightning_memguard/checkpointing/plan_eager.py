"""Planning a budget in eager mode: measure each link, let :class:`~.budget.BudgetSearch` choose, and hand each
choice to :func:`.surgery.apply`, the rebuild first where asked (see :func:`.plan.checkpoint_blocks`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_memguard.checkpointing import surgery
from lightning_memguard.checkpointing.budget import (
    BlockProfile,
    BudgetSearch,
    best_runs,
    budget_bytes,
    choose_blocks,
    predict_peak,
    value,
)
from lightning_memguard.checkpointing.families import Layout
from lightning_memguard.checkpointing.measure import StepMeter, can_rebuild, default_loss, in_model_order
from lightning_memguard.checkpointing.rebuild import DEFAULT_CONFIG, RebuildConfig
from lightning_memguard.checkpointing.result import CheckpointPlan, finished, warnings_once
from lightning_memguard.checkpointing.wrap import Link


def plan_eager(
    model: nn.Module,
    links: list[Link],
    joinable: list[bool],
    memory_budget: float | int,
    example_input: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    bn_correct: bool,
    rebuild_bn_relu: bool,
    config: RebuildConfig,
    layout: Layout,
) -> CheckpointPlan:
    """Measure, choose links under the budget, and leave the model as the plan says (see
    :func:`.plan.checkpoint_blocks`)."""
    meter = StepMeter(model, example_input, loss_fn or default_loss)
    baseline = meter.peak()
    budget = budget_bytes(baseline, memory_budget)
    profiles = meter.profile(links)
    start = baseline  # the peak the blocks are chosen against: after the rebuild, where there is one
    rebuilt = links if rebuild_bn_relu else []  # the rebuild goes wherever a link is left unchecked
    applied = surgery.Applied()
    if rebuild_bn_relu:
        plain = profiles  # what a checkpointed block brings back when it is recomputed: the rebuild stands aside
        applied = surgery.apply(model, rebuilt=rebuilt, config=config, layout=layout)
        profiles = _rebuilt_profiles(meter.profile(links), plain)
        start -= sum(q.saved_bytes for q in plain) - sum(p.saved_bytes for p in profiles)  # what the rebuild frees
    chosen, _, _ = choose_blocks(profiles, start, budget, joinable, meter.cuda)
    search = BudgetSearch(chosen, [value(p) for p in profiles], budget)  # the pure core decides, this measures
    with warnings_once():
        chosen, measured, applied = _search(
            search, meter.peak, model, links, joinable, profiles, start, applied, meter.cuda,
            rebuilt=rebuilt, bn_correct=bn_correct, config=config, layout=layout,
        )  # fmt: skip
    final_runs = best_runs(chosen, profiles, start, joinable, meter.cuda)
    lower = ["a smaller batch"]
    if not rebuild_bn_relu and any(can_rebuild(link, layout) for link in links):
        lower.append("rebuild_bn_relu=True (the rebuild, in the links left unchecked)")
    return finished(
        CheckpointPlan(
            blocks=in_model_order(applied.checkpointed, links),  # what was really changed, in model order
            candidates=len(links),
            runs=applied.runs,
            rebuilt=applied.rebuilt,
            baseline_bytes=baseline,
            budget_bytes=budget,
            predicted_bytes=predict_peak(start, profiles, final_runs, meter.cuda),
            measured_bytes=measured,
            profiles=profiles,
            lower=lower,
        )
    )


def _search(
    search: BudgetSearch,
    measure: Callable[[], int],
    model: nn.Module,
    links: list[Link],
    joinable: list[bool],
    profiles: list[BlockProfile],
    start: int,
    applied: surgery.Applied,
    cuda: bool,
    *,
    rebuilt: Sequence[Link] = (),
    bn_correct: bool,
    config: RebuildConfig = DEFAULT_CONFIG,
    layout: Layout,
) -> tuple[set[int], int, surgery.Applied]:
    """Hand each of ``search``'s proposals, cut into runs, to surgery and tell the search the peak ``measure`` reads;
    return its result and what is applied (the last proposal, the result's own set)."""
    while (indices := search.propose()) is not None:
        runs = [[links[i] for i in run] for run in best_runs(indices, profiles, start, joinable, cuda)]
        applied = surgery.apply(
            model, runs, rebuilt, bn_correct=bn_correct, config=config, replacing=applied, layout=layout
        )
        search.observe(measure())
    chosen, peak = search.result  # type: ignore[misc]
    return chosen, peak, applied


def _rebuilt_profiles(rebuilt: list[BlockProfile], plain: list[BlockProfile]) -> list[BlockProfile]:
    """The links as the planner sees them with the rebuild: what each keeps unchecked (``rebuilt``), what it brings
    back when recomputed (``plain``), and what checkpointing it makes real again: its output (the end of a run
    keeps it) and its input where the link before rebuilt it (the start of a run keeps it)."""
    out = []
    for i, (p, q) in enumerate(zip(rebuilt, plain, strict=True)):
        before = (rebuilt[i - 1].output_bytes, plain[i - 1].output_bytes) if i else (0, 0)
        out.append(
            replace(
                p,
                recomputed_bytes=q.saved_bytes,
                input_bytes=q.input_bytes + before[1] - before[0],
                output_bytes=q.output_bytes,
            )
        )
    return out
