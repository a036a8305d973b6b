"""The one ledger of saved tensors (``lightning_memguard._ledger``): its rules with exact bytes, and the three counts
that keep it (the planner's ``StepMeter``, the memory report's attribution, the spill emulator) agreeing to the byte
on one training step."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import trainer_kwargs
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard import _autograd
from lightning_memguard._ledger import DEVICE, HOST, Ledger
from lightning_memguard.checkpointing import checkpoint_blocks
from lightning_memguard.checkpointing.measure import StepMeter
from lightning_memguard.forensics.attribution import SavedTensorRecorder, measure_step
from lightning_memguard.levers import pointwise as pointwise_module
from lightning_memguard.levers.pointwise import recompute_pointwise
from lightning_memguard.testing import SysmemSpillEmulator

# ---------------------------------------------------------------- the ledger's rules


def test_a_storage_is_charged_once_whole_and_its_views_owners_share_it_exactly():
    hidden = torch.zeros(10, 10)  # 400 bytes, made in the step
    ledger: Ledger[str] = Ledger()
    ledger.save(hidden[:3], "a")  # rows 0-2: 120 bytes of its own
    ledger.save(hidden[2:4], "b")  # rows 2-3: row 2 is a's already, 40 bytes of its own
    ledger.save(hidden[:3], "c")  # nothing of its own: not an owner
    assert ledger.total == ledger.on_device == 400 and ledger.on_host == 0  # the whole storage, once
    # the rest (rows 4-9, 240 bytes), held alive only through the views, in proportion to their own bytes: 3 to 1
    assert ledger.shares() == {"a": 120 + 180, "b": 40 + 60}
    assert ledger.events == [("a", 120), ("b", 40)]
    assert ledger.timeline() == [("a", 300), ("b", 100)]  # the rest at each owner's first charge: held from then


def test_a_view_spanning_nothing_of_its_own_leaves_the_whole_storage_to_its_first_owner():
    hidden = torch.zeros(8, 8)
    ledger: Ledger[str] = Ledger()
    ledger.save(hidden[:0], "empty")  # a view of no elements keeps all 256 bytes alive
    ledger.save(hidden[:0], "again")
    assert ledger.shares() == {"empty": 256} and ledger.timeline() == [("empty", 256)]


def test_parameters_their_autocast_copies_buffers_and_the_batch_existed_before_the_step():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    batch = torch.randn(4, 8)
    ledger: Ledger[str] = Ledger([*model.parameters(), *model.buffers(), batch])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copy = model[0].weight.to(torch.bfloat16)  # autocast's copy of a weight, as a matmul takes it
    hidden = model[0](batch)
    existed = [model[0].weight.t(), copy.t(), model[1].running_mean, batch[:2], batch.to(torch.bfloat16)]
    assert [ledger.exists(t) for t in existed] == [True, True, True, True, False]  # a copy of the batch is new
    assert all(ledger.save(t, "x") is None for t in existed[:4]) and ledger.total == 0
    frozen = nn.Linear(8, 8).requires_grad_(False)  # a frozen weight is a leaf that needs no gradient: given
    assert not Ledger().exists(frozen.weight) and Ledger(frozen.parameters()).exists(frozen.weight)
    assert not ledger.exists(hidden)


def test_a_storage_freed_in_the_step_and_its_address_reused_is_a_new_storage():
    memory = bytearray(4096)  # the allocator's memory: a storage freed, the next one made at the same address
    ledger: Ledger[str] = Ledger()
    first = torch.frombuffer(memory, dtype=torch.float32)
    ledger.save(first, "a")
    del first  # its storage freed (a pack hook that moved it to the host would free it so)
    second = torch.frombuffer(memory, dtype=torch.float32)
    assert ledger.entry(second) is None  # the same address and size, yet not the storage saved before
    ledger.save(second, "b")
    assert ledger.total == 2 * 4096 and ledger.shares() == {"a": 4096, "b": 4096} and len(ledger.retired) == 1


def test_offloaded_and_fused_entries_are_counted_where_their_bytes_are():
    """Nothing fills these yet: the offload lever's hook and a fused loss will (hand-made entries here)."""
    ledger: Ledger[str] = Ledger()
    offloaded = torch.zeros(100)  # 400 bytes moved to the host by an offload hook
    gradient = torch.zeros(50)  # 200 bytes a fused loss keeps from its forward: its input's gradient
    kept = torch.zeros(25)  # 100 bytes, an ordinary activation
    ledger.save(offloaded, "block", where=HOST)
    entry = ledger.save(gradient, "loss", fused="linear_cross_entropy")
    ledger.save(kept, "block")
    assert entry is not None and entry.fused == "linear_cross_entropy" and entry.where == DEVICE
    assert (ledger.total, ledger.on_device, ledger.on_host) == (700, 300, 400)
    assert ledger.shares() == {"block": 500, "loss": 200}


# ---------------------------------------------------------------- the three counts agree on one step

# Conv2d(3, 8) -> BatchNorm2d -> ReLU -> MaxPool2d(2) -> Flatten -> a slice -> Linear, on 4 images of 3 x 8 x 8: the
# convolution's output (4 x 8 x 8 x 8) kept by BatchNorm with its batch statistics (8 + 8 floats); the ReLU's output
# (as large) kept by the ReLU, and by the max-pooling with its indices (4 x 8 x 4 x 4, int64); the pooled output
# (4 x 8 x 4 x 4) kept by the Linear through a slice of it, flattened: all of it, the allocator keeps the whole storage
FLOAT32_SAVED = {"net.1": 8192 + 64, "net.2": 8192, "net.3": 4096, "net.6": 2048}
# under bf16 autocast the activations are bf16 (the statistics float32), and the convolution keeps a bf16 copy of the
# batch (4 x 3 x 8 x 8), new memory; the bf16 copies of the weights are the weights'
BFLOAT16_SAVED = {"net.0": 1536, "net.1": 4096 + 64, "net.2": 4096, "net.3": 4096, "net.6": 1024}


class First(nn.Module):
    """The first ``n`` features: a view of a part of its input's storage."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : self.n]


class SmallConvNet(LightningModule):
    """The net above; each training step also recorded as the memory report records it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), First(96),
            nn.Linear(96, 10),
        )  # fmt: skip
        self.images = torch.randn(4, 3, 8, 8)
        self.recorder = SavedTensorRecorder(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        with self.recorder.on(batch):
            return self(batch[0]).float().sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.images), batch_size=4)


@pytest.mark.parametrize(("precision", "saved"), [("32-true", FLOAT32_SAVED), ("bf16-mixed", BFLOAT16_SAVED)])
def test_the_planner_the_report_and_the_emulator_count_the_same_saved_bytes_on_one_step(tmp_path, precision, saved):
    model = SmallConvNet()
    autocast = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16-mixed" else contextlib.nullcontext
    )
    with autocast():  # the planner's measurement, as a plan under this precision runs it
        planner = StepMeter(model.net, model.images, lambda out: out.float().sum()).peak()

    def run() -> torch.Tensor:
        with autocast():
            return model(model.images).float().sum()

    redone = measure_step(model, run, batch=model.images).activations  # the report's step redone
    emulator = SysmemSpillEmulator(capacity="1TB")  # nothing spills
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=1, precision=precision, callbacks=[emulator]))
    trainer.fit(model)
    report = model.recorder.largest()  # the report's attribution of the step the emulator ran

    assert emulator.spilled_bytes == 0
    assert planner == redone == report.total == emulator.resident_bytes == sum(saved.values())
    assert report.saved == saved


# ---------------------------------------------------------------- what a selective checkpoint keeps, past the hooks

# Linear(8, 16) -> a block recomputing pointwise [Linear(16, 32) -> GELU -> Linear(32, 16)] -> ReLU -> Linear(16, 4),
# on 4 rows: the block's input (the first Linear's output, 4 x 16) kept by its checkpoint, through the hooks; the two
# matrix products' outputs (4 x 32 and 4 x 16) kept in its selective checkpoint's cache, which no hook sees; GELU's
# input and output recomputed, not kept; the ReLU's output (4 x 16) kept by the ReLU and the last Linear. Under bf16
# autocast the activations are bf16, and the first Linear keeps a bf16 copy of the batch (4 x 8), new memory.
ROWS = 4


def pointwise_saved(size: int, copy_of_batch: int) -> tuple[dict[str, int], int]:
    """The bytes each module keeps, at ``size`` bytes an element, and of them what the block's cache holds."""
    cached = ROWS * 32 * size + ROWS * 16 * size
    saved = {"net.1": ROWS * 16 * size + cached, "net.2": ROWS * 16 * size}
    return ({"net.0": copy_of_batch} if copy_of_batch else {}) | saved, cached


class PointwiseNet(SmallConvNet):
    """The net above, its block recomputing pointwise; each training step recorded as the memory report does."""

    def __init__(self) -> None:
        LightningModule.__init__(self)
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.net = nn.Sequential(nn.Linear(8, 16), block, nn.ReLU(), nn.Linear(16, 4))
        recompute_pointwise(self.net, units=["1"])
        self.images = torch.randn(ROWS, 8)
        self.recorder = SavedTensorRecorder(self)


def cached_tensors(model: nn.Module, x: torch.Tensor, autocast: Callable[[], Any]) -> tuple[torch.Tensor, list[Any]]:
    """One forward of ``model`` (its loss, for a backward to come) and the tensors its block's selective checkpoint
    cached, read from the cache itself (``storage``: each op's outputs where the policy kept them), before backward
    consumes them."""
    made: list[Any] = []
    contexts = pointwise_module.create_selective_checkpoint_contexts

    def recorded(policy: Any) -> tuple[Any, Any]:
        pair = contexts(policy)
        made.append(pair[0])
        return pair

    with pytest.MonkeyPatch.context() as patch, autocast():
        patch.setattr(pointwise_module, "create_selective_checkpoint_contexts", recorded)
        loss = model(x).float().sum()
    [caching] = made
    kept = [
        v.val
        for entries in caching.storage.values()
        for v in (entries.values() if isinstance(entries, dict) else entries)
        if isinstance(getattr(v, "val", None), torch.Tensor)
    ]
    return loss, kept


def cache_bytes(model: nn.Module, x: torch.Tensor, autocast: Callable[[], Any]) -> int:
    """What the block's selective checkpoint caches on one step: each storage once."""
    loss, kept = cached_tensors(model, x, autocast)
    size = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    loss.backward()
    return sum(size.values())


@pytest.mark.parametrize(("precision", "size", "copy_of_batch"), [("32-true", 4, 0), ("bf16-mixed", 2, ROWS * 8 * 2)])
def test_what_a_pointwise_blocks_selective_checkpoint_keeps_is_counted_alike_by_all_three(
    tmp_path, precision, size, copy_of_batch
):
    saved, cached = pointwise_saved(size, copy_of_batch)
    model = PointwiseNet()
    autocast = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16-mixed" else contextlib.nullcontext
    )
    assert cache_bytes(model.net, model.images, autocast) == cached  # the shapes' figure, as the cache holds it
    with autocast():
        planner = StepMeter(model.net, model.images, lambda out: out.float().sum()).peak()

    def run() -> torch.Tensor:
        with autocast():
            return model(model.images).float().sum()

    redone = measure_step(model, run, batch=model.images).activations
    emulator = SysmemSpillEmulator(capacity="1TB")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=1, precision=precision, callbacks=[emulator]))
    trainer.fit(model)
    report = model.recorder.largest()

    assert emulator.spilled_bytes == 0
    assert planner == redone == report.total == emulator.resident_bytes == sum(saved.values())
    assert report.saved == saved  # the cache charged to the block that keeps it


def test_the_emulator_cannot_move_what_the_cache_keeps_so_counts_it_on_the_card():
    """On a card of 1 byte every saved tensor the hooks see spills to the host; the cache's stay on the card."""
    model = PointwiseNet()
    saved, cached = pointwise_saved(4, 0)
    emulator = SysmemSpillEmulator(capacity=1, sleep=lambda seconds: None)
    with emulator:  # as a context manager: it knows no model, so the batch is a leaf it takes to exist
        model.net(model.images).sum().backward()
    assert emulator.resident_bytes == cached
    assert emulator.spilled_bytes == sum(saved.values()) - cached


def test_inside_a_block_checkpointed_whole_the_cache_is_still_held_and_counted_alike():
    """A block recomputing pointwise inside a block checkpointed whole: the whole checkpoint keeps its input alone of
    what the hooks see, yet the inner block's graph, which holds its cache, lives until backward; all three count it."""
    torch.manual_seed(0)
    outer = nn.Sequential(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), nn.ReLU())
    net = nn.Sequential(nn.Linear(8, 16), outer, nn.Linear(16, 4))
    recompute_pointwise(net, units=["1.0"])
    checkpoint_blocks(net, units=["1"])
    x = torch.randn(ROWS, 8)
    loss, kept = cached_tensors(net, x, contextlib.nullcontext)
    cached = sum(t.untyped_storage().nbytes() for t in kept)  # two products' outputs, two storages
    watches = [_autograd.storage_watch(t) for t in kept]
    del kept  # no reference of ours keeps them alive now
    gc.collect()
    assert cached == ROWS * (32 + 16) * 4 and len(watches) == 2 and not any(freed() for freed in watches)
    loss.backward()

    planner = StepMeter(net, x, lambda out: out.sum()).peak()
    redone = measure_step(net, lambda: net(x).sum(), batch=x)
    emulator = SysmemSpillEmulator(capacity="1TB")
    with emulator:
        net(x).sum().backward()
    # the whole checkpoint's input, the inner block's cache, the ReLU's output (the last Linear's input)
    held = {"1": ROWS * 16 * 4, "1.0": cached, "2": ROWS * 16 * 4}
    assert planner == redone.activations == emulator.resident_bytes == sum(held.values())
    assert redone.forward.saved == held


class OutOfMemory(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory (a test's)")


@pytest.mark.parametrize("hooks", ["emulator", "recorder", "emulator_spilling"])
def test_a_step_that_raises_under_the_saved_tensor_hooks_leaves_nothing_alive(hooks):
    """A step that fails before its backward (an out-of-memory error, which MemGuard adapts through) must free what it
    saved. Its hooks once returned each tensor as it was: a saved output then kept its own node alive in a cycle only
    backward breaks, and each failed step's activations stayed on the card for good."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), OutOfMemory())
    made: list[Any] = []
    for module in net[:4]:
        module.register_forward_hook(lambda module, args, out: made.append(weakref.ref(out)))
    contexts = {
        "emulator": lambda: SysmemSpillEmulator(capacity="1TB"),
        "emulator_spilling": lambda: SysmemSpillEmulator(capacity=1, sleep=lambda seconds: None),
        "recorder": lambda: SavedTensorRecorder(net),
    }
    with pytest.raises(RuntimeError, match="out of memory"), contexts[hooks]():
        net(torch.randn(32, 8))
    gc.collect()
    assert len(made) == 4 and [ref() for ref in made] == [None] * 4


# ---------------------------------------------------------------- what an offload keeps, past the hooks outside it


@pytest.mark.parametrize("moved", [False, True])
def test_what_an_offload_keeps_on_the_device_is_counted_alike_by_all_three_and_what_it_moves_by_none(moved):
    from lightning_memguard.levers.offload import ActivationOffload, HostCopies

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    x = torch.randn(512, 256)  # each activation 0.5 MiB: under the offload's own floor, kept unless min_bytes=1

    def counts(offload: ActivationOffload | None) -> tuple[int, int, int]:
        def run() -> torch.Tensor:
            return net(x).sum()

        with offload or contextlib.nullcontext():
            planner = StepMeter(net, x, lambda out: out.sum()).peak()
            report = measure_step(net, run, batch=x).activations
            emulator = SysmemSpillEmulator(capacity="1TB")  # as a context manager: no model, no batch known
            with emulator:
                run().backward()
        return planner, report, emulator.resident_bytes

    activation = 512 * 256 * 4
    plain = counts(None)
    assert plain == (2 * activation,) * 3  # net.1's input; the ReLU's output, which net.3 saves too
    offload = ActivationOffload([net[0], net[1], net[3]], min_bytes=1 if moved else 2**20, streams=HostCopies())
    offloaded = counts(offload)
    # moved: the batch (net.0's input: it existed before, and is held by its caller), net.1's input, and net.3's,
    # whose storage the ReLU (not offloaded) still keeps on the device. Kept: the batch too, which none counts
    assert offload.moved_bytes == (3 * activation if moved else 0)
    assert offloaded == tuple(count - (activation if moved else 0) for count in plain)
