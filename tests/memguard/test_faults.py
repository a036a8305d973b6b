"""Nothing lost under faults: a full disk or a kill while the spill checkpoint is written, a kill during the trials,
Ctrl+C at each step of the trials' restore. Each test asserts what is on disk afterwards and the model's state."""

from __future__ import annotations

import errno
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import FakeProbe, StepClock, TinyModel, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from tuner_helpers import BatchClock

from lightning_memguard import BatchSizeTuner, MemGuard, SysmemSpillError
from lightning_memguard.tuning import trials as _trials

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the scripts beside conftest.py
ROOT = os.path.dirname(TESTS)


class SpillAt(Callback):
    """From optimizer step ``at`` on, the probe's peak is twice the card: a decisive spill."""

    def __init__(self, probe: FakeProbe, at: int) -> None:
        self.probe, self.at = probe, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.at:
            self.probe.peak = 2 * self.probe.capacity()


def spilling_run(tmp_path, on_spill="raise", **guard_kwargs):
    probe = FakeProbe()
    guard = MemGuard(
        probe=probe, on_spill=on_spill, warmup_steps=1, reference_steps=1, clock=StepClock(), **guard_kwargs
    )
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, callbacks=[SpillAt(probe, 3), guard]))
    return guard, trainer


def full_disk(monkeypatch, trainer) -> None:
    """The disk fills up halfway through writing: a partial file, then ENOSPC."""

    def write(checkpoint, path, storage_options=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.strategy.checkpoint_io, "save_checkpoint", write)


def files_under(folder) -> list[str]:
    """The files under ``folder``, but the memory reports beside a spill checkpoint
    (tests/memguard/test_memguard_reports.py)."""
    found = [p for p in pathlib.Path(folder).rglob("*") if p.is_file() and not p.name.startswith("memguard-report-")]
    return sorted(str(p.relative_to(folder)) for p in found)


# ---------------------------------------------------------------- the spill checkpoint


def test_the_spill_checkpoint_goes_where_lightning_writes_checkpoints_and_loads(tmp_path):
    guard, trainer = spilling_run(tmp_path)
    with pytest.raises(SysmemSpillError) as info:
        trainer.fit(TinyModel())
    path = info.value.checkpoint_path
    assert path == guard.checkpoint_path and path in str(info.value)
    assert os.path.dirname(path) == os.path.join(tmp_path, "checkpoints")
    assert files_under(tmp_path) == [os.path.join("checkpoints", os.path.basename(path))]  # no temporary left
    assert torch.load(path, weights_only=False)["global_step"] == trainer.global_step


def test_the_spill_checkpoint_follows_model_checkpoint_a_chosen_folder_or_none(tmp_path):
    keeper = ModelCheckpoint(dirpath=tmp_path / "mine", save_top_k=0)
    probe = FakeProbe()
    guard = MemGuard(probe=probe, warmup_steps=1, reference_steps=1, clock=StepClock())
    trainer = Trainer(
        **trainer_kwargs(
            tmp_path, max_epochs=3, enable_checkpointing=True, callbacks=[keeper, SpillAt(probe, 3), guard]
        )
    )
    with pytest.raises(SysmemSpillError):
        trainer.fit(TinyModel())
    assert os.path.dirname(guard.checkpoint_path) == str(tmp_path / "mine")

    guard, trainer = spilling_run(tmp_path / "b", spill_checkpoint=tmp_path / "chosen")
    with pytest.raises(SysmemSpillError):
        trainer.fit(TinyModel())
    assert os.path.dirname(guard.checkpoint_path) == str(tmp_path / "chosen") and os.path.exists(guard.checkpoint_path)

    guard, trainer = spilling_run(tmp_path / "c", spill_checkpoint=False)
    with pytest.raises(SysmemSpillError) as info:
        trainer.fit(TinyModel())
    assert guard.checkpoint_path is None and info.value.checkpoint_path is None
    assert files_under(tmp_path / "c") == []


@pytest.mark.parametrize("on_spill", ["raise", "stop"])
def test_a_full_disk_still_reports_the_spill_and_leaves_no_partial_file(tmp_path, monkeypatch, on_spill):
    guard, trainer = spilling_run(tmp_path, on_spill=on_spill)
    full_disk(monkeypatch, trainer)
    if on_spill == "raise":
        with pytest.raises(SysmemSpillError, match="could not be written: OSError.*No space left") as info:
            trainer.fit(TinyModel())
        assert info.value.checkpoint_path is None
    else:
        with pytest.warns(RuntimeWarning, match="could not be written: OSError.*No space left"):
            trainer.fit(TinyModel())
        assert trainer.should_stop and trainer.state.finished and trainer.global_step < 3 * 8
    assert guard.checkpoint_path is None and "No space left" in guard.checkpoint_error
    assert files_under(tmp_path) == []  # neither the partial temporary nor a file under the final name


def run_child(script: str, tmp_path, **env) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter with its own HOME and temporary folder (both under ``tmp_path``)."""
    home, temp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir(exist_ok=True)
    temp.mkdir(exist_ok=True)
    environ = {
        **os.environ,
        "HOME": str(home),
        "TMPDIR": str(temp),
        "PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.path.dirname(os.path.abspath(__file__))]),
        **env,
    }
    header = "import os, signal, sys\nsys.path[:0] = [os.environ['PYTHONPATH']]\n"
    return subprocess.run(
        [sys.executable, "-c", header + textwrap.dedent(script)],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


KILLED_WHILE_SAVING = """
    from conftest import TinyModel
    from test_faults import spilling_run

    guard, trainer = spilling_run(os.environ["RUN_DIR"])

    def write(checkpoint, path, storage_options=None):
        with open(path, "wb") as f:
            f.write(b"\\0" * 1000)
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    trainer.strategy.checkpoint_io.save_checkpoint = write
    trainer.fit(TinyModel())
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL is POSIX")
def test_a_kill_while_the_spill_checkpoint_is_written_leaves_no_file_under_its_name(tmp_path):
    run_dir = tmp_path / "run"
    child = run_child(KILLED_WHILE_SAVING, tmp_path, RUN_DIR=str(run_dir))
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    left = files_under(run_dir)
    assert len(left) == 1 and os.path.basename(left[0]).startswith(".memguard-spill-step=")  # hidden temporary
    assert not any(os.path.basename(f).startswith("memguard-spill") for f in left)

    # the next spill written there removes the dead process's temporary and writes a checkpoint that loads
    guard, trainer = spilling_run(run_dir)
    with pytest.raises(SysmemSpillError):
        trainer.fit(TinyModel())
    assert files_under(run_dir) == [os.path.relpath(guard.checkpoint_path, run_dir)]
    assert torch.load(guard.checkpoint_path, weights_only=False)["global_step"] > 0


# ---------------------------------------------------------------- the trials


KILLED_IN_A_TRIAL = """
    from conftest import FakeProbe, TinyModel, trainer_kwargs
    from lightning.pytorch import Callback, Trainer
    from tuner_helpers import BatchClock
    from lightning_memguard import BatchSizeTuner

    class Kill(Callback):
        memguard_keep_in_trials = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if pl_module.batch_size == int(os.environ["KILL_AT_SIZE"]):
                os.kill(os.getpid(), signal.SIGKILL)

    clock = BatchClock()
    tuner = BatchSizeTuner(init_size=2, max_size=16, probe=FakeProbe(), clock=clock, cache=False)
    root = os.environ["RUN_DIR"]
    trainer = Trainer(**trainer_kwargs(root, max_steps=2, callbacks=[clock, Kill(), tuner]))
    trainer.fit(TinyModel())
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL is POSIX")
def test_a_run_killed_during_the_trials_leaves_nothing_on_disk(tmp_path):
    child = run_child(KILLED_IN_A_TRIAL, tmp_path, RUN_DIR=str(tmp_path / "run"), KILL_AT_SIZE="8")
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert files_under(tmp_path / "run") == [] and files_under(tmp_path / "tmp") == []
    assert not list(tmp_path.glob("**/.memguard_trials_*"))


class Watch(Callback):
    """Inside the trials: the files in the run's folder, and the model's first weight."""

    memguard_keep_in_trials = True

    def __init__(self, root) -> None:
        self.root, self.files = root, set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.files.update(files_under(self.root))


class LoadHook(TinyModel):
    def __init__(self) -> None:
        super().__init__(n=64)
        self.loaded = 0

    def on_load_checkpoint(self, checkpoint) -> None:
        self.loaded += 1


def test_the_trials_keep_the_original_state_in_memory_and_never_call_on_load_checkpoint(tmp_path):
    clock = BatchClock()
    watch = Watch(tmp_path)
    model = LoadHook()
    tuner = BatchSizeTuner(init_size=2, max_size=16, probe=FakeProbe(), clock=clock, cache=False)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=1, callbacks=[clock, watch, tuner]))
    trainer.fit(model)
    assert tuner.results and watch.files == set()  # nothing written while the trials ran
    assert model.loaded == 0  # nothing was resumed


RESTORE_STEPS = ["set_batch_size", "load_training_state", "reload_train_dataloader", "set_rng_states"]


class Interrupt(Callback):
    """Ctrl+C at the second trial's first batch (raised as the signal would be)."""

    memguard_keep_in_trials = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.batch_size == 4:
            signal.raise_signal(signal.SIGINT)


@pytest.fixture
def ctrl_c_interrupts():
    """Ctrl+C raises KeyboardInterrupt, as in a terminal: pytest-xdist's workers ignore SIGINT (the controller
    handles it), and under them the signal these tests raise would do nothing."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, handler)


def original_state(model: TinyModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("where", ["trial", *RESTORE_STEPS])
@pytest.mark.usefixtures("ctrl_c_interrupts")
def test_ctrl_c_during_a_trial_or_at_any_step_of_the_restore_keeps_the_original_model(tmp_path, monkeypatch, where):
    if where != "trial":  # the signal arrives as this step of the restore starts
        original = getattr(_trials, where)
        calls = []

        def interrupted(*args, **kwargs):
            if not calls:
                calls.append(1)
                signal.raise_signal(signal.SIGINT)
            return original(*args, **kwargs)

        restore = _trials.TrialSession._restore

        def restoring(self):
            monkeypatch.setattr(_trials, where, interrupted)
            restore(self)

        monkeypatch.setattr(_trials.TrialSession, "_restore", restoring)
    handler = signal.getsignal(signal.SIGINT)
    clock = BatchClock()
    model = TinyModel(n=64)
    before = original_state(model)
    tuner = BatchSizeTuner(init_size=2, max_size=16, probe=FakeProbe(), clock=clock, cache=False)
    callbacks = [clock, tuner] if where != "trial" else [clock, Interrupt(), tuner]
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=3, callbacks=callbacks))
    with pytest.raises(SystemExit):  # Lightning's answer to Ctrl+C inside fit
        trainer.fit(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # not one trial step kept
    assert trainer.global_step == 0 and model.batch_size == 8
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl+C works again afterwards

    monkeypatch.undo()
    again = Trainer(**trainer_kwargs(tmp_path, max_steps=3, callbacks=[clock, tuner]))
    again.fit(model)  # the model trains normally afterwards
    assert again.global_step == 3


def test_the_sweeps_table_and_picture_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """`memguard sweep` writes sweep.csv and sweep.png: a failure halfway (a full disk) leaves neither, nor a
    temporary file, and an earlier complete file stays as it was."""
    from lightning_memguard.commands import sweep
    from lightning_memguard.core.epoch_record import SweepRow

    rows = [SweepRow(32, 10.0, 1.0, 3200.0, "ok"), SweepRow(64, 18.0, 2.0, 3555.0, "ok")]
    table, picture = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    sweep.write_csv(rows, str(table))
    earlier = table.read_text(encoding="utf-8")

    def no_space(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SweepRow, "to_dict", no_space)  # the rows cannot be written
    with pytest.raises(OSError, match="No space left"):
        sweep.write_csv(rows, str(table))
    assert table.read_text(encoding="utf-8") == earlier
    monkeypatch.undo()

    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: no_space(self))
    with pytest.raises(OSError, match="No space left"):
        sweep.plot(rows, 16.0, str(picture), "sweep")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.csv"]
