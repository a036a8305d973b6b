"""MemGuard when a stopped run goes on: resumed from its own spill checkpoint in the same process (a notebook, a retry
loop) on the same card, and each batch trained once across the stopped run and the resumed one. The card is the
emulator on the CPU; time is virtual, so nothing here depends on this machine's speed."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import trainer_kwargs
from lightning.pytorch import Trainer
from test_spill import VirtualTime

from lightning_memguard import MemGuard, SysmemSpillError
from lightning_memguard.core.units import to_gb
from lightning_memguard.testing import ImageClassifier, SysmemSpillEmulator

# resnet18 on 64-pixel images: about 137 MB at batch 2, 160 MB at batch 16 on the emulated card
CARD = 150_000_000
STEPS = 8


class Counted(ImageClassifier):
    """Records the (epoch, batch index) of every training step it runs."""

    def __init__(self, seen: list[tuple[int, int]], batch_size: int) -> None:
        super().__init__("resnet18", image_size=64, batch_size=batch_size, steps_per_epoch=STEPS, pool_size=16)
        self.seen = seen

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)


def spill_and_stop(tmp_path, on_spill: str = "stop"):
    """A run at batch 16 on a 150 MB card, stopped (or raised) by MemGuard mid-epoch, with its spill checkpoint: the
    emulator (the card), the guard, the checkpoint, the batches the run trained and the message."""
    time = VirtualTime()
    emu = SysmemSpillEmulator(capacity=CARD, sleep=time.sleep)
    # no memory report: under "raise" it redoes the batch in hand through training_step, which Counted would count
    guard = MemGuard(probe=emu.probe, on_spill=on_spill, warmup_steps=3, clock=time.clock, memory_report=False)
    seen: list[tuple[int, int]] = []
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[emu, guard]))
    if on_spill == "stop":
        with pytest.warns(RuntimeWarning, match="MemGuard stopped the Trainer") as record:
            trainer.fit(Counted(seen, batch_size=16))
        (message,) = [str(w.message) for w in record if "spilling" in str(w.message)]
    else:
        with pytest.raises(SysmemSpillError) as info:
            trainer.fit(Counted(seen, batch_size=16))
        message = str(info.value)
    assert guard.spill is not None and guard.spill.used_bytes > CARD
    assert guard.checkpoint_path is not None and 0 < trainer.global_step < STEPS  # mid-epoch
    return emu, guard, guard.checkpoint_path, seen, message


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[list[tuple[int, int]], int]:
    """The batches a run at batch 2 trains when nothing stops it, and its peak on the emulated card."""
    emu = SysmemSpillEmulator(capacity="1TB")
    seen: list[tuple[int, int]] = []
    trainer = Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, callbacks=[emu],
    )  # fmt: skip
    trainer.fit(Counted(seen, batch_size=2))
    return seen, emu.probe.read().peak_allocated


def test_a_run_resumed_from_its_spill_checkpoint_in_the_same_process_is_judged_by_its_own_readings(
    tmp_path, uninterrupted
):
    emu, guard, path, _, _ = spill_and_stop(tmp_path)

    # the same process, the same card and the same guard (a retry loop): the fit goes on from the checkpoint, mid-epoch,
    # with a smaller batch
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[emu, guard]))
    trainer.fit(Counted([], batch_size=2), ckpt_path=path)
    assert not trainer.should_stop and trainer.global_step == STEPS
    assert guard.spill is None and guard.checkpoint_path is None

    need = uninterrupted[1]
    assert need < (1 - guard.headroom) * CARD  # well below the card: nothing to stop
    logged = float(trainer.callback_metrics["memguard/peak_allocated_gb"])
    assert [r.epoch for r in guard.epochs] == [0] and guard.epochs[0].peak_allocated_gb == pytest.approx(logged)
    assert logged == pytest.approx(to_gb(need), rel=0.01)  # this run's peak, not the spilling run's


@pytest.mark.parametrize("on_spill", ["stop", "raise"])
def test_the_stopped_run_and_the_run_resumed_from_its_checkpoint_train_each_batch_once(
    tmp_path, uninterrupted, on_spill
):
    _, _, path, stopped, message = spill_and_stop(tmp_path, on_spill)
    resumed: list[tuple[int, int]] = []
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1))  # later, on a card with room
    trainer.fit(Counted(resumed, batch_size=2), ckpt_path=path)
    assert sorted(stopped + resumed) == uninterrupted[0]  # each batch of the epoch once, as in a run never stopped

    assert torch.load(path, weights_only=False)["global_step"] == len(stopped)  # every batch the stopped run trained
    assert f"a checkpoint was saved to {path}, holding every batch trained so far" in message
    if on_spill == "stop":
        assert "MemGuard stopped the Trainer after the batch in flight had trained" in message


def test_the_spill_message_on_a_small_card_gives_its_sizes_in_megabytes(tmp_path):
    *_, message = spill_and_stop(tmp_path)
    peak, card = re.search(r"peak ([\d.]+) MB against ([\d.]+) MB of physical memory", message).groups()
    assert float(card) == 150.0 and 150.0 < float(peak) < 200.0
    advice = re.search(r"a step starts from ([\d.]+) MB, and each sample adds ([\d.]+) MB", message)
    assert advice is not None and 100.0 < float(advice[1]) < 150.0 and float(advice[2]) > 0
