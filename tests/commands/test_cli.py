"""The `memguard` command on the CPU: output, files, exit codes, and one-line errors for bad input."""

from __future__ import annotations

import csv
import functools
import importlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

from lightning_memguard.commands.cli import main
from lightning_memguard.commands.doctor import verdict

TINY = ["--model", "resnet18", "--image-size", "32", "--device", "cpu"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_doctor_prints_one_screen(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for label in ("OS", "GPU", "driver model", "GPU memory", "PCIe", "torch / lightning / CUDA", "sysmem fallback"):
        assert label in out
    assert "cannot happen here" in out


def test_doctor_json(capsys):
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"os", "gpu", "driver_model", "memory_gb", "pcie", "torch", "lightning", "verdict"} <= info.keys()


def test_verdicts():
    assert verdict("Linux", "6.8.0-generic", None, True, None) == "cannot happen here"
    assert verdict("Linux", "5.15.1-microsoft-standard-WSL2", None, True, None).startswith("possible: turn it off")
    assert verdict("Windows", "11", "TCC", True, None) == "cannot happen here"
    assert verdict("Windows", "11", "WDDM", True, True).startswith(
        "ON: allocating more than the GPU's memory succeeded"
    )
    assert verdict("Windows", "11", "WDDM", True, False).startswith("off:")
    assert verdict("Linux", "6.8.0", None, False, None) == "cannot happen here (no CUDA GPU)"


@pytest.fixture
def temp(tmp_path, monkeypatch):
    """The folder ``tempfile`` hands out folders in, for this test."""
    folder = tmp_path / "temp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_sweep_prints_the_table_and_writes_csv_and_png(tmp_path, capsys, temp):
    out = tmp_path / "sweep"
    code = main(["sweep", *TINY, "--batch-sizes", "8,4,32", "--steps", "2", "--emulate-capacity", "1GB",
                 "--out", str(out)])  # fmt: skip
    assert code == 0
    assert not any(temp.iterdir())  # the Trainers' run folders are gone with the sweep
    text = capsys.readouterr().out
    assert "batch    step ms    peak GB    samples/s  status" in text
    with open(out / "sweep.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["batch"]) for r in rows] == [4, 8, 32]
    assert all(r["status"] == "ok" and float(r["samples_per_sec"]) > 0 for r in rows)
    assert (out / "sweep.png").stat().st_size > 10_000


def test_sweep_marks_spills_on_a_small_emulated_card(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", *TINY, "--batch-sizes", "4", "--steps", "1", "--emulate-capacity", "50MB",
                 "--out", str(out)]) == 0  # fmt: skip
    with open(out / "sweep.csv", encoding="utf-8") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["spill"]


def test_plan_prints_a_recommendation_and_lines_to_paste(capsys, temp):
    assert main(["plan", *TINY, "--effective-batch", "16", "--min-micro-batch", "4"]) == 0
    assert not any(temp.iterdir())  # the Trainer's run folder is gone with the plan
    out = capsys.readouterr().out
    assert "effective batch 16: micro-batch" in out
    assert "expected:" in out and "samples/s" in out
    assert "model.batch_size = " in out and "Trainer(accumulate_grad_batches=" in out


def test_plan_compile_measures_each_micro_batch_compiled(capsys):
    import torch

    torch._dynamo.reset()
    argv = ["plan", *TINY, "--effective-batch", "8", "--min-micro-batch", "4", "--compile", "--compile-backend"]
    assert main([*argv, "aot_eager"]) == 0
    out = capsys.readouterr().out
    assert "compiled (aot_eager): the search took" in out
    rows = [line for line in out.splitlines() if "samples/s" in line and " x " in line]
    assert rows and all("compiled," in line for line in rows)  # every trial ran its own compiled graph
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sweep", "--model", "resnet9000", "--device", "cpu"], "unknown model 'resnet9000'"),
        (["plan", *TINY, "--effective-batch", "8", "--compile-backend", "eager"], "--compile-backend needs --compile"),
        (["sweep", *TINY, "--batch-sizes", "0,32"], "--batch-sizes must be integers >= 1, got '0,32'"),
        (["sweep", *TINY, "--batch-sizes", "a,b"], "--batch-sizes must be integers separated by commas"),
        (["sweep", *TINY, "--emulate-capacity", "16XB"], "--emulate-capacity must be a number of bytes"),
        (["plan", *TINY, "--effective-batch", "0"], "--effective-batch must be >= 1, got 0"),
        (["demo", "--epochs", "0"], "--epochs must be >= 1, got 0"),
        (["sweep", *TINY, "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_unwritable_output_folder(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code = main(["sweep", *TINY, "--batch-sizes", "4", "--out", str(blocker / "sub")])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot write to '{blocker / 'sub'}'" in err and err.count("\n") == 1


# ---------------------------------------------------------------- bad input is found before any training


@pytest.fixture
def no_training(monkeypatch):
    """Any Trainer.fit fails the test: bad input must be reported before training starts."""
    from lightning.pytorch import Trainer

    def fit(*args, **kwargs):
        raise AssertionError("training started before the input was checked")

    monkeypatch.setattr(Trainer, "fit", fit)


def _one_line_error(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_demo_on_cuda_without_a_gpu(no_training, capsys):
    err = _one_line_error(["demo", "--device", "cuda"], capsys)
    assert "--device cuda, but no CUDA GPU is available" in err


def test_demo_into_an_unwritable_folder(tmp_path, no_training, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    err = _one_line_error(["demo", "--device", "cpu", "--out", str(blocker / "logs")], capsys)
    assert f"cannot write to '{blocker / 'logs'}'" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sweep", "--model", "vit_b_16", "--image-size", "32", "--device", "cpu"],
         "--model vit_b_16 cannot take --image-size 32: Wrong image height! Expected 224 but got 32!"),
        (["sweep", "--model", "inception_v3", "--image-size", "32", "--device", "cpu"],
         "--model inception_v3 cannot take --image-size 32: "),
        (["sweep", *TINY, "--batch-sizes", "1,4"],
         "--batch-sizes 1: resnet18 at 32 px cannot train on a batch of 1 sample (Expected more than 1 value per"
         " channel when training"),
        (["plan", *TINY, "--effective-batch", "4", "--min-micro-batch", "1"],
         "micro-batch 1 (--min-micro-batch): resnet18 at 32 px cannot train on a batch of 1 sample"),
    ],
    ids=["vit-at-32px", "inception-at-32px", "batchnorm-batch-1", "plan-batchnorm-micro-batch-1"],
)  # fmt: skip
def test_a_model_that_cannot_take_the_input_is_bad_input(tmp_path, no_training, capsys, argv, message):
    err = _one_line_error([*argv, *(["--out", str(tmp_path)] if argv[0] == "sweep" else [])], capsys)
    assert message in err


def test_batch_one_is_fine_where_batchnorm_sees_more_than_one_value(tmp_path, capsys):
    # at 64 px resnet18's last BatchNorm sees 2 x 2 values per channel: a batch of 1 trains
    code = main(["sweep", "--model", "resnet18", "--image-size", "64", "--device", "cpu", "--batch-sizes", "1",
                 "--steps", "1", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0 and "    1  " in capsys.readouterr().out


def test_plan_when_nothing_fits_does_not_advise_what_it_already_did(capsys):
    code = main(["plan", *TINY, "--effective-batch", "4", "--min-micro-batch", "2", "--emulate-capacity", "1MB"])
    *progress, err = capsys.readouterr().err.splitlines()  # the settings and a line per trial, then the error
    assert code == 1 and all(line.startswith("memguard plan") for line in progress) and err.startswith("memguard: ")
    assert "nothing fits: not even a micro-batch of 2" in err and "with activation checkpointing as well" in err
    assert "allow_checkpointing" not in err and "checkpoint" not in err.split("; try")[-1]
    assert "--min-micro-batch (now 2)" in err and "--image-size (now 32)" in err


# ---------------------------------------------------------------- sweep and plan are quiet unless asked


def _command(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """The command in a fresh process, as a user runs it (Lightning not yet imported), on this checkout's code."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "lightning_memguard.commands.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


LIGHTNING_CHATTER = ("GPU available:", "TPU available:", "`Trainer.fit` stopped", "MemGuard: peak memory")


def test_sweep_is_quiet_by_default(tmp_path):
    proc = _command(tmp_path, "sweep", *TINY, "--batch-sizes", "2,4", "--steps", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for chatter in LIGHTNING_CHATTER:
        assert chatter not in proc.stderr and chatter not in proc.stdout
    assert "batch    step ms" in proc.stdout and "memguard sweep" in proc.stderr  # the table, the progress bar


def test_sweep_verbose_shows_every_runs_messages(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        assert main(["sweep", *TINY, "--batch-sizes", "2,4", "--steps", "1", "--out", str(tmp_path), "--verbose"]) == 0
    assert caplog.text.count("`Trainer.fit` stopped") == 2
    assert caplog.text.count("MemGuard: peak memory against throughput") == 2


# ---------------------------------------------------------------- defaults by device, progress, --help


@pytest.fixture
def sweep_configs(monkeypatch):
    """The sweep's runs record their config and return a made-up row at once: no training."""
    from lightning_memguard.commands import sweep
    from lightning_memguard.core.epoch_record import SweepRow

    configs = []

    def run_one(cfg, batch, root):
        configs.append(cfg)
        return SweepRow(batch, 10.0, 0.1, batch * 100.0, "ok"), 1.0

    monkeypatch.setattr(sweep, "run_one", run_one)
    monkeypatch.setattr(sweep, "plot", lambda *args: False)
    return configs


@pytest.mark.parametrize(
    ("cuda", "expected", "line"),
    [
        (False, ("resnet18", 32, (8, 16, 32, 64), 6, 2, "32-true"),
         "memguard sweep on the CPU: resnet18 at 32 px, batch sizes 8,16,32,64, 2 warm-up + 6 timed steps each,"
         " 32-true (the CPU's defaults for --model, --image-size, --batch-sizes, --steps; pass them for others)"),
        (True, ("resnet50", 224, (32, 64, 128, 256), 16, 3, "bf16-mixed"),
         "memguard sweep on CUDA: resnet50 at 224 px, batch sizes 32,64,128,256, 3 warm-up + 16 timed steps each,"
         " bf16-mixed (CUDA's defaults for --model, --image-size, --batch-sizes, --steps; pass them for others)"),
    ],
    ids=["cpu", "cuda"],
)  # fmt: skip
def test_sweep_defaults_follow_the_device(monkeypatch, tmp_path, capsys, sweep_configs, cuda, expected, line):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Fake GPU")
    assert main(["sweep", "--out", str(tmp_path)]) == 0
    cfg = sweep_configs[0]
    assert (cfg.model, cfg.image_size, cfg.batch_sizes, cfg.steps, cfg.warmup, cfg.precision) == expected
    assert [c.batch_sizes for c in sweep_configs] == [expected[2]] * len(expected[2])  # one run per batch size
    err = capsys.readouterr().err
    assert err.splitlines()[0] == line  # the settings, in one line, before anything runs
    progress = err.replace("\r", "\n")
    assert f"{len(expected[2])}/{len(expected[2])}" in progress and f"batch {expected[2][-1]}" in progress


def test_given_values_win_over_the_device_defaults(monkeypatch, tmp_path, capsys, sweep_configs):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["sweep", "--out", str(tmp_path), "--model", "resnet34", "--image-size", "48", "--batch-sizes", "4,2"]
    assert main([*argv, "--steps", "3"]) == 0
    cfg = sweep_configs[0]
    assert (cfg.model, cfg.image_size, cfg.batch_sizes, cfg.steps) == ("resnet34", 48, (2, 4), 3)
    assert "defaults" not in capsys.readouterr().err.splitlines()[0]
    sweep_configs.clear()
    assert main(["sweep", "--out", str(tmp_path), "--model", "resnet34"]) == 0  # the rest from the CPU's defaults
    cfg = sweep_configs[0]
    assert (cfg.model, cfg.image_size, cfg.batch_sizes, cfg.steps) == ("resnet34", 32, (8, 16, 32, 64), 6)
    first = capsys.readouterr().err.splitlines()[0]
    assert first.endswith("(the CPU's defaults for --image-size, --batch-sizes, --steps; pass them for others)")


def test_plan_defaults_follow_the_device(monkeypatch, capsys):
    from lightning.pytorch import Trainer

    seen = {}

    def fit(trainer, model):  # what plan would measure, without measuring it
        (tuner,) = [c for c in trainer.callbacks if hasattr(c, "effective_batch_size")]
        seen.update(arch=model.hparams.arch, image_size=model.hparams.image_size, warmup=tuner.warmup_steps,
                    steps=tuner.timed_steps, precision=trainer.precision)  # fmt: skip
        raise RuntimeError("not measured in this test")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(Trainer, "fit", fit)
    assert main(["plan", "--effective-batch", "256"]) == 1
    assert seen == {"arch": "resnet18", "image_size": 32, "warmup": 1, "steps": 1, "precision": "32-true"}
    assert capsys.readouterr().err.splitlines()[0] == (
        "memguard plan on the CPU: resnet18 at 32 px, micro-batches from 8 up to 256, 1 warm-up + 1 timed optimizer"
        " step each, 32-true (the CPU's defaults for --model, --image-size, --steps; pass them for others)"
    )
    assert main(["plan", "--effective-batch", "64", "--model", "resnet34", "--image-size", "40", "--steps", "5"]) == 1
    assert seen == {"arch": "resnet34", "image_size": 40, "warmup": 1, "steps": 5, "precision": "32-true"}
    assert "defaults" not in capsys.readouterr().err.splitlines()[0]


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("sweep", ["default: resnet50 on CUDA, resnet18 on the CPU", "default: 224 px on CUDA, 32 px on the CPU",
                   "default: 32,64,128,256 on CUDA, 8,16,32,64 on the CPU", "default: 16 on CUDA, 6 on the CPU",
                   "(default: memguard-sweep)", "default: bf16-mixed on CUDA, else 32-true"]),
        ("plan", ["default: resnet50 on CUDA, resnet18 on the CPU", "default: 224 px on CUDA, 32 px on the CPU",
                  "default: 3 on CUDA, 1 on the CPU", "smallest micro-batch to try (default: 8)"]),
    ],
)  # fmt: skip
def test_help_shows_the_defaults_on_cuda_and_on_the_cpu(command, shown, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "300")  # no line breaks inside a default
    with pytest.raises(SystemExit, match="0"):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in shown:
        assert default in text
    assert "default: None" not in text and "default: False" not in text


def test_plan_prints_a_progress_line_per_trial_as_it_goes(monkeypatch, capsys):
    from lightning_memguard.tuning.trials import TrialSession

    seen_before_each_trial = []
    run = TrialSession.run

    def spy(self, size, accumulate=1, steps=None):
        seen_before_each_trial.append(capsys.readouterr().err)
        return run(self, size, accumulate, steps)

    monkeypatch.setattr(TrialSession, "run", spy)
    assert main(["plan", *TINY, "--effective-batch", "16", "--min-micro-batch", "4", "--steps", "1"]) == 0
    seen_before_each_trial.append(capsys.readouterr().err)
    progress = [[line for line in text.splitlines() if line.startswith("memguard plan: ")] for text in
                seen_before_each_trial]  # fmt: skip
    assert "memguard plan on the CPU: resnet18 at 32 px" in seen_before_each_trial[0]  # the settings come first
    assert progress[0] == []
    trials = len(seen_before_each_trial) - 1
    assert trials >= 2
    for i, lines in enumerate(progress[1:]):  # before the next trial starts, the last one's line is out
        assert len(lines) == 1, seen_before_each_trial
        size, accumulate = 4 * 2**i, 4 // 2**i
        row = rf"memguard plan: +{size} x {accumulate} +ok +[\d.]+ samples/s  peak [\d.]+ [kMG]?B  \([\d.]+ s\)$"
        assert re.match(row, lines[0])


# ---------------------------------------------------------------- the demo is never silent for long


def test_demo_says_what_it_does_before_importing_torch(tmp_path):
    # torch's import is refused: what the demo printed before it is what a user sees while torch loads
    refuse_torch = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            raise ImportError('torch is being imported')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "from lightning_memguard.commands.cli import main\n"
        f"main(['demo', '--device', 'cpu', '--out', {str(tmp_path / 'logs')!r}])\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", refuse_torch], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)  # fmt: skip
    assert "torch is being imported" in proc.stderr
    assert proc.stdout.startswith(
        "memguard demo: a short training run of a ResNet on synthetic images with MemGuard, then its table of peak"
        " memory against throughput; importing torch and Lightning first\n"
    )


def test_demo_says_how_far_it_is_at_least_every_ten_seconds(monkeypatch, tmp_path, capsys):
    import itertools

    from lightning_memguard.commands import demo

    monkeypatch.setattr(demo, "CPU_DEMO", demo.DemoConfig("resnet18", 16, 4, "32-true", False, 4, 1))
    clock = itertools.count(0.0, 4.0).__next__  # 4 s pass between any two readings
    monkeypatch.setattr(demo._Progress.__init__, "__defaults__", (10.0, clock))
    assert main(["demo", "--device", "cpu", "--out", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memguard demo: ")]
    assert lines[1].startswith("memguard demo: imported in ")
    assert lines[2:] == [
        "memguard demo: resnet18, batch 4, 16 px, 32-true, 1 epoch of 4 steps on the CPU; then MemGuard's table",
        "memguard demo: first step done in 4.0 s (it carries the start-up)",  # read at the epoch's start, then at 4 s
        "memguard demo: epoch 1 of 1: step 4 of 4",  # at 16 s: 12 s since the last line
        "memguard demo: epoch 1 of 1: 4 steps in 20.0 s",
    ]


# ---------------------------------------------------------------- --model: torchvision, timm, or your own

OWN_MODELS = """
import torch
from torch import nn


class TinyNet(nn.Module):  # 7 classes
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 7))

    def forward(self, x):
        return self.layers(x)


def tiny_net():
    return TinyNet()


class Only64(nn.Module):  # takes 64 px images only, and names no size of its own
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3 * 64 * 64, 10)

    def forward(self, x):
        return self.head(x.flatten(1))


class Segmenter(nn.Module):  # scores per pixel, not per image
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        return self.conv(x)


class NeedsWidth(nn.Module):
    def __init__(self, width):
        super().__init__()


def no_batch_size():
    from lightning.pytorch import LightningModule

    return LightningModule()
"""


@pytest.fixture
def own_models(tmp_path, monkeypatch):
    """``my_models.py`` in the folder the command runs in, which is not on ``sys.path``: as a user's own project."""
    (tmp_path / "my_models.py").write_text(OWN_MODELS, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    yield tmp_path
    sys.modules.pop("my_models", None)


def _csv_rows(folder) -> list[dict]:
    with open(folder / "sweep.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    "model", ["resnet10t", "my_models:TinyNet", "my_models:tiny_net", "lightning_memguard.testing:ImageClassifier"]
)
def test_sweep_takes_a_timm_name_and_your_own_module(own_models, capsys, model):
    argv = ["sweep", "--model", model, "--device", "cpu", "--batch-sizes", "2,4", "--steps", "1", "--out", "out"]
    size = [] if model.startswith("lightning_memguard") else ["--image-size", "32"]  # a LightningModule: its own data
    assert main([*argv, *size]) == 0, capsys.readouterr().err
    assert [(r["batch"], r["status"]) for r in _csv_rows(own_models / "out")] == [("2", "ok"), ("4", "ok")]
    first = capsys.readouterr().err.splitlines()[0]
    described = f"{model} (a LightningModule, on its own data)" if not size else f"{model} at 32 px"
    assert first.startswith(f"memguard sweep on the CPU: {described}, batch sizes 2,4")


def test_plan_takes_a_timm_name_and_your_own_module(own_models, capsys):
    for model in ("resnet10t", "my_models:TinyNet", "lightning_memguard.testing:ImageClassifier"):
        argv = ["plan", "--model", model, "--device", "cpu", "--effective-batch", "8", "--min-micro-batch", "4"]
        assert main([*argv, "--steps", "1"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "effective batch 8: micro-batch" in out and "model.batch_size = " in out


def test_a_model_the_default_image_size_does_not_fit_takes_its_own(monkeypatch, tmp_path, capsys, sweep_configs):
    # vit_b_16 takes 224 px only: the CPU's default of 32 px was blamed on an --image-size the user never passed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["sweep", "--model", "vit_b_16", "--batch-sizes", "2", "--out", str(tmp_path)]) == 0
    assert {cfg.image_size for cfg in sweep_configs} == {224}
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(
        "memguard sweep on the CPU: vit_b_16 at 224 px (vit_b_16's own size: it cannot take the CPU's default of 32"
        " px),"
    )
    assert first.endswith("(the CPU's defaults for --steps; pass them for others)")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sweep", "--model", "my_models:Only64"],
         "--model my_models:Only64 cannot take images of 32 px, the CPU's default size (pass --image-size for"
         " another): "),
        (["sweep", "--model", "my_models:Segmenter"],
         "--model my_models:Segmenter: its output for a batch of images is of shape (2, 4, 32, 32), not class scores"
         " of shape (batch, classes)"),
        (["plan", "--effective-batch", "8", "--model", "my_models:NeedsWidth"],
         "--model my_models:NeedsWidth cannot be built with no arguments: "),
        (["sweep", "--model", "my_models:no_batch_size"],
         "--model my_models:no_batch_size: a LightningModule without a batch_size attribute"),
        (["sweep", "--model", "lightning_memguard.testing:ImageClassifier", "--image-size", "64"],
         "--image-size: lightning_memguard.testing:ImageClassifier is a LightningModule, which brings its own data"),
        (["sweep", "--model", "my_models:Nothing"], "--model my_models:Nothing: my_models has no 'Nothing'"),
        (["sweep", "--model", "no_such_package.models:Net"], "--model no_such_package.models:Net: cannot import"),
        (["sweep", "--model", "resnet10t_and_more"], "unknown model 'resnet10t_and_more': neither a torchvision nor a"
         " timm classification model"),
    ],
    ids=["default-size-unfit", "not-class-scores", "needs-arguments", "no-batch-size", "lightning-image-size",
         "no-such-name", "no-such-module", "unknown-name"],
)  # fmt: skip
def test_a_model_that_cannot_be_measured_is_bad_input(own_models, no_training, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _one_line_error([*argv, "--device", "cpu"], capsys)
    assert message in err
    assert "--image-size 32" not in err  # never a flag the user did not pass


def test_a_timm_name_without_timm_says_to_install_it(monkeypatch, no_training, capsys):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm fails, as where it is not installed
    err = _one_line_error(["sweep", "--model", "resnet10t", "--device", "cpu"], capsys)
    assert "unknown model 'resnet10t': not a torchvision classification model such as resnet50, and timm is not" \
           " installed for timm's (pip install timm)" in err  # fmt: skip


def test_help_names_the_forms_of_model(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "300")
    for command in ("sweep", "plan"):
        with pytest.raises(SystemExit, match="0"):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert (
            "a torchvision classification model's name (resnet50), else a timm model's (resnet10t; needs timm)" in text
        )
        assert "or your own as package.module:Callable" in text and "or a LightningModule" in text


# ---------------------------------------------------------------- a mistyped argument answers before torch loads

REFUSE_TORCH = (
    "import sys\n"
    "class Refuse:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('torch', 'lightning', 'torchvision'):\n"
    "            raise ImportError(f'{name} is being imported')\n"
    "sys.meta_path.insert(0, Refuse())\n"
    "from lightning_memguard.commands.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sweep", "--batch-sizes", "a,b"], "--batch-sizes must be integers separated by commas, got 'a,b'"),
        (["sweep", "--batch-sizes", "0,32"], "--batch-sizes must be integers >= 1, got '0,32'"),
        (["sweep", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["sweep", "--accumulate", "0"], "--accumulate must be >= 1, got 0"),
        (["sweep", "--image-size", "-3"], "--image-size must be >= 1, got -3"),
        (["sweep", "--emulate-capacity", "16XB"], "--emulate-capacity must be a number of bytes"),
        (["sweep", "--compile-backend", "eager"], "--compile-backend needs --compile"),
        (["sweep", "--compile", "--report", "reports"], "--report measures each module's memory through hooks"),
        (["plan", "--effective-batch", "0"], "--effective-batch must be >= 1, got 0"),
        (["plan", "--effective-batch", "8", "--min-micro-batch", "16"], "--min-micro-batch 16 is larger than"),
        (["plan", "--effective-batch", "8", "--steps", "0"], "--steps must be >= 1, got 0"),
    ],
)
def test_argument_errors_answer_without_importing_torch(tmp_path, argv, message):
    # torch and Lightning cannot be imported in this process: the error must come before they would be
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", REFUSE_TORCH, *argv, "--out" if argv[0] == "sweep" else "--device",
                           str(tmp_path / "out") if argv[0] == "sweep" else "cpu"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=60)  # fmt: skip
    assert "is being imported" not in proc.stderr, proc.stderr
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.count("\n") == 1


def test_a_mistyped_model_name_is_answered_with_the_name_meant(no_training, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _one_line_error(["sweep", "--model", "restnet50", "--device", "cpu"], capsys)
    assert "unknown model 'restnet50' (did you mean resnet50?): neither a torchvision nor a timm" in err
    err = _one_line_error(["sweep", "--model", "vit_tiny_patch16_22", "--device", "cpu"], capsys)  # a timm name
    assert "(did you mean vit_tiny_patch16_224?)" in err


# ---------------------------------------------------------------- Ctrl+C keeps what was measured


def test_ctrl_c_during_a_sweep_keeps_the_rows_measured_and_says_so(monkeypatch, tmp_path, capsys):
    from lightning_memguard.commands import sweep
    from lightning_memguard.core.epoch_record import SweepRow

    def run_one(cfg, batch, root):
        if batch == 32:
            raise KeyboardInterrupt
        return SweepRow(batch, 10.0, 0.1, batch * 100.0, "ok"), 1.0

    monkeypatch.setattr(sweep, "run_one", run_one)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "sweep"
    assert main(["sweep", *TINY, "--batch-sizes", "8,16,32,64", "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert "memguard sweep: interrupted (Ctrl+C) while measuring batch size 32; the table and sweep.csv hold the 2" \
           " batch sizes measured before it" in captured.err  # fmt: skip
    table = captured.out.splitlines()
    assert [line.split()[0] for line in table[1:3]] == ["8", "16"]
    assert [int(r["batch"]) for r in _csv_rows(out)] == [8, 16]
    assert (out / "sweep.png").stat().st_size > 10_000


def test_ctrl_c_inside_a_training_run_reaches_the_sweep_as_an_interrupt(tmp_path):
    # Lightning turns Ctrl+C inside fit into sys.exit(1) and ignores Ctrl+C from then on: run_one gives it back
    import signal

    from lightning_memguard.commands.sweep import ModelSource, SweepConfig, run_one
    from lightning_memguard.testing import ImageClassifier

    class PressesCtrlC(ImageClassifier):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    def build():
        return PressesCtrlC("resnet18", num_classes=4, image_size=16, batch_size=2, steps_per_epoch=8)

    source = ModelSource("tests:PressesCtrlC", "LightningModule", build)
    cfg = SweepConfig("tests:PressesCtrlC", (2,), 16, "32-true", steps=3, warmup=1, device="cpu", source=source)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        run_one(cfg, 2, str(tmp_path))
    assert signal.getsignal(signal.SIGINT) is before


# ---------------------------------------------------------------- sizes in the unit that fits a small or emulated card


def test_a_sweep_on_a_small_emulated_card_writes_its_sizes_in_mb(monkeypatch, tmp_path, capsys):
    import matplotlib.pyplot as plt

    from lightning_memguard.commands import sweep
    from lightning_memguard.core.epoch_record import SweepRow

    def run_one(cfg, batch, root):  # a card of 150 MB: 4 fits at 70 MB, 8 spills
        row = SweepRow(batch, 10.0, 0.0703, 400.0, "ok") if batch == 4 else SweepRow(batch, 90.0, 0.1603, 89.0, "spill")
        return row, 0.15

    figures = []
    monkeypatch.setattr(sweep, "run_one", run_one)
    monkeypatch.setattr(plt, "close", figures.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["sweep", *TINY, "--batch-sizes", "4,8", "--emulate-capacity", "150MB", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[:4] == [
        "batch    step ms    peak MB    samples/s  status",
        "    4       10.0       70.3        400.0  ok",
        "    8       90.0      160.3         89.0  spill",
        "capacity: 150.0 MB",
    ]
    (figure,) = figures
    ax, mem = figure.axes
    assert ax.get_title() == "resnet18 on the CPU: 32-true, emulated 150 MB card with sysmem fallback"
    assert mem.get_ylabel() == "peak memory (MB)"
    assert [round(y, 1) for y in mem.lines[0].get_ydata()] == [70.3, 160.3]
    assert "capacity 150.0 MB" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(figure)


def test_plan_writes_peaks_in_the_unit_of_the_emulated_card(monkeypatch):
    from lightning_memguard.commands.plan import PlanConfig, _size, trial_row
    from lightning_memguard.tuning.search import TrialResult

    cfg = PlanConfig(None, 10, 32, 16, 4, False, "32-true", False, None, 150_000_000, 1, 1)  # type: ignore[arg-type]
    row = trial_row(TrialResult(8, 20.0, 70_312_000, 400.0, "ok", accumulate=2), _size(cfg))
    assert row.endswith("400.0 samples/s  peak 70.3 MB")
    assert trial_row(TrialResult(8, 20.0, 70_312_000, 400.0, "ok")).endswith("peak 70.3 MB")  # the CPU: its own unit


def test_a_cpu_sweep_on_an_emulated_card_shows_the_spill_as_a_slowdown():
    """On the CPU a fixed 25 GB/s transfer vanished in the compute and the spilling size ran faster per sample under
    its "cliff: spill" mark; charged relative to the step's own time, the spill slows it down as on a card (8 samples
    spilling most of their activations: about 9x slower a step, more than a larger batch gains on any CPU)."""
    from torch import nn

    from lightning_memguard.commands.sweep import ModelSource, SweepConfig, run_one

    def build():
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))  # fmt: skip

    source = ModelSource("tests:convnet", "network", build)
    cfg = SweepConfig("tests:convnet", (2, 16), 32, "32-true", steps=2, warmup=1, emulate_capacity=2 * 10**6,
                      device="cpu", num_classes=10, source=source)  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        fits, _ = run_one(cfg, 2, root)
        spills, _ = run_one(cfg, 16, root)
    assert (fits.status, spills.status) == ("ok", "spill")
    assert spills.samples_per_sec < fits.samples_per_sec


def test_plan_levers_prints_the_levers_plan_every_set_measured_and_the_calls(capsys, monkeypatch):
    from conftest import ticking_planner_clocks

    ticking_planner_clocks(monkeypatch)  # the plan follows the step's structure, not this machine's load
    assert main(["plan", *TINY, "--effective-batch", "8", "--levers", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("levers: block recomputed in stem, ") and "no fused loss: ResNet is not a Hugging Face" in out
    assert "measured:\n  as it is: peak " in out
    assert "paste:\n  apply_plan(model, [['stem'], " in out


def test_plan_levers_pastes_the_pointwise_lever_after_the_checkpoints(capsys, monkeypatch):
    """With the pointwise chains' recomputation measured at 0 ms (an injected clock), they are the cheapest way for
    every block but the stem (several modules: none of its own); their call is pasted after the checkpoints'. The
    blocks' clocks tick (conftest), so that a block is never timed at about 0 ms on a loaded machine."""
    from conftest import ticking_planner_clocks

    ticking_planner_clocks(monkeypatch)
    levers = importlib.import_module("lightning_memguard.levers.plan_levers")
    monkeypatch.setattr(levers, "plan_levers", functools.partial(levers.plan_levers, clock=lambda: 0.0))
    assert main(["plan", *TINY, "--effective-batch", "8", "--levers", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "pointwise chains recomputed in layer1.0, " in out
    assert "paste:\n  apply_plan(model, [['stem']])\n  recompute_pointwise(model, units=['layer1.0', " in out


def test_plan_levers_says_the_floor_where_no_set_meets_the_budget(capsys):
    assert main(["plan", *TINY, "--effective-batch", "8", "--levers", "0.05"]) == 1
    assert "budget not met: the floor reached is " in capsys.readouterr().out


@pytest.mark.parametrize(
    ("budget", "message"),
    [("3", "--levers 3: the budget as a fraction must be in (0, 1]"), ("lots", "--levers lots: ")],
)
def test_plan_levers_refuses_a_budget_it_cannot_read(capsys, budget, message):
    assert main(["plan", *TINY, "--effective-batch", "8", "--levers", budget]) == 2
    assert message in capsys.readouterr().err
