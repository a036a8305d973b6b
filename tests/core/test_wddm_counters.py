"""Windows' own count of this process's GPU memory in system RAM, read through a fake ``win32pdh``.

The card is tests/fake_wddm.py's (PyTorch's counters and a WDDM NVML), the counters tests/fake_pdh.py's: scripted
per step by a callback, as Windows would report them while the driver moves memory into system RAM.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import FakeProbe, TinyModel, trainer_kwargs
from fake_pdh import GERMAN, FakePdh, PdhError
from fake_wddm import FakeWddmCard
from lightning.pytorch import Callback, Trainer

from lightning_memguard import MemGuard, SysmemSpillError
from lightning_memguard.core import Evidence, MemoryReading, Verdict, judge
from lightning_memguard.core.spill import counted_in_system_ram
from lightning_memguard.probes import CudaProbe, wddm

GB = 10**9
ME = os.getpid()  # this process, as Windows names it in the counters' instances
NVIDIA, INTEL = (0, 0xC1A8), (0, 0x95CA)  # the CUDA device's adapter and an integrated GPU's


# ---------------------------------------------------------------- the rule


def _evidence(shared, pinned=0, baseline=0, offload=0, rates=(100.0,)):
    reading = MemoryReading(8 * GB, 8 * GB, 16 * GB, 0, shared=shared, pinned=pinned)
    return Evidence(reading, 16 * GB, 0.05, 100.0, rates, 2.5, 1, shared_baseline=baseline, offload=offload)


def test_the_counter_is_decisive_above_what_is_pinned_and_offloaded_on_purpose():
    assert judge(_evidence(2 * GB + 50 * 10**6, pinned=2 * GB)).verdict is Verdict.OK  # a pin_memory loader
    assert judge(_evidence(4 * GB, pinned=2 * GB, offload=2 * GB)).verdict is Verdict.OK  # offload the user chose
    assert judge(_evidence(700 * 10**6, baseline=600 * 10**6)).verdict is Verdict.OK  # there before the run
    spill = judge(_evidence(int(4.3 * GB), pinned=2 * GB))
    assert spill.verdict is Verdict.SPILL  # PyTorch's 8 GB are far below the capacity: only Windows sees it
    assert spill.reason == "Windows counts 2.30 GB of this run's GPU memory in system RAM (Shared GPU memory)"
    slow = counted_in_system_ram(_evidence(int(4.3 * GB), pinned=2 * GB, rates=(10.0,)))
    assert slow is not None and slow.reason.endswith(", and the steps slowed down")
    assert counted_in_system_ram(_evidence(None)) is None  # not counted (not Windows): no say


# ---------------------------------------------------------------- the counters


def _pdh(language=None) -> FakePdh:
    pdh = FakePdh(language)
    pdh.process[(ME, NVIDIA)] = (7 * GB, 300 * 10**6)
    pdh.process[(ME, INTEL)] = (0, 9 * GB)  # the desktop's integrated GPU: not the CUDA device
    pdh.process[(77, NVIDIA)] = (2 * GB, 0)  # another process on the same card
    pdh.adapter[NVIDIA] = (9 * GB, 300 * 10**6)
    pdh.adapter[INTEL] = (0, 12 * GB)
    return pdh


@pytest.mark.parametrize("language", [None, GERMAN], ids=["english", "german"])
def test_the_counters_read_this_process_on_the_cuda_devices_adapter(language):
    pdh = _pdh(language)
    if language:  # a localized Windows knows its counters only by its own names, except through the English call
        with pytest.raises(PdhError):
            pdh.AddCounter(None, "\\GPU Process Memory(*)\\Shared Usage")
    counters = wddm.WddmCounters(pdh, NVIDIA, pid=ME)
    usage = counters.read()
    assert usage == wddm.WddmUsage(7 * GB, 300 * 10**6, 9 * GB, 300 * 10**6)
    counters.close()
    assert pdh.open_queries == 0


def test_without_a_luid_the_adapter_where_this_process_holds_most_is_taken():
    usage = wddm.WddmCounters(_pdh(), None, pid=ME).read()
    assert usage is not None and usage.dedicated == 7 * GB and usage.shared == 300 * 10**6
    assert wddm.WddmCounters(_pdh(), None, pid=5).read() is None  # no figure for a process before it allocates


def test_the_luid_comes_from_the_cuda_driver_high_part_first(monkeypatch):
    class Driver:
        def cuInit(self, flags):  # noqa: N802 - the CUDA driver's names
            return 0

        def cuDeviceGet(self, device, ordinal):  # noqa: N802
            device._obj.value = ordinal
            return 0

        def cuDeviceGetLuid(self, luid, mask, device):  # noqa: N802
            luid[:] = list((0xC1A8).to_bytes(4, "little") + (0x1).to_bytes(4, "little"))  # LowPart, HighPart
            return 0

    monkeypatch.setattr(wddm, "ON_WINDOWS", True)
    monkeypatch.setattr(ctypes, "WinDLL", lambda name: Driver(), raising=False)
    assert wddm.luid_of(0) == (0x1, 0xC1A8)
    monkeypatch.setattr(ctypes, "WinDLL", lambda name: (_ for _ in ()).throw(OSError("nvcuda.dll not found")))
    assert wddm.luid_of(0) is None


def test_counters_that_cannot_be_read_say_why():
    assert wddm.open_counters(0) == (None, "not Windows")  # this machine
    counters, why = wddm.open_counters(0, pdh=FakePdh(available=False))
    assert counters is None and why.startswith("Windows' GPU memory counters cannot be read (PdhError")


# ---------------------------------------------------------------- MemGuard on a Windows desktop


class _Windows:
    """The fake card, the fake counters and a clock whose steps slow down once memory goes to system RAM."""

    def __init__(self, monkeypatch, pdh: FakePdh, pinned: int = 0) -> None:
        self.card = FakeWddmCard().install(monkeypatch, cuda_available=False)
        self.card.hold(8 * GB)
        self.pdh, self.pinned, self.slow = pdh, pinned, False
        self.now = 0.0
        monkeypatch.setattr("platform.system", lambda: "Windows")
        monkeypatch.setattr("platform.release", lambda: "11")
        monkeypatch.setattr(wddm, "ON_WINDOWS", True)
        monkeypatch.setattr(wddm, "luid_of", lambda index: NVIDIA)
        monkeypatch.setitem(sys.modules, "win32pdh", pdh)
        stats = {"allocated_bytes": {"current": pinned}}
        monkeypatch.setattr(torch.cuda, "host_memory_stats_as_nested_dict", lambda: stats)
        self.counts(8 * GB, pinned + 50 * 10**6)

    def counts(self, dedicated: int, shared: int, others: int = 0) -> None:
        self.pdh.process[(ME, NVIDIA)] = (dedicated, shared)
        self.pdh.process[(77, NVIDIA)] = (others, 0)
        self.pdh.adapter[NVIDIA] = (dedicated + others, shared)

    def clock(self) -> float:
        self.now += 0.7 if self.slow else 0.1  # a spilled step runs 7x slower
        return self.now


class _Script(Callback):
    """From training step ``at`` on, ``change(step)`` sets what Windows counts."""

    def __init__(self, windows: _Windows, at: int, change) -> None:
        self.windows, self.at, self.change = windows, at, change

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.at:
            self.change(trainer.global_step)
            self.windows.slow = True


def _fit(tmp_path, windows: _Windows, script: Callback | None, **guard_args):
    probe = CudaProbe(0, others_every_s=0)
    guard = MemGuard(probe=probe, clock=windows.clock, **guard_args)
    callbacks = [script, guard] if script is not None else [guard]
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=4, callbacks=callbacks))
    return trainer, guard


def test_no_alarm_for_two_gb_pinned_by_the_loader(tmp_path, monkeypatch):
    windows = _Windows(monkeypatch, FakePdh(), pinned=2 * GB)
    trainer, guard = _fit(tmp_path, windows, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.fit(TinyModel())
    assert guard.spill is None and len(guard.epochs) == 4
    assert windows.pdh.collections >= 12  # read while warming up and measuring, and at each epoch's end


@pytest.mark.parametrize("language", [None, GERMAN], ids=["english", "german"])
def test_a_spill_growing_mid_run_is_caught_within_three_steps_with_a_checkpoint(tmp_path, monkeypatch, language):
    windows = _Windows(monkeypatch, FakePdh(language), pinned=2 * GB)
    grow = _Script(windows, 20, lambda step: windows.counts(8 * GB, 2 * GB + 50 * 10**6 + (step - 19) * 1150 * 10**6))
    trainer, guard = _fit(tmp_path, windows, grow)
    with pytest.raises(SysmemSpillError, match="1.15 GB of this run's GPU memory is in system RAM") as err:
        trainer.fit(TinyModel())
    assert err.value.report is not None and err.value.report.step <= 20 + 3
    assert "Detected by: Windows counts 1.15 GB" in str(err.value) and "Prefer No Sysmem Fallback" in str(err.value)
    assert guard.checkpoint_path is not None and torch.load(guard.checkpoint_path, weights_only=False)["global_step"]


def test_another_process_that_pushes_this_run_out_is_caught(tmp_path, monkeypatch):
    """A game starts beside the run: it takes 6 GB of the card and the driver moves 1.5 GB of ours to system RAM,
    while PyTorch's own figures (8 GB) and the device's (8 + 6 GB used of 16) stay below the capacity."""
    windows = _Windows(monkeypatch, FakePdh())
    windows.card.desktop = 0

    def game(step):
        windows.card.desktop = 6 * GB
        windows.counts(int(6.5 * GB), int(1.5 * GB) + 50 * 10**6, others=6 * GB)

    trainer, guard = _fit(tmp_path, windows, _Script(windows, 20, game), on_spill="stop")
    with pytest.warns(RuntimeWarning, match="1.50 GB of this run's GPU memory is in system RAM"):
        trainer.fit(TinyModel())
    assert guard.spill is not None and guard.spill.reason.startswith("Windows counts 1.50 GB")
    assert guard.spill.used_bytes < 16 * GB * 0.95  # no other signal could have seen it
    assert trainer.global_step <= 20 + 3


def test_where_the_counters_cannot_be_read_one_notice_and_the_other_signals(tmp_path, monkeypatch):
    windows = _Windows(monkeypatch, FakePdh(available=False))
    grow = _Script(windows, 20, lambda step: windows.card.hold(17 * GB))  # above the card: seen without counters
    trainer, guard = _fit(tmp_path, windows, grow)
    with (
        pytest.warns(RuntimeWarning) as said,
        pytest.raises(SysmemSpillError, match=r"peak 18\.50 GB .*counting 1\.50 GB that other"),
    ):
        trainer.fit(TinyModel())
    notices = [w for w in said if "cannot read how much of this run's GPU memory Windows" in str(w.message)]
    assert len(notices) == 1 and "infers a spill from PyTorch's and NVML's figures" in str(notices[0].message)
    assert guard.spill is not None and guard.spill.in_system_ram is None


def test_the_preflight_is_confirmed_by_the_counter(monkeypatch):
    windows = _Windows(monkeypatch, FakePdh())
    probe = CudaProbe(0)
    real_empty = torch.empty

    def overallocate(size, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":  # the driver places 0.26 GB in system RAM
            windows.counts(16 * GB, 50 * 10**6 + 268 * 10**6)
            return real_empty(1)
        return real_empty(size, *args, **kwargs)

    monkeypatch.setattr(torch, "empty", overallocate)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    from lightning_memguard.callbacks._prevention import run_preflight

    with pytest.warns(RuntimeWarning, match=r"card has succeeded \(Windows counted 0.27 GB of it in system RAM\)"):
        assert run_preflight(probe) is True
    assert probe.preflight_moved == 268 * 10**6


def test_the_doctor_shows_what_windows_counts(monkeypatch):
    from lightning_memguard.commands.doctor import collect, format_report

    windows = _Windows(monkeypatch, FakePdh())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    windows.counts(7 * GB, 300 * 10**6, others=2 * GB)
    info = collect()
    assert info["windows_counters"] == {
        "dedicated_gb": 7.0, "shared_gb": 0.3, "adapter_dedicated_gb": 9.0, "adapter_shared_gb": 0.3,
    }  # fmt: skip
    report = format_report(info)
    assert "this process 7.0 GB dedicated, 0.3 GB shared; the adapter 9.0 / 0.3 GB" in report
    report.encode("cp1252")
    monkeypatch.setitem(sys.modules, "win32pdh", None)  # pywin32 missing
    monkeypatch.setitem(sys.modules, "triton", None)  # PyTorch's Windows wheels bring no Triton
    info = collect()
    assert info["windows_counters"] == "pywin32 is not installed (`pip install pywin32`)"
    # the pip line pairs with the installed torch, from its own metadata (this torch's Linux wheel names its Triton)
    assert re.fullmatch(
        r'missing: pip install -U "triton-windows>=3\.\d+,<3\.\d+"',  # no PyPI name: the package is not on PyPI
        info["triton"],
    ), info["triton"]


def test_a_fake_probe_without_the_count_is_judged_as_before(tmp_path):
    guard = MemGuard(probe=FakeProbe(peak=17 * GB), on_spill="stop")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[guard]))
    with pytest.warns(RuntimeWarning, match="Detected by: peak memory above the physical capacity"):
        trainer.fit(TinyModel())
    assert guard.spill is not None and guard.spill.in_system_ram is None


def test_the_windows_extra_and_pywin32_install_nothing_elsewhere():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    windows_only = [Requirement(r) for r in project["optional-dependencies"]["windows"]]
    windows_only += [Requirement(r) for r in project["dependencies"] if r.startswith("pywin32")]
    assert {r.name for r in windows_only} == {"triton-windows", "pywin32"}
    for requirement in windows_only:
        assert requirement.marker is not None
        assert not requirement.marker.evaluate({"sys_platform": "linux"})  # a no-op on Linux (and macOS)
        assert requirement.marker.evaluate({"sys_platform": "win32"})


class _CountedProbe(FakeProbe):
    """A card whose driver already counts 1 GB of this process in system RAM before the trials (another stage of
    the script, an earlier fit), and counts ``extra`` more once a trial's batch reaches ``spills_from``."""

    def __init__(self, spills_from: int | None = None) -> None:
        super().__init__(capacity=16 * GB, peak=2 * GB)
        self.model, self.spills_from = TinyModel(n=128), spills_from

    def read(self) -> MemoryReading:
        reading = super().read()
        extra = 2 * GB if self.spills_from is not None and self.model.batch_size >= self.spills_from else 0
        return MemoryReading(reading.peak_allocated, reading.peak_reserved, reading.capacity, 0, shared=GB + extra)


@pytest.mark.parametrize("spills_from", [None, 16], ids=["counted_before", "spills_at_16"])
def test_the_trials_judge_the_counter_from_the_baseline_before_them(tmp_path, spills_from):
    from tuner_helpers import BatchClock

    from lightning_memguard import BatchSizeTuner

    probe = _CountedProbe(spills_from)
    clock = BatchClock()  # throughput rises with the size, whatever this CPU's speed (a timed step of 16 ran faster)
    tuner = BatchSizeTuner(
        init_size=4, max_size=32, cache=False, warmup_steps=1, timed_steps=1, probe=probe, clock=clock
    )
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[clock, tuner]))
    trainer.fit(probe.model)  # the tuner sets the model's batch_size for each trial
    outcomes = {r.size: r.outcome for r in tuner.results}
    if spills_from is None:  # the 1 GB was there before: no size spills
        assert set(outcomes.values()) == {"ok"} and tuner.batch_size == max(outcomes)
    else:  # 2 GB more in system RAM from size 16 on: spills, and the tuner stays below
        assert outcomes[16] == "spill" and tuner.batch_size == 8


class _Offloader:
    """What MemGuard reads of an ActivationOffload given as ``offload``: the pinned host bytes it holds now."""

    host_bytes = 0


class _OffloadMore(Callback):
    """From step 20 on, the offloader holds 1.15 GB more each step, and Windows counts it in system RAM."""

    def __init__(self, windows: _Windows, offloader: _Offloader) -> None:
        self.windows, self.offloader = windows, offloader

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= 20:
            self.offloader.host_bytes = (trainer.global_step - 19) * 1150 * 10**6
            self.windows.counts(8 * GB, 2 * GB + 50 * 10**6 + self.offloader.host_bytes)


@pytest.mark.parametrize("declared", [True, False])
def test_an_offloader_given_to_memguard_is_read_at_every_reading(tmp_path, monkeypatch, declared):
    """What the offloader holds grows as it runs: MemGuard reads it again with each reading, so Windows' count of it is
    no spill; the same bytes not declared are one."""
    windows = _Windows(monkeypatch, FakePdh(), pinned=2 * GB)
    offloader = _Offloader()
    trainer, guard = _fit(tmp_path, windows, _OffloadMore(windows, offloader), on_spill="stop",
                          **({"offload": offloader} if declared else {}))  # fmt: skip
    if declared:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            trainer.fit(TinyModel())
        assert guard.spill is None and len(guard.epochs) == 4 and offloader.host_bytes > 10 * GB
    else:
        with pytest.warns(RuntimeWarning, match="of this run's GPU memory is in system RAM"):
            trainer.fit(TinyModel())
        assert guard.spill is not None and guard.spill.reason.startswith("Windows counts")
