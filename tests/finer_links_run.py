"""Two CPU processes (gloo): a budget whose plan checkpoints parts of blocks (a ViT layer's ``attn`` and ``mlp``),
planned on rank zero (DDP) or measured on every rank (ModelParallelStrategy, FSDP2's ``fully_shard`` on each block),
against the same run without it. Run by test_checkpointing_finer_links_matrix.py, through ``ddp_run.py``.

Scenarios (each rank writes SCENARIO-rankN.json into OUT_DIR); the planner sees steady forward times
(:func:`steady_forward_times`), so what it chooses does not depend on this machine's load:
  ddp:   plain DDP; ActivationCheckpointing(memory_budget=0.8) under "ddp"; CheckpointingDDPStrategy(memory_budget=0.8)
  fsdp2: ModelParallelStrategy without ActivationCheckpointing; with it and a budget (every rank measures); with a
         budget of half the peak whose measured peaks favour parts nested in their blocks; and given runs of parts
         alone and nested (as a resumed run's checkpoint hands them back)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import replace

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import timm  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lightning_memguard import ActivationCheckpointing  # noqa: E402
from lightning_memguard.checkpointing import is_checkpointed  # noqa: E402
from lightning_memguard.strategies import CheckpointingDDPStrategy  # noqa: E402
from lightning_memguard.testing import ImageClassifier  # noqa: E402

RANK = int(os.environ.get("LOCAL_RANK", "0"))
BUDGET = 0.8
# parts alone in an unchecked block, and nested in their checkpointed block
GIVEN = [["net.blocks.0"], ["net.blocks.0.attn"], ["net.blocks.0.mlp"], ["net.blocks.1.mlp"], ["net.blocks.2.attn"]]


def vit() -> torch.nn.Module:
    """Dropout everywhere and stochastic depth: recomputation must draw the same numbers."""
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", img_size=32, depth=3, num_classes=5, drop_rate=0.1, proj_drop_rate=0.1,
        attn_drop_rate=0.1, drop_path_rate=0.2,
    )  # fmt: skip


class ViTClassifier(ImageClassifier):
    def __init__(self) -> None:
        super().__init__("vit", num_classes=5, image_size=32, batch_size=4, steps_per_epoch=4, pool_size=8, net=vit())
        self.example_input_array = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))


class ShardedViT(ViTClassifier):
    """FSDP2's ``fully_shard`` on each transformer block, then on the network, as ModelParallelStrategy asks."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.device_mesh is None or isinstance(self.net, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@contextlib.contextmanager
def steady_forward_times() -> Iterator[None]:
    """Inside, the planner sees the forward times an idle CPU measures for the ViT's links (a block 1.2 ms, its
    ``attn`` and ``mlp`` 0.4 ms each), not this machine's clock, which on a loaded machine may make a whole block
    look cheaper than its parts: so the plan depends on the bytes measured alone."""
    from lightning_memguard.checkpointing.measure import StepMeter

    measured = StepMeter.profile

    def profile(meter, links, parts=()):
        steady = {"attn": 0.4, "mlp": 0.4}
        return [
            replace(p, forward_ms=steady.get(p.name.rpartition(".")[2], 1.2)) for p in measured(meter, links, parts)
        ]

    StepMeter.profile = profile  # type: ignore[method-assign]
    try:
        yield
    finally:
        StepMeter.profile = measured  # type: ignore[method-assign]


def own(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter and buffer."""
    with torch.no_grad():
        return {
            name: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
            for name, t in [*module.named_parameters(), *module.named_buffers()]
        }


def fit(model: ImageClassifier, out: str, strategy, callbacks=()) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out,
        callbacks=list(callbacks),
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(model)
    return trainer


def trained(model: ImageClassifier, plain: dict[str, torch.Tensor], runs, plan, trainer: Trainer) -> dict:
    ours = own(model)
    return {
        "runs": runs,
        "parts": None if plan is None else plan.parts,
        "checkpointed": sorted(n.removeprefix("net.") for n, m in model.named_modules() if is_checkpointed(m)),
        "same_keys": ours.keys() == plain.keys(),
        "differ": sorted(k for k in plain if not torch.equal(ours[k], plain[k])),  # bit for bit
        "step": trainer.global_step,
    }


def ddp(out: str) -> dict:
    plain = ViTClassifier()
    fit(plain, out, DDPStrategy(process_group_backend="gloo"))
    callback = ActivationCheckpointing(memory_budget=BUDGET)
    model = ViTClassifier()
    with steady_forward_times():
        trainer = fit(model, out, "ddp", [callback])
    result = {"callback": trained(model, own(plain), callback.runs, callback.plan, trainer)}
    strategy = CheckpointingDDPStrategy(memory_budget=BUDGET, process_group_backend="gloo")
    model = ViTClassifier()
    with steady_forward_times():
        trainer = fit(model, out, strategy)
    result["strategy"] = trained(model, own(plain), strategy.checkpointing.runs, strategy.checkpointing.plan, trainer)
    return result


def fsdp2(out: str) -> dict:
    def strategy():
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)

    plain = ShardedViT()
    fit(plain, out, strategy())
    result = {}
    for name in ("budget", "nested", "given"):
        callback = ActivationCheckpointing(memory_budget=0.5 if name == "nested" else BUDGET)
        if name == "given":  # as a resumed run's checkpoint hands them back: applied on every rank, nothing measured
            callback.load_state_dict({"runs": GIVEN})
        model = ShardedViT()
        with steady_forward_times(), peaks_favouring_nested_parts() if name == "nested" else contextlib.nullcontext():
            trainer = fit(model, out, strategy(), [callback])
        result[name] = trained(model, own(plain), callback.runs, callback.plan, trainer)
    return result


@contextlib.contextmanager
def peaks_favouring_nested_parts():
    """The measured peak as a function of what is checkpointed, the same on every rank (FSDP2's gathered weights
    make the CPU's count of saved bytes vary from pass to pass): 100 a block, 30 a part alone, 10 a part nested in
    its checkpointed block, so that a budget of half the peak takes every block and the parts nested in them."""
    from lightning_memguard.checkpointing.measure import StepMeter
    from lightning_memguard.checkpointing.wrap import is_checkpointed

    def peak(meter):
        blocks = list(meter.model.net.blocks)
        whole = sum(is_checkpointed(b) for b in blocks)
        parts = [(is_checkpointed(b), is_checkpointed(p)) for b in blocks for p in (b.attn, b.mlp)]
        return 1000 - 100 * whole - 30 * parts.count((False, True)) - 10 * parts.count((True, True))

    measured = StepMeter.peak
    StepMeter.peak = peak  # type: ignore[method-assign]
    try:
        yield
    finally:
        StepMeter.peak = measured  # type: ignore[method-assign]


def run(out: str, scenario: str) -> None:
    """One scenario on this rank, its result in OUT/SCENARIO-rankN.json (``ddp_run.py`` calls it)."""
    result = {"ddp": ddp, "fsdp2": fsdp2}[scenario](out)
    with open(os.path.join(out, f"{scenario}-rank{RANK}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
