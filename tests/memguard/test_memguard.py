"""MemGuard's monitoring with real Trainers on the CPU."""

from __future__ import annotations

import csv
import logging
import math
import warnings

import pytest
import torch
from conftest import StepClock, TinyModel, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard import MemGuard, SysmemSpillError
from lightning_memguard.probes import CpuProbe

KEYS = (
    "memguard/peak_allocated_gb",
    "memguard/peak_reserved_gb",
    "memguard/capacity_gb",
    "memguard/samples_per_sec",
    "memguard/step_ms",
)


def _epoch_rows(log_dir):
    with open(f"{log_dir}/metrics.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if r.get("memguard/step_ms")]


def test_every_epoch_row_has_the_five_keys(tmp_path):
    guard = MemGuard()
    logger = CSVLogger(tmp_path, name="run")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, logger=logger, callbacks=[guard]))
    trainer.fit(TinyModel(batch_size=8, n=64))
    rows = _epoch_rows(logger.log_dir)
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    ram_gb = CpuProbe().capacity() / 1e9
    for row in rows:
        values = {k: float(row[k]) for k in KEYS}
        assert 0 < values["memguard/peak_allocated_gb"] <= values["memguard/peak_reserved_gb"] + 1e-9
        assert values["memguard/capacity_gb"] == pytest.approx(ram_gb, rel=1e-6)
        assert values["memguard/samples_per_sec"] > 0
        assert 0 < values["memguard/step_ms"] < 10_000
    assert len(guard.epochs) == 3


def test_step_time_and_throughput_follow_the_clock(tmp_path, fake_probe):
    # the clock advances 0.1 s per call, one call per batch start: every batch takes 0.1 s
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1))
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[guard]))
    trainer.fit(TinyModel(batch_size=8, n=64))
    for record in guard.epochs:
        assert record.step_ms == pytest.approx(100.0)
        assert record.samples_per_sec == pytest.approx(80.0)  # 8 samples / 0.1 s
    metrics = trainer.callback_metrics
    assert float(metrics["memguard/step_ms"]) == pytest.approx(100.0)
    assert float(metrics["memguard/peak_allocated_gb"]) == pytest.approx(1.0)
    assert float(metrics["memguard/capacity_gb"]) == pytest.approx(16.0)


class UnevenBatches(TinyModel):
    def train_dataloader(self):
        sizes = [8, 2, 8, 2, 8, 2]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        batches = [list(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)]
        return DataLoader(TensorDataset(self.x, self.y), batch_sampler=batches)


def test_samples_come_from_the_real_batch(tmp_path, fake_probe):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1))
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[guard]))
    trainer.fit(UnevenBatches())
    # five complete intervals of 0.1 s carrying 8 + 2 + 8 + 2 + 8 samples
    assert guard.epochs[0].samples_per_sec == pytest.approx(28 / 0.5)


def test_single_batch_epochs_are_timed_by_the_batch_itself(tmp_path, fake_probe):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1))
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, limit_train_batches=1, callbacks=[guard]))
    trainer.fit(TinyModel(batch_size=8))
    assert [r.step_ms for r in guard.epochs] == [pytest.approx(100.0)] * 2


def test_each_epoch_resets_the_peak(tmp_path, fake_probe):
    guard = MemGuard(probe=fake_probe)
    peaks = iter([2 * 10**9, 3 * 10**9])

    from lightning.pytorch import Callback

    class Bump(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            fake_probe.peak = next(peaks)

    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[guard, Bump()]))
    trainer.fit(TinyModel())
    assert fake_probe.resets == 3  # at train start (an epoch resumed mid-way has no start), then at each epoch's
    assert [r.peak_allocated_gb for r in guard.epochs] == [2.0, 3.0]


def test_no_memory_read_on_every_step(tmp_path, fake_probe):
    # an injected clock: with the host's own, a busy machine's slow steps would ask for readings
    guard = MemGuard(probe=fake_probe, read_every=25, warmup_steps=1, reference_steps=2, clock=StepClock(0.1))
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[guard]))
    trainer.fit(TinyModel(batch_size=1, n=200))
    # warm-up, reference and patience steps, then every 25th step, plus one read at epoch end
    assert fake_probe.reads < 20


def test_logger_false_still_works_and_validation_is_not_timed(tmp_path, fake_probe):
    clock = StepClock(0.1)
    guard = MemGuard(probe=fake_probe, clock=clock)
    trainer = Trainer(
        **trainer_kwargs(tmp_path, max_epochs=2, limit_val_batches=2, val_check_interval=4, callbacks=[guard])
    )
    trainer.fit(TinyModel(batch_size=8, n=64, val=True))
    # validation runs twice an epoch; its clock calls would show as slow steps if they were counted
    assert all(r.step_ms == pytest.approx(100.0) for r in guard.epochs)


def test_progress_bar_shows_peak_share_and_throughput(tmp_path, fake_probe):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1), read_every=2)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[guard]))
    trainer.fit(TinyModel())
    bar = trainer.progress_bar_metrics
    assert bar["peak/cap"] == pytest.approx(1 / 16, abs=1e-3)
    assert bar["samples/s"] == pytest.approx(80.0)


def test_table_printed_at_fit_end(tmp_path, fake_probe, caplog):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1))
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[guard]))
    with caplog.at_level(logging.INFO):
        trainer.fit(TinyModel())
    text = caplog.text
    assert "peak GB / capacity GB" in text
    assert "1.00 / 16.00" in text and "100.0" in text and "80.0" in text


def test_resume_keeps_history_and_reference(tmp_path, fake_probe):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1), warmup_steps=0, reference_steps=2)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[guard]))
    trainer.fit(TinyModel())
    ckpt = trainer.checkpoint_callback.best_model_path
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    (saved,) = [v for k, v in state.items() if k.startswith("MemGuard")]
    assert saved["reference_rate"] == pytest.approx(80.0)
    assert "headroom" not in saved  # configuration is not state

    resumed = MemGuard(probe=fake_probe, clock=StepClock(0.1))
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[resumed]))
    trainer.fit(TinyModel(), ckpt_path=ckpt)
    assert [r.epoch for r in resumed.epochs] == [0, 1]
    assert resumed._timeline.detector.reference_rate == pytest.approx(80.0)
    resumed.load_state_dict({})  # tolerates missing keys
    assert resumed.epochs == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"headroom": 1.0}, ValueError, r"`headroom` must be in \[0, 1\), got 1.0"),
        ({"headroom": -0.1}, ValueError, r"`headroom` must be in \[0, 1\), got -0.1"),
        ({"headroom": "5%"}, TypeError, r"`headroom` must be a float, got '5%'"),
        ({"on_spill": "explode"}, ValueError, r"`on_spill` must be one of .*got 'explode'"),
        ({"capacity": "16XB"}, ValueError, r"`capacity` must be .*got '16XB'"),
        ({"capacity": 0}, ValueError, r"`capacity` must be a positive size, got 0"),
        ({"prevent": "yes"}, TypeError, r"`prevent` must be a bool, got 'yes'"),
        ({"probe": object()}, TypeError, r"`probe` must have capacity\(\), reset_peak\(\) and read\(\)"),
        ({"read_every": 0}, ValueError, r"`read_every` must be >= 1, got 0"),
        ({"warmup_steps": 1.5}, TypeError, r"`warmup_steps` must be an int, got 1.5"),
        ({"collapse": 1.0}, ValueError, r"`collapse` must be a number > 1, got 1.0"),
    ],
)
def test_bad_arguments_fail_at_once(kwargs, error, match):
    with pytest.raises(error, match=match):
        MemGuard(**kwargs)


def test_prevent_on_the_cpu_warns_once_and_guards_without_a_cap(tmp_path, fake_probe, monkeypatch):
    """One script for the laptop and the GPU box: no allocator cap on the CPU, said once; the spill is still caught."""
    capped = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *args: capped.append(args))
    fake_probe.peak = 17 * 10**9  # above the 16 GB card from the start
    guard = MemGuard(prevent=True, probe=fake_probe, warmup_steps=0)
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[guard]))
    with (
        pytest.warns(UserWarning, match=r"prevent=True\) caps the CUDA allocator, and this Trainer runs on 'cpu'"),
        pytest.raises(SysmemSpillError, match="peak 17.00 GB against 16.00 GB"),
    ):
        trainer.fit(TinyModel())
    assert capped == []


def test_barebones_trainers_are_guarded_without_logging(tmp_path, fake_probe):
    """Lightning refuses `self.log` under barebones (a warning at every call): MemGuard keeps its table only."""
    guard = MemGuard(probe=fake_probe)
    kwargs = trainer_kwargs(tmp_path, max_epochs=2, callbacks=[guard], barebones=True)
    for key in ("enable_progress_bar", "enable_model_summary", "enable_checkpointing", "logger"):
        kwargs.pop(key, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(**kwargs).fit(TinyModel(batch_size=8, n=64))
    assert not [w for w in caught if "barebones" in str(w.message)]
    assert [e.epoch for e in guard.epochs] == [0, 1]

    fake_probe.peak = 17 * 10**9  # and a spill is still stopped
    with pytest.raises(SysmemSpillError):
        Trainer(**kwargs).fit(TinyModel(batch_size=8, n=64))


def test_capacity_argument_overrides_the_probe(tmp_path, fake_probe):
    guard = MemGuard(capacity="8GiB", probe=fake_probe)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[guard]))
    trainer.fit(TinyModel())
    assert guard.epochs[0].capacity_gb == pytest.approx(8 * 2**30 / 1e9)


class _NoBatches(torch.utils.data.IterableDataset):
    """A stream that yields nothing: Lightning runs the epoch (its length is unknown), and no step is timed."""

    def __iter__(self):
        return iter(())


def test_epoch_without_timed_steps_logs_nan_not_garbage(tmp_path, fake_probe):
    guard = MemGuard(probe=fake_probe)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[guard]))
    trainer.fit(TinyModel(), train_dataloaders=DataLoader(_NoBatches(), batch_size=None))
    assert len(guard.epochs) == 1  # the epoch ran and was recorded
    assert math.isnan(guard.epochs[0].step_ms) and math.isnan(guard.epochs[0].samples_per_sec)


def test_a_spill_in_the_last_steps_of_an_epoch_is_not_lost(tmp_path, fake_probe):
    class SpillAtTheEnd(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch == 0 and batch_idx == 7:  # the epoch's last batch: no regular read follows
                fake_probe.peak = 17 * 10**9

        def on_train_epoch_start(self, trainer, pl_module):
            fake_probe.peak = 10**9  # a new epoch resets the peak

    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1), read_every=100, warmup_steps=0, reference_steps=1)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, callbacks=[SpillAtTheEnd(), guard]))
    with pytest.raises(SysmemSpillError, match="peak 17.00 GB against 16.00 GB"):
        trainer.fit(TinyModel(batch_size=8, n=64))
    assert trainer.current_epoch == 0 and trainer.global_step == 8  # stopped at that epoch's end, not one batch later


def test_memory_growing_to_the_capacity_with_collapsed_throughput_is_a_spill(tmp_path, fake_probe):
    """Signal (b) in a real Trainer: no reading above the capacity, but memory grew to it and steps got 10x slower."""
    clock = StepClock(0.1)
    fake_probe.peak = 14 * 10**9

    class Grow(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 20:
                fake_probe.peak = int(15.7 * 10**9)  # within 5 % of 16 GB, never above it
                clock.tick = 1.0

    guard = MemGuard(probe=fake_probe, clock=clock, on_spill="warn", warmup_steps=2, reference_steps=3)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[Grow(), guard]))
    with pytest.warns(RuntimeWarning, match="throughput collapsed with memory at the capacity"):
        trainer.fit(TinyModel(batch_size=2, n=64))
    assert guard.spill is not None and 20 < guard.spill.step <= 20 + 4
    assert guard.spill.slowdown == pytest.approx(10.0)


def test_a_slow_host_with_unchanged_memory_at_the_capacity_is_no_spill(tmp_path, fake_probe):
    clock = StepClock(0.1)
    fake_probe.peak = int(15.7 * 10**9)  # at the capacity from the start, and fast

    class Slow(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 20:
                clock.tick = 1.0  # the host gets busy; memory stays the same

    guard = MemGuard(probe=fake_probe, clock=clock, warmup_steps=2, reference_steps=3)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[Slow(), guard]))
    trainer.fit(TinyModel(batch_size=2, n=64))
    assert guard.spill is None and trainer.global_step == 32


def test_the_spill_message_says_what_would_fit_from_the_runs_own_readings(tmp_path, fake_probe):
    """A step starts from 1 GB and batch 64 peaks at 17 GB on a 16 GB card: 250 MB a sample, so at most 56 samples
    leave the 5 % headroom; the effective batch of 64 x 2 fits as 32 x 4, without checkpointing."""
    fake_probe.peak, fake_probe.allocated_now = 17 * 10**9 - 1000, 10**9  # (the fake's reserved peak adds 1000)
    guard = MemGuard(probe=fake_probe, warmup_steps=0)
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[guard], accumulate_grad_batches=2))
    with pytest.raises(SysmemSpillError) as caught:
        trainer.fit(TinyModel(batch_size=64, n=256))
    message = str(caught.value)
    assert "a step starts from 1.00 GB, and each sample adds 250.0 MB): a batch of at most 56 fits" in message
    assert "the effective batch of 128 fits as 32 x accumulate_grad_batches=4" in message
    assert "activation checkpointing is not needed" in message

    fake_probe.allocated_now = 15 * 10**9 + 500 * 10**6  # no room beside what a step starts from
    with pytest.raises(SysmemSpillError, match="not even a batch of one fits .* activation checkpointing"):
        Trainer(**trainer_kwargs(tmp_path, callbacks=[MemGuard(probe=fake_probe, warmup_steps=0)])).fit(
            TinyModel(batch_size=64, n=256)
        )
