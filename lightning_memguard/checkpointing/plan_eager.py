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
    NEAR,
    BlockProfile,
    BudgetSearch,
    Part,
    best_runs,
    budget_bytes,
    choose_blocks,
    predict_peak,
    value,
)
from lightning_memguard.checkpointing.families import Layout
from lightning_memguard.checkpointing.measure import StepMeter, can_rebuild, default_loss, in_model_order, link_parts
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
    # finer links (a layer's attention and MLP) where no rebuild is planned: the rebuild changes what a block keeps
    found = [] if rebuild_bn_relu else link_parts(links)
    measured = meter.profile(links, found)
    profiles = measured[: len(links)]
    kept = [(i, part, p) for (i, part), p in zip(found, measured[len(links) :], strict=True) if p.saving > 0]
    part_links = [part for _, part, _ in kept]  # each a finer link the search may checkpoint
    parts = [Part(i, p) for i, _, p in kept]
    start = baseline  # the peak the blocks are chosen against: after the rebuild, where there is one
    rebuilt = links if rebuild_bn_relu else []  # the rebuild goes wherever a link is left unchecked
    applied = surgery.Applied()
    if rebuild_bn_relu:
        plain = profiles  # what a checkpointed block brings back when it is recomputed: the rebuild stands aside
        applied = surgery.apply(model, rebuilt=rebuilt, config=config, layout=layout)
        profiles = _rebuilt_profiles(meter.profile(links), plain)
        start -= sum(q.saved_bytes for q in plain) - sum(p.saved_bytes for p in profiles)  # what the rebuild frees
    predicted, _, _ = choose_blocks(profiles, start, budget, joinable, meter.cuda, parts)
    n = len(links)
    values = [value(p) for p in [*profiles, *(part.profile for part in parts)]]

    def alone(indices: set[int]) -> set[int]:
        """Links, and parts of links left unchecked (a part inside a chosen link is its link's)."""
        return {i for i in indices if i < n or parts[i - n].link not in indices}

    def search(chosen: set[int], among: set[int], nested: bool, applied: surgery.Applied) -> Any:
        return _search(
            BudgetSearch(chosen, values, budget, among=among), meter.peak, model, links, joinable, profiles, start,
            applied, meter.cuda, rebuilt=rebuilt, bn_correct=bn_correct, config=config, layout=layout, parts=parts,
            part_links=part_links, kept=(lambda i: i) if nested else alone,
        )  # fmt: skip

    with warnings_once():
        # links and parts of links left unchecked first; where even that does not fit, parts nested in the links
        chosen, peak, applied = search(alone(predicted), set(range(len(values))), False, applied)
        chosen = alone(chosen)
        inside = {n + k for k, part in enumerate(parts) if part.link in chosen}
        if peak > budget and inside:
            flat = (chosen, peak)
            chosen, peak, applied = search(chosen | (predicted & inside), inside, True, applied)
            if peak > budget and peak > flat[1] * (1 - NEAR):  # a hair lower is not worth a third forward
                chosen, peak = flat
                applied = _apply(
                    model, links, joinable, profiles, start, applied, meter.cuda, chosen, parts, part_links,
                    rebuilt=rebuilt, bn_correct=bn_correct, config=config, layout=layout,
                )  # fmt: skip
    finer = [parts[i - len(links)] for i in sorted(chosen) if i >= len(links)]
    final_runs = best_runs({i for i in chosen if i < len(links)}, profiles, start, joinable, meter.cuda, finer)
    lower = ["a smaller batch"]
    if not rebuild_bn_relu and any(can_rebuild(link, layout) for link in links):
        lower.append("rebuild_bn_relu=True (the rebuild, in the links left unchecked)")
    named_parts = {part.name for part in part_links}
    every = [(part.link, link) for part, link in zip(parts, part_links, strict=True)]
    return finished(
        CheckpointPlan(
            # what was really changed, in model order
            blocks=in_model_order([n for n in applied.checkpointed if n not in named_parts], links),
            parts=in_model_order([n for n in applied.checkpointed if n in named_parts], links, every),
            candidates=len(links),
            runs=applied.runs,
            rebuilt=applied.rebuilt,
            baseline_bytes=baseline,
            budget_bytes=budget,
            predicted_bytes=predict_peak(start, profiles, final_runs, meter.cuda, finer),
            measured_bytes=peak,
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
    parts: Sequence[Part] = (),
    part_links: Sequence[Link] = (),
    kept: Callable[[set[int]], set[int]] = lambda indices: indices,
) -> tuple[set[int], int, surgery.Applied]:
    """Hand each of ``search``'s proposals, cut into runs, to surgery and tell the search the peak ``measure`` reads;
    return its result and what is applied (the last proposal, the result's own set). Index ``len(links) + k`` is the
    finer link ``part_links[k]`` (``parts[k]`` as the budget sees it), a run of its own; ``kept`` says which of a
    proposal's indices are applied."""
    while (indices := search.propose()) is not None:
        applied = _apply(
            model, links, joinable, profiles, start, applied, cuda, kept(indices), parts, part_links,
            rebuilt=rebuilt, bn_correct=bn_correct, config=config, layout=layout,
        )  # fmt: skip
        search.observe(measure())
    chosen, peak = search.result  # type: ignore[misc]
    return chosen, peak, applied


def _apply(
    model: nn.Module,
    links: list[Link],
    joinable: list[bool],
    profiles: list[BlockProfile],
    start: int,
    applied: surgery.Applied,
    cuda: bool,
    indices: set[int],
    parts: Sequence[Part],
    part_links: Sequence[Link],
    *,
    rebuilt: Sequence[Link],
    bn_correct: bool,
    config: RebuildConfig,
    layout: Layout,
) -> surgery.Applied:
    """Checkpoint the links and parts ``indices`` names (cut into runs), in place of what ``applied`` did."""
    n = len(links)
    finer = [parts[i - n] for i in sorted(indices) if i >= n]
    cut = best_runs({i for i in indices if i < n}, profiles, start, joinable, cuda, finer)
    runs = [[links[i] for i in run] for run in cut] + [[part_links[i - n]] for i in sorted(indices) if i >= n]
    return surgery.apply(model, runs, rebuilt, bn_correct=bn_correct, config=config, replacing=applied, layout=layout)


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
