"""What MemGuard costs a training step. Run on a CUDA machine:

    python benchmarks/overhead.py --out benchmarks/results/overhead.json

ResNet50, bf16-mixed, channels_last. Trainers with and without MemGuard run interleaved (A B A B ...), each for
warm-up plus timed steps; step times come from CUDA events recorded at every batch start. Also measured: the time
spent inside MemGuard's own hooks per training step, at batch 256 and at batch 32 (where the step is short and
the end-to-end ratio is noisy).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, free_memory, make_trainer, median, write_json  # noqa: E402

from lightning_memguard import MemGuard  # noqa: E402
from lightning_memguard.testing import ImageClassifier, StepTimer  # noqa: E402

STEP_HOOKS = ("on_train_batch_start",)
EPOCH_HOOKS = ("on_train_epoch_start", "on_train_epoch_end")


class TimedMemGuard(MemGuard):
    """MemGuard whose hooks add up their own wall time: per-step hooks and once-per-epoch hooks apart."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = {"step": 0.0, "epoch": 0.0}
        self.steps = 0
        self.reads = 0
        self.step_calls: list[float] = []  # each step hook's own time, for the median and the tail
        for name in STEP_HOOKS + EPOCH_HOOKS:
            setattr(self, name, self._timed(name, getattr(self, name)))

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        probe = self._require_probe()
        read = probe.read

        def counted() -> Any:
            self.reads += 1
            return read()

        probe.read = counted  # type: ignore[method-assign]

    def _timed(self, name: str, hook: Any) -> Any:
        kind = "step" if name in STEP_HOOKS else "epoch"

        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                self.seconds[kind] += took
                if kind == "step":
                    self.step_calls.append(took)
                self.steps += name == "on_train_batch_start"

        return run


def run_once(batch: int, guarded: bool, warmup: int, steps: int, root: str) -> dict[str, Any]:
    free_memory()
    model = ImageClassifier(
        "resnet50",
        image_size=224,
        batch_size=batch,
        steps_per_epoch=warmup + steps + 1,
        channels_last=True,
        pool_size=256,
        num_classes=1000,
    )
    timer = StepTimer(skip=warmup)
    callbacks: list[Any] = [timer]
    guard = TimedMemGuard() if guarded else None
    if guard is not None:
        callbacks.insert(0, guard)
    make_trainer(callbacks, warmup + steps, root).fit(model)
    times = timer.step_ms()
    row: dict[str, Any] = {"batch": batch, "memguard": guarded, "median_step_ms": median(times), "steps": len(times)}
    if guard is not None:
        steps = max(guard.steps, 1)
        row["step_hooks_us_per_step"] = guard.seconds["step"] / steps * 1e6
        row["epoch_hooks_ms_per_epoch"] = guard.seconds["epoch"] * 1e3
        row["all_hooks_us_per_step"] = (guard.seconds["step"] + guard.seconds["epoch"]) / steps * 1e6
        row["memory_reads_per_100_steps"] = guard.reads / steps * 100
        calls = sorted(guard.step_calls)
        row["step_hook_us_median"] = median(calls) * 1e6
        row["step_hook_us_p90"] = calls[int(0.9 * (len(calls) - 1))] * 1e6
        row["peak_allocated_gb"] = guard.epochs[-1].peak_allocated_gb if guard.epochs else None
    return row


def micro_costs(batch_size: int = 256) -> dict[str, float]:
    """Microseconds per call of the pieces a MemGuard step is made of, on this machine."""
    import torch
    from lightning.pytorch.utilities.data import extract_batch_size

    from lightning_memguard.core.detector import SpillDetector
    from lightning_memguard.probes import CudaProbe

    def per_call(fn: Any, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    batch = torch.arange(batch_size, device="cuda")
    probe = CudaProbe(0)
    probe.read()  # NVML set-up outside the timing
    detector = SpillDetector(10**11, warmup_steps=0, reference_steps=1)
    detector.observe_step(0.05, batch_size)
    return {
        "perf_counter_us": per_call(time.perf_counter, 100_000),
        "extract_batch_size_us": per_call(lambda: extract_batch_size(batch), 10_000),
        "detector_observe_step_us": per_call(lambda: detector.observe_step(0.05, batch_size), 10_000),
        "probe_read_us": per_call(probe.read, 1_000),
        "max_memory_allocated_us": per_call(torch.cuda.max_memory_allocated, 1_000),
        "memory_stats_as_nested_dict_us": per_call(torch.cuda.memory_stats_as_nested_dict, 1_000),
        "nvml_other_processes_us": per_call(lambda: probe._query_other_processes(None), 100),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/overhead.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    rows = []
    for batch, rounds in ((256, args.rounds), (32, args.rounds)):
        for r in range(rounds):
            for guarded in (r % 2 == 0, r % 2 == 1):  # alternate which goes first
                row = run_once(batch, guarded, args.warmup, args.steps, root)
                row["round"] = r
                rows.append(row)
                print(row, flush=True)
    summary = {}
    for batch in (256, 32):
        with_g = [r["median_step_ms"] for r in rows if r["batch"] == batch and r["memguard"]]
        without = [r["median_step_ms"] for r in rows if r["batch"] == batch and not r["memguard"]]
        guarded = [r for r in rows if r["batch"] == batch and r["memguard"]]
        summary[str(batch)] = {
            "median_step_ms_with": median(with_g),
            "median_step_ms_without": median(without),
            "ratio": median(with_g) / median(without),
            "step_hooks_us_per_step": median([r["step_hooks_us_per_step"] for r in guarded]),
            "epoch_hooks_ms_per_epoch": median([r["epoch_hooks_ms_per_epoch"] for r in guarded]),
            "all_hooks_us_per_step": median([r["all_hooks_us_per_step"] for r in guarded]),
            "memory_reads_per_100_steps": median([r["memory_reads_per_100_steps"] for r in guarded]),
            "step_hook_us_median": median([r["step_hook_us_median"] for r in guarded]),
            "step_hook_us_p90": median([r["step_hook_us_p90"] for r in guarded]),
        }
    costs = micro_costs()
    # each timed hook call includes about one clock read of the timing wrapper itself
    for entry in summary.values():
        entry["step_hooks_us_per_step_less_timer"] = entry["step_hooks_us_per_step"] - costs["perf_counter_us"]
    result = {
        "environment": environment(),
        "config": vars(args),
        "micro_costs_us": costs,
        "summary": summary,
        "runs": rows,
    }
    print(summary)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
