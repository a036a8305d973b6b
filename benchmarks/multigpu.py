"""The library under DDP on two GPUs. Run on a machine with 2 GPUs (NCCL multicast variables as set there):

    python benchmarks/multigpu.py --out benchmarks/results/multigpu.json [--parts tuning,overhead,...]

ResNet50, bf16-mixed, channels_last, strategy="ddp", 2 GPUs; the parts (all by default, in this order):
- ``tuning``: MemGuard() + AccumulationTuner(effective_batch_size=512): every rank's choice, and the logged
  samples/s (all ranks together) against the figure in each rank's table (the same merged record on every rank);
- ``overhead``: the tuned configuration with and without MemGuard, interleaved, median step time (CUDA events);
- ``spill``: SysmemSpillEmulator on rank 1 only: both ranks stop within 3 steps, SysmemSpillError with its own
  report on rank 1, no hang;
- ``oom``: a real CUDA out-of-memory error on rank 1 only, inside BatchSizeTuner's trials (``mode="max_fit"``, 64 to
  1024): rank 1 holds a ballast on its GPU that leaves it 40 GiB, so the trial at 1024 (about 51 GB) fails there
  alone while 512 (about 26 GB, the ballast counted in its peak) fits; both ranks must call 1024 "does not fit",
  agree on 512 and train on, without a hang;
- ``compiled``: BatchSizeTuner on ``torch.compile(model)`` under DDP (128..512), then 5 + 15 steps at its choice;
  the oracle: the same size compiled on its own (``dynamic=False``), trained the same way;
- ``strategy``: CheckpointingDDPStrategy(memory_budget=0.6) in fp32, batch 64, cuDNN deterministic: both ranks
  apply rank zero's plan, each rank's first forward and backward peak against the budget, and the weights after
  3 steps against plain DDP's from the same seed (with a second plain run's difference as the baseline);
- ``fsdp`` and ``model_parallel``: the sharded strategies (``FSDPStrategy``; ``ModelParallelStrategy`` with
  ``ShardedClassifier``, FSDP2's ``fully_shard`` on every block): MemGuard() + AccumulationTuner(512) (every rank's
  choice, the weights at the first real batch as before the trials, logged samples/s against each rank's table),
  then ActivationCheckpointing(memory_budget=0.6) (every rank's plan and step peaks against the budget; under
  FSDPStrategy on several devices a budget is refused, and the refusal is recorded);
- ``sharded_oom``: as ``oom``, under ModelParallelStrategy with ``ShardedClassifier`` (FSDP2's collectives inside
  the forward and backward where rank 1 runs out of memory).
Every rank writes its own JSON; rank 0 merges them. `--smoke` runs a tiny version on 2 CPU processes (gloo; the
``oom`` part then raises the error in rank 1's training step instead of allocating a ballast, and ``compiled``
uses the ``aot_eager`` backend; Lightning builds FSDPStrategy only on a GPU, so ``fsdp`` records that it was skipped).
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import StepPeak  # noqa: E402

from lightning_memguard import (  # noqa: E402
    AccumulationTuner,
    ActivationCheckpointing,  # noqa: E402
    BatchSizeTuner,
    MemGuard,
    SysmemSpillError,
)
from lightning_memguard.strategies import CheckpointingDDPStrategy  # noqa: E402
from lightning_memguard.testing import ImageClassifier, ShardedClassifier, StepTimer, SysmemSpillEmulator  # noqa: E402

PARTS = ("tuning", "overhead", "spill", "oom", "compiled", "strategy", "fsdp", "model_parallel", "sharded_oom")
WORLD = 2  # devices=2


def trainer(args: argparse.Namespace, callbacks: list[Any], max_steps: int, **kwargs: Any) -> Trainer:
    kwargs.setdefault("strategy", "ddp")
    kwargs.setdefault("precision", "32-true" if args.smoke else "bf16-mixed")
    return Trainer(
        accelerator="cpu" if args.smoke else "cuda", devices=2, max_steps=max_steps, max_epochs=1,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=args.tmp, **kwargs,
    )  # fmt: skip


def model(args: argparse.Namespace, batch: int, steps: int, cls: type[ImageClassifier] = ImageClassifier) -> Any:
    if args.smoke:
        return cls("resnet18", image_size=32, batch_size=batch, steps_per_epoch=steps, pool_size=32, seed=0)
    channels_last = not issubclass(cls, ShardedClassifier)  # fully_shard takes contiguous weights only
    return cls("resnet50", image_size=224, num_classes=1000, batch_size=batch, steps_per_epoch=steps,
               channels_last=channels_last, pool_size=256, seed=0)  # fmt: skip


class _OomOnRankOne(ImageClassifier):
    """Smoke only: rank 1 raises CUDA's out-of-memory error in its training step above 8 samples."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_rank == 1 and batch.shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (smoke: rank 1 only)")
        return super().training_step(batch, batch_idx)


class _ShardedOomOnRankOne(_OomOnRankOne, ShardedClassifier):
    """Smoke only: as :class:`_OomOnRankOne`, sharded (its training step, then ShardedClassifier's)."""


def part_tuning(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    effective, steps = (32, 6) if args.smoke else (512, 60)
    guard = MemGuard()
    tuner = AccumulationTuner(effective, min_micro_batch=8 if args.smoke else 32, cache=False)
    t = trainer(args, [guard, tuner], steps)
    t.fit(model(args, 64, 10_000))
    return {
        "choice": {"micro_batch": tuner.batch_size, "accumulate": tuner.accumulate_grad_batches},
        "trials": [r.to_dict() for r in tuner.results],
        "logged_samples_per_sec": float(t.callback_metrics["memguard/samples_per_sec"]),
        "table_samples_per_sec": guard.epochs[-1].samples_per_sec,  # the merged record this rank holds
    }


def part_overhead(args: argparse.Namespace, rank: int, micro: int, accumulate: int) -> list[dict[str, Any]]:
    steps = 6 if args.smoke else 60
    rows = []
    for round_ in range(2):
        for guarded in (True, False) if round_ % 2 == 0 else (False, True):
            timer = StepTimer(skip=5)
            callbacks: list[Any] = [MemGuard(), timer] if guarded else [timer]
            trainer(args, callbacks, steps, accumulate_grad_batches=accumulate).fit(model(args, micro, 10_000))
            rows.append({"memguard": guarded, "median_step_ms": statistics.median(timer.step_ms(accumulate))})
    return rows


def part_spill(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    spill_batch, capacity = (16, "120MB") if args.smoke else (384, "16GB")
    emu = SysmemSpillEmulator(capacity=capacity if rank == 1 else "10TB")
    guard = MemGuard(probe=emu.probe, warmup_steps=3)
    t = trainer(args, [emu, guard], 40)
    start = time.perf_counter()
    outcome: dict[str, Any] = {"error": None}
    try:
        t.fit(model(args, spill_batch, 10_000))
    except SysmemSpillError as err:
        outcome = {"error": "SysmemSpillError", "own_report": err.report is not None, "message": str(err)[:300]}
    outcome["stopped_at_step"] = t.global_step
    outcome["seconds"] = time.perf_counter() - start
    return outcome


def part_oom(args: argparse.Namespace, rank: int, sharded: bool = False) -> dict[str, Any]:
    """``sharded``: under ModelParallelStrategy, FSDP2 on every block, whose gathers and reductions are inside the
    forward and backward where rank 1 runs out of memory."""
    ballast = None
    if not args.smoke and rank == 1:
        device = torch.device("cuda", rank)  # this rank's GPU: Lightning sets the current device only inside fit
        gc.collect()
        torch.cuda.empty_cache()  # what earlier parts cached is free, not counted as the ballast's
        free, _ = torch.cuda.mem_get_info(device)
        ballast = torch.empty(max(0, free - 40 * 2**30), dtype=torch.uint8, device=device)  # leaves 40 GiB
    init, top, steps = (4, 16, 4) if args.smoke else (64, 1024, 20)
    tuner = BatchSizeTuner(init_size=init, max_size=top, mode="max_fit", cache=False)
    if sharded:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy: Any = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
        cls: type[ImageClassifier] = _ShardedOomOnRankOne if args.smoke else ShardedClassifier
    else:
        strategy, cls = "ddp", _OomOnRankOne if args.smoke else ImageClassifier
    t = trainer(args, [tuner], steps, strategy=strategy)
    start = time.perf_counter()
    try:
        t.fit(model(args, init, 10_000, cls))
    except RuntimeError as err:  # a trial the search cannot go on from ends the run on every rank: recorded
        if not sharded:
            raise
        return {"ended": str(err), "choice": None, "trials": [], "trained_steps": t.global_step,
                "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    result = {
        "ballast_bytes": None if ballast is None else ballast.numel(),
        "choice": tuner.batch_size,
        "trials": [{"size": r.size, "outcome": r.outcome} for r in tuner.results],
        "trained_steps": t.global_step,
        "seconds": round(time.perf_counter() - start, 1),
    }
    del ballast
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _timed_fit(args: argparse.Namespace, module: Any, callbacks: list[Any]) -> float:
    """This rank's samples/s over 15 training steps after 5 warm-up steps (compiling among them), at the batch size
    the module trains at (the tuner's choice, where there is a tuner: its trials are not training steps)."""
    timer = StepTimer(skip=5)
    t = trainer(args, [*callbacks, timer], 20)
    t.fit(module)
    return t.lightning_module.batch_size / statistics.median(timer.step_ms()) * 1e3  # type: ignore[attr-defined]


def part_compiled(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    backend = "aot_eager" if args.smoke else "inductor"
    init, top = (4, 16) if args.smoke else (128, 512)
    torch._dynamo.reset()
    tuner = BatchSizeTuner(init_size=init, max_size=top, cache=False)
    rate = _timed_fit(args, torch.compile(model(args, init, 10_000), backend=backend), [tuner])
    choice = tuner.batch_size or init
    torch._dynamo.reset()
    oracle = _timed_fit(args, torch.compile(model(args, choice, 10_000), backend=backend, dynamic=False), [])
    torch._dynamo.reset()
    return {
        "choice": choice,
        "search_s": tuner.search_s,
        "compile_s": tuner.compile_s,
        "trials": [r.to_dict() for r in tuner.results],
        "choice_img_s": round(rate, 1),
        "oracle_img_s": round(oracle, 1),
    }


def part_strategy(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    batch = 8 if args.smoke else 64
    gloo = {"process_group_backend": "gloo"} if args.smoke else {}

    def fit(strategy: Any, callbacks: list[Any]) -> Any:
        torch.manual_seed(0)
        net = model(args, batch, 10_000)
        net.example_input_array = net.images[:batch].clone()
        trainer(args, callbacks, 3, strategy=strategy, precision="32-true").fit(net)
        return net

    def difference(a: Any, b: Any) -> float:
        pairs = list(zip(a.state_dict().values(), b.state_dict().values(), strict=True))
        return max(float((x.float() - y.float()).abs().max()) for x, y in pairs if x.numel())

    deterministic = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        plain = fit(DDPStrategy(**gloo), [])
        plain_again = fit(DDPStrategy(**gloo), [])
        strategy = CheckpointingDDPStrategy(memory_budget=0.6, **gloo)
        peaks = StepPeak()
        checked = fit(strategy, [peaks])
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic
    pairs = list(zip(plain.state_dict().values(), checked.state_dict().values(), strict=True))
    plan = strategy.checkpointing.plan  # rank zero's; the other ranks apply its runs
    return {
        "runs": strategy.checkpointing.runs,
        "budget_bytes": plan.budget_bytes if plan is not None else None,
        "planned_peak_bytes": plan.measured_bytes if plan is not None else None,
        "step_peaks_bytes": peaks.peaks,
        "same_weights_as_plain_ddp": all(torch.equal(a, b) for a, b in pairs),
        "max_weight_difference": difference(plain, checked),
        "plain_vs_plain_difference": difference(plain, plain_again),  # the run-to-run baseline
    }


def _own_weights(module: Any) -> list[torch.Tensor]:
    """This rank's shard of every parameter and buffer, copied to the host."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return [
            (t.to_local() if isinstance(t, DTensor) else t).detach().cpu().clone()
            for t in [*module.parameters(), *module.buffers()]
        ]


class _WeightsAtStart(Callback):
    """Listed before the tuner: this rank's weights as the fit starts and at its first real batch."""

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.before = _own_weights(pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not hasattr(self, "first"):
            self.first = _own_weights(pl_module)


def part_sharded(args: argparse.Namespace, rank: int, name: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if name == "fsdp" and args.smoke:
        return {"skipped": "Lightning builds FSDPStrategy only on a GPU"}

    def strategy() -> Any:
        return (
            FSDPStrategy()
            if name == "fsdp"
            else ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
        )

    effective, steps = (32, 6) if args.smoke else (512, 30)
    guard, start = MemGuard(), _WeightsAtStart()
    tuner = AccumulationTuner(effective, min_micro_batch=8 if args.smoke else 32, cache=False)
    t = trainer(args, [start, guard, tuner], steps, strategy=strategy())
    t.fit(model(args, 64, 10_000, ShardedClassifier))
    out: dict[str, Any] = {
        "choice": {"micro_batch": tuner.batch_size, "accumulate": tuner.accumulate_grad_batches},
        "trials": [r.to_dict() for r in tuner.results],
        "weights_put_back": all(torch.equal(a, b) for a, b in zip(start.before, start.first, strict=True)),
        "logged_samples_per_sec": float(t.callback_metrics["memguard/samples_per_sec"]),
        "table_samples_per_sec": guard.epochs[-1].samples_per_sec,  # the merged record this rank holds
    }
    batch = 8 if args.smoke else 64
    net = model(args, batch, 10_000, ShardedClassifier)
    net.example_input_array = net.images[:batch].clone()
    peaks, checkpointing = StepPeak(), ActivationCheckpointing(memory_budget=0.6)
    try:
        trainer(args, [checkpointing, peaks], 3, strategy=strategy()).fit(net)
    except ValueError as err:  # refused in setup
        out["budget"] = {"refused": str(err)}
        return out
    plan = checkpointing.plan
    out["budget"] = {
        "runs": checkpointing.runs,
        "budget_bytes": plan.budget_bytes if plan is not None else None,
        "planned_peak_bytes": plan.measured_bytes if plan is not None else None,
        "step_peaks_bytes": peaks.peaks,
    }
    return out


def _summarize_sharded(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if "skipped" in rows[0]:
        return {"skipped": rows[0]["skipped"]}
    budget = rows[0]["budget"]
    summary: dict[str, Any] = {
        "same_choice_on_every_rank": len({json.dumps(r["choice"], sort_keys=True) for r in rows}) == 1,
        "choice": rows[0]["choice"],
        "weights_put_back_on_every_rank": all(r["weights_put_back"] for r in rows),
        "logged_samples_per_sec": rows[0]["logged_samples_per_sec"],
        # every rank holds the merged record (the ranks' samples/s summed): its table's figure is the logged one
        "every_rank_holds_the_logged_figure": all(
            abs(r["table_samples_per_sec"] - rows[0]["logged_samples_per_sec"]) < 1e-3 for r in rows
        ),
    }
    if "refused" in budget:
        summary["budget"] = budget
    else:
        summary["budget"] = {
            "same_runs_on_every_rank": len({json.dumps(r["budget"]["runs"]) for r in rows}) == 1,
            "runs": budget["runs"],
            "budget_bytes": budget["budget_bytes"],
            "peak_bytes_per_rank": [max(r["budget"]["step_peaks_bytes"], default=None) for r in rows],
        }
    return summary


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's view of every part that ran."""
    summary: dict[str, Any] = {"gpus": torch.cuda.device_count()}
    first = ranks[0]
    if "tuning" in first:
        summary["tuning"] = {
            "same_choice_on_every_rank": len({json.dumps(r["tuning"]["choice"], sort_keys=True) for r in ranks}) == 1,
            "choice": first["tuning"]["choice"],
            "logged_samples_per_sec": first["tuning"]["logged_samples_per_sec"],
            "every_rank_holds_the_logged_figure": all(
                abs(r["tuning"]["table_samples_per_sec"] - first["tuning"]["logged_samples_per_sec"]) < 1e-3
                for r in ranks
            ),
        }
    if "overhead" in first:
        with_g = [r["median_step_ms"] for r in first["overhead"] if r["memguard"]]
        without = [r["median_step_ms"] for r in first["overhead"] if not r["memguard"]]
        summary["overhead_ratio"] = statistics.median(with_g) / statistics.median(without)
    if "spill" in first:
        summary["spill"] = {r["rank"]: r["spill"] for r in ranks}
    for part in ("oom", "sharded_oom"):
        if part in first:
            summary[part] = {
                "ended": [r[part].get("ended") for r in ranks],
                "same_choice_on_every_rank": len({r[part]["choice"] for r in ranks}) == 1,
                "choice": first[part]["choice"],
                "trials": {r["rank"]: r[part]["trials"] for r in ranks},
                "sizes_out_of_memory": sorted(
                    {t["size"] for r in ranks for t in r[part]["trials"] if t["outcome"] == "oom"}
                ),
                "trained_steps": [r[part]["trained_steps"] for r in ranks],
                "seconds": [r[part]["seconds"] for r in ranks],
            }
    if "compiled" in first:
        rows = [r["compiled"] for r in ranks]
        summary["compiled"] = {
            "same_choice_on_every_rank": len({row["choice"] for row in rows}) == 1,
            "choice": rows[0]["choice"],
            "choice_vs_oracle": [round(row["choice_img_s"] / row["oracle_img_s"], 4) for row in rows],
            "search_s": rows[0]["search_s"],
            "compile_s": rows[0]["compile_s"],
        }
    if "strategy" in first:
        rows = [r["strategy"] for r in ranks]
        budget = rows[0]["budget_bytes"]
        summary["strategy"] = {
            "same_runs_on_every_rank": len({json.dumps(row["runs"]) for row in rows}) == 1,
            "budget_bytes": budget,
            "peak_bytes_per_rank": [max(row["step_peaks_bytes"], default=None) for row in rows],
            "held_on_every_rank": None
            if budget is None or not rows[0]["step_peaks_bytes"]
            else all(max(row["step_peaks_bytes"]) <= budget for row in rows),
            "same_weights_as_plain_ddp": [row["same_weights_as_plain_ddp"] for row in rows],
            "max_weight_difference": [row["max_weight_difference"] for row in rows],
            "plain_vs_plain_difference": [row["plain_vs_plain_difference"] for row in rows],
        }
    for name in ("fsdp", "model_parallel"):
        if name in first:
            summary[name] = _summarize_sharded([r[name] for r in ranks])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/multigpu.json")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--tmp", default=os.path.join(os.getcwd(), ".multigpu_runs"))
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    mine: dict[str, Any] = {"rank": rank, "parts": parts}
    own = os.path.join(args.tmp, f"rank{rank}.json")
    if os.path.exists(own):
        os.remove(own)  # an earlier run's, perhaps of other parts
    micro, accumulate = 8 if args.smoke else 64, 1
    if "tuning" in parts:
        mine["tuning"] = part_tuning(args, rank)
        micro, accumulate = mine["tuning"]["choice"]["micro_batch"], mine["tuning"]["choice"]["accumulate"]
    if "overhead" in parts:
        mine["overhead"] = part_overhead(args, rank, micro or 64, accumulate or 1)
    if "spill" in parts:
        mine["spill"] = part_spill(args, rank)
    if "oom" in parts:
        mine["oom"] = part_oom(args, rank)
    if "compiled" in parts:
        mine["compiled"] = part_compiled(args, rank)
    if "strategy" in parts:
        mine["strategy"] = part_strategy(args, rank)
    for name in ("fsdp", "model_parallel"):
        if name in parts:
            mine[name] = part_sharded(args, rank, name)
    if "sharded_oom" in parts:
        mine["sharded_oom"] = part_oom(args, rank, sharded=True)

    os.makedirs(args.tmp, exist_ok=True)
    with open(own + ".tmp", "w", encoding="utf-8") as f:
        json.dump(mine, f, indent=2)
    os.replace(own + ".tmp", own)  # whole, or not there
    if rank == 0:
        ranks = []
        deadline = time.monotonic() + 300
        while len(ranks) < WORLD and time.monotonic() < deadline:  # every rank's file of this run
            time.sleep(1)
            ranks = []
            for path in sorted(glob.glob(os.path.join(args.tmp, "rank*.json"))):
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
                if data.get("parts") == parts:
                    ranks.append(data)
        if len(ranks) < WORLD:
            raise SystemExit(f"only {len(ranks)} of {WORLD} ranks wrote their results within 300 s")
        summary = summarize(ranks)
        print(json.dumps(summary, indent=2))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "ranks": ranks}, f, indent=2)


if __name__ == "__main__":
    main()
