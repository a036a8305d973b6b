"""MemGuard when a stopped run goes on: resumed from its own spill checkpoint in the same process (a notebook, a retry
loop) on the same card, and each batch trained once across the stopped run and the resumed one. The card is the
emulator on the CPU; time is virtual, so nothing here depends on this machine's speed."""

from __future__ import annotations

import pytest
from conftest import trainer_kwargs
from lightning.pytorch import Trainer
from test_spill import VirtualTime, measured_need

from lightning_memguard import MemGuard, SysmemSpillError
from lightning_memguard.core.units import to_gb
from lightning_memguard.testing import ImageClassifier, SysmemSpillEmulator

# resnet18 on 64-pixel images: about 137 MB at batch 2, 160 MB at batch 16 on the emulated card
CARD = 150_000_000
STEPS = 12


class Counted(ImageClassifier):
    """Records the (epoch, batch index) of every training step it runs."""

    def __init__(self, seen: list[tuple[int, int]], batch_size: int) -> None:
        super().__init__("resnet18", image_size=64, batch_size=batch_size, steps_per_epoch=STEPS, pool_size=16)
        self.seen = seen

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)


def spill_and_stop(tmp_path, on_spill: str = "stop"):
    """A run at batch 16 on a 150 MB card, stopped by MemGuard's spill checkpoint mid-epoch: the emulator (the card),
    the guard, the checkpoint and the batches the run trained."""
    time = VirtualTime()
    emu = SysmemSpillEmulator(capacity=CARD, sleep=time.sleep)
    guard = MemGuard(probe=emu.probe, on_spill=on_spill, warmup_steps=3, clock=time.clock)
    seen: list[tuple[int, int]] = []
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[emu, guard]))
    if on_spill == "stop":
        with pytest.warns(RuntimeWarning, match="MemGuard stopped the Trainer"):
            trainer.fit(Counted(seen, batch_size=16))
    else:
        with pytest.raises(SysmemSpillError):
            trainer.fit(Counted(seen, batch_size=16))
    assert guard.spill is not None and guard.spill.used_bytes > CARD
    assert guard.checkpoint_path is not None and 0 < trainer.global_step < STEPS  # mid-epoch
    return emu, guard, guard.checkpoint_path, seen


def test_a_run_resumed_from_its_spill_checkpoint_in_the_same_process_is_judged_by_its_own_readings(tmp_path):
    emu, guard, path, _ = spill_and_stop(tmp_path)

    # the same process, the same card and the same guard (a retry loop): the fit goes on from the checkpoint, mid-epoch,
    # with a smaller batch
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[emu, guard]))
    trainer.fit(Counted([], batch_size=2), ckpt_path=path)
    assert not trainer.should_stop and trainer.global_step == STEPS
    assert guard.spill is None and guard.checkpoint_path is None

    need = measured_need(lambda: Counted([], batch_size=2))
    assert need < (1 - guard.headroom) * CARD  # well below the card: nothing to stop
    logged = float(trainer.callback_metrics["memguard/peak_allocated_gb"])
    assert [r.epoch for r in guard.epochs] == [0] and guard.epochs[0].peak_allocated_gb == pytest.approx(logged)
    assert logged == pytest.approx(to_gb(need), rel=0.01)  # this run's peak, not the spilling run's
