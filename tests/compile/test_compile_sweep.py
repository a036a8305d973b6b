"""`memguard sweep --compile` on the CPU with ``--compile-backend aot_eager``: one static graph per batch size, compile
time kept out of the timed steps and reported apart, rows that say they were compiled."""

from __future__ import annotations

import csv
import statistics
import types

import pytest
import torch

from lightning_memguard import _compiler
from lightning_memguard.commands.cli import main
from lightning_memguard.commands.sweep import MAX_COMPILE_STEPS, SweepConfig, _TimeStepsThatRan, run_one

TINY = ["--model", "resnet18", "--image-size", "32", "--device", "cpu"]
COMPILE = ["--compile", "--compile-backend", "aot_eager"]


# ---------------------------------------------------------------- steps that compiled are not timed (a fake counter)


def _drive(monkeypatch, graphs_after_batch: list[int], minimum: int, steps: int, accumulate: int) -> _TimeStepsThatRan:
    """Run the callback's hooks as a Trainer would, Dynamo's graph count after each batch given; until it stops."""
    count = [0]
    monkeypatch.setattr(_compiler.dynamo_state, "compiles", lambda: count[0])  # what CompileWatch reads
    timer = _TimeStepsThatRan(minimum=minimum, steps=steps, accumulate=accumulate)
    trainer = types.SimpleNamespace(should_stop=False)
    timer.on_train_start(trainer, None)  # type: ignore[arg-type]
    for batch, graphs in enumerate(graphs_after_batch):
        count[0] = graphs
        timer.on_train_batch_end(trainer, None, None, None, batch)  # type: ignore[arg-type]
        if trainer.should_stop:
            break
    return timer


def test_steps_that_compiled_are_left_out_and_replaced(monkeypatch):
    # step 0 compiles (graph 1), step 4 recompiles (graph 2, say the last short batch), nothing else
    timer = _drive(monkeypatch, [1, 1, 1, 1, 2, 2, 2, 2, 2, 2], minimum=2, steps=3, accumulate=1)
    assert timer.compiled == [True, False, False, False, True, False]
    assert timer.timed() == [2, 3, 5]  # past the 2 warm-up steps; step 4 compiled, so step 5 is timed in its place


def test_a_compile_in_any_micro_batch_marks_its_optimizer_step(monkeypatch):
    # accumulate 2: batches 0-1 are step 0 (compiles in batch 1, say the backward's first run), 2-3 step 1, ...
    timer = _drive(monkeypatch, [0, 1, 1, 1, 1, 2, 2, 2, 2, 2], minimum=1, steps=2, accumulate=2)
    assert timer.compiled == [True, False, True, False]
    assert timer.timed() == [1, 3]


def test_a_compile_between_two_batches_marks_the_next_step(monkeypatch):
    """The graph count is compared with the last batch's end, so a compile outside any batch (a hook, validation)
    marks the step whose time holds it."""
    count = [0]
    monkeypatch.setattr(_compiler.dynamo_state, "compiles", lambda: count[0])  # what CompileWatch reads
    timer = _TimeStepsThatRan(minimum=0, steps=5, accumulate=1)
    trainer = types.SimpleNamespace(should_stop=False)
    timer.on_train_start(trainer, None)  # type: ignore[arg-type]
    for batch in range(3):
        if batch == 1:
            count[0] = 1  # compiled between batch 0's end and batch 1's start
        timer.on_train_batch_start(trainer, None, None, batch)  # type: ignore[arg-type]
        timer.on_train_batch_end(trainer, None, None, None, batch)  # type: ignore[arg-type]
    assert timer.compiled == [False, True, False]


def test_a_run_that_keeps_compiling_is_cut_short(monkeypatch):
    timer = _drive(monkeypatch, list(range(1, 100)), minimum=3, steps=2, accumulate=1)  # a new graph every step
    assert len(timer.compiled) == 3 + 2 + MAX_COMPILE_STEPS and timer.timed() == []


def test_compile_time_is_the_steps_that_compiled_and_the_rest_are_timed(monkeypatch):
    timer = _drive(monkeypatch, [1, 1, 1, 2, 2, 2, 2], minimum=1, steps=3, accumulate=1)  # steps 0 and 3 compile
    assert len(timer.compiled) == 5  # stopped once 3 steps were timed
    timed, compiling = timer.split([9000.0, 40.0, 41.0, 3000.0, 40.0])
    assert timed == [40.0, 41.0, 40.0] and compiling == 9000.0 + 3000.0


# ---------------------------------------------------------------- the sweep


def test_each_batch_size_gets_its_own_static_graph(tmp_path, monkeypatch):
    calls = []
    real = torch.compile

    def spy(model, **kwargs):
        calls.append((model.batch_size, kwargs))
        return real(model, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    splits = []
    real_split = _TimeStepsThatRan.split

    def recorded(self, times):
        splits.append((list(self.compiled), list(times)))
        return real_split(self, times)

    monkeypatch.setattr(_TimeStepsThatRan, "split", recorded)
    cfg = SweepConfig("resnet18", (4, 8), 32, "32-true", steps=2, warmup=2, device="cpu", compile="aot_eager")
    rows = [run_one(cfg, batch, str(tmp_path))[0] for batch in cfg.batch_sizes]
    assert calls == [(4, {"backend": "aot_eager", "dynamic": False}), (8, {"backend": "aot_eager", "dynamic": False})]
    for row, (compiled, times) in zip(rows, splits, strict=True):
        assert row.status == "ok" and row.compiled == "aot_eager"
        assert row.step_ms is not None and row.compile_s is not None and row.samples_per_sec is not None
        # the first step compiled: its time is the compile time, reported apart; the timed steps are the two after
        # the warm-up that compiled nothing
        assert compiled[0] and not any(compiled[cfg.warmup :])
        assert row.compile_s == round(sum(t for t, c in zip(times, compiled, strict=False) if c) / 1e3, 3)
        assert row.step_ms == statistics.median(times[cfg.warmup : cfg.warmup + cfg.steps])


def test_sweep_compile_writes_compiled_rows_and_compile_time(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = main(["sweep", *TINY, *COMPILE, "--batch-sizes", "8,4", "--steps", "2", "--emulate-capacity", "1GB",
                 "--out", str(out)])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "batch    step ms    peak GB    samples/s  compile s  compiled   status" in text
    assert text.count("aot_eager  ok") == 2
    with open(out / "sweep.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["batch"]) for r in rows] == [4, 8]
    assert all(r["compiled"] == "aot_eager" and float(r["compile_s"]) > 0 for r in rows)
    assert all(r["status"] == "ok" and float(r["samples_per_sec"]) > 0 for r in rows)


def test_eager_sweep_rows_say_eager(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", *TINY, "--batch-sizes", "4", "--steps", "1", "--out", str(out)]) == 0
    assert "compile s" not in capsys.readouterr().out
    with open(out / "sweep.csv", encoding="utf-8") as f:
        (row,) = list(csv.DictReader(f))
    assert row["compiled"] == "" and row["compile_s"] == ""


# ---------------------------------------------------------------- bad input, before any training


@pytest.fixture
def no_training(monkeypatch):
    from lightning.pytorch import Trainer

    def fit(*args, **kwargs):
        raise AssertionError("training started before the input was checked")

    monkeypatch.setattr(Trainer, "fit", fit)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compile", "--compile-backend", "nope"], "unknown --compile-backend 'nope': use one of aot_eager, "),
        (["--compile-backend", "aot_eager"], "--compile-backend needs --compile"),
    ],
)
def test_bad_compile_options_are_one_line(tmp_path, no_training, capsys, argv, message):
    code = main(["sweep", *TINY, *argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_inductor_on_the_cpu_without_a_compiler_names_the_way_out(tmp_path, no_training, monkeypatch, capsys):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    code = main(["sweep", *TINY, "--compile", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "inductor on the CPU needs a C++ compiler" in err and "--compile-backend aot_eager" in err
