"""Two CPU processes under DDP (gloo) tune; run by test_ddp.py.

Usage: python ddp_tuner_run.py OUT_DIR [accumulation|oom|oom_backward|oom_compiled]
(or through ddp_run.py, with these as scenarios)

accumulation: AccumulationTuner, rank 1's card is smaller. oom: BatchSizeTuner, and only rank 1 raises
torch.OutOfMemoryError in its training step once a batch holds more than 8 samples (its model's OneCycle schedule is
sized by the run's steps: no trial may step it). oom_backward: the same, raised halfway through rank 1's backward.
oom_compiled: as oom, on ``torch.compile(model, backend="aot_eager")``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from models import tiny_convnet  # noqa: E402

from lightning_memguard import AccumulationTuner, BatchSizeTuner  # noqa: E402
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


class BatchClock:
    """The tuner's clock: each batch takes 10 ms + 1 ms per sample, whatever this machine's speed."""

    memguard_keep_in_trials = True

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.now += 0.01 + 0.001 * batch.shape[0]


class OneCycle(ImageClassifier):
    """A schedule sized by the run's optimizer steps: no trial may step it (it would run past its end)."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class OomOnRankOne(OneCycle):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch.shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected, rank 1 only)")
        return super().training_step(batch, batch_idx)


class OomInRankOnesBackward(OneCycle):
    """Rank 1 runs out of memory at the very end of its backward: the gradients of every layer exist (DDP would
    have sent them off already), the images' gradient never comes."""

    def _loss(self, batch):
        if self.global_rank != 1 or batch.shape[0] <= 8:
            return super()._loss(batch)
        idx = batch % self.images.shape[0]
        images = self.images[idx].clone().requires_grad_()

        def fail(grad):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected, in backward)")

        images.register_hook(fail)
        return torch.nn.functional.cross_entropy(self(images), self.labels[idx])


def main() -> None:
    run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "accumulation")


def run(out: str, mode: str) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    from lightning.pytorch import Callback

    clock = type("Clock", (BatchClock, Callback), {})()
    if mode in ("oom", "oom_backward", "oom_compiled"):
        cls = OomInRankOnesBackward if mode == "oom_backward" else OomOnRankOne
        model = cls("resnet18", image_size=16, batch_size=2, steps_per_epoch=40, pool_size=8)
        if mode == "oom_compiled":  # what is checked is the ranks' agreement, on any compiled network
            model = tiny_convnet(model)
        tuner = BatchSizeTuner(
            mode="max_fit", init_size=4, max_size=32, probe=PerSampleProbe(model, int(100e9)), cache=False,
            warmup_steps=1, timed_steps=2, clock=clock,
        )  # fmt: skip
    else:
        model = ImageClassifier("resnet18", image_size=16, batch_size=2, steps_per_epoch=40, pool_size=8)
        capacity = int(10e9) if rank == 0 else int(1.2e9)  # rank 1: micro-batches above 11 do not fit
        tuner = AccumulationTuner(
            effective_batch_size=64, min_micro_batch=4, probe=PerSampleProbe(model, capacity), cache=False,
            warmup_steps=1, timed_steps=1, clock=clock,
        )  # fmt: skip
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        # AccumulationTuner: one optimizer step after tuning (an epoch of 2 batches holds no step of 8 x 4)
        **({"max_steps": 1} if mode == "accumulation" else {"limit_train_batches": 2}),
        callbacks=[clock, tuner],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(torch.compile(model, backend="aot_eager") if mode == "oom_compiled" else model)
    with open(os.path.join(out, f"{mode}{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "batch_size": tuner.batch_size,
                "accumulate": tuner.accumulate_grad_batches,
                "model_batch_size": model.batch_size,
                "trainer_accumulate": trainer.accumulate_grad_batches,
                "results": [[r.size, r.accumulate, r.outcome] for r in tuner.results],
                "compiled": [r.compiled for r in tuner.results],
                "steps": trainer.global_step,
                "schedules": [
                    [c.scheduler.total_steps, c.scheduler.last_epoch]
                    for c in trainer.lr_scheduler_configs
                    if isinstance(c.scheduler, torch.optim.lr_scheduler.OneCycleLR)
                ],
            },
            f,
        )


if __name__ == "__main__":
    main()
