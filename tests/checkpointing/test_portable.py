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

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the scripts stand beside conftest.py
SCRIPT = os.path.join(TESTS, "ddp_spawn_run.py")

_LOAD_AND_STEP = """
import json, sys, torch, traceback
for model_path, x_path, grads_path in zip(*[iter(sys.argv[1:])] * 3):  # each case on a line of its own
    try:
        model = torch.load(model_path, weights_only=False)
        x = torch.load(x_path)
        model(x).square().mean().backward()
        swapped = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "_memguard_original")})
        torch.save([p.grad for p in model.parameters()], grads_path)
        print(json.dumps({"swapped": str(swapped)}))
    except Exception:
        print(json.dumps({"error": traceback.format_exc()}))
"""


def _model(rebuild: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    checkpoint_resnet(model, memory_budget=None, rebuild_bn_relu=rebuild)
    return model


@pytest.fixture(scope="module")
def fresh_interpreter(tmp_path_factory):
    """Both models (without and with the rebuild) saved, then loaded and stepped in one fresh interpreter: by rebuild,
    the model, its input, the path of the gradients the interpreter saved, and what it said (the swapped classes, or
    its error)."""
    folder = tmp_path_factory.mktemp("portable")
    cases, argv = {}, []
    for rebuild in (False, True):
        model, x = _model(rebuild), torch.randn(4, 3, 32, 32)
        paths = [folder / f"{name}{int(rebuild)}.pt" for name in ("model", "x", "grads")]
        torch.save(model, paths[0])
        torch.save(x, paths[1])
        cases[rebuild] = (model, x, paths[2])
        argv += [str(p) for p in paths]
    done = subprocess.run([sys.executable, "-c", _LOAD_AND_STEP, *argv], capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    lines += [{"error": f"no result; exit code {done.returncode}:\n{done.stderr[-3000:]}"}] * (len(cases) - len(lines))
    return {rebuild: (*cases[rebuild], lines[i]) for i, rebuild in enumerate(cases)}


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_saved_model_loads_and_trains_the_same_in_a_fresh_interpreter(fresh_interpreter, rebuild):
    model, x, grads, theirs = fresh_interpreter[rebuild]
    assert "error" not in theirs, theirs["error"]
    swapped = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "_memguard_original")})
    assert swapped  # something was changed, and it has to survive
    model(x).square().mean().backward()
    assert theirs["swapped"] == str(swapped)
    for mine, other in zip((p.grad for p in model.parameters()), torch.load(grads), strict=True):
        assert torch.equal(mine, other)


def test_deepcopy_keeps_the_swapped_classes():
    model = _model(rebuild=True)
    twin = copy.deepcopy(model)
    assert [type(m) for m in twin.modules()] == [type(m) for m in model.modules()]


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
