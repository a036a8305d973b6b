"""Two CPU processes under DDP (gloo) with injected clocks and memory: what MemGuard shows and does on each rank.
Run by test_ddp_guard.py.

Usage: python ddp_guard_run.py OUT_DIR SCENARIO (or through ddp_run.py, with SCENARIO as its scenario)
  mid-stop:  rank 1's memory goes above its card at its 4th batch, on_spill="stop"; rank 1 steps at half the pace
  last-raise: rank 1's memory goes above its card at the very last batch of the last epoch, on_spill="raise"
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

from conftest import FakeProbe, StepClock, TinyModel  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402

from lightning_memguard import MemGuard, SysmemSpillError  # noqa: E402


class Outgrow(Callback):
    """Rank 1's peak goes above the card at one batch; every epoch resets it."""

    def __init__(self, probe: FakeProbe, rank: int, epoch: int, batch_idx: int) -> None:
        self.probe, self.rank, self.epoch, self.batch_idx = probe, rank, epoch, batch_idx

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.rank == 1 and trainer.current_epoch == self.epoch and batch_idx == self.batch_idx:
            self.probe.peak = 17 * 10**9


def main() -> None:
    run(sys.argv[1], sys.argv[2])


def run(out: str, scenario: str) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    probe = FakeProbe()  # 16 GB, 1 GB used
    on_spill, epochs, at = {"mid-stop": ("stop", 2, (0, 3)), "last-raise": ("raise", 2, (1, 7))}[scenario]
    guard = MemGuard(probe=probe, on_spill=on_spill, clock=StepClock(0.1 * (rank + 1)), read_every=100)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        callbacks=[Outgrow(probe, rank, *at), guard],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=out,
    )
    result = {"rank": rank, "error": None, "message": "", "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(TinyModel(batch_size=4, n=64))  # 8 batches of 4 per rank and epoch
        except SysmemSpillError as err:
            result["error"] = type(err).__name__
            result["message"] = str(err)
    result["warnings"] = [str(w.message) for w in caught if "spill" in str(w.message)]
    result["global_step"] = trainer.global_step
    result["should_stop"] = trainer.should_stop
    result["epochs"] = [r.to_dict() for r in guard.epochs]
    result["reports"] = [os.path.basename(p) for p in guard.reports]
    metric = trainer.callback_metrics.get("memguard/samples_per_sec")
    result["logged_samples_per_sec"] = None if metric is None else float(metric)
    with open(os.path.join(out, f"{scenario}-rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
