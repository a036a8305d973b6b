"""What the memory report costs training that does not spill, and what one report's measurement takes. Run on a CUDA
machine:

    python benchmarks/forensics.py --out benchmarks/results/forensics.json

ResNet50, bf16-mixed, channels_last, batch 256. Four Trainers run in turns, round after round, the order rotated
each round: no MemGuard, ``MemGuard(memory_report=False)``, ``MemGuard()`` (reports on: nothing runs per step until
one is wanted) and ``MemGuard(record_memory=True)`` (the CUDA allocator's history recorded from fit start). Step
times come from CUDA events at every batch start (``StepTimer``); each configuration's ratio to the plain run of the
same round, then the median over rounds. ``report_vs_no_report`` is the default's own cost end to end:
``MemGuard()`` over ``MemGuard(memory_report=False)``; rounds differ by more than the 0.2 % goal, so the default's
per-step work (a reference to the batch kept and dropped) is also timed alone (``report_hooks_us_per_step``) and
set against the plain step (``report_hooks_pct_of_step``). Then one report's measurement on the same model and batch (a
step redone under the hooks, as a raised spill does), timed with the device synchronised, and its files written.

``--smoke``: a tiny CPU run of the same code (resnet18, 32 px, a few steps), for the tests.
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

import torch  # noqa: E402
from _common import environment, free_memory, make_trainer, median, write_json  # noqa: E402

from lightning_memguard import MemGuard  # noqa: E402
from lightning_memguard.forensics import MemoryReport, measure_step  # noqa: E402
from lightning_memguard.testing import ImageClassifier, StepTimer  # noqa: E402

CONFIGS = {
    "plain": None,
    "memguard_without_report": {"memory_report": False},
    "memguard": {},
    "memguard_recording": {"record_memory": True},
}


def _model(arch: str, image: int, batch: int, steps: int) -> ImageClassifier:
    return ImageClassifier(
        arch, image_size=image, batch_size=batch, steps_per_epoch=steps, channels_last=torch.cuda.is_available(),
        pool_size=max(64, batch), num_classes=1000,
    )  # fmt: skip


def run_once(name: str, arch: str, image: int, batch: int, warmup: int, steps: int, root: str) -> float:
    """The median step time (ms) of one configuration's run."""
    free_memory()
    torch.manual_seed(0)
    model = _model(arch, image, batch, warmup + steps + 1)
    timer = StepTimer(skip=warmup)
    kwargs = CONFIGS[name]
    callbacks: list[Any] = [timer] if kwargs is None else [MemGuard(**kwargs), timer]
    make_trainer(callbacks, warmup + steps, root).fit(model)
    return median(timer.step_ms())


def hook_cost(calls: int = 200_000) -> float:
    """Microseconds per training step of what the reports add to MemGuard's step hooks while nothing is wanted: a
    reference to the batch kept at its start and dropped at its end (the run's end-to-end ratio cannot resolve it)."""
    from types import SimpleNamespace

    from lightning_memguard.callbacks._reporting import MemoryReports

    reports = MemoryReports(True, False, True)
    trainer: Any = SimpleNamespace(num_training_batches=1000)
    batch = torch.zeros(1)
    start = time.perf_counter()
    for i in range(calls):
        reports.batch_start(batch, i % 1000)
        reports.batch_end(trainer, None, batch, i % 1000)  # type: ignore[arg-type]
    return (time.perf_counter() - start) / calls * 1e6


def one_report(arch: str, image: int, batch: int, root: str) -> dict[str, Any]:
    """One report's measurement on a model that has trained a step (its optimizer state exists), timed."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    free_memory()
    model = _model(arch, image, batch, 2).to(device)
    net = model.net
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, image, image, device=device)
    if cuda:
        x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            return torch.nn.functional.cross_entropy(net(x), y)

    step().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times = []
    memory = None
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        memory = measure_step(net, step, [optimizer], samples=batch)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    assert memory is not None
    start = time.perf_counter()
    report = MemoryReport.from_step(memory, "spill", step=1)
    paths = report.write(root, "memguard-report-benchmark")
    write_ms = (time.perf_counter() - start) * 1e3
    return {
        "measure_ms": median(times), "measure_ms_each": times, "write_ms": write_ms,
        "files_bytes": {os.path.basename(p): os.path.getsize(p) for p in paths},
        "peak_gb": report.peak / 1e9, "peak_measured": report.peak_measured,
        "split_gb": {k: v / 1e9 for k, v in report.split.items()},
        "top": [{**t, "bytes": t["bytes"]} for t in report.top], "verdict": report.verdict(),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/forensics.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU run of the same code")
    args = parser.parse_args()
    arch, image, batch = "resnet50", 224, args.batch
    if args.smoke:
        arch, image, batch = "resnet18", 32, 4
        args.rounds, args.steps, args.warmup = 1, 3, 1
        torch.set_num_threads(1)
    root = tempfile.mkdtemp()
    names = list(CONFIGS)
    rows = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # each configuration leads one round
        times = {name: run_once(name, arch, image, batch, args.warmup, args.steps, root) for name in order}
        row = {"round": r, "order": order, "step_ms": times, "vs_plain": {}}
        for name in names[1:]:
            row["vs_plain"][name] = times[name] / times["plain"]
        row["report_vs_no_report"] = times["memguard"] / times["memguard_without_report"]
        row["recording_vs_memguard"] = times["memguard_recording"] / times["memguard"]
        rows.append(row)
        print(row, flush=True)
    summary = {
        "vs_plain": {name: median([row["vs_plain"][name] for row in rows]) for name in names[1:]},
        "report_vs_no_report": median([row["report_vs_no_report"] for row in rows]),
        "recording_vs_memguard": median([row["recording_vs_memguard"] for row in rows]),
    }
    summary["default_overhead_pct"] = (summary["report_vs_no_report"] - 1) * 100
    summary["recording_overhead_pct"] = (summary["recording_vs_memguard"] - 1) * 100
    summary["report_hooks_us_per_step"] = hook_cost(20_000 if args.smoke else 200_000)
    plain_ms = median([row["step_ms"]["plain"] for row in rows])
    summary["report_hooks_pct_of_step"] = summary["report_hooks_us_per_step"] / (plain_ms * 1e3) * 100
    report = one_report(arch, image, batch, root)
    print(summary, flush=True)
    print(report["verdict"], f"\nmeasured in {report['measure_ms']:.0f} ms", flush=True)
    write_json(
        args.out,
        {
            "environment": environment(),
            "settings": {
                "model": arch,
                "image_size": image,
                "batch": batch,
                "precision": "bf16-mixed",
                "steps": args.steps,
                "warmup": args.warmup,
                "rounds": args.rounds,
            },  # fmt: skip
            "rows": rows,
            "summary": summary,
            "report": report,
        },
    )


if __name__ == "__main__":
    main()
