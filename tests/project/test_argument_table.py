"""Issue 30, items 8 and 9: one argument rule for every public entry point, as a table.

Each row: the entry point, its keyword arguments, the exception expected (None: accepted) and a pattern that names
the argument. Numbers are finite and in range, NumPy scalars are the numbers they are, a bool is no number, a flag is
a bool, an instance is an instance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from lightning_memguard import AccumulationTuner, ActivationCheckpointing, BatchSizeTuner, MemGuard
from lightning_memguard.checkpointing import RebuildConfig, apply_plan, checkpoint_blocks, checkpoint_resnet
from lightning_memguard.probes import CpuProbe
from lightning_memguard.strategies import CheckpointingDDPStrategy, CheckpointingSingleDeviceStrategy
from lightning_memguard.testing import SysmemSpillEmulator


def _resnet() -> nn.Module:
    return torchvision.models.resnet18(num_classes=10)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2


def _measured(budget) -> dict:
    """``checkpoint_blocks`` keywords that measure a budget on a model small enough to measure in a blink."""
    model = nn.Sequential(_Block(), _Block(), _Block())
    return {"model": model, "units": {_Block}, "memory_budget": budget, "example_input": torch.randn(32, 64)}


def _blocks(**kwargs):
    model = kwargs.pop("model") if "model" in kwargs else _resnet()
    return checkpoint_blocks(model, **kwargs)


def _resnet_plan(**kwargs):
    model = kwargs.pop("model") if "model" in kwargs else _resnet()
    return checkpoint_resnet(model, **kwargs)


def _apply_plan(**kwargs):
    model = kwargs.pop("model") if "model" in kwargs else _resnet()
    return apply_plan(model, [["layer1.0"]], **kwargs)


ENTRY_POINTS = {
    "MemGuard": MemGuard,
    "BatchSizeTuner": BatchSizeTuner,
    "AccumulationTuner": lambda **kw: AccumulationTuner(kw.pop("effective_batch_size", 64), **kw),
    "ActivationCheckpointing": ActivationCheckpointing,
    "CheckpointingDDPStrategy": CheckpointingDDPStrategy,
    "CheckpointingSingleDeviceStrategy": lambda **kw: CheckpointingSingleDeviceStrategy("cpu", **kw),
    "SysmemSpillEmulator": lambda **kw: SysmemSpillEmulator(**{"capacity": "1GB", **kw}),
    "RebuildConfig": RebuildConfig,
    "checkpoint_blocks": _blocks,
    "checkpoint_resnet": _resnet_plan,
    "apply_plan": _apply_plan,
}
GUARD_AND_TUNERS = ("MemGuard", "BatchSizeTuner", "AccumulationTuner")
TUNERS = ("BatchSizeTuner", "AccumulationTuner")
CHECKPOINTING = (
    "ActivationCheckpointing",
    "CheckpointingDDPStrategy",
    "CheckpointingSingleDeviceStrategy",
    "checkpoint_blocks",
    "checkpoint_resnet",
)
HUGE = 10**400  # no float holds it

BLOCKS = ("checkpoint_blocks", "checkpoint_resnet")
NAMED_MODEL = ("checkpoint_blocks", "checkpoint_resnet", "apply_plan")


def each(entries, kwargs, error=None, match=None) -> list:
    """The same row for several entry points."""
    return [(entry, kwargs, error, match) for entry in entries]


ROWS = [
    # ---- item 8: accepted wrongly, now refused at once, naming the argument
    *each(
        GUARD_AND_TUNERS, {"capacity": 16}, ValueError, r"`capacity` must be at least 1MB, got 16 \(a number is bytes"
    ),
    *each(GUARD_AND_TUNERS, {"capacity": "500KB"}, ValueError, r"`capacity` must be at least 1MB, got '500KB'"),
    *each(
        (*GUARD_AND_TUNERS, "SysmemSpillEmulator"), {"capacity": HUGE}, ValueError, r"`capacity` must be at most 1EB"
    ),
    ("SysmemSpillEmulator", {"bandwidth": HUGE}, ValueError, r"`bandwidth` must be at most 1EB"),
    ("MemGuard", {"prevent_margin": HUGE}, ValueError, r"`prevent_margin` must be at most 1EB"),
    ("MemGuard", {"collapse": math.inf}, ValueError, r"`collapse` must be a finite number \(a number > 1\), got inf"),
    ("MemGuard", {"collapse": math.nan}, ValueError, r"`collapse` must be a finite number .*got nan"),
    ("MemGuard", {"collapse": HUGE}, ValueError, r"`collapse` must be a finite number .*got 1000"),
    ("MemGuard", {"collapse": True}, TypeError, r"`collapse` must be a number > 1, got True"),
    ("MemGuard", {"collapse": "2.5"}, TypeError, r"`collapse` must be a number > 1, got '2.5'"),
    *each(GUARD_AND_TUNERS, {"headroom": math.nan}, ValueError, r"`headroom` must be a finite number .*got nan"),
    *each(
        GUARD_AND_TUNERS,
        {"probe": CpuProbe},
        TypeError,
        r"`probe` must be an instance, got the class CpuProbe: pass CpuProbe\(\)",
    ),
    *each(
        GUARD_AND_TUNERS, {"probe": object()}, TypeError, r"`probe` must have capacity\(\), reset_peak\(\) and read\(\)"
    ),
    *each((*CHECKPOINTING, "apply_plan"), {"bn_correct": None}, TypeError, r"`bn_correct` must be a bool, got None"),
    *each(
        (*CHECKPOINTING, "apply_plan"),
        {"rebuild_bn_relu": "False"},
        TypeError,
        r"`rebuild_bn_relu` must be a bool, got 'False'",
    ),
    ("apply_plan", {"split_graphs": 1}, TypeError, r"`split_graphs` must be a bool, got 1"),
    *each(
        CHECKPOINTING[:3], {"memory_budget": 0.5, "levers": "True"}, TypeError, r"`levers` must be a bool, got 'True'"
    ),
    *each(CHECKPOINTING[:3], {"levers": True}, ValueError, r"`levers=True` chooses among the levers for a budget"),
    *each(
        CHECKPOINTING,
        {"rebuild_config": RebuildConfig},
        TypeError,
        r"`rebuild_config` must be an instance, got the class RebuildConfig",
    ),
    *each(NAMED_MODEL, {"model": "resnet18"}, TypeError, r"`model` must be a torch.nn.Module .*got 'resnet18'"),
    (
        "checkpoint_resnet",
        {"model": nn.Sequential(nn.Linear(2, 2))},
        TypeError,
        r"`model`: checkpoint_resnet needs a torchvision ResNet, got Sequential",
    ),
    ("checkpoint_blocks", {"loss_fn": 5}, TypeError, r"`loss_fn` must be a callable .*or None, got 5"),
    *each(CHECKPOINTING, {"memory_budget": HUGE}, ValueError, r"`memory_budget` in bytes must be at most 1EB"),
    *each(CHECKPOINTING, {"memory_budget": math.inf}, ValueError, r"`memory_budget` must be a finite number"),
    *each(
        CHECKPOINTING,
        {"memory_budget": np.float64(1.5)},
        ValueError,
        r"`memory_budget` as a fraction must be in \(0, 1\]",
    ),
    *each(CHECKPOINTING, {"memory_budget": np.int64(1)}, ValueError, r"`memory_budget` in bytes must be at least 1MB"),
    *each(
        BLOCKS,
        {"compile_settings": 5},
        TypeError,
        r"`compile_settings` must be a sequence of fractions in \(0, 1\], got 5",
    ),
    *each(BLOCKS, {"compile_settings": "0.5"}, TypeError, r"`compile_settings` must be a sequence of fractions"),
    *each(BLOCKS, {"compile_settings": (0.8, True)}, TypeError, r"`compile_settings` must be a sequence of fractions"),
    *each(
        BLOCKS,
        {"compile_settings": (0.8, 0)},
        ValueError,
        r"`compile_settings` must be fractions in \(0, 1\], got \(0.8, 0\)",
    ),
    *each(BLOCKS, {"compile_settings": (1.5,)}, ValueError, r"`compile_settings` must be fractions in \(0, 1\]"),
    ("checkpoint_blocks", {"compile_settings": (math.nan,)}, ValueError, r"`compile_settings` must be a finite number"),
    ("SysmemSpillEmulator", {"sleep": 3}, TypeError, r"`sleep` must be a callable taking seconds, got 3"),
    ("SysmemSpillEmulator", {"clock": 3}, TypeError, r"`clock` must be a callable returning seconds, got 3"),
    ("SysmemSpillEmulator", {"spill_cost": 0}, ValueError, r"`spill_cost` must be a number > 0, got 0"),
    *each(GUARD_AND_TUNERS, {"clock": 3}, TypeError, r"`clock` must be .*callable.*got 3"),
    *each(
        GUARD_AND_TUNERS,
        {"warmup_steps": np.float64(2.0)},
        TypeError,
        r"`warmup_steps` must be an int, got np.float64\(2.0\)",
    ),
    ("BatchSizeTuner", {"init_size": np.int64(0)}, ValueError, r"`init_size` must be >= 1, got np.int64\(0\)"),
    ("RebuildConfig", {"chain_kept": np.int64(-1)}, ValueError, r"`chain_kept` must be at least 0"),
    ("RebuildConfig", {"chain_kept": 1.0}, TypeError, r"`chain_kept` must be an int, got 1.0"),
    # ---- item 9: refused wrongly, now accepted
    *each((*GUARD_AND_TUNERS, "SysmemSpillEmulator"), {"capacity": np.int64(16 * 10**9)}),
    *each(GUARD_AND_TUNERS, {"capacity": "1MB"}),
    ("SysmemSpillEmulator", {"capacity": 1}, None, None),  # a card on which everything spills: the tests' tool
    ("SysmemSpillEmulator", {"bandwidth": np.float64(1e9)}, None, None),
    *each(GUARD_AND_TUNERS, {"headroom": np.float32(0.1), "warmup_steps": np.int64(2)}),
    ("MemGuard", {"reference_steps": np.int32(3), "read_every": np.uint8(5), "collapse": np.int64(3)}, None, None),
    ("MemGuard", {"collapse": np.float32(2.5)}, None, None),
    ("MemGuard", {"prevent_margin": 0}, None, None),
    ("MemGuard", {"prevent_margin": "0MB"}, None, None),
    ("MemGuard", {"prevent_margin": np.int64(10**9)}, None, None),
    ("MemGuard", {"memory_report": False, "record_memory": True}, None, None),
    ("MemGuard", {"memory_report": "False"}, TypeError, r"`memory_report` must be a bool, got 'False'"),
    ("MemGuard", {"record_memory": None}, TypeError, r"`record_memory` must be a bool, got None"),
    *each(GUARD_AND_TUNERS, {"probe": CpuProbe()}),
    ("BatchSizeTuner", {"init_size": np.int64(4), "max_size": np.int32(64), "min_gain": np.float64(0.1)}, None, None),
    ("AccumulationTuner", {"effective_batch_size": np.int64(64), "min_micro_batch": np.int16(8)}, None, None),
    *each(CHECKPOINTING[:3], {"memory_budget": np.float32(0.6)}),
    *each(CHECKPOINTING[:3], {"memory_budget": np.int64(6 * 10**9)}),
    *each(CHECKPOINTING[:3], {"memory_budget": np.float32(0.6), "levers": True}),
    ("checkpoint_blocks", _measured(np.float32(0.6)), None, None),
    ("checkpoint_blocks", _measured(np.int64(10**6)), None, None),
    ("checkpoint_blocks", {**_measured(0.6), "compile_settings": np.array([1.0, 0.5])}, None, None),
    ("RebuildConfig", {"chain_kept": np.int64(1)}, None, None),
    *each(BLOCKS, {"compile_settings": (1,)}),
    *each(BLOCKS, {"compile_settings": np.array([0.8, 0.5])}),
    ("checkpoint_blocks", {"compile_settings": [np.float32(0.5), 1.0], "loss_fn": lambda out: out.sum()}, None, None),
    ("checkpoint_blocks", {"compile_settings": ()}, None, None),
]


@pytest.mark.parametrize(
    ("entry", "kwargs", "error", "match"),
    ROWS,
    ids=[f"{row[0]}-{'-'.join(row[1])}-{row[2].__name__ if row[2] else 'ok'}-{i}" for i, row in enumerate(ROWS)],
)
def test_argument_table(entry, kwargs, error, match):
    build = ENTRY_POINTS[entry]
    if error is None:
        build(**kwargs)
    else:
        with pytest.raises(error, match=match):
            build(**kwargs)


def test_every_public_entry_point_has_rows_of_both_kinds():
    for entry in ENTRY_POINTS:
        kinds = {row[2] is None for row in ROWS if row[0] == entry}
        assert kinds == {True, False} or entry == "apply_plan", entry


def test_numpy_scalars_are_kept_as_the_python_numbers_they_are():
    guard = MemGuard(
        capacity=np.int64(16 * 10**9), headroom=np.float64(0.25), collapse=np.int64(3), read_every=np.int64(5),
        prevent_margin=np.int64(10**9),
    )  # fmt: skip
    values = (guard.capacity, guard.headroom, guard.collapse, guard.read_every, guard.prevent_margin)
    assert values == (16 * 10**9, 0.25, 3.0, 5, 10**9)
    assert [type(v) for v in values] == [int, float, float, int, int]
    tuner = BatchSizeTuner(init_size=np.int64(4), max_size=np.int64(64))
    assert (type(tuner.init_size), type(tuner.max_size)) == (int, int)
    assert type(AccumulationTuner(np.int64(64)).effective_batch_size) is int
    callback = ActivationCheckpointing(memory_budget=np.float64(0.5))
    assert callback.memory_budget == 0.5 and type(callback.memory_budget) is float
    assert type(ActivationCheckpointing(memory_budget=np.int64(10**9)).memory_budget) is int
    assert ActivationCheckpointing(memory_budget="6GB").memory_budget == "6GB"  # a string stays as given
    assert type(RebuildConfig(chain_kept=np.int64(1)).chain_kept) is int
    assert type(SysmemSpillEmulator(capacity=np.int64(10**9)).capacity) is int


def test_a_flag_that_looks_false_no_longer_changes_the_model():
    """``rebuild_bn_relu="False"`` applied the rebuild and ``bn_correct=None`` dropped the BatchNorm correction:
    both are refused before the model is touched."""
    model = _resnet()
    before = [type(m) for m in model.modules()]
    for kwargs in ({"rebuild_bn_relu": "False"}, {"bn_correct": None}):
        with pytest.raises(TypeError, match="must be a bool"):
            checkpoint_blocks(model, **kwargs)
    assert [type(m) for m in model.modules()] == before
