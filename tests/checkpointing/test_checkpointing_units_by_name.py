"""Blocks chosen by name: the fix a memory report prints (``ActivationCheckpointing(units=["body.1", ...])``) runs as
printed, in the callback, ``checkpoint_blocks`` and the strategies, and a name that names no module is refused with
the names closest to it."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import trainer_kwargs
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard import ActivationCheckpointing, checkpoint_blocks
from lightning_memguard.checkpointing import is_checkpointed
from lightning_memguard.forensics.attribution import measure_step
from lightning_memguard.forensics.memory_report import MemoryReport
from lightning_memguard.strategies import CheckpointingSingleDeviceStrategy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """A model of no known family: its blocks (``body.0`` .. ``body.3``) are found by structure."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.body = nn.Sequential(*(Block() for _ in range(4)))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.inp(x)))


class Classifier(LightningModule):
    """A LightningModule holding the model as ``self.net``, as most do: its modules are ``net.body.0``, ..."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(16, 8, generator=gen), torch.randint(0, 2, (16,), generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8)


def _advice(model: nn.Module, run) -> str:
    """The code in the fix the report prints first (its ``Fix:`` line), as a user would paste it."""
    report = MemoryReport.from_step(measure_step(model, run), "spill")
    fix = next(line for line in report.verdict().splitlines() if line.startswith("Fix:"))
    found = re.search(r"ActivationCheckpointing\(units=\[[^\]]*\]\)", fix)
    assert found, fix
    return found.group(0)


def _fit(tmp_path, model: LightningModule, **kwargs) -> Trainer:
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, **kwargs))
    trainer.fit(model)
    return trainer


def _checkpointed(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if is_checkpointed(m)]


@pytest.mark.parametrize("measured", ["model", "lightning_module"])
def test_the_memory_reports_advice_runs_as_printed(tmp_path, measured):
    """A report measured on the model names its blocks ``body.0``, one measured on the LightningModule (MemGuard's
    own) ``net.body.0``: pasted into the callback, either checkpoints those blocks, which then train as before."""
    plain = Classifier()
    x = plain.x[:8]
    target = plain.net if measured == "model" else plain
    code = _advice(target, lambda: target(x).sum())
    prefix = "" if measured == "model" else "net."
    names = ", ".join(f'"{prefix}body.{i}"' for i in range(4))
    assert code == f"ActivationCheckpointing(units=[{names}])"
    callback = eval(code, {"ActivationCheckpointing": ActivationCheckpointing})  # the advice, as printed

    checked = Classifier()
    _fit(tmp_path, checked, callbacks=[callback])
    assert callback.blocks == ["net.body.0", "net.body.1", "net.body.2", "net.body.3"]
    assert _checkpointed(checked) == callback.blocks
    _fit(tmp_path, plain)
    for (name, a), b in zip(plain.state_dict().items(), checked.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # two steps later: the same weights


def test_checkpoint_blocks_and_the_strategies_take_module_names(tmp_path):
    model = Net()
    plan = checkpoint_blocks(model, units=["body.1", "body.3"])
    assert plan.blocks == ["body.1", "body.3"] and _checkpointed(model) == ["body.1", "body.3"]

    module = Classifier()
    strategy = CheckpointingSingleDeviceStrategy("cpu", activation_checkpointing_policy=["body.2"])
    kwargs = trainer_kwargs(tmp_path, max_epochs=1, strategy=strategy)
    kwargs.pop("devices")
    Trainer(**kwargs).fit(module)
    assert strategy.checkpointing.runs == [["net.body.2"]] and _checkpointed(module) == ["net.body.2"]


def test_a_resnet_named_by_blocks_gets_those_blocks_only():
    """Classes checkpoint a ResNet's stem beside its blocks; names checkpoint exactly what they name."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=4)
    assert checkpoint_blocks(model, units=["layer1.0", "layer3.1"]).blocks == ["layer1.0", "layer3.1"]


def test_a_name_that_names_no_module_is_refused_with_the_closest_names(tmp_path):
    with pytest.raises(ValueError, match=r"Net has no module named 'body\.7' .*closest: body\.3, body\.2, body\.1"):
        checkpoint_blocks(Net(), units=["body.7"])
    with pytest.raises(ValueError, match=r"'up' names several modules of Net \(body\.0\.up, body\.1\.up, "):
        checkpoint_blocks(Net(), units=["up"])
    with pytest.raises(ValueError, match=r"'body\.1' lies inside the block 'body', which is checkpointed whole"):
        checkpoint_blocks(Net(), units=["body", "body.1"])
    with pytest.raises(ValueError, match=r"module names go in a list: units=\['body\.1'\]"):
        ActivationCheckpointing(units="body.1")
    callback = ActivationCheckpointing(units=["net.bdy.1"])
    with pytest.raises(ValueError, match=r"Classifier has no module named 'net\.bdy\.1' .*the closest: net\.body\.1"):
        _fit(tmp_path, Classifier(), callbacks=[callback])
