"""Two CPU processes (gloo): a tiny GPT-2 held by a LightningModule, fitted under plain DDP and then with the levers
(``ActivationCheckpointing(levers=True)``, or ``CheckpointingDDPStrategy(levers=True)``), from the same seed. Each
rank writes the record it applied, the levers on its model and whether its weights are plain DDP's. Run by
tests/levers/test_levers_in_the_trainer.py through ddp_run.py.

Scenarios: ``callback``, ``strategy``.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from language_model import LanguageModel
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy

from lightning_memguard import ActivationCheckpointing
from lightning_memguard.checkpointing import is_checkpointed
from lightning_memguard.levers.huggingface_loss import is_fused
from lightning_memguard.levers.pointwise import PointwiseRecomputed
from lightning_memguard.strategies import CheckpointingDDPStrategy

BUDGET = 0.4


def _fit(strategy, out: str, callbacks=()) -> tuple[LanguageModel, Trainer]:
    model = LanguageModel(batch_size=4)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out, callbacks=list(callbacks),
        use_distributed_sampler=True,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    return model, trainer


def run(out: str, scenario: str) -> None:
    plain, _ = _fit(DDPStrategy(process_group_backend="gloo"), out)
    if scenario == "callback":
        cb = ActivationCheckpointing(memory_budget=BUDGET, levers=True)
        model, trainer = _fit(DDPStrategy(process_group_backend="gloo"), out, [cb])
        record, measured = cb.lever_record, cb.lever_plan is not None
    else:
        strategy = CheckpointingDDPStrategy(memory_budget=BUDGET, levers=True, process_group_backend="gloo")
        model, trainer = _fit(strategy, out)
        record, measured = strategy.checkpointing.lever_record, strategy.checkpointing.lever_plan is not None
    close = all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-5)
        for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True)
    )
    result = {
        "record": record,
        "measured": measured,
        "fused": [n for n, m in model.named_modules() if is_fused(m)],
        "checkpointed": [n for n, m in model.named_modules() if is_checkpointed(m)],
        "pointwise": [n for n, m in model.named_modules() if isinstance(m, PointwiseRecomputed)],
        "close_to_plain": close,
        "checksum": float(sum(p.double().sum() for p in model.parameters())),
        "step": trainer.global_step,
    }
    with open(os.path.join(out, f"levers{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
