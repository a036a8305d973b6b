"""Checkpointed and rebuilt models leave the process that made them: torch.save / torch.load in a fresh
interpreter, deepcopy, and ``ddp_spawn`` (Windows' only start method) on 2 CPU processes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torchvision

from lightning_memguard.checkpointing import checkpoint_resnet

SCRIPT = os.path.join(os.path.dirname(__file__), "ddp_spawn_run.py")

_LOAD_AND_STEP = """
import sys, torch
model = torch.load(sys.argv[1], weights_only=False)
x = torch.load(sys.argv[2])
model(x).square().mean().backward()
print(sorted({type(m).__name__ for m in model.modules() if hasattr(m, "_memguard_original")}))
torch.save([p.grad for p in model.parameters()], sys.argv[3])
"""


def _model(rebuild: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    checkpoint_resnet(model, memory_budget=None, rebuild_bn_relu=rebuild)
    return model


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_saved_model_loads_and_trains_the_same_in_a_fresh_interpreter(tmp_path, rebuild):
    model = _model(rebuild)
    swapped = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "_memguard_original")})
    assert swapped  # something was changed, and it has to survive
    x = torch.randn(4, 3, 32, 32)
    torch.save(model, tmp_path / "model.pt")
    torch.save(x, tmp_path / "x.pt")
    model(x).square().mean().backward()
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_STEP, *(str(tmp_path / n) for n in ("model.pt", "x.pt", "grads.pt"))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(swapped)
    theirs = torch.load(tmp_path / "grads.pt")
    for mine, other in zip((p.grad for p in model.parameters()), theirs, strict=True):
        assert torch.equal(mine, other)


def test_deepcopy_keeps_the_swapped_classes():
    model = _model(rebuild=True)
    twin = copy.deepcopy(model)
    assert [type(m) for m in twin.modules()] == [type(m) for m in model.modules()]


@pytest.mark.slow
def test_ddp_spawn_trains_a_model_checkpointed_before_fit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    done = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"spawn{rank}.json").read_text(encoding="utf-8"))
        assert result["global_step"] == 1  # 2 batches, one per rank
        assert {"CheckpointedBasicBlock", "RunMemberBasicBlock", "RebuiltStemReLU"} <= set(result["classes"])
