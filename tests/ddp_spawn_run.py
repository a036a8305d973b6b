"""A model checkpointed and rebuilt before `fit`, trained under ``ddp_spawn`` on 2 CPU processes: each child gets
the model by pickling, as on Windows, where spawn is the only start method. Run by test_portable.py.

Usage: python ddp_spawn_run.py OUT_DIR
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


def main() -> None:
    out = sys.argv[1]
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
