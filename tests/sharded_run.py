"""Two CPU processes (gloo) under ModelParallelStrategy, the model sharded with FSDP2's ``fully_shard``: the tuners,
MemGuard and ActivationCheckpointing, each scenario its own ``fit`` in one launch. Run by test_sharded.py.

Usage: python sharded_run.py OUT_DIR SCENARIO...
  batch_size:    BatchSizeTuner; rank 1's card holds fewer samples
  accumulation:  AccumulationTuner; rank 1's card holds fewer samples
  guard:         MemGuard; rank 1's memory goes above its card at its 4th batch, on_spill="stop"; rank 1 steps at
                 half the pace
  adapt:         MemGuard(on_spill="adapt"); another application takes memory of rank 1's card at its 3rd step: both
                 ranks split their batches from the same step (BatchNorm frozen), against the same run unsplit
  checkpointing: ActivationCheckpointing() on the sharded blocks, against the same run without it
  budget:        ActivationCheckpointing(memory_budget=0.7): every rank measures, rank zero's plan on all
  oom_forward, oom_backward, oom_head, oom_stem: BatchSizeTuner; rank 1 runs out of memory above 8 samples inside a
                 sharded block's forward, inside a sharded block's backward, in the head's or the stem's backward
  oom_accumulation: AccumulationTuner; rank 1 runs out of memory above 8 samples in a sharded block's backward
Each rank writes SCENARIO-rankN.json into OUT_DIR. The suite runs the scenarios inside the one DDP launch
(``ddp_run.py``, ``conftest.DDP_SCENARIOS``) through :func:`run`.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
from conftest import FakeProbe, StepClock  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from tuner_helpers import BatchClock, PerSample  # noqa: E402

from lightning_memguard import AccumulationTuner, ActivationCheckpointing, BatchSizeTuner, MemGuard  # noqa: E402
from lightning_memguard.checkpointing import is_checkpointed  # noqa: E402
from lightning_memguard.testing import ShardedClassifier  # noqa: E402

RANK = int(os.environ.get("LOCAL_RANK", "0"))


def own(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter and buffer."""
    with torch.no_grad():
        return {
            name: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
            for name, t in [*module.named_parameters(), *module.named_buffers()]
        }


class Before(Callback):
    """Listed before the tuner: this rank's shards and the optimizer's state as the run starts."""

    def on_fit_start(self, trainer, pl_module):
        self.weights = own(pl_module)
        self.optimizer_state = len(trainer.optimizers[0].state)


class FirstBatch(Callback):
    """What the run looks like at its first training batch, after the trials."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if hasattr(self, "weights"):
            return
        self.weights = own(pl_module)
        self.optimizer_state = len(trainer.optimizers[0].state)
        self.global_step = trainer.global_step
        self.samples = batch.shape[0]


def trainer(out, callbacks, **kwargs):
    kwargs = {"max_epochs": 1, "limit_train_batches": 2, **kwargs}
    return Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
        **kwargs,
    )


def model(**kwargs):
    torch.manual_seed(0)
    return ShardedClassifier(
        "resnet18", image_size=16, **{"batch_size": 2, "steps_per_epoch": 40, "pool_size": 8, **kwargs}
    )


def tuned(out, scenario):
    net = model()
    clock, before, first = BatchClock(), Before(), FirstBatch()
    if scenario == "batch_size":
        probe = PerSample(net, int(10e9) if RANK == 0 else int(1.3e9))  # rank 1: 12 samples fit, 16 do not
        tuner = BatchSizeTuner(
            mode="max_fit", init_size=4, max_size=32, probe=probe, cache=False, warmup_steps=1, timed_steps=2,
            clock=clock,
        )  # fmt: skip
        kwargs = {}
    else:
        probe = PerSample(net, int(10e9) if RANK == 0 else int(1.2e9))  # rank 1: above 11 samples do not fit
        tuner = AccumulationTuner(
            effective_batch_size=32, min_micro_batch=4, probe=probe, cache=False, warmup_steps=1, timed_steps=1,
            clock=clock,
        )  # fmt: skip
        kwargs = {"max_steps": 1, "limit_train_batches": 1.0}
    t = trainer(out, [before, clock, tuner, first], **kwargs)
    t.fit(net)
    return {
        **searched(tuner, net, before, first),
        "accumulate": tuner.accumulate_grad_batches,
        "trainer_accumulate": t.accumulate_grad_batches,
        "global_step_at_first_batch": first.global_step,
        "sharded": isinstance(next(net.parameters()), DTensor),
    }


def searched(tuner, net, before, first):
    """What a tuner's search left: its trials and choice, and the run at its first real batch against before."""
    return {
        "batch_size": tuner.batch_size,
        "model_batch_size": net.batch_size,
        "results": [[r.size, r.accumulate, r.outcome] for r in tuner.results],
        "samples_at_first_batch": first.samples,
        "weights_put_back": all(torch.equal(before.weights[k], v) for k, v in first.weights.items()),
        "optimizer_state_before_and_at_first_batch": [before.optimizer_state, first.optimizer_state],
    }


class Outgrow(Callback):
    def __init__(self, probe):
        self.probe = probe

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if RANK == 1 and batch_idx == 3:
            self.probe.peak = 17 * 10**9


def guard(out):
    probe = FakeProbe()  # 16 GB, 1 GB used
    memguard = MemGuard(probe=probe, on_spill="stop", clock=StepClock(0.1 * (RANK + 1)), read_every=100)
    t = trainer(out, [Outgrow(probe), memguard], limit_train_batches=8, max_epochs=2)
    result = {"warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model(batch_size=4))
    result["warnings"] = [str(w.message) for w in caught if "spill" in str(w.message)]
    result["global_step"] = t.global_step
    result["should_stop"] = t.should_stop
    result["epochs"] = [r.to_dict() for r in memguard.epochs]
    metric = t.callback_metrics.get("memguard/samples_per_sec")
    result["logged_samples_per_sec"] = None if metric is None else float(metric)
    return result


class ForwardProbe(FakeProbe):
    """A card whose step peak is 1 GB, plus what another application holds, plus 0.9 GB for each sample of the
    largest forward since the last reset: a split batch peaks lower, as on a card."""

    def __init__(self, net) -> None:
        super().__init__()
        self.most, self.taken = 0, 0
        net.register_forward_pre_hook(self._forward)

    def _forward(self, module, args) -> None:
        if args and torch.is_tensor(args[0]):
            self.most = max(self.most, args[0].shape[0])

    def reset_peak(self) -> None:
        super().reset_peak()
        self.most = 0

    def read(self):
        self.peak = 10**9 + self.taken + self.most * 9 * 10**8
        return super().read()


class TakeMemory(Callback):
    def __init__(self, probe: ForwardProbe) -> None:
        self.probe = probe
        self.micro_batches: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if RANK == 1 and trainer.global_step == 2:
            self.probe.taken = 13 * 10**9  # 4 samples: 17.6 GB of 16; 2: 15.8 GB

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.micro_batches.append(self.probe.most)


class FrozenNorm(ShardedClassifier):
    """BatchNorm on its running statistics (eval mode) while training: a split batch trains exactly as the whole."""

    def on_train_epoch_start(self) -> None:
        for m in self.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.eval()


def adapt(out):
    def frozen():
        torch.manual_seed(0)
        return FrozenNorm("resnet18", image_size=16, batch_size=4, steps_per_epoch=40, pool_size=8)

    plain = frozen()
    trainer(out, [], limit_train_batches=8).fit(plain)
    net = frozen()
    probe = ForwardProbe(net)
    memguard = MemGuard(
        probe=probe, on_spill="adapt", clock=StepClock(0.1), read_every=1, warmup_steps=1, reference_steps=1,
        spill_checkpoint=False,
    )  # fmt: skip
    taker = TakeMemory(probe)
    t = trainer(out, [taker, memguard], limit_train_batches=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(net)
    ours, theirs = own(net), own(plain)
    return {
        "adaptations": [[a.step, a.before, a.after] for a in memguard.adaptations],
        "global_step": t.global_step,
        "largest_forward": taker.micro_batches,
        "max_difference": max(float((ours[k].float() - theirs[k].float()).abs().max()) for k in ours),
    }


def checkpointing(out):
    trained = {}
    for name, callbacks in (("plain", []), ("checkpointed", [ActivationCheckpointing()])):
        net = model(batch_size=4)
        trainer(out, callbacks, max_steps=3, limit_train_batches=3).fit(net)
        trained[name] = (own(net), sum(is_checkpointed(m) for m in net.modules()))
    (plain, _), (ours, blocks) = trained["plain"], trained["checkpointed"]
    return {
        "checkpointed_blocks": blocks,
        "same_keys": plain.keys() == ours.keys(),
        "max_difference": max(float((plain[k].float() - ours[k].float()).abs().max()) for k in plain),
    }


def budget(out):
    net = model(batch_size=4)
    net.example_input_array = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    callback = ActivationCheckpointing(memory_budget=0.7)
    trainer(out, [callback], max_steps=2, limit_train_batches=2).fit(net)
    return {
        "runs": callback.runs,
        "checkpointed": sorted(n for n, m in net.named_modules() if is_checkpointed(m)),
        "planned_here": callback.plan is not None,
    }


def _out_of_memory(where):
    raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 GiB (injected on rank 1, {where})")


def inject_out_of_memory(net, where):
    """Rank 1 runs out of memory above 8 samples: inside a sharded block's forward (``forward``), inside a sharded
    block's backward (``backward``), in the backward of the model's own head, before any block's (``head``), or of
    its stem, after every block's (``stem``)."""
    if RANK != 1:
        return

    def big(x):
        return torch.is_grad_enabled() and x.shape[0] > 8

    def in_forward(module, args, output):
        if big(output):
            _out_of_memory("in layer2.0's forward")

    def in_backward(module, args, output):
        if big(output):
            output.register_hook(lambda grad: _out_of_memory(f"in the backward of {where}"))

    if where == "forward":
        net.net.layer2[0].conv2.register_forward_hook(in_forward)
    elif where == "backward":
        net.net.layer3[0].conv1.register_forward_hook(in_backward)
    elif where == "stem":  # the last stretch of backward, after every block's gradients were reduced
        net.net.conv1.register_forward_hook(in_backward)
    else:
        net.net.fc.register_forward_hook(in_backward)


def out_of_memory(out, where):
    """BatchSizeTuner, both cards large; rank 1 fails above 8 samples, in the middle of FSDP's collectives.
    ``accumulation``: AccumulationTuner, rank 1 failing in a block's backward (the micro-batches before the last
    reduce no gradients: Lightning turns FSDP2's gradient sync off for them)."""
    net = model()
    inject_out_of_memory(net, "backward" if where == "accumulation" else where)
    clock, before, first = BatchClock(), Before(), FirstBatch()
    common = {"probe": PerSample(net, int(10e9)), "cache": False, "warmup_steps": 1, "timed_steps": 1, "clock": clock}
    if where == "accumulation":
        tuner = AccumulationTuner(effective_batch_size=32, min_micro_batch=4, **common)
        limits = {"max_steps": 1, "limit_train_batches": 1.0}
    else:
        tuner = BatchSizeTuner(mode="max_fit", init_size=4, max_size=32, **common)
        limits = {"limit_train_batches": 1}
    t = trainer(out, [before, clock, tuner, first], **limits)
    try:
        t.fit(net)
    except RuntimeError as err:  # before torch 2.14 the agreed error ends the run on every rank
        return {"ended": str(err), "global_step": t.global_step}
    return {**searched(tuner, net, before, first), "global_step": t.global_step,
            "accumulate": t.accumulate_grad_batches}  # fmt: skip


def run(out: str, scenario: str) -> None:
    """One scenario on this rank, its result in OUT/SCENARIO-rankN.json (``ddp_run.py`` calls it)."""
    if scenario in ("batch_size", "accumulation"):
        result = tuned(out, scenario)
    elif scenario.startswith("oom_"):
        result = out_of_memory(out, scenario.removeprefix("oom_"))
    else:
        result = {"guard": guard, "adapt": adapt, "checkpointing": checkpointing, "budget": budget}[scenario](out)
    with open(os.path.join(out, f"{scenario}-rank{RANK}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


def main() -> None:
    out, scenarios = sys.argv[1], sys.argv[2:]
    for scenario in scenarios:
        try:
            run(out, scenario)
        except Exception as err:  # named in the scenario's result; the next scenario still runs
            with open(os.path.join(out, f"{scenario}-rank{RANK}.json"), "w", encoding="utf-8") as f:
                json.dump({"error": f"{type(err).__name__}: {err}"}, f)


if __name__ == "__main__":
    main()
