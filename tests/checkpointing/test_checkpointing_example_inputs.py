"""Example inputs the way Lightning takes them, and a budget without one.

``example_input_array`` is a tensor (``forward(x)``), a tuple (``forward(*x)``) or a dict (``forward(**x)``), as
Lightning's model summary calls it; a budget is planned on each form. Without ``example_input_array``, a budget is
measured on the first training batch (the rule: a tensor is the input; a tuple or list, its first element; a dict,
the keys ``forward`` takes), the run still sees every batch in the same order, and the line says so.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
from conftest import trainer_kwargs
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from lightning_memguard import ActivationCheckpointing
from lightning_memguard.checkpointing import checkpoint_blocks, is_checkpointed
from lightning_memguard.strategies import CheckpointingSingleDeviceStrategy
from lightning_memguard.testing import ImageClassifier

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


# ---------------------------------------------------------------- item 11: no example_input_array, a budget


def _order_seen(tmp_path, batch: str, callbacks: list, caplog=None, **fit_kwargs) -> list[list[int]]:
    seed_everything(0)
    model = TokenModel(batch=batch)
    with caplog.at_level(logging.INFO) if caplog is not None else contextlib.nullcontext():
        _fit(tmp_path, model, callbacks, **fit_kwargs)
    return model.seen


@pytest.mark.parametrize(
    ("batch", "said"),
    [
        ("dict", "entries 'input_ids', 'attention_mask' (keywords of forward)"),
        ("tuple", "first element (2 positional arguments of forward)"),
    ],
)
def test_without_an_example_the_budget_is_measured_on_the_first_batch(tmp_path, caplog, batch, said):
    """A dict batch gives the entries forward takes (not ``labels``); a tuple ``((ids, mask), labels)`` its first
    element. The run sees every batch, in the order an un-checkpointed run sees them, and the line says so."""
    plain = _order_seen(tmp_path, batch, [])
    cb = ActivationCheckpointing(memory_budget=0.5)
    seen = _order_seen(tmp_path, batch, [cb], caplog)
    assert cb.plan is not None and cb.plan.blocks
    assert seen == plain and len(seen) == 12  # 24 samples by 4, two epochs, shuffled alike
    assert (
        f"ActivationCheckpointing: no example_input_array: measuring the budget on the first training batch's {said}"
        in caplog.text
    )


class TokenData(LightningDataModule):
    def __init__(self, batch: str) -> None:
        super().__init__()
        self.batch = batch

    def train_dataloader(self) -> DataLoader:
        return token_loader(self.batch)


@pytest.mark.parametrize("source", ["a loader passed to fit", "a datamodule"])
def test_the_first_batch_of_a_loader_passed_to_fit_or_a_datamodule(tmp_path, source):
    if source == "a loader passed to fit":
        kwargs: dict = {"train_dataloaders": token_loader("dict")}
    else:
        kwargs = {"datamodule": TokenData("dict")}
    plain = _order_seen(tmp_path, "dict", [], **kwargs)
    kwargs = {k: token_loader("dict") if k == "train_dataloaders" else TokenData("dict") for k in kwargs}
    cb = ActivationCheckpointing(memory_budget=0.5)
    assert _order_seen(tmp_path, "dict", [cb], **kwargs) == plain and cb.plan is not None and cb.plan.blocks


def test_the_strategy_measures_on_the_first_batch_too(tmp_path):
    plain = _order_seen(tmp_path, "dict", [])
    seed_everything(0)
    model = TokenModel(batch="dict")
    strategy = CheckpointingSingleDeviceStrategy("cpu", memory_budget=0.5)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, strategy=strategy))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    assert strategy.checkpointing.runs and _checkpointed(model) and model.seen == plain


class _Batch:
    """A batch of a kind the rule does not read."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids


class ObjectBatches(TokenModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader([_Batch(torch.zeros(LENGTH, dtype=torch.long))] * 8, batch_size=None)


class NoTrainingBatches(TokenModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader([], batch_size=4)


@pytest.mark.parametrize(
    ("model", "why"),  # the model built in the test
    [
        (ObjectBatches, r"cannot be told \(it is a _Batch\)"),
        (lambda: TokenModel(batch="flat"), r"cannot be told \(forward does not take its first element"),
        (NoTrainingBatches, r"it has neither \(an empty train loader\)"),
        # a batch of indices into images the module holds: a tensor, which forward does not take
        (
            lambda: ImageClassifier(batch_size=4, steps_per_epoch=2),
            r"measuring on the first training batch's tensor of shape",
        ),
    ],
)
def test_the_refusal_names_both_ways_when_no_inputs_can_be_had(tmp_path, model, why):
    """No example and a batch that is an object, a flat tuple whose first element is not all forward takes, an
    empty loader, or a tensor the model fails on: refused, with both ways named, and the model left as it was."""
    model = model()
    cb = ActivationCheckpointing(memory_budget=0.5)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[cb]))
    refused = pytest.raises(
        ValueError, match=f"`example_input_array`, or without one on the first training batch.*{why}"
    )
    with refused, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    assert not _checkpointed(model)


class NoBlocks(LightningModule):
    """One linear layer: nothing to checkpoint, whatever the inputs."""

    def __init__(self, example: bool) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)
        if example:
            self.example_input_array = torch.randn(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(list(zip(torch.randn(8, 8), torch.randint(0, 2, (8,)), strict=True)), batch_size=4)


@pytest.mark.parametrize("example", [False, True], ids=["first-batch", "example_input_array"])
def test_a_budget_on_a_model_without_blocks_says_no_blocks_found_first(tmp_path, example):
    """Nothing to checkpoint: the error says so, and does not send the user to set inputs that would not help."""
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[ActivationCheckpointing(memory_budget=0.5)]))
    with pytest.raises(ValueError, match=r"^ActivationCheckpointing: no blocks to checkpoint found in NoBlocks") as err:
        trainer.fit(NoBlocks(example))
    assert "example_input_array" not in str(err.value)
