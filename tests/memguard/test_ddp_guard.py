"""MemGuard under DDP (two CPU processes, gloo) with injected clocks and memory: the numbers every rank shows, and
a spill in the very last step. Rank 0 steps every 0.1 s, rank 1 every 0.2 s, 4 samples a step each."""

from __future__ import annotations

import pytest
from conftest import ddp_scenario_results

# the scenarios run in one launch with test_ddp.py's and test_checkpointing_strategies.py's
# (conftest.DDP_SCENARIOS, the ddp_launch fixture)


def _run(ddp_launch, scenario: str) -> dict[int, dict]:
    return ddp_scenario_results(ddp_launch, f"ddp_guard_run:{scenario}", scenario + "-rank{rank}.json")


def test_stop_shows_the_spilling_ranks_numbers_and_the_table_sums_the_ranks(ddp_launch):
    results = _run(ddp_launch, "mid-stop")
    assert results[0]["should_stop"] and results[1]["should_stop"]
    assert results[0]["global_step"] == results[1]["global_step"]
    # rank 0 did not spill; its warning (the one the user sees) carries rank 1's numbers
    (warning,) = results[0]["warnings"]
    assert "Another rank's GPU memory spilled into system RAM (rank 1)" in warning
    assert "peak 17.00 GB against 16.00 GB" in warning and "MemGuard stopped the Trainer" in warning
    for rank in (0, 1):
        (epoch,) = results[rank]["epochs"]
        # 40 + 20 samples/s: the table's figure is the logged key's, on every rank
        assert epoch["samples_per_sec"] == pytest.approx(60.0) == results[rank]["logged_samples_per_sec"]
        assert epoch["step_ms"] == pytest.approx(200.0) and epoch["peak_allocated_gb"] == pytest.approx(17.0)
        # each rank measured its own step, written with its rank in the name
        (report,) = results[rank]["reports"]
        assert report.startswith("memguard-report-step=") and report.endswith(f"-spill-rank={rank}.json")


def test_a_spill_in_the_last_step_of_the_last_epoch_raises_on_every_rank(ddp_launch):
    results = _run(ddp_launch, "last-raise")
    assert results[0]["error"] == results[1]["error"] == "SysmemSpillError"
    assert results[0]["global_step"] == results[1]["global_step"] == 16
    assert results[1]["message"].startswith("GPU memory is spilling into system RAM at training step 16")
    assert "(rank 1)" in results[0]["message"] and "peak 17.00 GB against 16.00 GB" in results[0]["message"]
    assert [e["samples_per_sec"] for e in results[0]["epochs"]] == [pytest.approx(60.0)] * 2
    # the spill settled at the last epoch's end: each rank redid its last batch, its report named in its error
    assert [results[r]["reports"] for r in (0, 1)] == [["memguard-report-step=16-spill-rank=0.json"],
                                                      ["memguard-report-step=16-spill-rank=1.json"]]  # fmt: skip
    assert "Memory report: " in results[0]["message"] and "Memory report: " in results[1]["message"]
