"""`memguard sweep --compile` on the CPU with ``--compile-backend aot_eager``: one static graph per batch size, compile
time kept out of the timed steps and reported apart, rows that say they were compiled."""

from __future__ import annotations

import csv
import types

import pytest
import torch

from lightning_memguard.cli import main
from lightning_memguard.core.throughput import settled_from, warmup_excess
from lightning_memguard.sweep import MAX_EXTRA_WARMUP, SweepConfig, _WarmUpUntilSettled, run_one

TINY = ["--model", "resnet18", "--image-size", "32", "--device", "cpu"]
COMPILE = ["--compile", "--compile-backend", "aot_eager"]


# ---------------------------------------------------------------- warm-up until step times settle (exact numbers)


@pytest.mark.parametrize(
    ("times", "minimum", "expected"),
    [
        ([9000, 41, 40, 40.5], 2, 3),  # compiled in step 0, steady from step 1: timed from step 3
        ([9000, 41, 40, 40.5], 3, 3),
        ([9000, 41, 40, 40.5, 40], 4, 4),  # at least `minimum`
        ([9000, 3000, 41, 40], 2, 4),  # a recompile in step 1
        ([9000, 3000, 41], 2, None),  # not settled yet
        ([40, 40, 40], 1, 2),  # one step alone never says it is steady
        ([100, 130, 125], 2, 3),  # 30 % apart, then 4 %
    ],
)
def test_settled_from(times, minimum, expected):
    assert settled_from(times, minimum) == expected


def test_warmup_excess_is_the_compile_time():
    assert warmup_excess([9000, 3000, 41, 40, 40, 42, 39], end=4) == 9000 + 3000 + 41 + 40 - 4 * 40
    assert warmup_excess([30, 50, 40], end=1) == 0.0  # a warm-up faster than the steady steps: no compile time
    assert warmup_excess([9000, 40], end=2) == 0.0  # nothing timed


class FakeTimer:
    """The StepTimer interface the warm-up reads: batch starts marked, optimizer-step times in ms."""

    def __init__(self, times: list[float]) -> None:
        self.times, self.marks = times, []

    def step_ms(self, accumulate: int = 1) -> list[float]:
        done = (len(self.marks) - 1) // accumulate
        return self.times[:done]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_warm_up_until_settled_then_time_the_steps_and_stop(accumulate):
    timer = FakeTimer([9000, 3000, 41, 40, 40, 42, 39, 40, 40])
    warmup = _WarmUpUntilSettled(timer, minimum=3, steps=3, accumulate=accumulate)  # type: ignore[arg-type]
    trainer = types.SimpleNamespace(should_stop=False)
    batches = 0
    while not trainer.should_stop:
        timer.marks.append(batches)  # the timer marks each batch's start before the warm-up looks
        warmup.on_train_batch_start(trainer, None, None, batches)  # type: ignore[arg-type]
        warmup.on_train_batch_end(trainer, None, None, None, batches)  # type: ignore[arg-type]
        batches += 1
    assert warmup.first_timed == 4  # 9000 and 3000 compile, 41 and 40 agree: steps 4, 5 and 6 are timed
    assert batches == (4 + 3) * accumulate


def test_warm_up_that_never_settles_is_cut_short():
    timer = FakeTimer([100.0 * 2**i for i in range(40)])  # every step twice the last
    warmup = _WarmUpUntilSettled(timer, minimum=3, steps=2, accumulate=1)  # type: ignore[arg-type]
    trainer = types.SimpleNamespace(should_stop=False)
    while not trainer.should_stop:
        timer.marks.append(0)
        warmup.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
        warmup.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
    assert warmup.first_timed == 3 + MAX_EXTRA_WARMUP and len(timer.marks) == 3 + MAX_EXTRA_WARMUP + 2


# ---------------------------------------------------------------- the sweep


def test_each_batch_size_gets_its_own_static_graph(tmp_path, monkeypatch):
    calls = []
    real = torch.compile

    def spy(model, **kwargs):
        calls.append((model.batch_size, kwargs))
        return real(model, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    cfg = SweepConfig("resnet18", (4, 8), 32, "32-true", steps=2, warmup=2, device="cpu", compile="aot_eager")
    rows = [run_one(cfg, batch, str(tmp_path))[0] for batch in cfg.batch_sizes]
    assert calls == [(4, {"backend": "aot_eager", "dynamic": False}), (8, {"backend": "aot_eager", "dynamic": False})]
    for row in rows:
        assert row.status == "ok" and row.compiled == "aot_eager"
        assert row.step_ms is not None and row.compile_s is not None and row.samples_per_sec is not None
        # the compile (seconds) is reported apart; a timed step is a step (tens of milliseconds here)
        assert row.step_ms < row.compile_s * 1e3 / 5


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
