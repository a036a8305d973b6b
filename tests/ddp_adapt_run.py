"""Two CPU processes under DDP (gloo); on rank 1 alone another application takes memory of the emulated card at
optimizer step 4, and MemGuard(on_spill="adapt") adapts. Run by test_adapt.py, through ddp_run.py, as scenario
``adapt``; scenario ``savers``: the same on a model with blocks, met by the savers that keep the batch whole. Each
rank also trains the same run without the spill: the weights must agree. Scenario ``planning_raises``: as ``savers``,
but rank zero's planning of the savers raises a RuntimeError (injected): each rank writes what its fit raised, then
waits (a minute at most, reading files, not in a collective) until the other has written too.

Usage: python ddp_adapt_run.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_memguard import MemGuard  # noqa: E402
from lightning_memguard.testing import SysmemSpillEmulator  # noqa: E402

TAKEN_AT = 4


class Wide(LightningModule):
    """An MLP without BatchNorm whose saved activations grow with the batch (16 kB a sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 32
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2))
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32 * 16, 16, generator=gen), torch.randint(0, 2, (32 * 16,), generator=gen)
        self.micro_batches: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        if batch_idx >= len(self.micro_batches):
            self.micro_batches.append([])
        if self.training:  # not the check of the loss's weighting before the first split (in eval mode)
            self.micro_batches[batch_idx].append(len(batch[0]))
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=True)


class TakeMemory(Callback):
    def __init__(self, emulator: SysmemSpillEmulator, nbytes: int, at: int = TAKEN_AT) -> None:
        self.emulator, self.nbytes, self.at = emulator, nbytes, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            self.emulator.other_processes = self.nbytes


def _fit(out: str, adapt: bool) -> Wide:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.manual_seed(0)
    model = Wide()
    callbacks: list[Callback] = []
    if adapt:
        emu = SysmemSpillEmulator(capacity=2 * 10**6, sleep=lambda s: None)  # the batch needs 1.46 MB of it
        guard = MemGuard(
            on_spill="adapt", probe=emu.probe, read_every=1, warmup_steps=1, reference_steps=1, spill_checkpoint=False
        )
        callbacks = [emu, guard, TakeMemory(emu, 7 * 10**5 if rank == 1 else 0)]
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    model.adaptations = [a.to_dict() for a in guard.adaptations] if adapt else []  # type: ignore[attr-defined]
    model.steps = trainer.global_step  # type: ignore[attr-defined]
    return model


def _fit_blocks(out: str, adapt: bool) -> tuple[LightningModule, list[dict], list[list[str]]]:
    """The model with blocks (tests/models.py): on rank 1 alone another application takes 1.5 MB of the 56 MB card
    at step 2, which the savers' plan (made on rank zero) meets without a split."""
    from models import Blocks

    from lightning_memguard.checkpointing import is_checkpointed

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.manual_seed(0)
    model = Blocks()
    callbacks: list[Callback] = []
    guard = None
    if adapt:
        emu = SysmemSpillEmulator(capacity=56 * 10**6, sleep=lambda s: None)
        guard = MemGuard(
            on_spill="adapt", probe=emu.probe, read_every=1, warmup_steps=1, reference_steps=1, headroom=0.01,
            spill_checkpoint=False,
        )  # fmt: skip
        callbacks = [emu, guard, TakeMemory(emu, 1_500_000 if rank == 1 else 0, at=2)]
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    adaptations = [a.to_dict() for a in guard.adaptations] if guard is not None else []
    checkpointed = [name for name, m in model.named_modules() if is_checkpointed(m)]
    return model, adaptations, [checkpointed]


def savers(out: str) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    (adapted, adaptations, checkpointed), (plain, _, _) = _fit_blocks(out, True), _fit_blocks(out, False)
    with open(os.path.join(out, f"savers{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "adaptations": adaptations,
                "checkpointed": checkpointed[0],
                "same_as_plain": all(
                    torch.equal(a, b) for a, b in zip(adapted.parameters(), plain.parameters(), strict=True)
                ),
            },
            f,
        )


def planning_raises(out: str, wait_s: float = 60.0) -> None:
    from lightning_memguard.tuning.adapter import RunAdapter

    rank = int(os.environ.get("LOCAL_RANK", "0"))

    def fails(*args, **kwargs):
        raise RuntimeError("injected while rank zero plans the savers")

    planned = RunAdapter._plan_savers
    RunAdapter._plan_savers = fails  # type: ignore[method-assign]  # called on rank zero alone
    raised = None
    try:
        _fit_blocks(out, True)
    except Exception as err:
        raised = {"type": type(err).__name__, "message": str(err)}
    finally:
        RunAdapter._plan_savers = planned  # type: ignore[method-assign]
    with open(os.path.join(out, f"planning{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"raised": raised}, f)
    other = os.path.join(out, f"planning{1 - rank}.json")
    deadline = time.monotonic() + wait_s  # a rank left waiting in rank zero's broadcast never writes its file
    while not os.path.exists(other) and time.monotonic() < deadline:
        time.sleep(0.1)


def run(out: str, scenario: str = "adapt") -> None:
    if scenario == "savers":
        savers(out)
        return
    if scenario == "planning_raises":
        planning_raises(out)
        return
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    adapted, plain = _fit(out, adapt=True), _fit(out, adapt=False)
    with open(os.path.join(out, f"adapt{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "adaptations": adapted.adaptations,  # type: ignore[attr-defined]
                "steps": adapted.steps,  # type: ignore[attr-defined]
                "micro_batches": adapted.micro_batches,
                "weights_sum": float(sum(p.double().sum() for p in adapted.parameters())),
                "same_as_plain": all(
                    torch.allclose(a, b, atol=1e-6, rtol=1e-5)
                    for a, b in zip(adapted.parameters(), plain.parameters(), strict=True)
                ),
            },
            f,
        )


def main() -> None:
    run(sys.argv[1])


if __name__ == "__main__":
    main()
