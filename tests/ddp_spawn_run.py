"""A model checkpointed and rebuilt before `fit`, trained under ``ddp_spawn`` on 2 CPU processes: each child gets
the model by pickling, as on Windows, where spawn is the only start method. Run by test_portable.py.
``levers``: a tiny GPT-2 under ``ddp_spawn`` with ``ActivationCheckpointing(memory_budget=0.4, levers=True)``, the
callback pickled into each child with the model; each rank writes the record it applied, whether it measured, the
levers on its model and its weights' checksum, and the launching process, after the fit, its own callback's record
and its model's checksum.
Run by tests/levers/test_levers_in_the_trainer.py.

Usage: python ddp_spawn_run.py OUT_DIR [levers]
"""

from __future__ import annotations

import json
import os
import sys

from lightning.pytorch import Callback, Trainer

from lightning_memguard.checkpointing import apply_plan
from lightning_memguard.testing import ImageClassifier


class WhatEachRankTrained(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        classes = sorted({type(m).__name__ for m in pl_module.net.modules() if hasattr(m, "_memguard_original")})
        path = os.path.join(self.out, f"spawn{trainer.global_rank}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"global_step": trainer.global_step, "classes": classes}, f)


class WhatEachRankPlanned(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        from lightning_memguard import ActivationCheckpointing
        from lightning_memguard.checkpointing import is_checkpointed
        from lightning_memguard.levers.huggingface_loss import is_fused
        from lightning_memguard.levers.pointwise import PointwiseRecomputed

        cb = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))  # this process's copy
        result = {
            "record": cb.lever_record,
            "measured": cb.lever_plan is not None,
            "fused": [n for n, m in pl_module.named_modules() if is_fused(m)],
            "checkpointed": [n for n, m in pl_module.named_modules() if is_checkpointed(m)],
            "pointwise": [n for n, m in pl_module.named_modules() if isinstance(m, PointwiseRecomputed)],
            "checksum": float(sum(p.double().sum() for p in pl_module.parameters())),
            "step": trainer.global_step,
        }
        with open(os.path.join(self.out, f"levers{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)


def levers(out: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from language_model import LanguageModel

    from lightning_memguard import ActivationCheckpointing

    cb = ActivationCheckpointing(memory_budget=0.4, levers=True)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[cb, WhatEachRankPlanned(out)],
    )  # fmt: skip
    model = LanguageModel(batch_size=4)
    trainer.fit(model)
    checksum = float(sum(p.double().sum() for p in model.parameters()))  # rank zero's weights, brought back
    with open(os.path.join(out, "launcher.json"), "w", encoding="utf-8") as f:
        json.dump({"record": cb.lever_record, "checksum": checksum}, f)


def main() -> None:
    out = sys.argv[1]
    if sys.argv[2:] == ["levers"]:
        levers(out)
        return
    model = ImageClassifier("resnet18", image_size=16, batch_size=4, steps_per_epoch=2, pool_size=8)
    # a block and a run of two checkpointed, the rest rebuilt: every kind of swapped class
    apply_plan(model.net, [["layer1.0"], ["layer2.0", "layer2.1"]], rebuild_bn_relu=True)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[WhatEachRankTrained(out)],
    )  # fmt: skip
    trainer.fit(model)


if __name__ == "__main__":
    main()
