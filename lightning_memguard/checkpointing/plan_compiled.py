"""Planning a budget for a compiled model: :class:`~.budget.CompileBudgetSearch` chooses compile's
``activation_memory_budget`` and the links together, each choice applied (a :class:`~.result.Change` the entrance
hands to :func:`.surgery.apply`) and measured compiled afresh, a graph per container of blocks (see
:func:`.entrances.checkpoint_blocks`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memguard import _compiler
from lightning_memguard.checkpointing.budget import CompileBudgetSearch, best_runs, budget_bytes, choose_blocks, value
from lightning_memguard.checkpointing.measure import StepMeter, default_loss, tensors
from lightning_memguard.checkpointing.model_map import ModelMap
from lightning_memguard.checkpointing.result import Change, CheckpointPlan, Planner, Steps, finished, warnings_once
from lightning_memguard.checkpointing.wrap import Link

ONE_GRAPH_MARGIN = 0.02
"""How much faster (a fraction of the step time) the compiled plan's pick must be as one graph than with a graph per
container to be kept so: one measurement's timing differs by about that much from the next."""


def plan_compiled(
    measured: nn.Module,
    model_map: ModelMap,
    memory_budget: float | int,
    example_input: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    options: dict[str, Any] | None,
    settings: tuple[float, ...],
) -> Planner:
    """The budget under compile: each of compile's settings alone, then with the fewest most valuable blocks that
    fit where it may still be the fastest (:class:`~lightning_memguard.checkpointing.budget.CompileBudgetSearch`),
    measured compiled, the blocks' containers each a graph of its own; the fastest that fits is applied, in one
    graph where that fits and is faster (see :func:`.entrances.checkpoint_blocks`). ``measured`` is the model as it
    is called (compiled, or not yet), ``model_map`` the map of its modules. A :data:`~.result.Planner`: each choice is
    a change asked of the entrance, measured once made."""
    loss_fn = loss_fn or default_loss
    links, joinable = list(model_map.links), list(model_map.joinable)
    with _compiler.eager():  # each link's own bytes and time, to rank them: in eager mode, hooks and all
        profiles = StepMeter(model_map.model, example_input, loss_fn).profile(links)
    gradients = any(t.is_cuda for t in tensors(example_input))
    now = _compiler.activation_memory_budget_now()
    levels = (None, *(s for s in dict.fromkeys(settings) if s != now))  # the default in force is measured once
    search = CompileBudgetSearch(
        [now if s is None else s for s in levels],
        lambda peak, budget: choose_blocks(profiles, peak, budget, joinable, gradients)[0],
        [value(p) for p in profiles],
        [p.saving for p in profiles],
        lambda baseline: budget_bytes(baseline, memory_budget),  # of compile's default peak alone
    )
    candidates: list[dict[str, Any]] = []

    def measure(setting: float | None, runs: list[list[Link]], split_graphs: bool) -> Steps[dict[str, Any]]:
        applied = yield Change(runs, split_graphs=split_graphs)
        with _compiler.activation_memory_budget(setting):  # each measurement compiles anew, under its setting
            meter = StepMeter(measured, example_input, loss_fn, _compiler.fresh_compiled(measured, options))
            candidate = {
                "activation_memory_budget": setting,
                "runs": applied.runs,
                "graph_splits": applied.splits,
                "peak_bytes": meter.peak(),  # measured first, then timed
                "step_ms": round(meter.seconds() * 1e3, 3),
            }
        candidates.append(candidate)
        return candidate

    with warnings_once():
        while (step := search.propose()) is not None:
            index, chosen = step
            start = search.alone(index)  # the peak the links are cut into runs against (None: measuring it now)
            cut = best_runs(chosen, profiles, start.peak if start else 0, joinable, gradients)
            runs = [[links[i] for i in run] for run in cut]
            tried = yield from measure(levels[index], runs, split_graphs=True)
            search.observe(tried["peak_bytes"], tried["step_ms"] / 1e3)
        budget = search.budget
        assert budget is not None and search.result is not None
        pick = candidates[search.result]
        runs = model_map.runs_named(pick["runs"])  # the twin below has the same runs
        if pick["graph_splits"]:  # the same blocks in one graph: chosen instead where it fits and is faster
            twin = yield from measure(pick["activation_memory_budget"], runs, split_graphs=False)
            # one graph peaks higher at about the same speed (ResNet50: 0.3 %): it must be faster beyond the noise
            if twin["peak_bytes"] <= budget and twin["step_ms"] < pick["step_ms"] * (1 - ONE_GRAPH_MARGIN):
                pick = twin
    applied = yield Change(runs, split_graphs=bool(pick["graph_splits"]))
    _compiler.forget_graphs_apart()  # training compiles its graphs apart anew, under its own settings
    return finished(
        CheckpointPlan(
            blocks=applied.checkpointed,  # in model order, as best_runs cut them
            candidates=len(links),
            runs=applied.runs,
            baseline_bytes=search.tried[0].peak,
            budget_bytes=budget,
            measured_bytes=pick["peak_bytes"],
            profiles=profiles,
            graph_splits=applied.splits,
            compiled=True,
            activation_memory_budget=pick["activation_memory_budget"],
            compile_candidates=candidates,
            lower=_lower_compiled(settings),
        )
    )


def _lower_compiled(settings: tuple[float, ...]) -> list[str]:
    """What would lower a compiled plan's floor: a smaller batch, compile's lower settings."""
    lowest = min(settings, default=None)
    below = f"below {lowest}" if lowest is not None else "such as 0.5"
    return ["a smaller batch", f"compile's activation_memory_budget {below} (`compile_settings`)"]
