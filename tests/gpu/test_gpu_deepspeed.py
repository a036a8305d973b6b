"""The callbacks under Lightning's DeepSpeedStrategy (ZeRO stage 2) on one CUDA device: MemGuard logs and guards,
the tuners and ActivationCheckpointing are refused in ``setup``. Lightning builds DeepSpeedStrategy on CUDA only and
DeepSpeed is not a dependency, so these run where it is installed (``benchmarks/run_gpu.sh OUT deepspeed`` installs
it from wheels brought along). CPU twins: tests/tuning/test_sharded.py (the refusals, with the strategy as the
callbacks see
it) and tests/memguard/test_memguard.py (the figures, the spill response)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import trainer_kwargs
from lightning.pytorch import Callback, Trainer

from lightning_memguard import AccumulationTuner, ActivationCheckpointing, BatchSizeTuner, MemGuard, SysmemSpillError
from lightning_memguard.testing import ImageClassifier, SysmemSpillEmulator

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
deepspeed = pytest.importorskip("deepspeed")


def _fit(tmp_path, callbacks, model, **kwargs):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    overrides = dict(accelerator="cuda", devices=1, strategy=DeepSpeedStrategy(stage=2), precision="32-true",
                     max_epochs=1, callbacks=callbacks)  # fmt: skip
    trainer = Trainer(**trainer_kwargs(tmp_path, **{**overrides, **kwargs}))
    trainer.fit(model)
    return trainer


def _model(**kwargs):
    """ResNet50 in the default (contiguous) memory format: DeepSpeed broadcasts the weights viewed as bytes, which a
    channels_last convolution weight cannot be (RuntimeError from DeepSpeed's engine, not from the callbacks). In 32-bit
    precision: DeepSpeed's bf16 casts the weights and the batch, and this model's batch holds indices into a pool of
    images that stay 32-bit."""
    torch.manual_seed(0)
    kwargs = {"image_size": 224, "batch_size": 32, "steps_per_epoch": 20, **kwargs}
    return ImageClassifier("resnet50", **kwargs)


def test_memguard_under_deepspeed_logs_the_epochs_own_peak(tmp_path):
    class TorchPeak(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            self.peak = torch.cuda.max_memory_allocated() / 1e9

    guard, torch_peak = MemGuard(), TorchPeak()
    trainer = _fit(tmp_path, [guard, torch_peak], _model())
    (epoch,) = guard.epochs
    print(f"deepspeed stage 2: peak {epoch.peak_allocated_gb:.2f} GB, {epoch.samples_per_sec:.0f} samples/s")
    assert trainer.state.finished and guard.spill is None
    assert epoch.peak_allocated_gb == pytest.approx(torch_peak.peak, rel=0.01)
    assert epoch.samples_per_sec > 0


def test_a_spill_under_deepspeed_stops_the_run_with_a_checkpoint_written(tmp_path):
    """DeepSpeed saves a checkpoint as a folder of its own files: the spill checkpoint is written through it."""
    emu = SysmemSpillEmulator(capacity="2GB")  # ResNet50 at batch 64 needs about 3.2 GB
    guard = MemGuard(probe=emu.probe, warmup_steps=3)
    with pytest.raises(SysmemSpillError, match="spilling into system RAM") as caught:
        _fit(tmp_path, [emu, guard], _model(batch_size=64))
    print(caught.value)
    path = caught.value.checkpoint_path
    assert emu.total_spilled_bytes > 0 and path is not None and os.path.exists(path), path
    assert f"a checkpoint was saved to {path}" in str(caught.value)


@pytest.mark.parametrize("name", ["batch_size", "accumulation", "checkpointing"])
def test_what_cannot_work_under_deepspeed_is_refused_before_the_first_step(tmp_path, name):
    callback = {
        "batch_size": lambda: BatchSizeTuner(init_size=16, max_size=64, cache=False),
        "accumulation": lambda: AccumulationTuner(effective_batch_size=64, min_micro_batch=16, cache=False),
        "checkpointing": lambda: ActivationCheckpointing(),
    }[name]()

    class NoStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            raise AssertionError("a training step ran")

    with pytest.raises(ValueError, match="DeepSpeedStrategy"):
        _fit(tmp_path, [callback, NoStep()], _model(batch_size=16))
