"""Windows, as far as Linux can check it: a desktop's share of the card under WDDM, the doctor, and an import of
every module where the modules Windows lacks cannot be imported."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from conftest import StepClock, TinyModel, trainer_kwargs
from fake_wddm import GB, FakeWddmCard
from lightning.pytorch import Callback, Trainer

import lightning_memguard.callbacks._prevention as mg
from lightning_memguard import MemGuard, SysmemSpillError
from lightning_memguard.commands.doctor import collect, format_report
from lightning_memguard.probes import CudaProbe

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "lightning_memguard"
DESKTOP = 1_500_000_000
MARGIN = 512 * 2**20


def _cuda_trainer() -> types.SimpleNamespace:
    return types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)), world_size=1)


# ---------------------------------------------------------------- other processes on a desktop


def test_wddm_others_are_the_device_wide_use_less_this_run(monkeypatch):
    card = FakeWddmCard().install(monkeypatch)
    probe = CudaProbe(0, others_every_s=0)
    assert probe.other_processes() == DESKTOP  # before training: the desktop alone
    card.hold(6 * GB)
    reading = probe.read()
    assert reading.other_processes == DESKTOP
    assert reading.used == 6 * GB + DESKTOP
    assert probe.driver_info() == {"driver_version": "566.36", "driver_model": "WDDM"}


def test_linux_per_process_figures_are_kept(monkeypatch):
    card = FakeWddmCard().install(monkeypatch)
    nvml = sys.modules["pynvml"]
    nvml.nvmlDeviceGetDriverModel = lambda handle: (_ for _ in ()).throw(RuntimeError("Not Supported"))
    proc = types.SimpleNamespace
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [proc(pid=os.getpid(), usedGpuMemory=card.reserved)]
    nvml.nvmlDeviceGetGraphicsRunningProcesses = lambda h: [proc(pid=7, usedGpuMemory=300 * 10**6)]  # Xorg
    monkeypatch.setattr("platform.system", lambda: "Linux")
    monkeypatch.setattr("platform.release", lambda: "6.8.0-generic")
    assert CudaProbe(0).other_processes() == 300 * 10**6


def test_unknown_others_are_unknown_not_zero(monkeypatch):
    FakeWddmCard().install(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # NVML cannot load
    with pytest.warns(RuntimeWarning, match="NVML is unavailable"):
        assert CudaProbe(0).read().other_processes is None
    info = collect()
    assert info["other_processes_gb"] is None
    assert "other processes           unknown" in format_report(info)


def test_prevent_leaves_the_desktop_its_share_and_a_margin(monkeypatch):
    card = FakeWddmCard().install(monkeypatch)
    monkeypatch.setattr(mg.platform, "system", lambda: "Windows")
    monkeypatch.setattr(mg.platform, "release", lambda: "11")
    said = []
    monkeypatch.setattr(mg, "rank_zero_info", said.append)
    guard = MemGuard(prevent=True)
    trainer = _cuda_trainer()
    with pytest.warns(UserWarning, match="under a WDDM driver.*Prefer No Sysmem Fallback"):
        guard.setup(trainer, None, "fit")
    guard.on_fit_start(trainer, None)
    assert card.fractions == [pytest.approx((16 * GB - DESKTOP - MARGIN) / (16 * GB))]
    assert card.fractions[0] * 16 * GB < 16 * GB - DESKTOP
    assert any("other processes hold 1.50 GB" in line and "PyTorch may use 13.96 GB" in line for line in said)
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    guard.on_exception(trainer, None, err)
    assert "16.00 GB capacity less other processes' 1.50 GB and a margin of 0.54 GB" in str(err)
    guard.teardown(trainer, None, "fit")
    assert card.fractions[-1] == 1.0


def test_prevent_without_nvml_warns_that_others_are_unknown(monkeypatch):
    card = FakeWddmCard().install(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    guard = MemGuard(prevent=True, prevent_margin="1GB")
    trainer = _cuda_trainer()
    guard._probe = CudaProbe(0)
    with pytest.warns(RuntimeWarning, match="other processes' use of this GPU is unknown"):
        guard.on_fit_start(trainer, None)
    assert card.fractions == [pytest.approx(15 / 16)]


class _Grows(Callback):
    """From training step ``at`` on, PyTorch holds ``after`` bytes of the card (before: ``before``)."""

    def __init__(self, card: FakeWddmCard, at: int, before: int, after: int) -> None:
        self.card, self.at, self.before, self.after = card, at, before, after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.card.hold(self.after if trainer.global_step >= self.at else self.before)


def test_spill_that_reaches_capacity_less_the_desktop_is_stopped(monkeypatch, tmp_path):
    """15.0 GB of PyTorch memory on a 16 GB card of which the desktop holds 1.5 GB: the card is full."""
    card = FakeWddmCard().install(monkeypatch, cuda_available=False)
    guard = MemGuard(probe=CudaProbe(0, others_every_s=0), read_every=1, clock=StepClock())
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[_Grows(card, 6, 8 * GB, 15 * GB), guard]))
    with pytest.raises(
        SysmemSpillError, match=r"peak 16\.50 GB against 16\.00 GB of physical memory \(counting 1\.50 GB that other"
    ):
        trainer.fit(TinyModel())
    assert guard.spill is not None and guard.spill.other_bytes == DESKTOP


def test_doctor_names_wddm_and_the_desktops_share(monkeypatch):
    FakeWddmCard().install(monkeypatch)
    monkeypatch.setattr("platform.system", lambda: "Windows")
    monkeypatch.setattr("platform.release", lambda: "11")
    info = collect()
    assert info["driver_model"] == "WDDM"
    assert info["other_processes_gb"] == 1.5
    assert info["verdict"].startswith("possible: turn it off with NVIDIA Control Panel")
    report = format_report(info)
    assert "driver model              WDDM" in report and "other processes           1.5 GB" in report
    report.encode("cp1252")  # a Windows console


def test_doctor_names_a_cpu_only_pytorch_on_a_machine_with_a_gpu(monkeypatch):
    FakeWddmCard().install(monkeypatch, cuda_available=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr("platform.system", lambda: "Windows")
    monkeypatch.setattr("platform.release", lambda: "11")
    info = collect()
    assert info["gpu"] == "NVIDIA GeForce RTX 4080 SUPER (seen by NVML; PyTorch cannot use it)"
    assert info["verdict"].startswith("unknown: this PyTorch is a CPU-only build, but NVML sees a NVIDIA GeForce")
    assert "--index-url https://download.pytorch.org/whl/cu" in info["verdict"]
    assert "CPU-only build" in format_report(info)


def test_doctor_gives_wsl2_its_own_advice(monkeypatch):
    FakeWddmCard().install(monkeypatch)
    nvml = sys.modules["pynvml"]
    nvml.nvmlDeviceGetDriverModel = lambda handle: (_ for _ in ()).throw(RuntimeError("Not Supported"))
    monkeypatch.setattr("platform.system", lambda: "Linux")
    monkeypatch.setattr("platform.release", lambda: "5.15.153.1-microsoft-standard-WSL2")
    info = collect()
    assert info["os"].endswith("(WSL2)") and info["driver_model"] == "WDDM, through the Windows host"
    assert "Windows host's NVIDIA Control Panel -> Manage 3D Settings -> Global Settings" in info["verdict"]
    assert info["other_processes_gb"] == 1.5  # the device-wide figure: WSL2 lists no per-process use either


# ---------------------------------------------------------------- the package where Windows' modules are missing

_UNIX_ONLY = ["resource", "fcntl", "termios", "pwd", "grp", "posix", "pty", "tty", "crypt", "syslog", "readline"]

_WINDOWS_LIKE = textwrap.dedent(
    """
    import importlib, os, pkgutil, sys
    # third-party libraries import their own platform's modules; ours must import nothing that Windows lacks
    import psutil, torch, lightning  # noqa: F401
    for name in {unix_only!r}:
        sys.modules[name] = None  # `import name` now raises ImportError, as on Windows
    del os.sysconf
    import lightning_memguard
    for info in pkgutil.walk_packages(lightning_memguard.__path__, "lightning_memguard."):
        importlib.import_module(info.name)
    {body}
    """
)

_TRAIN = textwrap.dedent(
    """
    from lightning import Trainer
    from lightning_memguard import BatchSizeTuner, MemGuard
    from lightning_memguard.probes import CpuProbe
    from lightning_memguard.testing import SysmemSpillEmulator
    sys.path.insert(0, 'tests')
    from conftest import TinyModel
    emu = SysmemSpillEmulator(capacity="1TB")
    tuner = BatchSizeTuner(init_size=4, max_size=8, cache=False, warmup_steps=1, timed_steps=1, probe=emu.probe)
    guard = MemGuard(probe=emu.probe)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[emu, tuner, guard], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, default_root_dir=sys.argv[1])
    trainer.fit(TinyModel())
    host = CpuProbe()
    host.reset_peak()
    print("trained", tuner.batch_size in (4, 8), len(guard.epochs), host.read().peak_allocated > 0)
    """
)


_DOCTOR = "from lightning_memguard.commands.cli import main\nprint('doctor exit', main(['doctor']))"

_COUNTERS = textwrap.dedent(
    """
    from _pytest.monkeypatch import MonkeyPatch
    sys.path.insert(0, 'tests')
    from fake_pdh import GERMAN, FakePdh
    from fake_wddm import FakeWddmCard
    from lightning_memguard.core import Evidence, judge
    from lightning_memguard.probes import CudaProbe, wddm
    patch = MonkeyPatch()
    FakeWddmCard().install(patch, cuda_available=False)
    patch.setattr(torch.cuda, "host_memory_stats_as_nested_dict", lambda: {"allocated_bytes": {"current": 10**9}})
    pdh = FakePdh(GERMAN)  # a German Windows
    pdh.process[(os.getpid(), (0, 0xC1A8))] = (7 * 10**9, 3_300_000_000)
    pdh.adapter[(0, 0xC1A8)] = (9 * 10**9, 3_300_000_000)
    patch.setitem(sys.modules, "win32pdh", pdh)
    patch.setattr(wddm, "ON_WINDOWS", True)
    patch.setattr(wddm, "luid_of", lambda index: (0, 0xC1A8))
    reading = CudaProbe(0).read()
    print("counted", reading.shared, reading.pinned, judge(Evidence(reading, 16 * 10**9)).reason)
    """
)


def _run_windows_like(bodies: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """One fresh interpreter without Unix's modules runs each body in turn, each after a line naming it, a failing one
    printing its traceback and the next still running (one interpreter: the imports are the slow part)."""
    body = "import traceback\n" + "".join(
        f"print('== {name}', flush=True)\ntry:\n{textwrap.indent(code, '    ')}\nexcept BaseException:\n"
        f"    print('!! {name}'); traceback.print_exc(file=sys.stdout)\n"
        for name, code in bodies.items()
    )
    script = _WINDOWS_LIKE.format(unix_only=_UNIX_ONLY, body=body)
    env = {**os.environ, "PYTHONIOENCODING": "cp1252:strict", "USERNAME": "tester"}  # a Windows console
    return subprocess.run(
        [sys.executable, "-c", script, *args], cwd=PACKAGE.parent, env=env, capture_output=True, text=True,
        encoding="cp1252", timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def windows_like(tmp_path_factory) -> dict[str, str]:
    """What each body printed (training, the doctor, the counters), from one interpreter without Unix's modules."""
    done = _run_windows_like(
        {"train": _TRAIN, "doctor": _DOCTOR, "counters": _COUNTERS}, str(tmp_path_factory.mktemp("w"))
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sections, name = {}, None
    for line in done.stdout.splitlines():
        if line.startswith("== "):
            name = line[3:]
            sections[name] = ""
        elif name is not None:
            sections[name] += line + "\n"
    return sections


def _section(windows_like: dict[str, str], name: str) -> list[str]:
    out = windows_like.get(name)
    assert out is not None and f"!! {name}" not in out, out
    return out.strip().splitlines()


def test_every_module_imports_and_trains_without_unix_modules(windows_like):
    assert _section(windows_like, "train")[-1] == "trained True 1 True"


def test_the_doctor_prints_on_a_windows_console_without_unix_modules(windows_like):
    out = _section(windows_like, "doctor")
    assert out[-1] == "doctor exit 0" and "sysmem fallback" in "\n".join(out)


def test_the_windows_counter_probe_reads_through_the_fake_without_unix_modules(windows_like):
    last = _section(windows_like, "counters")[-1]
    counted = "Windows counts 2.30 GB of this run's GPU memory in system RAM (Shared GPU memory)"
    assert last == f"counted 3300000000 1000000000 {counted}"


def test_the_windows_probe_reads_the_peak_working_set(monkeypatch):
    import lightning_memguard.probes.cpu as cpu

    monkeypatch.setattr(cpu.sys, "platform", "win32")
    monkeypatch.setattr(cpu.psutil, "Process", lambda: types.SimpleNamespace(
        memory_info=lambda: types.SimpleNamespace(peak_wset=3 * GB, rss=GB)))  # fmt: skip
    probe = cpu.CpuProbe()
    assert probe.read().peak_allocated == 3 * GB


def test_package_text_is_encodable_for_a_windows_console():
    """Every message the package can print goes through cp1252 on an older Windows console."""
    for path in PACKAGE.rglob("*.py"):
        path.read_text(encoding="utf-8").encode("cp1252")  # raises UnicodeEncodeError naming the character


def test_python_dash_m_runs_the_command():
    """Where pip's console script is not on the PATH (a venv not activated, Windows), the module is the command."""
    done = subprocess.run(
        [sys.executable, "-m", "lightning_memguard", "doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"verdict"' in done.stdout
    bad = subprocess.run([sys.executable, "-m", "lightning_memguard", "sweep", "--batch-sizes", "0"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
