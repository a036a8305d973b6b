"""Two CPU processes under DDP (gloo) tune accumulation; rank 1's card is smaller. Run by test_ddp.py.

Usage: python ddp_tuner_run.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from lightning.pytorch import Trainer  # noqa: E402

from lightning_memguard import AccumulationTuner  # noqa: E402
from lightning_memguard.probes import MemoryReading  # noqa: E402
from lightning_memguard.testing import ImageClassifier  # noqa: E402


class PerSampleProbe:
    """100 MB per sample of the current micro-batch."""

    def __init__(self, model, capacity):
        self.model, self._capacity = model, capacity

    def capacity(self):
        return self._capacity

    def reset_peak(self):
        pass

    def read(self):
        peak = self.model.batch_size * 100 * 10**6
        return MemoryReading(peak, peak, self._capacity)


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    model = ImageClassifier("resnet18", image_size=16, batch_size=2, steps_per_epoch=40, pool_size=8)
    capacity = int(10e9) if rank == 0 else int(1.2e9)  # rank 1: micro-batches above 11 do not fit
    tuner = AccumulationTuner(
        effective_batch_size=64,
        min_micro_batch=4,
        probe=PerSampleProbe(model, capacity),
        cache=False,
        warmup_steps=1,
        timed_steps=1,
        min_gain=0.0,
        tolerance=0.9,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        limit_train_batches=2,
        callbacks=[tuner],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(model)
    with open(os.path.join(out, f"tuner{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "batch_size": tuner.batch_size,
                "accumulate": tuner.accumulate_grad_batches,
                "model_batch_size": model.batch_size,
                "trainer_accumulate": trainer.accumulate_grad_batches,
                "results": [[r.size, r.accumulate, r.outcome] for r in tuner.results],
            },
            f,
        )


if __name__ == "__main__":
    main()
