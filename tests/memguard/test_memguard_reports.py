"""MemGuard's memory report, with real Trainers on the CPU: each trigger writes one, names it in its message, and
changes nothing the run trains."""

from __future__ import annotations

import json
import os
import pathlib
import warnings
import weakref

import pytest
import torch
from conftest import FakeProbe, StepClock, trainer_kwargs
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard import MemGuard, SysmemSpillError, _autograd
from lightning_memguard.probes import MemoryReading
from lightning_memguard.testing import SysmemSpillEmulator

GB = 10**9


class Squares(torch.nn.Module):
    """Widens its input and squares it: the module whose saved activations dwarf the others'."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 2048)

    def forward(self, x):
        return self.up(x) ** 2


class HugeActivation(LightningModule):
    def __init__(self, batch_size: int = 16, n: int = 128) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.stem = torch.nn.Linear(16, 8)
        self.huge = Squares()
        self.head = torch.nn.Linear(2048, 2)
        self.drop = torch.nn.Dropout(0.1)  # a redone step must leave the random generators as they were
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = torch.randint(0, 2, (n,), generator=gen)
        self.oom_above: int | None = None  # a batch larger than this raises CUDA's out-of-memory error
        self.oom_from_step = 0

    def forward(self, x):
        return self.head(self.huge(self.drop(torch.relu(self.stem(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.oom_above is not None and len(x) > self.oom_above and self.trainer.global_step >= self.oom_from_step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


class SpillAt(Callback):
    """The fake card's peak passes its capacity from optimizer step ``step`` on."""

    def __init__(self, probe: FakeProbe, step: int) -> None:
        self.probe, self.step = probe, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.probe.peak = 17 * GB


def _guard(probe, **kwargs) -> MemGuard:
    defaults = dict(probe=probe, clock=StepClock(0.1), read_every=1, warmup_steps=0, reference_steps=1)
    return MemGuard(**{**defaults, **kwargs})


def _fit(tmp_path, guard, model=None, callbacks=(), **trainer_kw) -> tuple[Trainer, HugeActivation]:
    torch.manual_seed(0)
    model = HugeActivation() if model is None else model
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[*callbacks, guard], **trainer_kw))
    trainer.fit(model)
    return trainer, model


def _report(path) -> dict:
    return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))


def _checks_the_top_module(report: dict, why: str) -> None:
    assert report["why"] == why
    assert report["top"][0]["name"] == "huge" and report["top"][0]["class"] == "Squares"
    assert sum(report["split"].values()) == report["peak"]


def test_a_stopped_spill_writes_a_report_beside_the_checkpoint_and_names_it(tmp_path, fake_probe):
    guard = _guard(fake_probe, on_spill="stop")
    with pytest.warns(RuntimeWarning, match=r"(?s)Memory report: .*memguard-report-step=3-spill\.html") as caught:
        trainer, _ = _fit(tmp_path, guard, callbacks=[SpillAt(fake_probe, 3)])
    assert trainer.global_step == 4  # the batch in flight trained, measured as it did
    assert len(guard.reports) == 1 and os.path.dirname(guard.reports[0]) == os.path.dirname(guard.checkpoint_path)
    report = _report(guard.reports[0])
    _checks_the_top_module(report, "spill")
    assert report["samples"] == report["batch"] == 16 and report["step"] == 3
    page = pathlib.Path(guard.reports[0]).with_suffix(".html").read_text(encoding="utf-8")
    assert "Spill at step 3: peak 17.00 GB against 16.00 GB of physical memory, 1.00 GB over; batch 16" in page
    message = str(next(w.message for w in caught if "Memory report" in str(w.message)))
    assert "Largest saved activations: huge (Squares)" in message and "Fix:" in message
    assert sorted(os.listdir(os.path.dirname(guard.reports[0]))) == [
        "memguard-report-step=3-spill.html", "memguard-report-step=3-spill.json", "memguard-spill-step=4.ckpt",
    ]  # fmt: skip


def test_a_raised_spill_measures_the_batch_in_hand_and_its_error_names_the_report(tmp_path, fake_probe):
    guard = _guard(fake_probe, on_spill="raise")
    with pytest.raises(SysmemSpillError, match=r"(?s)Memory report: .*step=3-spill\.html.*huge \(Squares\)"):
        _fit(tmp_path, guard, callbacks=[SpillAt(fake_probe, 3)])
    report = _report(guard.reports[0])
    _checks_the_top_module(report, "spill")
    assert report["samples"] == 16  # the batch in hand, redone


def test_a_spill_in_an_epochs_last_step_is_measured_on_that_epochs_last_batch(tmp_path, fake_probe):
    class AtTheEnd(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 7:
                fake_probe.peak = 17 * GB

    guard = _guard(fake_probe, on_spill="raise", read_every=100)
    with pytest.raises(SysmemSpillError, match="Memory report: "):
        _fit(tmp_path, guard, callbacks=[AtTheEnd()])
    _checks_the_top_module(_report(guard.reports[0]), "spill")


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_warned_spill_names_the_report_and_the_run_trains_as_without_it(tmp_path, fake_probe):
    with pytest.warns(RuntimeWarning, match=r"(?s)GPU memory is spilling.*Memory report: "):
        _, reported = _fit(tmp_path / "a", _guard(fake_probe, on_spill="warn"), callbacks=[SpillAt(fake_probe, 3)])
    fake_probe.peak = GB
    with pytest.warns(RuntimeWarning, match="GPU memory is spilling") as caught:
        guard = _guard(fake_probe, on_spill="warn", memory_report=False)
        _, plain = _fit(tmp_path / "b", guard, callbacks=[SpillAt(fake_probe, 3)])
    assert not any("Memory report" in str(w.message) for w in caught) and guard.reports == []
    assert all(torch.equal(a, b) for a, b in zip(_weights(reported), _weights(plain), strict=True))


def test_a_report_redone_at_an_epochs_end_changes_no_weight(tmp_path, fake_probe):
    """The redone measurement (a warned spill at an epoch's end) puts gradients, buffers and generators back."""

    class AtTheEnd(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch == 0 and batch_idx == 7:
                fake_probe.peak = 17 * GB

    runs = []
    for report in (True, False):
        fake_probe.peak = GB
        guard = _guard(fake_probe, on_spill="warn", read_every=100, memory_report=report)
        with pytest.warns(RuntimeWarning, match="GPU memory is spilling"):
            runs.append(_fit(tmp_path / str(report), guard, callbacks=[AtTheEnd()])[1])
        assert len(guard.reports) == report
    assert all(torch.equal(a, b) for a, b in zip(_weights(runs[0]), _weights(runs[1]), strict=True))


def test_an_out_of_memory_error_is_measured_on_a_part_of_its_batch_and_scaled(tmp_path, fake_probe):
    model = HugeActivation()
    model.oom_above, model.oom_from_step = 4, 2  # the batch of 16 no longer fits from step 2; 4 samples do
    guard = _guard(fake_probe)
    with pytest.raises(torch.OutOfMemoryError, match=r"(?s)injected.*Memory report: .*step=2-out_of_memory"):
        _fit(tmp_path, guard, model=model)
    report = _report(guard.reports[0])
    _checks_the_top_module(report, "out_of_memory")
    assert report["scale"] == 4 and "1/4 of the batch" in report["note"] and report["samples"] == 16
    assert report["top"][0]["bytes"] == 16 * 2048 * 4  # the batch's 16 samples, measured on 4 and scaled


def test_each_adaptation_writes_the_report_of_its_first_step(tmp_path):
    emulator = SysmemSpillEmulator(capacity=7 * 10**5, sleep=lambda s: None)

    class Taken(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                emulator.other_processes = 3 * 10**5

    guard = MemGuard(
        on_spill="adapt", probe=emulator.probe, clock=StepClock(), read_every=1, warmup_steps=1, reference_steps=1,
        spill_checkpoint=tmp_path / "reports",
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="MemGuard adapted"):
        _fit(tmp_path, guard, callbacks=[emulator, Taken()], max_epochs=1)
    assert guard.adaptations and len(guard.reports) == len(guard.adaptations)
    report = _report(guard.reports[0])
    _checks_the_top_module(report, "adaptation")
    assert report["step"] == guard.adaptations[0].step
    assert os.path.dirname(guard.reports[0]) == str(tmp_path / "reports")
    micro = 16 // guard.adaptations[0].after
    assert report["top"][0]["bytes"] == micro * 2048 * 4  # the largest micro-batch's, as the step ran split


class RetryingProbe(FakeProbe):
    """A card whose allocator starts retrying allocations at a given read."""

    def __init__(self, from_read: int) -> None:
        super().__init__()
        self.from_read = from_read

    def read(self) -> MemoryReading:
        reading = super().read()
        retries = max(0, self.reads - self.from_read)
        return MemoryReading(reading.peak_allocated, reading.peak_reserved, reading.capacity, alloc_retries=retries)


def test_allocator_thrash_warns_once_with_a_report(tmp_path):
    guard = _guard(RetryingProbe(from_read=5))
    with pytest.warns(RuntimeWarning, match=r"(?s)allocator thrash.*Memory report: .*-thrash\.html") as caught:
        _fit(tmp_path, guard, max_epochs=1)
    assert sum("allocator thrash" in str(w.message) for w in caught) == 1
    _checks_the_top_module(_report(guard.reports[0]), "thrash")


def test_without_a_trigger_no_hook_is_installed_and_no_report_written(tmp_path, fake_probe):
    class NoHooks(Callback):
        def __init__(self):
            self.steps = 0

        def on_before_backward(self, trainer, pl_module, loss):
            assert "training_step" not in pl_module.__dict__
            assert all(not m._forward_hooks and not m._forward_pre_hooks for m in pl_module.modules())
            self.steps += 1

    class Forward(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            assert _autograd.saved_tensors_hooks_in_force() is None

    check = NoHooks()
    guard = _guard(fake_probe)
    _fit(tmp_path, guard, callbacks=[check, Forward()])
    assert check.steps == 16 and guard.reports == []


def test_a_report_armed_on_a_step_leaves_no_hook_after_it(tmp_path, fake_probe):
    model_seen = []

    class After(Callback):
        def on_train_end(self, trainer, pl_module):
            model_seen.append("training_step" in pl_module.__dict__)
            model_seen.append(any(m._forward_hooks or m._forward_pre_hooks for m in pl_module.modules()))

    with pytest.warns(RuntimeWarning, match="Memory report"):
        _fit(tmp_path, _guard(fake_probe, on_spill="warn"), callbacks=[SpillAt(fake_probe, 2), After()])
    assert model_seen == [False, False]


def test_record_memory_on_the_cpu_warns_once_and_records_nothing(tmp_path, fake_probe):
    guard = _guard(fake_probe, record_memory=True)
    with pytest.warns(UserWarning, match=r"record_memory=True\) records the CUDA allocator's history"):
        _fit(tmp_path, guard)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _fit(tmp_path, guard)  # the same instance, a second fit: no second warning


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"memory_report": "yes"}, "`memory_report` must be a bool"), ({"record_memory": 1}, "`record_memory`")],
)
def test_the_report_flags_are_bools(kwargs, match):
    with pytest.raises(TypeError, match=match):
        MemGuard(**kwargs)


# ---------------------------------------------------------------- memguard sweep / plan --report

TINY = ["--model", "resnet18", "--image-size", "32", "--device", "cpu"]


def test_sweep_writes_a_report_per_batch_size(tmp_path, capsys):
    from lightning_memguard.commands.cli import main

    reports = tmp_path / "reports"
    argv = ["sweep", *TINY, "--batch-sizes", "2,4", "--steps", "1", "--out", str(tmp_path), "--report", str(reports)]
    assert main(argv) == 0
    assert sorted(os.listdir(reports)) == [
        "memguard-report-batch=2.html", "memguard-report-batch=2.json",
        "memguard-report-batch=4.html", "memguard-report-batch=4.json",
    ]  # fmt: skip
    small, large = (_report(reports / f"memguard-report-batch={b}.json") for b in (2, 4))
    assert small["why"] == "sweep" and small["samples"] == 2 and large["samples"] == 4
    names = [t["name"] for t in small["top"]]
    assert names and not any(n.startswith("net.") for n in names)  # the model's own names, not the sweep's wrapper's
    assert "MemGuard memory report: sweep" in (reports / "memguard-report-batch=2.html").read_text(encoding="utf-8")
    assert large["split"]["activations"] == pytest.approx(2 * small["split"]["activations"], rel=0.05)
    assert small["split"]["weights"] == large["split"]["weights"] > 0
    assert small["fixes"][0].startswith("checkpoint the blocks holding them")  # a ResNet's blocks, found
    assert 'checkpoint_blocks(model, units=["layer' in small["fixes"][0]


def test_plan_writes_a_report_per_micro_batch_tried(tmp_path, capsys):
    from lightning_memguard.commands.cli import main

    reports = tmp_path / "reports"
    assert main(["plan", *TINY, "--effective-batch", "8", "--min-micro-batch", "4", "--report", str(reports)]) == 0
    written = sorted(n for n in os.listdir(reports) if n.endswith(".json"))
    assert written and all(n.startswith("memguard-report-micro-batch=") for n in written)
    assert "memory reports: " in capsys.readouterr().out
    first = _report(reports / written[0])
    assert first["why"] == "plan" and first["samples"] == int(written[0].split("=")[1].split(".")[0])


def test_report_is_refused_beside_compile(tmp_path, capsys):
    from lightning_memguard.commands.cli import main

    code = main(["plan", *TINY, "--effective-batch", "8", "--compile", "--report", str(tmp_path)])
    assert code != 0 and "leave out --compile for the report" in capsys.readouterr().err


# ---------------------------------------------------------------- the emulated card (CPU twin of tests/gpu/test_gpu.py)


class WideBlock(torch.nn.Module):
    """A convolution to many channels and its ReLU: the module a test makes large."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, channels, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


def wide_network(channels: int, classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), WideBlock(channels), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(channels, classes),
    )  # fmt: skip


def test_an_emulated_spill_names_the_module_the_test_made_large(tmp_path):
    from lightning_memguard.testing import ImageClassifier

    torch.manual_seed(0)
    model = ImageClassifier("wide", image_size=32, batch_size=8, steps_per_epoch=6, net=wide_network(64))
    emulator = SysmemSpillEmulator(capacity="1MB", sleep=lambda s: None)  # the wide block alone saves 2 MB
    guard = MemGuard(probe=emulator.probe, on_spill="stop", warmup_steps=1, clock=StepClock())
    with pytest.warns(RuntimeWarning, match=r"(?s)Memory report: .*net\.1 \(WideBlock\)"):
        Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[emulator, guard])).fit(model)
    report = _report(guard.reports[0])
    assert report["top"][0]["name"] == "net.1" and report["top"][0]["share"] > 0.5
    assert report["top"][0]["bytes"] == 8 * 64 * 32 * 32 * 4  # the ReLU's output, kept for its backward
    assert emulator.total_spilled_bytes > 0  # the recorder handed the saved tensors on to the emulator


def test_the_forensics_benchmark_smoke_run_writes_its_ratios(tmp_path, monkeypatch):
    import importlib.util

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "forensics.py"
    spec = importlib.util.spec_from_file_location("forensics_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "forensics.json"
    monkeypatch.setattr("sys.argv", ["forensics.py", "--smoke", "--out", str(out)])
    module.main()
    result = json.loads(out.read_text(encoding="utf-8"))
    assert set(result["summary"]["vs_plain"]) == {"memguard_without_report", "memguard", "memguard_recording"}
    assert result["summary"]["report_vs_no_report"] > 0 and result["report"]["measure_ms"] > 0
    assert 0 < result["summary"]["report_hooks_us_per_step"] < 1000
    assert result["report"]["top"][0]


def test_a_measured_steps_reset_of_the_cuda_peak_is_carried_into_memguards_next_readings():
    from lightning_memguard.callbacks._reporting import MemoryReports

    reports = MemoryReports(True, False, True)
    reports._counts_cuda = True  # MemGuard's probe reads the allocator's counters (a CudaProbe)
    reports._carry((17 * GB, 18 * GB))  # the peaks before the measured step reset them
    reading = reports.with_carried(MemoryReading(3 * GB, 4 * GB, 16 * GB))
    assert (reading.peak_allocated, reading.peak_reserved) == (17 * GB, 18 * GB)
    reports._counts_cuda = False  # another probe (the emulator's, a user's) keeps its own figures
    assert reports.with_carried(MemoryReading(3 * GB, 4 * GB, 16 * GB)).peak_allocated == 3 * GB


def test_a_compiled_model_is_reported_without_modules_and_compiles_at_most_one_graph_more(tmp_path, fake_probe):
    graphs = []
    for report in (True, False):
        torch._dynamo.reset()
        fake_probe.peak = GB
        guard = _guard(fake_probe, on_spill="stop", memory_report=report)
        model = torch.compile(HugeActivation(), backend="aot_eager")
        counters = torch._dynamo.utils.counters
        counters.clear()
        with pytest.warns(RuntimeWarning, match="MemGuard stopped"):
            _fit(tmp_path / str(report), guard, model=model, callbacks=[SpillAt(fake_probe, 3)], max_epochs=1)
        graphs.append(counters["stats"]["unique_graphs"])
        if report:
            measured = _report(guard.reports[0])
    torch._dynamo.reset()
    assert measured["top"] == [] and "runs compiled" in measured["note"]
    assert measured["split"]["activations"] > 16 * 2048 * 4  # the graph's saved tensors, counted
    assert graphs[0] <= graphs[1] + 1  # the measured step's saved-tensor hooks: at most one graph more


def test_memguard_pickles_before_and_after_a_fit_that_wrote_a_report(tmp_path, fake_probe):
    """ddp_spawn pickles the callbacks: nothing of the reports may stand in the way."""
    import pickle

    guard = _guard(fake_probe, on_spill="warn", record_memory=True)
    pickle.loads(pickle.dumps(guard))
    with pytest.warns(RuntimeWarning, match="Memory report"):
        _fit(tmp_path, guard, callbacks=[SpillAt(fake_probe, 2)], max_epochs=1)
    again = pickle.loads(pickle.dumps(guard))
    assert again.reports == guard.reports and len(guard.reports) == 1


def test_an_out_of_memory_error_on_an_uneven_batch_is_scaled_by_the_samples_measured(tmp_path, fake_probe):
    model = HugeActivation(batch_size=10, n=40)
    model.oom_above = 3  # 5 samples still fail, 2 (a quarter of 10, rounded) fit: scaled by 10 / 2
    with pytest.raises(torch.OutOfMemoryError, match="Memory report: "):
        _fit(tmp_path, _guard(fake_probe), model=model)
    report = _report(_guard_reports(tmp_path)[0])
    assert report["scale"] == 5 and report["top"][0]["bytes"] == 10 * 2048 * 4


def _guard_reports(folder) -> list[pathlib.Path]:
    return sorted(pathlib.Path(folder).rglob("memguard-report-*.json"))


def test_fast_dev_run_spilling_from_its_first_step_is_reported(tmp_path, fake_probe):
    fake_probe.peak = 17 * GB
    guard = _guard(fake_probe, on_spill="raise")
    # found at the one batch's start, acted on at the epoch's end: measured on that epoch's last (its only) batch
    with pytest.raises(SysmemSpillError, match=r"Memory report: .*step=1-spill\.html"):
        _fit(tmp_path, guard, fast_dev_run=True)
    _checks_the_top_module(_report(guard.reports[0]), "spill")


class HeldUntilFreed(HugeActivation):
    """Runs out of memory while a failed step's activations are still held, as a full card does until they are
    freed: its step at ``fail_at`` fails on the whole batch, its activations kept by the failed frame."""

    def __init__(self, fail_at: int = 2) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.held: list[weakref.ref] = []
        self.calls: list[int] = []  # samples of each training_step call from the failure on

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step >= self.fail_at:
            self.calls.append(len(x))
        if any(ref() is not None for ref in self.held):
            raise torch.OutOfMemoryError("CUDA out of memory (the failed step's activations are still held)")
        hidden = self(x)
        if self.trainer.global_step == self.fail_at and len(x) == self.batch_size:
            self.held.append(weakref.ref(hidden))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return torch.nn.functional.cross_entropy(hidden, y)


def test_an_out_of_memory_error_lets_go_of_the_failed_step_before_measuring_and_runs_the_step_once_more(
    tmp_path, fake_probe
):
    model = HeldUntilFreed()
    guard = _guard(fake_probe, on_spill="raise")  # as with prevent=True, which on the CPU caps nothing
    with pytest.raises(torch.OutOfMemoryError, match=r"(?s)injected.*Memory report: .*step=2-out_of_memory"):
        _fit(tmp_path, guard, model=model)
    assert model.calls == [16, 8]  # the failed step, then one half of its batch, measured
    report = _report(guard.reports[0])
    _checks_the_top_module(report, "out_of_memory")
    assert "training_step ran 1 time more to measure this (8 samples: measured)" in report["note"]
    assert report["samples"] == 16 and report["batch"] == 16 and report["capacity"] == fake_probe.capacity()


def test_an_out_of_memory_error_that_no_part_survives_is_reported_and_each_run_said(tmp_path, fake_probe):
    model = HugeActivation()
    model.oom_above, model.oom_from_step = 0, 2  # from step 2 even one sample runs out of memory
    guard = _guard(fake_probe)
    with pytest.raises(torch.OutOfMemoryError, match=r"(?s)injected.*Memory report: .*step=2-out_of_memory"):
        _fit(tmp_path, guard, model=model)
    report = _report(guard.reports[0])
    assert report["split"]["activations"] == 0 and report["split"]["weights"] > 0
    assert "no part of the batch could be measured" in report["note"]
    assert (
        "training_step ran 4 times more to measure this (8 samples: out of memory; 4 samples: out of memory;"
        in (report["note"])
    )


def test_other_processes_pushing_a_step_over_the_card_are_named_first_in_the_report(tmp_path):
    probe = FakeProbe(peak=GB, other=int(15.5 * GB))  # 16.5 GB on a 16 GB card: this process's own 1 GB would fit
    guard = _guard(probe, on_spill="raise")
    with pytest.raises(SysmemSpillError, match=r"(?s)Memory report: .*= other processes 15\.50 GB.*Fix: other proce"):
        _fit(tmp_path, guard)
    report = _report(guard.reports[0])
    assert report["split"]["others"] == int(15.5 * GB) and report["other_processes"] == int(15.5 * GB)
    assert report["fixes"][0].startswith("other processes hold 15.50 GB of the card's 16.00 GB")
    assert report["judged_peak"] == GB + 1000 + int(15.5 * GB)  # the spill message's peak: the reserved peak, theirs


def test_weights_gradients_and_optimizer_state_above_the_card_are_reported_with_what_shrinks_them(tmp_path):
    probe = FakeProbe(capacity=200_000, peak=300_000)  # SGD with momentum: about 270 kB before any activation
    guard = _guard(probe, on_spill="raise")
    with pytest.raises(SysmemSpillError, match=r"(?s)Memory report: .*Fix: weights, gradients and optimizer state"):
        _fit(tmp_path, guard)
    report = _report(guard.reports[0])
    assert len(report["fixes"]) == 1 and "sharding" in report["fixes"][0]
    page = pathlib.Path(guard.reports[0]).with_suffix(".html").read_text(encoding="utf-8")
    assert "peak 301.0 kB against 200.0 kB of physical memory, 101.0 kB over; batch 16; others 0.0 kB" in page
    assert "ActivationCheckpointing" not in page and "smaller micro-batch" not in page


def test_a_grow_back_report_names_no_fix(tmp_path):
    emulator = SysmemSpillEmulator(capacity=7 * 10**5, sleep=lambda s: None)

    class TakenThenFreed(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                emulator.other_processes = 3 * 10**5
            if trainer.global_step == 5:
                emulator.other_processes = 0

    guard = MemGuard(
        on_spill="adapt", probe=emulator.probe, clock=StepClock(), read_every=1, warmup_steps=1, reference_steps=1,
        grow_every=2,
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="MemGuard adapted"):
        _fit(tmp_path, guard, callbacks=[emulator, TakenThenFreed()], max_epochs=1)
    grown = [i for i, a in enumerate(guard.adaptations) if a.after < a.before]
    assert grown and len(guard.reports) == len(guard.adaptations)
    report = _report(guard.reports[grown[0]])
    assert report["fixes"] == [] and "this step fits, nothing to fix" in report["note"]
    split = _report(guard.reports[0])
    assert split["fixes"] and split["other_processes"] == 3 * 10**5  # the spill it adapted to: others named
