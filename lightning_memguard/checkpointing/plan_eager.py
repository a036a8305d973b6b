"""Planning a budget in eager mode: measure each link, let :class:`~.budget.BudgetSearch` choose, and ask for each
choice to be applied (a :class:`~.result.Change` the entrance hands to :func:`.surgery.apply`), the rebuild first
where asked (see :func:`.entrances.checkpoint_blocks`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

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
from lightning_memguard.checkpointing.measure import StepMeter, default_loss
from lightning_memguard.checkpointing.model_map import ModelMap
from lightning_memguard.checkpointing.result import Change, CheckpointPlan, Planner, Steps, finished, warnings_once
from lightning_memguard.checkpointing.wrap import Link

if TYPE_CHECKING:
    from lightning_memguard.checkpointing.surgery import Applied


def plan_eager(
    model_map: ModelMap,
    memory_budget: float | int,
    example_input: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    rebuild_bn_relu: bool,
    rebuildable: bool,
) -> Planner:
    """Measure the links of ``model_map``, choose among them under the budget, and leave the model as the plan says
    (see :func:`.entrances.checkpoint_blocks`); ``rebuildable``: whether the rebuild takes anything among the links
    (:func:`.rebuild_targets.can_rebuild`), for what else would lower the floor. A :data:`~.result.Planner`: each
    choice is a change asked of the entrance, measured once made."""
    links = list(model_map.links)
    meter = StepMeter(model_map.model, example_input, loss_fn or default_loss)
    baseline = meter.peak()
    budget = budget_bytes(baseline, memory_budget)
    # finer links (a layer's attention and MLP) where no rebuild is planned: the rebuild changes what a block keeps
    found = [] if rebuild_bn_relu else list(model_map.parts)
    measured = meter.profile(links, found)
    profiles = measured[: len(links)]
    kept = [(i, part, p) for (i, part), p in zip(found, measured[len(links) :], strict=True) if p.saving > 0]
    start = baseline  # the peak the blocks are chosen against: after the rebuild, where there is one
    applied: Applied | None = None
    if rebuild_bn_relu:
        plain = profiles  # what a checkpointed block brings back when it is recomputed: the rebuild stands aside
        applied = yield Change(rebuilt=links)
        profiles = _rebuilt_profiles(meter.profile(links), plain)
        start -= sum(q.saved_bytes for q in plain) - sum(p.saved_bytes for p in profiles)  # what the rebuild frees
    plan = _Planning(
        meter, links, list(model_map.joinable), profiles, [Part(i, p) for i, _, p in kept],
        [part for _, part, _ in kept], start, budget, links if rebuild_bn_relu else [], applied,
    )  # fmt: skip
    with warnings_once():
        chosen, peak = yield from plan.choose()
    finer, final_runs = plan.cut(chosen)
    lower = ["a smaller batch"]
    if not rebuild_bn_relu and rebuildable:
        lower.append("rebuild_bn_relu=True (the rebuild, in the links left unchecked)")
    named_parts = {part.name for part in plan.part_links}
    assert plan.applied is not None  # every search measures at least one change
    checkpointed = plan.applied.checkpointed
    return finished(
        CheckpointPlan(
            # what was really changed, in model order (_apply hands over the runs of links in order, then the parts)
            blocks=[name for name in checkpointed if name not in named_parts],
            parts=[name for name in checkpointed if name in named_parts],
            candidates=len(links),
            runs=plan.applied.runs,
            rebuilt=plan.applied.rebuilt,
            baseline_bytes=baseline,
            budget_bytes=budget,
            predicted_bytes=predict_peak(start, profiles, final_runs, meter.cuda, finer),
            measured_bytes=peak,
            profiles=profiles,
            lower=lower,
        )
    )


@dataclass
class _Planning:
    """One eager plan's search: what it chooses among, and the model as the last measured choice left it
    (``applied``). Index ``len(links) + k`` is the finer link ``part_links[k]`` (``parts[k]`` as the budget sees
    it), a run of its own."""

    meter: StepMeter
    links: list[Link]
    joinable: list[bool]
    profiles: list[BlockProfile]
    parts: list[Part]
    part_links: list[Link]
    start: int  # the peak the links are chosen against
    budget: int
    rebuilt: Sequence[Link]
    applied: Applied | None

    def choose(self) -> Steps[tuple[set[int], int]]:
        """Links and parts of links left unchecked first; where even that does not fit, parts nested in the chosen
        links, kept where the budget then fits or the floor drops by :data:`~.budget.NEAR`. Returns the chosen
        indices and their measured peak, the model left as they say."""
        n, budget = len(self.links), self.budget
        predicted, _, _ = choose_blocks(self.profiles, self.start, budget, self.joinable, self.meter.cuda, self.parts)
        # a link a checkpoint may not recompute (it changes its input in place) is never applied, not even to measure
        every = [*self.profiles, *(part.profile for part in self.parts)]
        among = {i for i, p in enumerate(every) if p.recomputable}
        chosen, peak = yield from self._search(self._alone(predicted), among, nested=False)
        chosen = self._alone(chosen)
        inside = {n + k for k, part in enumerate(self.parts) if part.link in chosen}
        if peak <= budget or not inside:
            return chosen, peak
        flat = (chosen, peak)
        # every part nested at once first: where even that is not 1 % lower, no nesting is worth a search
        yield from self._apply(chosen | inside)
        if self.meter.peak() > flat[1] * (1 - NEAR):
            yield from self._apply(chosen)
            return flat
        chosen, peak = yield from self._search(chosen | (predicted & inside), inside, nested=True)
        if peak > budget and peak > flat[1] * (1 - NEAR):  # a hair lower is not worth a third forward
            chosen, peak = flat
            yield from self._apply(chosen)
        return chosen, peak

    def _alone(self, indices: set[int]) -> set[int]:
        """Links, and parts of links left unchecked (a part inside a chosen link is its link's)."""
        n = len(self.links)
        return {i for i in indices if i < n or self.parts[i - n].link not in indices}

    def _search(self, chosen: set[int], among: set[int], nested: bool) -> Steps[tuple[set[int], int]]:
        """Apply each of a :class:`~.budget.BudgetSearch`'s proposals (nested parts only where ``nested``) and tell
        it the peak measured; its result, applied (the last proposal is the result's own set)."""
        every = [*self.profiles, *(part.profile for part in self.parts)]
        # a set that does not fit gets as many links as the gap needs at once: a model with a hundred parts would
        # otherwise measure a step for each where no set fits
        search = BudgetSearch(
            chosen, [value(p) for p in every], self.budget, among=among, savings=[p.saving for p in every]
        )  # the pure core decides, this measures
        seen: dict[frozenset[int], int] = {}  # a proposal that applies what was measured already is not measured
        while (indices := search.propose()) is not None:
            applied = frozenset(indices if nested else self._alone(indices))
            yield from self._apply(set(applied))
            if applied not in seen:
                seen[applied] = self.meter.peak()
            search.observe(seen[applied])
        return search.result  # type: ignore[return-value]

    def cut(self, indices: set[int]) -> tuple[list[Part], list[list[int]]]:
        """The parts among ``indices``, and its links cut into runs."""
        n = len(self.links)
        finer = [self.parts[i - n] for i in sorted(indices) if i >= n]
        return finer, best_runs(
            {i for i in indices if i < n}, self.profiles, self.start, self.joinable, self.meter.cuda, finer
        )

    def _apply(self, indices: set[int]) -> Steps[None]:
        """Ask for the links and parts ``indices`` names (cut into runs) to be checkpointed, in place of what was
        applied before."""
        n = len(self.links)
        runs = [[self.links[i] for i in run] for run in self.cut(indices)[1]]
        runs += [[self.part_links[i - n]] for i in sorted(indices) if i >= n]
        self.applied = yield Change(runs, self.rebuilt)


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
