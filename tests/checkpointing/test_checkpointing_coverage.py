"""The coverage table's fast subset (``benchmarks/coverage.py --fast``): a timm ResNet, ViT, EfficientNet, RegNet,
HRNet (blocks that take and return lists) and DLA (a tree), GPT-2 and T5, each with every block checkpointed, train
one step with the same gradients and buffers as the plain model, bit for bit (dropout and stochastic depth drawing
the same numbers), keep their ``state_dict`` keys and keep fewer bytes for backward. The benchmark's own judgement
is checked too: a difference of one bit, or a model that saves nothing, is reported with its reason. The whole
table (every family, every model with a switch of its own covered) runs where ``MEMGUARD_COVERAGE_ALL=1``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("timm")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _coverage():
    spec = importlib.util.spec_from_file_location("benchmark_coverage", ROOT / "benchmarks" / "coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


coverage = _coverage()


@pytest.mark.parametrize(("library", "name"), coverage.FAST, ids=[name for _, name in coverage.FAST])
def test_every_block_checkpointed_trains_exactly_as_the_plain_model_and_keeps_less(library, name):
    row = coverage.examine(library, name, seconds=0)  # no time limit: a slow machine must not fail the test
    assert row["covered"], row["reason"]
    assert row["blocks"] and row["checkpointed"] and row["same_state_dict_keys"]
    assert row["same_gradients"] and row["same_buffers"]
    assert row["kept_bytes"]["ours"] < row["kept_bytes"]["plain"]


@pytest.mark.skipif(
    not os.environ.get("MEMGUARD_COVERAGE_ALL"),
    reason="the whole table: set MEMGUARD_COVERAGE_ALL=1 (about 20 minutes on two cores)",
)
def test_every_model_of_the_table_that_can_checkpoint_itself_is_covered():
    rows = [coverage.examine(library, name) for library, name in coverage.selection(None, None, False)]
    missed = {r["model"]: r["reason"] for r in rows if "error" not in r and r.get("switch") and not r["covered"]}
    assert not missed


def test_a_gradient_one_bit_off_is_reported_with_its_size_and_name():
    a = {"w": torch.tensor([1.0, 2.0]), "b": None}
    b = {"w": torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item()]), "b": None}
    diff = coverage.differences(a, b)
    assert not diff["same"] and diff["first"] == "w" and 0 < diff["max_abs"] < 1e-6
    assert coverage.differences(a, {k: None if v is None else v.clone() for k, v in a.items()})["same"]
    assert not coverage.differences(a, {"w": a["w"], "b": torch.zeros(1)})["same"]  # a gradient where none was
    row = {
        "model": "m",
        "blocks": 2,
        "checkpointed": 2,
        "same_gradients": False,
        "same_buffers": True,
        "gradient_difference": diff,
        "same_state_dict_keys": True,
        "kept_bytes": {"plain": 10, "ours": 10},
    }
    row["covered"] = coverage.covered(row)
    assert not row["covered"]
    assert coverage.reason(row).startswith("gradients differ (max abs") and coverage.reason(row).endswith(
        "w); no memory saved"
    )


def test_the_bytes_kept_for_backward_count_what_a_checkpoint_holds_for_its_recomputation():
    class Checkpointed(nn.Module):
        def __init__(self, checkpointed: bool) -> None:
            super().__init__()
            self.layers = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
            self.checkpointed = checkpointed

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.checkpointed:
                return torch.utils.checkpoint.checkpoint(self.layers, x.tanh(), use_reentrant=False)
            return self.layers(x.tanh())

    torch.manual_seed(0)
    plain, checkpointed = Checkpointed(False), Checkpointed(True)
    checkpointed.load_state_dict(plain.state_dict())
    x = {"x": torch.randn(8, 64)}
    kept_plain, kept_checkpointed = coverage.step(plain, x), coverage.step(checkpointed, x)
    assert kept_checkpointed == 8 * 64 * 4  # the checkpoint's input (x.tanh()), held for the recomputation
    assert kept_plain == 4 * kept_checkpointed  # the input of every layer (the output is the loss's, not counted)
