"""The examples run (on the CPU here) and say what they promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def _run(name: str, *args: str, cwd: str) -> str:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_spill_example_stops_the_run(tmp_path):
    out = _run("spill_stopped.py", cwd=tmp_path)
    assert "stopped at step" in out and "spilling into system RAM" in out
    # on the CPU the 100 MB card is smaller than the weights, gradients and momentum alone: the advice says so, and
    # what can help (before: "activation checkpointing ... is needed", which cannot)
    (advice,) = [line for line in out.splitlines() if line.startswith("From this run's readings")]
    assert "alone exceeds the card's 100.0 MB" in advice and "a lighter optimizer state" in advice
    assert (
        "ActivationCheckpointing" not in advice
        and "ActivationCheckpointing" not in out.split("Fixes")[1].split(advice)[0]
    )
    # its checkpoint went to a temporary folder, removed, and the output says so: nothing is left where it ran
    (checkpoint,) = re.findall(r"a checkpoint was saved to (\S+\.ckpt)", out)
    assert not os.path.exists(checkpoint) and not any(tmp_path.iterdir())
    assert "was a temporary one: removed now, checkpoint and all; --out DIR keeps it" in out


def test_spill_example_keeps_its_checkpoint_in_the_folder_given(tmp_path):
    out = _run("spill_stopped.py", "--out", "spill_run", cwd=tmp_path)
    (checkpoint,) = re.findall(r"a checkpoint was saved to (\S+\.ckpt)", out)
    checkpoint = os.path.relpath(os.path.join(tmp_path, checkpoint), tmp_path)  # as given: relative to where it ran
    assert checkpoint.startswith(f"spill_run{os.sep}") and os.path.isfile(tmp_path / checkpoint)


def test_spill_example_without_a_spill(tmp_path):
    assert "no spill: batch 16 fits in 10GB" in _run("spill_stopped.py", "--capacity", "10GB", cwd=tmp_path)


def test_tune_accumulation_example(tmp_path):
    out = _run("tune_accumulation.py", "--effective-batch", "16", cwd=tmp_path)
    assert "chose micro-batch" in out and "x accumulate_grad_batches" in out


@pytest.mark.parametrize("budget", ["0.7"])
def test_checkpoint_budget_example(budget, tmp_path):
    out = _run("checkpoint_budget.py", "--budget", budget, cwd=tmp_path)
    runs = out.split("runs, one checkpoint each: ")[1].splitlines()[0]
    assert "checkpointed" in out and "budget" in out and "measured" in out
    # which links are chosen depends on their measured forward times; each named one is the stem, a block or a part
    # of a block (its downsampling: a finer link)
    names = [name for run in runs.split("; ") for name in run.split(" + ")]
    assert names and all(re.fullmatch(r"stem|layer\d\.\d+(\.downsample)?", name) for name in names), runs


def test_checkpoint_budget_example_with_the_rebuild(tmp_path):
    out = _run("checkpoint_budget.py", "--budget", "0.85", "--rebuild", cwd=tmp_path)
    assert "checkpointed 0 of 17 blocks" in out and "runs, one checkpoint each: none" in out
    assert "BatchNorm + ReLU rebuilt in: stem, layer1.0, layer1.1" in out
