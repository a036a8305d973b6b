"""The `memguard` command on the CPU: output, files, exit codes, and one-line errors for bad input."""

from __future__ import annotations

import csv
import json

import pytest

from lightning_memguard.cli import main
from lightning_memguard.doctor import verdict

TINY = ["--model", "resnet18", "--image-size", "32", "--device", "cpu"]


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


def test_sweep_prints_the_table_and_writes_csv_and_png(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = main(["sweep", *TINY, "--batch-sizes", "8,4,32", "--steps", "2", "--emulate-capacity", "1GB",
                 "--out", str(out)])  # fmt: skip
    assert code == 0
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


def test_plan_prints_a_recommendation_and_lines_to_paste(capsys):
    assert main(["plan", *TINY, "--effective-batch", "16", "--min-micro-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "effective batch 16: micro-batch" in out
    assert "expected:" in out and "samples/s" in out
    assert "model.batch_size = " in out and "Trainer(accumulate_grad_batches=" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sweep", "--model", "resnet9000", "--device", "cpu"], "unknown model 'resnet9000'"),
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
