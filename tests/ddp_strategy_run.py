"""Two CPU processes (gloo): plain DDP, then CheckpointingDDPStrategy with a budget, from the same seed. Each rank
writes the plan it applied and its weights' checksum. Run by test_checkpointing_strategies.py.

Usage: python ddp_strategy_run.py OUT_DIR [compiled|planning_fails]
compiled: both fits on an aot_eager torch.compile. planning_fails: rank zero runs out of memory while it plans.
Or through ddp_run.py, with eager and compiled as scenarios (compiled last: it fixes the planner's step times for good).
"""

from __future__ import annotations

import json
import os
import sys
import types

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy
from models import one_block_a_stage

from lightning_memguard.strategies import CheckpointingDDPStrategy
from lightning_memguard.testing import ImageClassifier


class _Setting(Callback):
    """Compile's activation_memory_budget in each training step, on this rank."""

    def __init__(self) -> None:
        self.steps: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append(torch._functorch.config.activation_memory_budget)


def _fit(strategy, out: str, compiled: bool, callbacks=()) -> tuple[ImageClassifier, Trainer]:
    model = ImageClassifier("resnet18", image_size=16, batch_size=4, steps_per_epoch=6, pool_size=16, seed=0)
    if compiled:
        model = one_block_a_stage(model)
    model.example_input_array = model.images[:4].clone()
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out, callbacks=list(callbacks),
    )  # fmt: skip
    torch.manual_seed(0)
    torch._dynamo.reset()
    trainer.fit(torch.compile(model, backend="aot_eager") if compiled else model)  # type: ignore[arg-type]
    return model, trainer


def main() -> None:
    run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "eager")


def run(out: str, mode: str) -> None:
    compiled = mode == "compiled"
    if mode == "planning_fails":  # rank zero measures; the other ranks wait for its plan
        from lightning_memguard.checkpointing import policy

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory (injected while rank zero plans)")

        policy.checkpoint_blocks = out_of_memory  # type: ignore[assignment]
        _fit(CheckpointingDDPStrategy(memory_budget=0.6, process_group_backend="gloo"), out, False)
        return
    if compiled:  # this CPU's timing decides nothing: compile's setting 0.5 is the fastest, alone and with blocks
        from conftest import planner_step_times

        def seconds(setting: float, blocks: int, split: bool) -> float:
            return (0.05 if setting == 0.5 else 0.2) + blocks * 1e-3

        planner_step_times(types.SimpleNamespace(setattr=setattr), seconds)  # for good: no monkeypatch to undo
    plain, _ = _fit(DDPStrategy(process_group_backend="gloo"), out, compiled)
    # compiled: a budget that compile's own setting alone does not meet, so runs and the setting travel together
    strategy = CheckpointingDDPStrategy(memory_budget=0.3 if compiled else 0.6, process_group_backend="gloo")
    setting = _Setting()
    checked, trainer = _fit(strategy, out, compiled, [setting])
    same = all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(), checked.state_dict().values(), strict=False)
    )
    swapped = sorted(n for n, m in checked.net.named_modules() if hasattr(m, "_memguard_original"))
    result = {
        "runs": strategy.checkpointing.runs,
        "swapped": swapped,
        "same_weights": same,
        "step": trainer.global_step,
        "compiled_plan": strategy.checkpointing.plan.compiled if strategy.checkpointing.plan is not None else None,
        "compile_setting": strategy.checkpointing.compile_setting,
        "split_graphs": strategy.checkpointing.split_graphs,
        "split": sorted(n for n, m in checked.net.named_modules() if type(m).__name__.startswith("GraphSplit")),
        "step_settings": setting.steps,
    }
    with open(os.path.join(out, f"strategy{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
