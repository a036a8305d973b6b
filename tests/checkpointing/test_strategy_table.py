"""The README's strategy table, for ``ddp`` and ``ddp_spawn``: every callback in two fits on two gloo processes
(tests/strategy_cells_run.py: ``ddp`` in the suite's one two-rank launch, ``ddp_spawn`` its own). The sharded
strategies' cells are tests/tuning/test_sharded.py's and tests/gpu/test_gpu_sharded.py's; the single device's are the
rest of
the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ddp_scenario_results

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the scripts stand beside conftest.py
SCRIPT = os.path.join(TESTS, "strategy_cells_run.py")


@pytest.fixture(scope="module", params=["ddp", "ddp_spawn"])
def cells(request, tmp_path_factory, ddp_launch):
    if request.param == "ddp":  # in the suite's one two-rank launch (conftest.DDP_SCENARIOS)
        fits = ("batch_size", "accumulation")
        return "ddp", {
            f"{fit}-rank{rank}": result
            for fit in fits
            for rank, result in ddp_scenario_results(
                ddp_launch, "strategy_cells_run:ddp", fit + "-rank{rank}.json"
            ).items()
        }
    out = tmp_path_factory.mktemp(request.param)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    try:
        proc = subprocess.run(
            [sys.executable, SCRIPT, str(out), request.param], capture_output=True, text=True, timeout=300, env=env,
            cwd=out,
        )  # fmt: skip
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the {request.param} run did not end within {err.timeout} s: a rank was left waiting")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return request.param, {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in out.glob("*.json")}


@pytest.mark.parametrize("fit", ["batch_size", "accumulation"])
def test_every_callback_under_ddp_and_ddp_spawn_agrees_on_every_rank(cells, fit):
    strategy, results = cells
    r0, r1 = results[f"{fit}-rank0"], results[f"{fit}-rank1"]
    for key in ("results", "batch_size", "accumulate", "runs", "checkpointed", "table_samples_per_sec"):
        assert r0[key] == r1[key], key  # one choice, one plan, one merged record
    # rank 1's card: 16 samples per device would not fit there, so neither rank runs them
    assert [r[2] for r in r0["results"]] == ["ok", "ok", "predicted_over"]
    assert r0["batch_size"] == r0["samples_at_first_batch"] == 8
    assert r0["accumulate"] == (2 if fit == "accumulation" else 1)
    # ActivationCheckpointing: every block, or rank zero's budgeted plan, applied on both ranks (which links a budget
    # takes depends on the forward times rank zero measures on this machine: only that it took some is fixed)
    assert r0["runs"]
    if fit == "batch_size":
        assert len(r0["runs"]) == 9 and set(r0["checkpointed"]) >= {"net.conv1"}  # the stem and the eight BasicBlocks
    assert r0["epochs"] == 1 and r0["table_samples_per_sec"] == pytest.approx(r0["logged_samples_per_sec"])
    if strategy == "ddp_spawn":
        # Lightning brings back the weights and the metrics only: the launching process's objects are as they were
        launcher = results[f"{fit}-launcher"]
        assert launcher == {"tuner_batch_size": None, "model_batch_size": 4}
