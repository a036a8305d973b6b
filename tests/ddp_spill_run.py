"""Two CPU processes under DDP (gloo); the emulated card spills on one rank only. Run by test_ddp.py, through
ddp_run.py, as scenarios ``ON_SPILL-SPILL_RANK`` (``raise-0``, ``stop-1``, ...).

Usage: python ddp_spill_run.py OUT_DIR SPILL_RANK ON_SPILL
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from lightning.pytorch import Trainer  # noqa: E402

from lightning_memguard import MemGuard, SysmemSpillError  # noqa: E402
from lightning_memguard.testing import ImageClassifier, SysmemSpillEmulator  # noqa: E402


def run(out: str, scenario: str) -> None:
    """Scenario ``ON_SPILL-SPILL_RANK``."""
    on_spill, spill_rank = scenario.split("-")
    fit(out, int(spill_rank), on_spill)


def main() -> None:
    fit(sys.argv[1], int(sys.argv[2]), sys.argv[3])


def fit(out: str, spill_rank: int, on_spill: str) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    capacity = "10MB" if rank == spill_rank else "1TB"  # resnet18's weights alone exceed 10 MB
    emu = SysmemSpillEmulator(capacity=capacity)
    guard = MemGuard(probe=emu.probe, on_spill=on_spill, warmup_steps=2)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=3,
        callbacks=[emu, guard],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    model = ImageClassifier("resnet18", image_size=16, batch_size=4, steps_per_epoch=10, pool_size=8)
    result = {"rank": rank, "error": None, "message": "", "global_step": None, "own_report": None}
    try:
        trainer.fit(model)
    except SysmemSpillError as err:
        result["error"] = type(err).__name__
        result["message"] = str(err)
        result["own_report"] = err.report is not None
    result["global_step"] = trainer.global_step
    result["should_stop"] = trainer.should_stop
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
