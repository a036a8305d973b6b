"""Two CPU processes (gloo) under ``ddp`` or ``ddp_spawn``: every callback in two fits, the table's cells for these
strategies. Run by test_strategy_table.py.

Usage: python strategy_cells_run.py OUT_DIR ddp|ddp_spawn
  fit "batch_size":   MemGuard + BatchSizeTuner + ActivationCheckpointing() (every block)
  fit "accumulation": MemGuard(on_spill="adapt") + AccumulationTuner + ActivationCheckpointing(memory_budget=0.7)
Rank 1's card holds fewer samples. Each rank writes FIT-rankN.json from inside the fit; under ``ddp_spawn`` the
launching process writes FIT-launcher.json (Lightning brings back only the weights and the metrics).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
from conftest import FakeProbe  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from tuner_helpers import BatchClock  # noqa: E402

from lightning_memguard import (  # noqa: E402
    AccumulationTuner,
    ActivationCheckpointing,
    BatchSizeTuner,
    MemGuard,
)
from lightning_memguard.checkpointing import is_checkpointed  # noqa: E402
from lightning_memguard.probes import MemoryReading  # noqa: E402
from lightning_memguard.testing import ImageClassifier  # noqa: E402


class PerSampleProbe:
    """100 MB per sample of the model's batch size; rank 1's card is 1.3 GB (12 samples within the headroom)."""

    def __init__(self, model):
        self.model = model

    def capacity(self):
        return int(10e9) if self.model.global_rank == 0 else int(1.3e9)

    def reset_peak(self):
        pass

    def read(self):
        peak = self.model.batch_size * 100 * 10**6
        return MemoryReading(peak, peak, self.capacity())


class Report(Callback):
    """What this rank trained, written from inside the fit."""

    def __init__(self, out, fit, tuner, checkpointing, guard, spawned=False):
        self.out, self.fit, self.tuner, self.checkpointing, self.guard = out, fit, tuner, checkpointing, guard
        self.spawned = spawned

    def teardown(self, trainer, pl_module, stage):
        # a spawned rank's process ends with its fit: its gloo group is destroyed here, not left to the interpreter's
        # exit, where on torch's floor release a rank now and then aborted ("terminate called without an active
        # exception") after its fit had passed
        if self.spawned and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not hasattr(self, "samples"):
            self.samples = batch.shape[0]

    def on_train_end(self, trainer, pl_module):
        metric = trainer.callback_metrics.get("memguard/samples_per_sec")
        result = {
            "results": [[r.size, r.accumulate, r.outcome] for r in self.tuner.results],
            "batch_size": pl_module.batch_size,
            "accumulate": trainer.accumulate_grad_batches,
            "samples_at_first_batch": self.samples,
            "runs": self.checkpointing.runs,
            "checkpointed": sorted(n for n, m in pl_module.named_modules() if is_checkpointed(m)),
            "epochs": len(self.guard.epochs),
            "table_samples_per_sec": self.guard.epochs[-1].samples_per_sec if self.guard.epochs else None,
            "logged_samples_per_sec": None if metric is None else float(metric),
            "global_step": trainer.global_step,
        }
        with open(os.path.join(self.out, f"{self.fit}-rank{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)


def main() -> None:
    run(sys.argv[1], sys.argv[2])


def run(out: str, strategy: str) -> None:
    """Both fits under ``strategy`` (``ddp_run.py`` calls it for ``ddp``)."""
    for fit in ("batch_size", "accumulation"):
        torch.manual_seed(0)
        model = ImageClassifier("resnet18", image_size=16, batch_size=4, steps_per_epoch=40, pool_size=8)
        model.example_input_array = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        clock, probe = BatchClock(), PerSampleProbe(model)
        common = {"probe": probe, "cache": False, "warmup_steps": 1, "timed_steps": 1, "clock": clock}
        if fit == "batch_size":
            tuner = BatchSizeTuner(mode="max_fit", init_size=4, max_size=32, **common)
            checkpointing = ActivationCheckpointing()
            limits = {"limit_train_batches": 2}
        else:
            tuner = AccumulationTuner(effective_batch_size=32, min_micro_batch=4, **common)
            checkpointing = ActivationCheckpointing(memory_budget=0.7)
            limits = {"max_steps": 1}
        # the accumulation fit's MemGuard adapts (nothing spills: its training step is MemGuard's, the same training)
        guard = MemGuard(probe=FakeProbe(), on_spill="adapt" if fit == "accumulation" else "raise")
        report = Report(out, fit, tuner, checkpointing, guard, spawned=strategy == "ddp_spawn")
        trainer = Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out,
            callbacks=[clock, checkpointing, tuner, guard, report], **limits,
        )  # fmt: skip
        trainer.fit(model)
        if strategy == "ddp_spawn":  # the launching process: what Lightning brought back from the spawned ones
            with open(os.path.join(out, f"{fit}-launcher.json"), "w", encoding="utf-8") as f:
                json.dump({"tuner_batch_size": tuner.batch_size, "model_batch_size": model.batch_size}, f)


if __name__ == "__main__":
    main()
