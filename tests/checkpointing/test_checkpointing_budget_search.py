"""The budget search (``checkpointing/budget.py``): which links to checkpoint, cut into which runs, and the step
objects that check a choice against measured peaks; exact numbers in, exact decisions out, with neither torch nor
Lightning loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_memguard.checkpointing.budget import BlockProfile, BudgetSearch, choose_blocks, predict_peak


def test_the_budget_search_is_pure_it_loads_neither_torch_nor_lightning():
    """The module read on its own, without its package (whose entry points need torch): numbers in, decisions out."""
    path = Path(__file__).parents[2] / "lightning_memguard" / "checkpointing" / "budget.py"
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('budget', sys.argv[1]);"
        " module = importlib.util.module_from_spec(spec); sys.modules['budget'] = module;"
        " spec.loader.exec_module(module);"
        " print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning'}))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_planner_cuts_runs_so_that_recomputation_does_not_bring_the_peak_back():
    """Joining every chosen block into one run frees the most in forward, but recomputing it brings everything back:
    a one-run plan of a whole chain has the baseline's peak (seen on the GPU before runs were cut)."""
    chain = [BlockProfile(f"b{i}", saved_bytes=100, input_bytes=0, output_bytes=20, forward_ms=1.0) for i in range(8)]
    joinable = [True] * 7
    baseline = 1000  # 800 of activations, 200 of weights and the rest
    assert predict_peak(baseline, chain, [list(range(8))]) == baseline
    chosen, runs, predicted = choose_blocks(chain, baseline, budget=500, joinable=joinable)
    assert predicted <= 500 and len(runs) > 1
    assert sorted(i for run in runs for i in run) == sorted(chosen)


def test_a_recomputed_run_holds_the_gradient_of_its_output_on_cuda():
    """Seen on the H200: recomputing ResNet50's first stage peaked about twice its output above the activations."""
    first = BlockProfile("first", saved_bytes=500, input_bytes=0, output_bytes=100, forward_ms=1.0)
    rest = BlockProfile("rest", saved_bytes=100, input_bytes=0, output_bytes=0, forward_ms=1.0)
    baseline = 700  # 600 of activations
    assert predict_peak(baseline, [first, rest], [[0]], gradients=False) == 100 + 500 + 0  # recomputed: all back
    assert predict_peak(baseline, [first, rest], [[0]]) == 100 + 500 + 2 * 100
    assert predict_peak(baseline, [first, rest], [[1]]) == baseline  # at the end: in the baseline's peak already


def _run_budget_search(chosen, values, budget, peaks):
    search = BudgetSearch(chosen, values, budget)
    while (links := search.propose()) is not None:
        search.observe(peaks[tuple(sorted(links))])
    return search


def test_budget_search_adds_until_it_fits_then_gives_back_the_least_valuable():
    peaks = {(0,): 90, (0, 1): 75, (0, 1, 2): 55, (0, 2): 65, (1, 2): 70, (2,): 85}
    search = _run_budget_search({0}, [3.0, 2.0, 1.0], 70, peaks)
    # over: add 1, still over: add 2, fits; give back 2 (75: no), 1 (65: yes), 0 ({2}: 85, no); measure the result
    assert search.tried == [((0,), 90), ((0, 1), 75), ((0, 1, 2), 55), ((0, 1), 75), ((0, 2), 65), ((2,), 85),
                            ((0, 2), 65)]  # fmt: skip
    assert search.result == ({0, 2}, 65)


def test_budget_search_keeps_the_lowest_peak_when_nothing_fits():
    peaks = {(0,): 90, (0, 1): 95}  # adding link 1 made it worse
    search = _run_budget_search({0}, [3.0, 2.0], 50, peaks)
    assert search.tried == [((0,), 90), ((0, 1), 95), ((0,), 90)]
    assert search.result == ({0}, 90)


def test_budget_search_never_returns_a_set_it_did_not_measure_last():
    peaks = {(): 40, (0,): 30}
    search = _run_budget_search({0}, [1.0], 50, peaks)  # the prediction was cautious: nothing is needed
    assert search.tried[-1] == ((), 40) and search.result == (set(), 40)
    with pytest.raises(RuntimeError, match="observe\\(\\) called after the search ended"):
        search.observe(1)
