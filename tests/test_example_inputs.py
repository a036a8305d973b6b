"""Issue 38, item 4: example inputs the way Lightning takes them.

``example_input_array`` is a tensor (``forward(x)``), a tuple (``forward(*x)``) or a dict (``forward(**x)``), as
Lightning's model summary calls it; a budget is planned on each form.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import trainer_kwargs
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from lightning_memguard import ActivationCheckpointing
from lightning_memguard.checkpointing import checkpoint_blocks, is_checkpointed
from lightning_memguard.strategies import CheckpointingSingleDeviceStrategy

VOCAB, WIDTH, LENGTH = 50, 32, 6


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.linear(self.norm(h)))


class TokenModel(LightningModule):
    """A Hugging Face-style module, ``forward(input_ids, attention_mask)``, trained on batches of ``batch`` form:
    ``"dict"`` (``input_ids``, ``attention_mask``, ``labels``), ``"tuple"`` (``((input_ids, attention_mask),
    labels)``) or ``"flat"`` (``(input_ids, attention_mask, labels)``). ``seen`` holds each training batch's first
    tokens, so two runs can be compared batch for batch."""

    def __init__(self, batch: str = "dict", example: str | None = None, samples: int = 24, batch_size: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(_Layer() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.batch, self.samples, self.batch_size = batch, samples, batch_size
        self.seen: list[list[int]] = []
        ids = torch.randint(0, VOCAB, (4, LENGTH))
        mask = torch.ones(4, LENGTH)
        if example == "dict":
            self.example_input_array = {"attention_mask": mask, "input_ids": ids}  # keywords: not in forward's order
        elif example == "tuple":
            self.example_input_array = (ids, mask)
        elif example == "list":
            self.example_input_array = [ids, mask]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):
            ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        elif isinstance(batch[0], list | tuple):
            (ids, mask), labels = batch
        else:
            ids, mask, labels = batch
        self.seen.append(ids[:, 0].tolist())
        return nn.functional.cross_entropy(self(ids, mask).flatten(0, 1), labels.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return token_loader(self.batch, self.samples, self.batch_size)


def token_loader(batch: str, samples: int = 24, batch_size: int = 4) -> DataLoader:
    """Shuffled, so that the order a run sees tells whether its random numbers were left alone."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (samples, LENGTH), generator=gen)
    labels = torch.randint(0, VOCAB, (samples, LENGTH), generator=gen)
    mask = torch.ones(samples, LENGTH)
    if batch == "dict":
        data: list = [
            {"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels, strict=True)
        ]
    elif batch == "tuple":
        data = [((i, m), y) for i, m, y in zip(ids, mask, labels, strict=True)]
    else:  # "flat": (input_ids, attention_mask, labels)
        data = [(i, m, y) for i, m, y in zip(ids, mask, labels, strict=True)]
    return DataLoader(data, batch_size=batch_size, shuffle=True)


def _fit(tmp_path, model: LightningModule, callbacks: list, **fit_kwargs) -> Trainer:
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's remarks on the loaders' workers
        trainer.fit(model, **fit_kwargs)
    return trainer


def _checkpointed(model: nn.Module) -> list[str]:
    return sorted(name for name, module in model.named_modules() if is_checkpointed(module))


# ---------------------------------------------------------------- item 4: the three forms of example_input_array


@pytest.mark.parametrize("example", ["dict", "tuple", "list"])
def test_a_budget_is_planned_on_a_dict_or_tuple_example_input(tmp_path, example):
    """A dict example is keywords (``forward(**x)``), a tuple or a list positional (``forward(*x)``), as Lightning's
    summary calls them: the budget is planned on each and the run trains."""
    seed_everything(0)
    model = TokenModel(example=example)
    cb = ActivationCheckpointing(memory_budget=0.5)
    trainer = _fit(tmp_path, model, [cb])
    assert cb.plan is not None and cb.plan.blocks
    assert _checkpointed(model) and trainer.global_step == 12


def test_checkpoint_blocks_measures_a_dict_example_compiled():
    """The compiled measurement takes keywords too (``torch.compile``, ``aot_eager`` on the CPU)."""
    seed_everything(0)
    model = TokenModel()
    example = {"input_ids": torch.randint(0, VOCAB, (4, LENGTH)), "attention_mask": torch.ones(4, LENGTH)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = checkpoint_blocks(model, memory_budget=0.5, example_input=example, compile={"backend": "aot_eager"})
    assert plan.compiled and plan.baseline_bytes > 0 and len(plan.compile_candidates) >= 2


def test_the_strategy_plans_on_a_dict_example_input(tmp_path):
    seed_everything(0)
    model = TokenModel(example="dict")
    strategy = CheckpointingSingleDeviceStrategy("cpu", memory_budget=0.5)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, strategy=strategy))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    assert strategy.checkpointing.runs and _checkpointed(model) and trainer.global_step == 6


def test_the_tuners_cache_key_holds_a_dict_examples_shapes(tmp_path):
    """A choice measured on one dict example's shapes is not reused for another's; the same shapes find it again."""
    from tuner_helpers import BatchClock, PerSample

    from lightning_memguard import BatchSizeTuner

    def fit(length: int) -> BatchSizeTuner:
        model = TokenModel(example="dict")
        model.example_input_array = {k: v[:, :1].repeat(1, length) for k, v in model.example_input_array.items()}
        clock = BatchClock()
        probe = PerSample(model, capacity=int(100e9))
        tuner = BatchSizeTuner(
            init_size=4, max_size=8, probe=probe, clock=clock, cache_dir=tmp_path / "cache", warmup_steps=1,
            timed_steps=1,
        )  # fmt: skip
        trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, max_steps=1, callbacks=[clock, tuner]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model)
        return tuner

    assert not fit(LENGTH).from_cache
    assert not fit(2 * LENGTH).from_cache  # another example: measured again
    assert fit(LENGTH).from_cache
