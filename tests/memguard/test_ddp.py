"""Under DDP a spill on any rank stops every rank at the same step, without a hang (CPU, gloo)."""

from __future__ import annotations

import pytest
from conftest import ddp_scenario_results

# the scenarios run in one launch with test_ddp_guard.py's and test_checkpointing_strategies.py's
# (conftest.DDP_SCENARIOS, the ddp_launch fixture)


def _run(ddp_launch, spill_rank: int, on_spill: str) -> dict[int, dict]:
    return ddp_scenario_results(ddp_launch, f"ddp_spill_run:{on_spill}-{spill_rank}", "rank{rank}.json")


@pytest.mark.parametrize("spill_rank", [0, 1])
def test_spill_on_one_rank_raises_on_both(ddp_launch, spill_rank):
    results = _run(ddp_launch, spill_rank, "raise")
    other = 1 - spill_rank
    assert results[spill_rank]["error"] == "SysmemSpillError"
    assert results[spill_rank]["own_report"] is True
    assert "spilling into system RAM" in results[spill_rank]["message"]
    assert results[other]["error"] == "SysmemSpillError"
    assert "Another rank's GPU memory spilled" in results[other]["message"]
    # same step on both ranks, within 3 steps of the end of warm-up
    assert results[0]["global_step"] == results[1]["global_step"] <= 2 + 3


def test_stop_mode_stops_both_ranks(ddp_launch):
    results = _run(ddp_launch, 1, "stop")
    assert results[0]["error"] is None and results[1]["error"] is None
    assert results[0]["should_stop"] and results[1]["should_stop"]
    assert results[0]["global_step"] == results[1]["global_step"] <= 2 + 4


def _run_tuner(ddp_launch, mode: str) -> dict[int, dict]:
    # a rank left waiting in a collective would hang until gloo's 30-minute timeout: the launch fails fast instead
    return ddp_scenario_results(ddp_launch, f"ddp_tuner_run:{mode}", mode + "{rank}.json")


def test_accumulation_tuner_ranks_agree_on_one_choice_that_fits_everywhere(ddp_launch):
    results = _run_tuner(ddp_launch, "accumulation")
    assert results[0] == results[1]
    r = results[0]
    # 32 samples per device: micro 4 x 8, 8 x 4; then 16 x 2 is predicted above rank 1's card (1.6 GB on 1.2 GB),
    # the smallest, so no rank runs it (rank 0's card alone would have let it run: the ranks would have parted)
    assert r["results"] == [[4, 8, "ok"], [8, 4, "ok"], [16, 2, "predicted_over"]]
    assert r["batch_size"] == 8 and r["accumulate"] == 4  # the injected clock: 8 x 4 is the faster
    assert r["model_batch_size"] == r["batch_size"] and r["trainer_accumulate"] == r["accumulate"]


@pytest.mark.parametrize("mode", ["oom", "oom_backward", "oom_compiled"])
def test_an_out_of_memory_error_on_one_rank_is_every_ranks_and_nobody_waits(ddp_launch, mode):
    """In the training step, or at the end of backward, when DDP would already have sent the gradients off; and
    with the model compiled (each trial size its own graph on both ranks)."""
    results = _run_tuner(ddp_launch, mode)
    assert results[0] == results[1]
    r = results[0]
    assert r["compiled"] == [mode == "oom_compiled"] * 3
    # rank 1 alone raises above 8 samples: 16 is out of memory for both ranks, in the same step
    assert r["results"] == [[4, 1, "ok"], [8, 1, "ok"], [16, 1, "oom"]]
    assert r["batch_size"] == r["model_batch_size"] == 8
    assert r["schedules"] == [[2, 2]] and r["steps"] == 2  # no trial stepped the OneCycle: the run's 2 steps did
